"""Deprecated: moved to :mod:`flexdemo.app.tasks.base` (this path will be removed in the next
release)."""

from .._moved import moved

moved(__name__, "flexdemo.app.tasks.base")
