"""The transport interface and the collectives, with byte and time accounting.

A replicator names the replicas it talks to by a *group*: a ``torch.distributed`` process group
(served by :class:`ProcessGroupTransport`, one replica per process) or an
:class:`~flexdemo.transport.InProcessTransport` (one replica's view of N replicas simulated in
one process, see :mod:`flexdemo.simulate`). The functions below (:func:`all_gather`,
:func:`all_reduce_sum`, :func:`gather_into`, :func:`group_size`, :func:`group_rank`,
:func:`global_rank`, :func:`group_ranks`) take either kind of group; they are the only place in
the library that runs collectives, and they count bytes the same way for both.

Byte counts follow the ring algorithms that gloo and NCCL use for large messages, per rank,
for a group of ``n`` ranks and a buffer of ``B`` bytes (``E`` elements of ``s`` bytes):

* all-reduce: reduce-scatter then all-gather, each moving ``n - 1`` of ``n`` chunks:
  sent = received = ``2 * (n - 1) * ceil(E / n) * s`` (``2 (n-1)/n * B`` when ``n`` divides ``E``);
* all-gather of ``B`` bytes from every rank: sent = received = ``(n - 1) * B``;
* all-to-all of ``B`` bytes in ``n`` equal parts: sent = received = ``(n - 1) * B / n``;
* a group of one rank moves nothing and calls no collective.

Seconds are wall-clock time spent inside the (blocking) collective on this rank.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Literal, overload

import torch
import torch.distributed as dist

__all__ = ["CommStats", "Pending", "PeerLostError", "ProcessGroupTransport", "Transport",
           "all_gather",
           "all_gather_bytes", "all_reduce_bytes", "all_reduce_sum", "all_to_all",
           "all_to_all_bytes", "all_to_all_equal", "gather_into", "global_rank", "group_rank",
           "group_ranks", "group_size", "transport_for"]


class PeerLostError(RuntimeError):
    """A peer died, left or became unreachable, so a collective failed; ``lost_ranks`` names
    the lost ranks where they are known (empty otherwise). Raised by the fault-tolerant
    group's transport (:class:`~flexdemo.transport.ManagerTransport`: the step is not
    committed and is undone) and by ``flexdemo train`` once its heartbeats told which rank
    was lost."""

    def __init__(self, message: str, lost_ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.lost_ranks = lost_ranks or []


def all_reduce_bytes(numel: int, element_size: int, group_size: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``numel`` elements."""
    n = group_size
    if n <= 1:
        return 0
    return 2 * (n - 1) * math.ceil(numel / n) * element_size


