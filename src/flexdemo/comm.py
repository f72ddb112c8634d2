"""Former home of the collectives; they live in :mod:`flexdemo.transport` now.

Every name stays importable from here (``from flexdemo.comm import all_gather`` keeps working).
"""

from .transport import (
    CommStats,
    InProcessHub,
    InProcessTransport,
    Pending,
    ProcessGroupTransport,
    ReplicaAbortedError,
    Transport,
    _all_gather_single,
    all_gather,
    all_gather_bytes,
    all_reduce_bytes,
    all_reduce_sum,
    gather_into,
    global_rank,
    group_rank,
    group_ranks,
    group_size,
    ring_sum_,
    transport_for,
)

__all__ = [
    "CommStats", "InProcessHub", "InProcessTransport", "Pending", "ProcessGroupTransport",
    "ReplicaAbortedError", "Transport", "_all_gather_single", "all_gather", "all_gather_bytes",
    "all_reduce_bytes", "all_reduce_sum", "gather_into", "global_rank", "group_rank",
    "group_ranks", "group_size", "ring_sum_", "transport_for",
]
