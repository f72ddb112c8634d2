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

from ..transport import all_reduce_bytes, all_reduce_sum
from .agreement import Agreement, nonfinite_flag, zero_where
from .base import Replicator
from .full import FlatLayout


class _SubsetReplicator(Replicator):
    """The shared step. All parameters' momenta live in one flat buffer; the index sets of a
    step are computed for all parameters at once from per-entry tables built at setup, so a
    step runs a fixed number of ops whatever the number of parameters."""

    keeps_replica_state = True  # its momenta

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

    syncs_replicas = True
    state_tensor_keys = ("buffers",)  # the momenta (error feedback): per replica
    fault_tolerant = True

    def _group_resized(self) -> None:  # the bucket's trailer; the momenta stay
        self._bucket = torch.zeros(self._total + Agreement.trailer_size(self.world),
                                   dtype=torch.float32, device=self.device)

    def reset_replica_state(self) -> None:
        with torch.no_grad():
            torch._foreach_zero_(self.buffers)

    def _setup_state(self) -> None:
        numels = [s.numel() for s in self._local_shapes]
        self.counts = [0 if n == 0 else self._count(n) for n in numels]
        flat_shapes = [torch.Size([n]) for n in numels]
        self.momentum = FlatLayout(flat_shapes, self.device)  # the momenta, end to end
        self.buffers = self.momentum.views  # one 1-D view per parameter
        self.work = FlatLayout(self._local_shapes, self.device)  # gradients in, outputs out
        self._work_1d = [v.view(-1) for v in self.work.views]
        self._total = sum(self.counts)
        self._bucket = torch.zeros(self._total + Agreement.trailer_size(self.world),
                                   dtype=torch.float32, device=self.device)
        # per sent entry: its parameter's offset in the flat momentum, size, count, and its
        # position among its parameter's entries
        off = [0]
        for n in numels:
            off.append(off[-1] + n)
        rows = [(off[i], numels[i], m, j) for i, m in enumerate(self.counts) for j in range(m)]

        def table(k: int) -> torch.Tensor:
            return torch.tensor([r[k] for r in rows], dtype=torch.int64, device=self.device)

        self._ent_off, self._ent_numel, self._ent_count, self._ent_pos = (table(k)
                                                                          for k in range(4))
        self._pos = [0]
        for m in self.counts:
            self._pos.append(self._pos[-1] + m)
        self._sel_plans: dict[tuple, torch.Tensor | None] = {}

    def _count(self, numel: int) -> int:
        return max(1, math.ceil(self.rate * numel))

    def _local_indices(self, step: int) -> torch.Tensor:
        """Every sent entry's position within its parameter at ``step`` (one tensor)."""
        raise NotImplementedError

    def indices(self, i: int, step: int) -> torch.Tensor:
        """The shared index set of parameter ``i`` at ``step`` (flat positions)."""
        return self._local_indices(step)[self._pos[i]: self._pos[i + 1]]

    def payload_bytes(self) -> int:
        return self._bucket.numel() * 4

    def exchange_bytes(self) -> int:
        return all_reduce_bytes(self._bucket.numel(), 4, self.world)

    def _selected(self, grads) -> torch.Tensor | None:
        """Positions (in the payload) of the entries of parameters that have a gradient;
        None when all have one. Built once per pattern of missing gradients."""
        key = tuple(g is None for g in grads)
        if key not in self._sel_plans:
            pos = [p for i, g in enumerate(grads) if g is not None
                   for p in range(self._pos[i], self._pos[i + 1])]
            self._sel_plans[key] = None if len(pos) == self._total else torch.tensor(
                pos, dtype=torch.int64, device=self.device)
        return self._sel_plans[key]

    def _accumulate(self, present: list[int], lrs, decay) -> None:
        """``buf = decay * buf + s * grad`` for the parameters with a gradient (the gradients
        wait in the work buffer); one op per distinct learning rate."""
        if not present:
            return
        bufs = [self.buffers[i] for i in present]
        grads = [self._work_1d[i] for i in present]
        torch._foreach_mul_(bufs, decay)
        scales: dict[float, list[int]] = {}
        for j, i in enumerate(present):
            scales.setdefault(float(lrs[i]) if self.scale_by_lr else 1.0, []).append(j)
        for s, js in scales.items():
            if len(js) == len(present):
                torch._foreach_add_(bufs, grads, alpha=s)
            else:
                torch._foreach_add_([bufs[j] for j in js], [grads[j] for j in js], alpha=s)

    def replicate(self, grads, lrs, step, communicate):
        present, _, _ = self.work.plan(grads)
        if not self._total or (not present and not communicate):
            self.agreement.check_local(nonfinite_flag(grads, self.device), step)
            return grads
        self.work.fill(grads)
        flag, code = self.agreement.local([self.work.flat], grads)
        decay: torch.Tensor | float
        if communicate:
            # a rank with a non-finite input leaves its momentum as it was: decay by one, add
            # zeros (decided on the device; every rank raises after the exchange)
            zero_where(self.work.flat, flag)
            decay = torch.where(flag, 1.0, self.decay)
        else:
            self.agreement.check_local(flag, step)
            decay = self.decay
        self._accumulate(present, lrs, decay)
        mom = self.momentum.flat
        index = self._local_indices(step) + self._ent_off  # positions in the flat momentum
        sel = self._selected(grads)
        flat, trailer = self._bucket[: self._total], self._bucket[self._total:]
        if sel is None:
            torch.index_select(mom, 0, index, out=flat)
        else:  # parameters without a gradient send zeros and keep their momentum
            index = index[sel]
            flat.zero_()
            flat.index_copy_(0, sel, mom[index])
        mom.index_fill_(0, index, 0.0)  # error feedback: what is sent leaves the momentum
        if communicate:
            self.agreement.write_trailer(trailer, flag, code)
            sent = flat.clone() if sel is None else flat[sel]
            all_reduce_sum(self._bucket, self.transport, self.stats)
            try:
                self.agreement.read_trailer(trailer, code, step)
            except Exception:
                mom.index_put_((index,), sent)  # undo the error feedback
                raise
            flat.div_(self.world)
        out = self.work.flat
        out.zero_()
        out.index_put_((index,), flat if sel is None else flat[sel])
        if self.sign:
            out.sign_()
        self.work.scatter(grads)
        return grads

    def state_dict(self) -> dict:
        return self._state(copy=True)

    def live_state(self) -> dict:
        return self._state(copy=False)

    def _state(self, copy: bool) -> dict:
        return {**super().state_dict(),
                "buffers": [b.clone() if copy else b for b in self.buffers]}

    def state_tensors(self) -> list[torch.Tensor]:
        return list(self.buffers)

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        bufs = state["buffers"]
        if len(bufs) != len(self.buffers) or any(
                a.shape != b.shape for a, b in zip(self.buffers, bufs)):
            raise ValueError(f"{self.name}: saved buffers do not match this model's parameters")
        torch._foreach_copy_(self.buffers, [b.to(self.device) for b in bufs])


