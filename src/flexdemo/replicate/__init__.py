"""Replicators: what crosses the slow link, on which group, and how often."""

import re
from collections.abc import Callable
from functools import partial

from .agreement import Agreement, CorruptPayloadError, NonFiniteGradientError
from .base import Replicator, setting_names
from .demo import PRESETS as DEMO_PRESETS
from .demo import DeMoReplicator
from .diloco import DiLoCoReplicator
from .frontier import FRONTIER, frontier_preset
from .full import FullReplicator, NoReplication
from .pace import Pace, adapted_counts, measured_counts, step_counts
from .phased import PhasedReplicator, demo_warmup
from .registry import REPLICATORS
from .subset import RandomReplicator, SlicingReplicator, StridingReplicator

REPLICATORS.update({
    "demo": DeMoReplicator,
    "diloco": DiLoCoReplicator,
    "full": FullReplicator,
    "none": NoReplication,
    "demo-warmup": demo_warmup,
    "random": RandomReplicator,
    "striding": StridingReplicator,
    "slicing": SlicingReplicator,
})
for _preset in FRONTIER:  # the papers' presets and our variants (frontier.py)
    REPLICATORS[_preset] = partial(frontier_preset, _preset)
for _preset in DEMO_PRESETS:
    if _preset != "default":
        REPLICATORS[f"demo-{_preset}"] = partial(DeMoReplicator.preset, _preset)


def _settings(fn: Callable) -> list[str]:
    """The keyword settings ``fn`` accepts (the DeMo presets and the warm-up forward the rest
    to DeMo)."""
    fn = fn.func if isinstance(fn, partial) else fn
    forwards_to = DiLoCoReplicator if fn is frontier_preset else DeMoReplicator
    chain = (fn,) if isinstance(fn, type) else (fn, forwards_to)
    return [n for n in setting_names(*chain) if n != "name"]


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


__all__ = ["DEMO_PRESETS", "FRONTIER", "REPLICATORS", "Agreement", "CorruptPayloadError",
           "DeMoReplicator", "DiLoCoReplicator", "FullReplicator", "NoReplication",
           "NonFiniteGradientError", "Pace", "PhasedReplicator", "RandomReplicator",
           "Replicator", "SlicingReplicator", "StridingReplicator", "make_replicator",
           "adapted_counts", "measured_counts", "step_counts"]
