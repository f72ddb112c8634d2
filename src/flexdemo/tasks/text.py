"""Deprecated: moved to :mod:`flexdemo.app.tasks.text` (this path will be removed in the next
release)."""

from .._moved import moved

moved(__name__, "flexdemo.app.tasks.text")
