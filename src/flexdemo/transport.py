"""Transports: how replicators' payloads move between replicas, with byte and time accounting.

A replicator names the replicas it talks to by a *group*: a ``torch.distributed`` process group
(served by :class:`ProcessGroupTransport`, one replica per process) or an
:class:`InProcessTransport` (one replica's view of N replicas simulated in one process, see
:mod:`flexdemo.simulate`). The functions below (:func:`all_gather`, :func:`all_reduce_sum`,
:func:`gather_into`, :func:`group_size`, :func:`group_rank`, :func:`global_rank`,
:func:`group_ranks`) take either kind of group; they are the only place in the library that
runs collectives, and they count bytes the same way for both.

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
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal, overload

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


class ReplicaAbortedError(RuntimeError):
    """A simulated collective could not complete: a peer replica failed, left or timed out."""


class InProcessHub:
    """The meeting point of ``world`` replicas simulated in one process (one thread each).

    Every collective is a *round*: each replica deposits its tensor and waits; the last one to
    arrive checks that all called the same collective on alike buffers and combines the deposits
    once (concatenates or sums them) while the others are still blocked, so no deposit is copied
    or changed under it. Every replica then copies the shared result into its own output (the
    next round, which would replace it, needs every replica's deposit: all have read it by
    then). Cost per round: one concatenation or sum, and one copy per replica. A replica that
    fails calls :meth:`abort`, one that returns calls :meth:`leave`; either ends every wait
    with :class:`ReplicaAbortedError`, as does waiting longer than ``timeout`` seconds.
    """

    def __init__(self, world: int, timeout: float = 300.0) -> None:
        if not isinstance(world, int) or isinstance(world, bool) or world < 1:
            raise ValueError(f"the number of replicas must be an integer >= 1, got {world!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        self.world, self.timeout = world, float(timeout)
        self._cond = threading.Condition()
        self.reset()

    def reset(self) -> None:
        """Start a fresh run: no deposits, no failures (call between runs, never during)."""
        with self._cond:
            self._deposits: list = [None] * self.world
            self._result: torch.Tensor | str | None = None
            self._round = 0
            self._arrived = 0
            self._left: set[int] = set()
            self._error: str | None = None

    def transport(self, rank: int) -> InProcessTransport:
        """Replica ``rank``'s view of the hub: pass it as a replicator's or optimizer's group."""
        return InProcessTransport(self, rank)

    def abort(self, reason: str) -> None:
        """End every pending and future wait of this run with ``reason``."""
        with self._cond:
            if self._error is None:
                self._error = reason
            self._cond.notify_all()

    def leave(self, rank: int) -> None:
        """Replica ``rank`` has finished its work of this run and joins no more collectives."""
        with self._cond:
            self._left.add(rank)
            self._cond.notify_all()

    def _fail(self, reason: str) -> ReplicaAbortedError:
        if self._error is None:
            self._error = reason
        self._cond.notify_all()
        return ReplicaAbortedError(self._error)

    def _complete(self, n: int, combine: Callable) -> None:
        """Close round ``n`` (the last replica has arrived; the lock is held)."""
        deposits, self._deposits = self._deposits, [None] * self.world
        sig = [(k, t.dtype, t.numel()) for k, t in deposits]
        if len(set(sig)) != 1:
            result = (f"collective #{n}: the replicas called different collectives or gave "
                      f"different buffers (kind, dtype, numel by replica: {sig})")
        else:
            try:
                result = combine([t for _, t in deposits])
            except Exception as e:  # noqa: BLE001 - every replica reports it
                result = f"collective #{n} failed: {type(e).__name__}: {e}"
        self._result = result
        self._round += 1
        self._arrived = 0
        self._cond.notify_all()

    def collective(self, rank: int, kind: str, tensor: torch.Tensor,
                   combine: Callable[[list[torch.Tensor]], torch.Tensor]) -> torch.Tensor:
        """Deposit ``tensor`` for a collective ``kind``; ``combine(deposits in rank order)``,
        computed once per round, is returned to every replica (shared: read it, never write)."""
        with self._cond:
            if self._error is not None:
                raise ReplicaAbortedError(self._error)
            n = self._round
            what = f"collective #{n} ({kind})"
            if self._left:
                raise self._fail(f"replica(s) {sorted(self._left)} finished their step while "
                                 f"replica {rank} entered {what}: the replicas ran different "
                                 "sequences of collectives")
            self._deposits[rank] = (kind, tensor.detach())
            self._arrived += 1
            if self._arrived == self.world:
                self._complete(n, combine)
            deadline = time.monotonic() + self.timeout
            while self._round == n:
                if self._error is not None:
                    raise ReplicaAbortedError(self._error)
                if self._left:
                    raise self._fail(
                        f"replica(s) {sorted(self._left)} finished their step while replica "
                        f"{rank} waited in {what}: the replicas ran different sequences of "
                        "collectives")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._fail(
                        f"replica {rank} waited {self.timeout:g} s in {what} for the other "
                        "replicas (one of them is stuck or runs other collectives)")
                self._cond.wait(left)
            result = self._result
        if isinstance(result, str):
            raise ReplicaAbortedError(result)
        assert result is not None  # set by _complete before the round advanced
        return result


