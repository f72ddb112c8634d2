"""Balanced batches: each replica's batch sized to its speed (issue 55, docs/stragglers.md).

Replicas of different speeds that exchange at every step (full sync, DeMo) wait for the
slowest at each step. Giving each replica a batch in proportion to its speed makes their
steps take about as long: :func:`balanced_batches` sizes the batches from each replica's
seconds per sample (pure, deterministic), :func:`measured_batches` all-gathers this rank's
measurement first (8 bytes per replica) so every rank gets the same sizes. The exchange then
weighs each replica by its tokens: ``FullReplicator(weights="tokens")`` or
``DeMoReplicator(weights="tokens")`` with ``opt.count_tokens(n)`` at every step
(:mod:`flexdemo.replicate.weights`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import torch

from .transport import CommStats, all_gather, transport_for

__all__ = ["balanced_batches", "measured_batches"]


def balanced_batches(seconds_per_sample: Sequence[float], global_batch: int) -> list[int]:
    """Each replica's batch size, in proportion to its speed (``1 / seconds_per_sample``),
    summing to ``global_batch``, each at least 1: the largest remainders of the exact
    quotas (``B v_i / sum v``, in exact rational arithmetic; ties to the lower rank), so the
    same numbers give the same sizes on every rank and platform."""
    secs = [float(s) for s in seconds_per_sample]
    if not secs or not all(s > 0 and math.isfinite(s) for s in secs):
        raise ValueError(f"seconds per sample must be finite numbers > 0, got {secs}")
    if (isinstance(global_batch, bool) or not isinstance(global_batch, int)
            or global_batch < len(secs)):
        raise ValueError(f"global_batch must be an integer of at least one sample per "
                         f"replica ({len(secs)}), got {global_batch!r}")
    speeds = [1 / Fraction(s) for s in secs]
    total = sum(speeds)
    quotas = [global_batch * v / total for v in speeds]
    sizes = [max(1, math.floor(q)) for q in quotas]
    while sum(sizes) < global_batch:  # the largest shortfall first
        i = max(range(len(sizes)), key=lambda i: (quotas[i] - sizes[i], -i))
        sizes[i] += 1
    while sum(sizes) > global_batch:  # (raised to 1): the largest excess gives one back
        i = max((i for i in range(len(sizes)) if sizes[i] > 1),
                key=lambda i: (sizes[i] - quotas[i], -i))
        sizes[i] -= 1
    return sizes


def measured_batches(seconds_per_sample: float, global_batch: int, group=None,
                     device: torch.device | str = "cpu") -> list[int]:
    """All-gather this rank's ``seconds_per_sample`` over ``group`` (a process group or
    transport; default: the world; one float64 per rank) and return every replica's batch
    size (:func:`balanced_batches`), the same on every rank."""
    tr = transport_for(group)
    mine = torch.tensor([float(seconds_per_sample)], dtype=torch.float64, device=device)
    gathered = all_gather(mine, tr, CommStats()).reshape(-1)
    return balanced_batches(gathered.tolist(), global_batch)
