"""Old module paths of the application and tools, kept for one release.

``flexdemo.train``, ``flexdemo.config``, ``flexdemo.cli``, ``flexdemo.bench``,
``flexdemo.plots``, ``flexdemo.tasks`` and ``flexdemo.cluster`` moved to :mod:`flexdemo.app`
and :mod:`flexdemo.tools`; each old path is a shim that warns once and hands out the new
module itself (so monkeypatching either path patches the same object).
"""

from __future__ import annotations

import importlib
import sys
import warnings
from types import ModuleType


def moved(old: str, new: str) -> ModuleType:
    """Warn that ``old`` moved to ``new`` and make ``import old`` give the module ``new``."""
    warnings.warn(f"{old} moved to {new}; import it from there ({old} will be removed in "
                  "the next release)", DeprecationWarning, stacklevel=3)
    module = importlib.import_module(new)
    sys.modules[old] = module
    return module