class _Done:
    """The handle of an in-process collective: it completed when launched."""

    def wait(self) -> bool:
        return True


_DONE = _Done()
# gloo's ring all-reduce cuts a buffer into segments of at most this many bytes (measured: the
# position-dependent summation order below matches gloo bitwise only with this bound)
GLOO_MAX_SEGMENT_BYTES = 1 << 20


def ring_sum_(out: torch.Tensor, parts: list[torch.Tensor],
              max_segment_bytes: int = GLOO_MAX_SEGMENT_BYTES) -> torch.Tensor:
    """Sum the flat ``parts`` of ``n`` ranks into ``out`` in the order of gloo's ring all-reduce.

    gloo splits the buffer into ``n`` chunks (whole segments each; the last chunks may be short
    or empty); chunk ``c`` starts as rank ``c - 1``'s values and travels down the ring, each
    rank adding its own: ``((x[c-1] + x[c-2]) + ...) + x[c]`` (ranks modulo ``n``). Summing in
    this order gives gloo's result bit for bit (checked for fp32, bf16, fp64 on 2 to 5 ranks).
    """
    n, numel, es = len(parts), out.numel(), out.element_size()
    segments = max(2 * n, -(-numel * es // max_segment_bytes))
    segments = -(-segments // n) * n
    chunk = segments // n * -(-numel // segments)
    flat = out.view(-1)
    for c in range(n):
        a, b = c * chunk, min((c + 1) * chunk, numel)
        if a >= b:
            continue
        seg = flat[a:b]
        seg.copy_(parts[(c - 1) % n][a:b])
        for j in range(2, n + 1):
            seg.add_(parts[(c - j) % n][a:b])
    return out


def _ring_total(parts: list[torch.Tensor]) -> torch.Tensor:
    flat = [t.reshape(-1) for t in parts]
    return ring_sum_(torch.empty_like(flat[0]), flat)


def _concat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in parts])


class InProcessTransport(Transport):
    """Replica ``rank`` of an :class:`InProcessHub`: a group for N replicas in one process.

    Collectives complete when launched (``async_op`` returns a finished handle); all-reduce sums
    in gloo's ring order, so results match a gloo process group bit for bit.
    """

    def __init__(self, hub: InProcessHub, rank: int) -> None:
        if not 0 <= rank < hub.world:
            raise ValueError(f"rank {rank} is outside the hub's {hub.world} replicas")
        self.hub, self.rank, self.size = hub, rank, hub.world

    def global_rank(self, r: int) -> int:
        return r

    def all_reduce_sum_(self, buf, async_op=False):
        total = self.hub.collective(self.rank, "all_reduce", buf, _ring_total)
        buf.copy_(total.view_as(buf))
        return _DONE if async_op else None

    def all_gather_into(self, out, inp, async_op=False):
        gathered = self.hub.collective(self.rank, "all_gather", inp, _concat)
        out.view(-1).copy_(gathered)
        return _DONE if async_op else None

    def all_to_all_equal_(self, out, inp, async_op=False):
        gathered = self.hub.collective(self.rank, "all_to_all", inp, _concat)
        n, part = self.size, inp.numel() // self.size
        if part * n != inp.numel():
            raise ValueError(f"all-to-all: {inp.numel()} elements are not {n} equal parts")
        rows = gathered.view(n, n, part)[:, self.rank]  # each sender's part for this rank
        out.view(n, part).copy_(rows)
        return _DONE if async_op else None

    def __deepcopy__(self, memo) -> InProcessTransport:
        return self  # a group is shared, never copied (like a process group)

    def __repr__(self) -> str:
        return f"InProcessTransport(rank={self.rank}, size={self.size})"


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
