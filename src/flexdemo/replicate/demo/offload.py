"""DeMo's momentum in host memory (``offload=True``): each group's coefficients are brought
to the device for its encode (and for error feedback) into one buffer of the largest group,
and sent back after, so the device holds one group of momentum, not the model's.

On CUDA the host copy is pinned and both copies are asynchronous on the current stream
(stream order keeps them correct; a read of the host copy, a checkpoint, synchronises first).
Off CUDA the same path runs between two host buffers (the same bits as ``offload=False``,
tested), so it is exercised everywhere."""

from __future__ import annotations

import torch

from .layout import Group


class HostMomentum:
    """Brings one group's momentum at a time to the device (see the module's docstring).

    ``groups``: the layout's groups, their ``coef`` in host memory at set-up; not
    ``enabled``: the momentum stays where it is and every call returns at once."""

    def __init__(self, groups: list[Group], device: torch.device, enabled: bool) -> None:
        self.device, self.enabled = device, enabled
        most = max([g.coef.numel() for g in groups] + [1]) if enabled else 0
        self.buf = torch.zeros(most, dtype=torch.float32, device=device)
        self.host: Group | None = None  # the group on the device now, and its host copy
        self.host_coef: torch.Tensor | None = None

    def bring(self, g: Group) -> None:
        """Group ``g``'s momentum onto the device (``g.coef`` is then the device copy); the
        group there before goes back first."""
        if not self.enabled or self.host is g:
            return
        self.send()
        dev = self.buf[: g.coef.numel()].view_as(g.coef)
        dev.copy_(g.coef, non_blocking=True)
        self.host, self.host_coef, g.coef = g, g.coef, dev

    def send(self) -> None:
        """The group on the device back to host memory (``g.coef`` the host copy again)."""
        g, host = self.host, self.host_coef
        if g is None or host is None:
            return
        host.copy_(g.coef, non_blocking=True)
        g.coef, self.host, self.host_coef = host, None, None

    def settle(self) -> None:
        """Every group's host copy complete (before the host reads it: a checkpoint)."""
        self.send()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
