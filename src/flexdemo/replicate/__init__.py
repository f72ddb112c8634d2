"""Replicators: what crosses the slow link, on which group, and how often."""

import inspect
import re
from collections.abc import Callable
from functools import partial

from .base import Agreement, CorruptPayloadError, NonFiniteGradientError, Replicator
from .demo import PRESETS as DEMO_PRESETS
from .demo import DeMoReplicator
from .diloco import DiLoCoReplicator
from .full import FullReplicator, NoReplication
from .phased import PhasedReplicator, demo_warmup
from .subset import RandomReplicator, SlicingReplicator, StridingReplicator

REPLICATORS: dict[str, Callable[..., Replicator]] = {
    "demo": DeMoReplicator,
    "diloco": DiLoCoReplicator,
    "full": FullReplicator,
    "none": NoReplication,
    "demo-warmup": demo_warmup,
    "random": RandomReplicator,
    "striding": StridingReplicator,
    "slicing": SlicingReplicator,
}
for _preset in DEMO_PRESETS:
    if _preset != "default":
        REPLICATORS[f"demo-{_preset}"] = partial(DeMoReplicator.preset, _preset)


def _settings(fn: Callable) -> set[str]:
    """The keyword settings ``fn`` accepts: its named parameters, and where it forwards
    ``**kwargs`` those of the classes it forwards to (base classes, or DeMo for the DeMo
    presets and the warm-up)."""
    if isinstance(fn, partial):
        fn = fn.func
    chain = inspect.getmro(fn) if isinstance(fn, type) else (fn,
                                                            *inspect.getmro(DeMoReplicator))
    names: set[str] = set()
    for f in chain:
        if f is object:
            break
        params = inspect.signature(f.__init__ if isinstance(f, type) else f).parameters
        names |= {n for n, p in params.items() if n not in ("self", "cls", "name")
                  and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            break
    return names


def make_replicator(spec, **kwargs) -> Replicator:
    """A replicator from a name (``"demo"``, ``"full"``, ...) and settings, or an instance."""
    if isinstance(spec, Replicator):
        if kwargs:
            raise ValueError("settings were given for a replicator instance; pass them to its "
                             "constructor instead")
        return spec
    if isinstance(spec, str):
        cls = REPLICATORS.get(spec.lower())
        if cls is None:
            raise ValueError(f"unknown replicator {spec!r}; choose one of {sorted(REPLICATORS)} "
                             "or pass a Replicator instance")
        try:
            return cls(**kwargs)
        except TypeError as e:
            bad = re.search(r"unexpected keyword argument '(\w+)'", str(e))
            if bad is None:
                raise
            raise ValueError(f"replicator {spec!r} has no setting {bad.group(1)!r}; its settings: "
                             f"{sorted(_settings(cls))}") from None
    raise TypeError(f"a replicator is a name or a Replicator instance, got {type(spec).__name__}")


__all__ = ["DEMO_PRESETS", "REPLICATORS", "Agreement", "CorruptPayloadError", "DeMoReplicator",
           "DiLoCoReplicator", "FullReplicator", "NoReplication",
           "NonFiniteGradientError", "PhasedReplicator", "RandomReplicator", "Replicator",
           "SlicingReplicator",
           "StridingReplicator", "make_replicator"]