def all_gather_bytes(nbytes_per_rank: int, group_size: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-gather of ``nbytes_per_rank`` each."""
    return max(group_size - 1, 0) * nbytes_per_rank


def all_to_all_bytes(nbytes: int, group_size: int) -> int:
    """Bytes one rank sends (and receives) in an all-to-all of ``nbytes`` split in equal parts
    over ``group_size`` ranks: every part but its own."""
    n = group_size
    return 0 if n <= 1 else (n - 1) * (nbytes // n)


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


# ---------------------------------------------------------------------- transports
class Transport(ABC):
    """Moves tensors between the replicas of one group; this replica is ``rank`` of ``size``.

    Collectives return ``None`` (done) or, with ``async_op``, a handle whose ``wait()``
    completes them; the caller must not touch the buffers before that.
    """

    size: int
    rank: int

    @abstractmethod
    def global_rank(self, r: int) -> int:
        """The global rank (process rank, or replica index) of the group's rank ``r``."""

    def ranks(self) -> list[int]:
        """Global ranks of the group's members, in group-rank order."""
        return [self.global_rank(r) for r in range(self.size)]

    @abstractmethod
    def all_reduce_sum_(self, buf: torch.Tensor, async_op: bool = False):
        """Sum ``buf`` over the group, in place."""

    @abstractmethod
    def all_gather_into(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        """Write every rank's ``inp`` (flattened) into ``out``, concatenated in rank order."""

    def all_to_all_equal_(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        """All-to-all of equal parts: ``inp`` (flat) is ``size`` equal parts, part ``r`` going
        to rank ``r``; ``out`` receives rank ``r``'s part for this rank at part ``r``.
        Optional: a transport without it raises ``NotImplementedError``."""
        raise NotImplementedError(f"{type(self).__name__} has no all-to-all")


# torch >= 2.12 names the single-tensor all-gather ``all_gather_single``
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ProcessGroupTransport(Transport):
    """A ``torch.distributed`` process group (``None``: the default group, if initialised)."""

    def __init__(self, group=None) -> None:
        self.group = group
        self.initialized = dist.is_initialized()
        self.size = dist.get_world_size(group) if self.initialized else 1
        self.rank = dist.get_rank(group) if self.initialized else 0

    def global_rank(self, r: int) -> int:
        if not self.initialized or self.group is None or self.group is dist.group.WORLD:
            return r
        return dist.get_global_rank(self.group, r)

    def all_reduce_sum_(self, buf, async_op=False):
        return dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)

    def all_gather_into(self, out, inp, async_op=False):
        return _all_gather_single(out, inp, group=self.group, async_op=async_op)

    def all_to_all_equal_(self, out, inp, async_op=False):
        return dist.all_to_all_single(out.view(-1), inp.view(-1), group=self.group,
                                      async_op=async_op)

    def all_to_all_into(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                        in_splits: list[int]) -> None:
        """Send ``in_splits[r]`` elements of the 1-D ``inp`` to rank ``r``, in rank order;
        receive ``out_splits[r]`` from rank ``r`` into ``out``."""
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)


def transport_for(group) -> Transport:
    """The transport serving ``group`` (a :class:`Transport`, a process group, or ``None``)."""
    if isinstance(group, Transport):
        return group
    return ProcessGroupTransport(group)


# ---------------------------------------------------------------------- collectives
def gather_into(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """All-gather ``inp`` of every rank into ``out`` (concatenated in rank order)."""
    transport_for(group).all_gather_into(out, inp)


def all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
               in_splits: list[int], group) -> None:
    """All-to-all of 1-D buffers over a process group (see
    :meth:`ProcessGroupTransport.all_to_all_into`); the caller counts the bytes."""
    tr = transport_for(group)
    if not isinstance(tr, ProcessGroupTransport):
        raise TypeError(f"an all-to-all needs a torch.distributed process group, not {tr!r}")
    tr.all_to_all_into(out, inp, out_splits, in_splits)


def group_size(group) -> int:
    """Number of ranks in ``group`` (1 without torch.distributed)."""
    if isinstance(group, Transport):
        return group.size
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group) -> int:
    """This replica's rank in ``group`` (0 without torch.distributed)."""
    if isinstance(group, Transport):
        return group.rank
    return dist.get_rank(group) if dist.is_initialized() else 0


def global_rank(group, r: int) -> int:
    """The global rank of ``group``'s rank ``r`` (for messages naming a peer)."""
    return transport_for(group).global_rank(r)


def group_ranks(group) -> list[int]:
    """The global ranks of ``group``'s members, in group-rank order."""
    return transport_for(group).ranks()


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
            assert stats is not None, "an asynchronous collective records into stats"
            stats.record(nbytes, nbytes, launch_seconds)

    def done(self) -> bool:
        """Whether it has completed (a look, no wait)."""
        return self._work is None or bool(self._work.is_completed())

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            t0 = time.perf_counter()
            self._work.wait()
            assert self._stats is not None
            self._stats.record(0, 0, time.perf_counter() - t0, collectives=0)
            self._work = None
        return self.result


@overload
def all_reduce_sum(buf: torch.Tensor, group, stats: CommStats,
                   async_op: Literal[False] = False) -> torch.Tensor: ...
@overload
def all_reduce_sum(buf: torch.Tensor, group, stats: CommStats,
                   async_op: Literal[True]) -> Pending: ...
