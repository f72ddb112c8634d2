"""Transports: how replicators' payloads move between replicas, with byte and time accounting.

The names below are the package's public face; other flexdemo packages import from here only.
Its modules, one job each:

* ``core``: the :class:`Transport` interface, :class:`ProcessGroupTransport` (a
  ``torch.distributed`` group), the collectives every replicator calls (:func:`all_gather`,
  :func:`all_reduce_sum`, ...), their byte counts and :class:`CommStats`, :class:`PeerLostError`;
* ``inprocess``: N replicas simulated in one process (:class:`InProcessHub`), summing in gloo's
  ring order (:func:`ring_sum_`);
* ``manager``: :class:`ManagerTransport`, the group of a torchft Manager under fault tolerance.
  It is loaded on first use; it takes the Manager as an argument and never imports torchft (an
  optional dependency), so ``import flexdemo`` works without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .core import (
    CommStats,
    PeerLostError,
    Pending,
    ProcessGroupTransport,
    Transport,
    all_gather,
    all_gather_bytes,
    all_reduce_bytes,
    all_reduce_sum,
    all_to_all,
    all_to_all_bytes,
    all_to_all_equal,
    gather_into,
    global_rank,
    group_rank,
    group_ranks,
    group_size,
    transport_for,
)
from .inprocess import (
    GLOO_MAX_SEGMENT_BYTES,
    InProcessHub,
    InProcessTransport,
    ReplicaAbortedError,
    ring_sum_,
)

if TYPE_CHECKING:
    from .manager import ManagerTransport


def __getattr__(name: str):
    if name == "ManagerTransport":
        from .manager import ManagerTransport
        return ManagerTransport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GLOO_MAX_SEGMENT_BYTES", "CommStats", "InProcessHub", "InProcessTransport",
    "ManagerTransport", "Pending", "PeerLostError", "ProcessGroupTransport",
    "ReplicaAbortedError", "Transport", "all_gather", "all_gather_bytes", "all_reduce_bytes",
    "all_reduce_sum", "all_to_all", "all_to_all_bytes", "all_to_all_equal", "gather_into",
    "global_rank", "group_rank", "group_ranks", "group_size", "ring_sum_", "transport_for",
]
