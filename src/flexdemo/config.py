"""Deprecated: moved to :mod:`flexdemo.app.config`; removed in the next release."""

from ._moved import moved

moved(__name__, "flexdemo.app.config")
