"""Deprecated: moved to :mod:`flexdemo.app.tasks` (this path will be removed in the next
release). Its names and submodules (``flexdemo.tasks.gpt``, ...) still resolve to the new
objects."""

import warnings

from ..app import tasks as _tasks
from ..app.tasks import *  # noqa: F403 - the old path re-exports the new package's names
from ..app.tasks import __all__  # noqa: F401

warnings.warn("flexdemo.tasks moved to flexdemo.app.tasks; import it from there "
              "(flexdemo.tasks will be removed in the next release)", DeprecationWarning,
              stacklevel=2)


def __getattr__(name: str):
    return getattr(_tasks, name)