@overload
def all_reduce_sum(buf: torch.Tensor, group, stats: CommStats,
                   async_op: bool = False) -> torch.Tensor | Pending: ...
def all_reduce_sum(buf: torch.Tensor, group, stats: CommStats,
                   async_op: bool = False) -> torch.Tensor | Pending:
    """Sum ``buf`` in place over ``group``, recording bytes and seconds.

    With ``async_op`` returns a :class:`Pending` whose ``wait()`` gives ``buf``.
    """
    tr = transport_for(group)
    n = tr.size
    if n <= 1:
        return Pending(buf) if async_op else buf
    nbytes = all_reduce_bytes(buf.numel(), buf.element_size(), n)
    t0 = time.perf_counter()
    work = tr.all_reduce_sum_(buf, async_op=async_op)
    if async_op:
        return Pending(buf, work, stats, nbytes, time.perf_counter() - t0)
    stats.record(nbytes, nbytes, time.perf_counter() - t0)
    return buf


@overload
def all_gather(buf: torch.Tensor, group, stats: CommStats,
               async_op: Literal[False] = False) -> torch.Tensor: ...
@overload
def all_gather(buf: torch.Tensor, group, stats: CommStats,
               async_op: Literal[True]) -> Pending: ...
@overload
def all_gather(buf: torch.Tensor, group, stats: CommStats,
               async_op: bool = False) -> torch.Tensor | Pending: ...
def all_gather(buf: torch.Tensor, group, stats: CommStats,
               async_op: bool = False) -> torch.Tensor | Pending:
    """Gather the 1-D ``buf`` of every rank of ``group``: returns ``(group_size, len(buf))``.

    With ``async_op`` returns a :class:`Pending` whose ``wait()`` gives that tensor.
    """
    tr = transport_for(group)
    n = tr.size
    if n <= 1:
        return Pending(buf.unsqueeze(0)) if async_op else buf.unsqueeze(0)
    out = torch.empty(n * buf.numel(), dtype=buf.dtype, device=buf.device)
    nbytes = all_gather_bytes(buf.numel() * buf.element_size(), n)
    t0 = time.perf_counter()
    work = tr.all_gather_into(out, buf, async_op=async_op)
    result = out.view(n, buf.numel())
    if async_op:
        return Pending(result, work, stats, nbytes, time.perf_counter() - t0)
    stats.record(nbytes, nbytes, time.perf_counter() - t0)
    return result


@overload
def all_to_all_equal(out: torch.Tensor, inp: torch.Tensor, group, stats: CommStats,
                     async_op: Literal[False] = False) -> torch.Tensor: ...
@overload
def all_to_all_equal(out: torch.Tensor, inp: torch.Tensor, group, stats: CommStats,
                     async_op: Literal[True]) -> Pending: ...
@overload
def all_to_all_equal(out: torch.Tensor, inp: torch.Tensor, group, stats: CommStats,
                     async_op: bool = False) -> torch.Tensor | Pending: ...
def all_to_all_equal(out: torch.Tensor, inp: torch.Tensor, group, stats: CommStats,
                     async_op: bool = False) -> torch.Tensor | Pending:
    """All-to-all of equal parts over ``group`` (see :meth:`Transport.all_to_all_equal_`),
    recording bytes (``(n - 1) / n`` of ``inp`` sent and received) and seconds. Returns
    ``out`` (with ``async_op``, a :class:`Pending` whose ``wait()`` gives it)."""
    tr = transport_for(group)
    n = tr.size
    if n <= 1:
        out.copy_(inp)
        return Pending(out) if async_op else out
    nbytes = all_to_all_bytes(inp.numel() * inp.element_size(), n)
    t0 = time.perf_counter()
    work = tr.all_to_all_equal_(out, inp, async_op=async_op)
    if async_op:
        return Pending(out, work, stats, nbytes, time.perf_counter() - t0)
    stats.record(nbytes, nbytes, time.perf_counter() - t0)
    return out
