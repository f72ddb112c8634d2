"""The in-process transport: N replicas simulated in one process (one thread each) meet in an
:class:`InProcessHub`; each replica's :class:`InProcessTransport` is a group that the
collectives of :mod:`flexdemo.transport` accept like a process group. Sums follow gloo's ring
order (:func:`ring_sum_`), so the results equal N gloo processes' bit for bit."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from .core import Transport

__all__ = ["GLOO_MAX_SEGMENT_BYTES", "InProcessHub", "InProcessTransport",
           "ReplicaAbortedError", "ring_sum_"]


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
            except Exception as e:  # every replica reports it
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
