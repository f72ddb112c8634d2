"""Replicators that send a subset of a momentum's entries, chosen identically on every replica.

Per parameter and step: ``buf = decay * buf + s * grad`` (``s`` = learning rate when
``scale_by_lr``, else 1); the entries of a shared index set ``S`` are sent (values only: every
replica knows ``S``, so no indices cross the link); ``buf[S] = 0`` (error feedback); the output
is the mean of the sent values at ``S`` and zero elsewhere, optionally ``sign()``-ed. All
parameters' values travel in one fp32 all-reduce per step. ``rate`` is the fraction of a
parameter's entries sent per step (at least one entry).

* :class:`RandomReplicator`: ``S`` drawn from a generator seeded by ``(seed, step, parameter)``
  (entries may repeat within a step; a repeat carries the same value twice);
* :class:`StridingReplicator`: every ``round(1/rate)``-th entry, the offset advancing each
  step, so every entry is sent once per ``round(1/rate)`` steps;
* :class:`SlicingReplicator`: a contiguous slice, advancing (and wrapping) each step.
"""

from __future__ import annotations

import math

import torch

from ..comm import all_reduce_sum
from .base import Replicator, all_finite, check_flags, presence_code


class _SubsetReplicator(Replicator):
    def __init__(self, rate: float = 1 / 64, decay: float = 0.999, *, sign: bool = True,
                 scale_by_lr: bool = True, **schedule) -> None:
        super().__init__(**schedule)
        if not isinstance(rate, (int, float)) or not 0.0 < rate <= 1.0:
            raise ValueError(f"rate must be a fraction in (0, 1], got {rate!r}")
        if not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must be a number in [0, 1], got {decay!r}")
        self.rate, self.decay, self.sign, self.scale_by_lr = float(rate), float(decay), sign, \
            scale_by_lr

    def extra_repr(self) -> str:
        return f"rate={self.rate}, decay={self.decay}, sign={self.sign}"

    def _setup_state(self) -> None:
        self.counts = [0 if s.numel() == 0 else self._count(s.numel()) for s in self._shapes]
        self.buffers = [torch.zeros(s.numel(), dtype=torch.float32, device=self.device)
                        for s in self._shapes]
        self._total = sum(self.counts)
        self._bucket = torch.zeros(self._total + 2 * self.world, dtype=torch.float32,
                                   device=self.device)

    def _count(self, numel: int) -> int:
        return max(1, math.ceil(self.rate * numel))

    def indices(self, i: int, step: int) -> torch.Tensor:
        """The shared index set of parameter ``i`` at ``step`` (flat positions)."""
        raise NotImplementedError

    def payload_bytes(self) -> int:
        return self._bucket.numel() * 4

    def replicate(self, grads, lrs, step, communicate):
        present = [g for g in grads if g is not None]
        bad = not all_finite(present)
        code = presence_code(grads)
        n = self.world if communicate else 1
        flat, trailer = self._bucket[: self._total], self._bucket[self._total:]
        sets: list = []
        off = 0
        for i, g in enumerate(grads):
            m = self.counts[i]
            seg = flat[off: off + m]
            off += m
            if g is None or m == 0 or bad:
                seg.zero_()
                sets.append(None)
                continue
            buf = self.buffers[i]
            buf.mul_(self.decay).add_(g.reshape(-1), alpha=lrs[i] if self.scale_by_lr else 1.0)
            idx = self.indices(i, step)
            seg.copy_(buf[idx])
            buf[idx] = 0.0
            sets.append(idx)
        if communicate:
            trailer.zero_()
            trailer[self.rank] = float(bad)
            trailer[self.world + self.rank] = float(code)
            sent = flat.clone()
            all_reduce_sum(self._bucket, self.group, self.stats)
            t = trailer.tolist()
            try:
                check_flags(self.name, t[: self.world], t[self.world:], code, step)
            except Exception:
                off = 0
                for i, idx in enumerate(sets):
                    if idx is not None:
                        self.buffers[i][idx] = sent[off: off + self.counts[i]]
                    off += self.counts[i]
                raise
            flat.div_(n)
        else:
            check_flags(self.name, [float(bad)], [float(code)], code, step)
        off = 0
        for i, g in enumerate(grads):
            m = self.counts[i]
            if g is not None and m:
                out = g.view(-1) if g.is_contiguous() else torch.empty_like(g).view(-1)
                out.zero_()
                out[sets[i]] = flat[off: off + m].to(out.dtype)
                if self.sign:
                    out.sign_()
                if out.data_ptr() != g.data_ptr():
                    g.copy_(out.view_as(g))
            off += m
        return grads

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["buffers"] = [b.clone() for b in self.buffers]
        return sd

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        bufs = state["buffers"]
        if len(bufs) != len(self.buffers) or any(
                a.shape != b.shape for a, b in zip(self.buffers, bufs)):
            raise ValueError(f"{self.name}: saved buffers do not match this model's parameters")
        for a, b in zip(self.buffers, bufs):
            a.copy_(b)


class RandomReplicator(_SubsetReplicator):
    """Send a random subset of entries chosen from a seed shared by all replicas."""

    name = "random"

    def __init__(self, rate: float = 1 / 64, decay: float = 0.999, *, seed: int = 0,
                 **kwargs) -> None:
        super().__init__(rate, decay, **kwargs)
        self.seed = int(seed)

    def indices(self, i: int, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 65_537 + i)
        idx = torch.randint(self._shapes[i].numel(), (self.counts[i],), generator=gen)
        return idx.to(self.device)


class StridingReplicator(_SubsetReplicator):
    """Send every ``round(1/rate)``-th entry; the offset advances by one each step.

    Every entry is sent exactly once per ``round(1/rate)`` steps; when the stride does not
    divide the tensor, the last stride wraps around and repeats one entry.
    """

    name = "striding"

    @property
    def stride(self) -> int:
        return max(1, round(1 / self.rate))

    def _count(self, numel: int) -> int:
        return math.ceil(numel / min(self.stride, numel))

    def indices(self, i: int, step: int) -> torch.Tensor:
        numel = self._shapes[i].numel()
        stride = min(self.stride, numel)
        idx = torch.arange(self.counts[i], device=self.device) * stride + step % stride
        return idx % numel


class SlicingReplicator(_SubsetReplicator):
    """Send a contiguous slice of entries; the slice advances (wrapping) each step."""

    name = "slicing"

    def indices(self, i: int, step: int) -> torch.Tensor:
        numel, m = self._shapes[i].numel(), self.counts[i]
        start = (step * m) % numel
        return (torch.arange(m, device=self.device) + start) % numel
