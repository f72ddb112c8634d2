"""DeMo's momentum away from the step's fp32 buffers: in host memory (``offload=True``), in
bf16 (``momentum_dtype="bf16"``), or both. Each group's coefficients are brought to the
device for its encode (and for error feedback) into one fp32 buffer of the largest group, and
sent back after, so the device holds one group of fp32 momentum, not the model's.

On CUDA the host copy is pinned and both copies are asynchronous on the current stream
(stream order keeps them correct; a read of the host copy, a checkpoint, synchronises first).
Off CUDA the same path runs between two host buffers (the same bits as ``offload=False``,
tested), so it is exercised everywhere.

In bf16 a group is widened on its way in (exact) and rounded stochastically on its way back
(:mod:`..rounding`), with random bits of the key (step, rank, group, sends of the group in
the step): unbiased, so ``0.999 * m`` still decays, and the same on a resumed run. Offloaded,
the rounding happens on the device into a bf16 buffer of the largest group, which then goes
to host memory (half the bytes across the link)."""

from __future__ import annotations

import torch

from ..rounding import StochasticRounding
from .layout import Group


class HostMomentum:
    """Brings one group's momentum at a time to the device (see the module's docstring).

    ``groups``: the layout's groups, their ``coef`` where the momentum is stored (host memory
    under ``offload``, in ``dtype``); fp32 on the device: the momentum stays where it is and
    every call returns at once."""

    def __init__(self, groups: list[Group], device: torch.device, offload: bool,
                 dtype: torch.dtype = torch.float32) -> None:
        self.device, self.low = device, dtype != torch.float32
        self.enabled = offload or self.low
        most = max([g.coef.numel() for g in groups] + [1]) if self.enabled else 0
        self.buf = torch.zeros(most, dtype=torch.float32, device=device)
        # offloaded bf16: the rounded group on the device, on its way to host memory
        self.low_buf = (torch.zeros(most, dtype=dtype, device=device) if self.low and offload
                        else None)
        self.rounding = StochasticRounding(device) if self.low else None
        self.index = {id(g): i for i, g in enumerate(groups)}
        self.key: tuple[int, int] = (0, 0)  # (step, rank): set by :meth:`begin`
        self.sends: dict[int, int] = {}  # sends of each group in this step
        self.host: Group | None = None  # the group on the device now, and its stored copy
        self.host_coef: torch.Tensor | None = None

    def begin(self, step: int, rank: int) -> None:
        """A step starts: the key of its random bits (bf16)."""
        self.key, self.sends = (int(step), int(rank)), {}

    def bring(self, g: Group) -> None:
        """Group ``g``'s momentum onto the device in fp32 (``g.coef`` is then the device
        copy); the group there before goes back first."""
        if not self.enabled or self.host is g:
            return
        self.send()
        n = g.coef.numel()
        dev = self.buf[:n].view_as(g.coef)
        if self.low_buf is not None:  # bf16 across the link, widened on the device
            dev.copy_(self.low_buf[:n].view_as(g.coef).copy_(g.coef, non_blocking=True))
        else:
            dev.copy_(g.coef, non_blocking=True)
        self.host, self.host_coef, g.coef = g, g.coef, dev

    def send(self) -> None:
        """The group on the device back where it is stored (``g.coef`` the stored copy
        again)."""
        g, host = self.host, self.host_coef
        if g is None or host is None:
            return
        if self.rounding is not None:
            gi = self.index[id(g)]
            k = self.sends[gi] = self.sends.get(gi, -1) + 1
            n = host.numel()
            low = host if self.low_buf is None else self.low_buf[:n].view_as(host)
            self.rounding.round_into(g.coef, low, *self.key, gi, k)
            if low is not host:
                host.copy_(low, non_blocking=True)
        else:
            host.copy_(g.coef, non_blocking=True)
        g.coef, self.host, self.host_coef = host, None, None

    def settle(self) -> None:
        """Every group's stored copy complete (before the host reads it: a checkpoint)."""
        self.send()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
