"""Collectives with byte and time accounting.

Byte counts follow the ring algorithms that gloo and NCCL use for large messages, per rank,
for a group of ``n`` ranks and a buffer of ``B`` bytes (``E`` elements of ``s`` bytes):

* all-reduce: reduce-scatter then all-gather, each moving ``n - 1`` of ``n`` chunks:
  sent = received = ``2 * (n - 1) * ceil(E / n) * s`` (``2 (n-1)/n * B`` when ``n`` divides ``E``);
* all-gather of ``B`` bytes from every rank: sent = received = ``(n - 1) * B``;
* a group of one rank moves nothing and calls no collective.

Seconds are wall-clock time spent inside the (blocking) collective on this rank.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist


def all_reduce_bytes(numel: int, element_size: int, group_size: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``numel`` elements."""
    n = group_size
    if n <= 1:
        return 0
    return 2 * (n - 1) * math.ceil(numel / n) * element_size


def all_gather_bytes(nbytes_per_rank: int, group_size: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-gather of ``nbytes_per_rank`` each."""
    return max(group_size - 1, 0) * nbytes_per_rank


@dataclass
class CommStats:
    """Running totals and last-step figures of one replicator's traffic on this rank."""

    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    collectives: int = 0
    steps_replicated: int = 0
    last_bytes_sent: int = 0
    last_bytes_received: int = 0
    last_seconds: float = 0.0
    last_collectives: int = 0

    def begin_step(self) -> None:
        self.last_bytes_sent = self.last_bytes_received = self.last_collectives = 0
        self.last_seconds = 0.0

    def record(self, sent: int, received: int, seconds: float, collectives: int = 1) -> None:
        self.bytes_sent += sent
        self.bytes_received += received
        self.seconds += seconds
        self.collectives += collectives
        self.last_bytes_sent += sent
        self.last_bytes_received += received
        self.last_seconds += seconds
        self.last_collectives += collectives

    def as_dict(self) -> dict:
        return asdict(self)

    def load(self, d: dict) -> None:
        for k, v in d.items():
            if hasattr(self, k):
                setattr(self, k, type(getattr(self, k))(v))


# torch >= 2.12 names the single-tensor all-gather ``all_gather_single``
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_into(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """All-gather ``inp`` of every rank into ``out`` (concatenated in rank order)."""
    _all_gather_single(out, inp, group=group)


def group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


class Pending:
    """An asynchronous collective in flight; :meth:`wait` returns its result.

    Its bytes are recorded when it is launched (they are on their way); its seconds are those
    this rank spent launching it and blocked in ``wait`` (time the collective ran behind
    computation is not counted).
    """

    def __init__(self, result: torch.Tensor, work=None, stats: CommStats | None = None,
                 nbytes: int = 0, launch_seconds: float = 0.0) -> None:
        self.result, self._work, self._stats = result, work, stats
        if work is not None:
            stats.record(nbytes, nbytes, launch_seconds)

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            t0 = time.perf_counter()
            self._work.wait()
            self._stats.record(0, 0, time.perf_counter() - t0, collectives=0)
            self._work = None
        return self.result


def all_reduce_sum(buf: torch.Tensor, group, stats: CommStats,
                   async_op: bool = False) -> torch.Tensor | Pending:
    """Sum ``buf`` in place over ``group``, recording bytes and seconds.

    With ``async_op`` returns a :class:`Pending` whose ``wait()`` gives ``buf``.
    """
    n = group_size(group)
    if n <= 1:
        return Pending(buf) if async_op else buf
    nbytes = all_reduce_bytes(buf.numel(), buf.element_size(), n)
    t0 = time.perf_counter()
    work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    if async_op:
        return Pending(buf, work, stats, nbytes, time.perf_counter() - t0)
    stats.record(nbytes, nbytes, time.perf_counter() - t0)
    return buf


def all_gather(buf: torch.Tensor, group, stats: CommStats,
               async_op: bool = False) -> torch.Tensor | Pending:
    """Gather the 1-D ``buf`` of every rank of ``group``: returns ``(group_size, len(buf))``.

    With ``async_op`` returns a :class:`Pending` whose ``wait()`` gives that tensor.
    """
    n = group_size(group)
    if n <= 1:
        return Pending(buf.unsqueeze(0)) if async_op else buf.unsqueeze(0)
    out = torch.empty(n * buf.numel(), dtype=buf.dtype, device=buf.device)
    nbytes = all_gather_bytes(buf.numel() * buf.element_size(), n)
    t0 = time.perf_counter()
    work = _all_gather_single(out, buf, group=group, async_op=async_op)
    result = out.view(n, buf.numel())
    if async_op:
        return Pending(result, work, stats, nbytes, time.perf_counter() - t0)
    stats.record(nbytes, nbytes, time.perf_counter() - t0)
    return result