class RandomReplicator(_SubsetReplicator):
    """Send a random subset of entries chosen from a seed shared by all replicas.

    One draw per step for all parameters, from a generator on the replicas' device seeded by
    ``(seed, step)``; entries may repeat within a step (a repeat carries the same value twice).
    """

    name = "random"

    def __init__(self, rate: float = 1 / 64, decay: float = 0.999, *, seed: int = 0,
                 **kwargs) -> None:
        super().__init__(rate, decay, **kwargs)
        self.seed = int(seed)

    def _setup_state(self) -> None:
        super()._setup_state()
        self._gen = torch.Generator(device=self.device)
        self._ent_numel_f = self._ent_numel.to(torch.float64)

    def _local_indices(self, step: int) -> torch.Tensor:
        self._gen.manual_seed((self.seed * 1_000_003 + step) * 65_537)
        u = torch.rand(self._total, generator=self._gen, dtype=torch.float64,
                       device=self.device)
        idx = (u * self._ent_numel_f).to(torch.int64)
        return torch.minimum(idx, self._ent_numel - 1)


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

    def _setup_state(self) -> None:
        super()._setup_state()
        self._ent_stride = torch.clamp(self._ent_numel, max=self.stride)

    def _local_indices(self, step: int) -> torch.Tensor:
        s = self._ent_stride
        return (self._ent_pos * s + step % s) % self._ent_numel


class SlicingReplicator(_SubsetReplicator):
    """Send a contiguous slice of entries; the slice advances (wrapping) each step."""

    name = "slicing"

    def _local_indices(self, step: int) -> torch.Tensor:
        n = self._ent_numel
        return (self._ent_pos + (step * self._ent_count) % n) % n
