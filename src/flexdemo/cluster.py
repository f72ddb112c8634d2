"""Deprecated: moved to :mod:`flexdemo.tools.cluster`; removed in the next release."""

from ._moved import moved

moved(__name__, "flexdemo.tools.cluster")
