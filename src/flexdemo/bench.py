"""Deprecated: moved to :mod:`flexdemo.app.bench`; removed in the next release."""

from ._moved import moved

moved(__name__, "flexdemo.app.bench")
