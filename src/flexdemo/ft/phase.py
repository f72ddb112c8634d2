"""The phases of an :class:`~flexdemo.ft.session.ElasticSession`'s step, as one enum with
its allowed moves (the session advances through them, and refuses any other move)."""

from __future__ import annotations

import enum
from typing import NamedTuple

from .state import Snapshot

__all__ = ["NEXT", "Phase", "StepUndo"]


class Phase(enum.Enum):
    """Where a session is in its step: ``NEW -> LAUNCHED -> JOINED (or STALE) -> STEPPING ->
    IDLE -> LAUNCHED ...`` (:data:`NEXT`: the moves allowed)."""

    NEW = "new"  # before its first quorum
    IDLE = "idle"  # between steps: the next quorum not started
    LAUNCHED = "launched"  # this step's quorum started (it may run behind the forward pass)
    JOINED = "joined"  # in this step's quorum, the replicators bound to it
    STALE = "stale"  # joined, but healed after its forward pass: it will vote no
    STEPPING = "stepping"  # the optimizer's own step runs (start_step .. finish_step)


NEXT: dict[Phase, frozenset[Phase]] = {
    Phase.NEW: frozenset({Phase.LAUNCHED}),
    Phase.IDLE: frozenset({Phase.LAUNCHED}),
    Phase.LAUNCHED: frozenset({Phase.JOINED, Phase.STALE}),
    Phase.JOINED: frozenset({Phase.STEPPING}),
    Phase.STALE: frozenset({Phase.STEPPING}),
    Phase.STEPPING: frozenset({Phase.IDLE}),
}


class StepUndo(NamedTuple):
    """What :meth:`ElasticSession.start_step` kept for :meth:`ElasticSession.finish_step`."""

    snapshot: Snapshot
    stale: bool  # healed after its forward pass: the step is voted down
