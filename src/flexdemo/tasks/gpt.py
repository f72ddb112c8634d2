"""Deprecated: moved to :mod:`flexdemo.app.tasks.gpt` (this path will be removed in the next
release)."""

from .._moved import moved

moved(__name__, "flexdemo.app.tasks.gpt")
