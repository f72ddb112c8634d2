"""Module buffers across replicas (BatchNorm running statistics and the like).

Policy (``prepare(..., buffers="mean")``, the default): whenever the optimizer's replicators
exchange anything in a step, the floating-point buffers of the model are averaged over every
rank of the job, in one all-reduce (all buffers of one dtype in one flat tensor). Reasons:

* Buffers are not parameters: no gradient reaches them and no replicator sees them, so
  without a rule every replica (and, under FSDP2, which leaves buffers unsharded, every rank
  of a replica) keeps statistics of its own data only and the copies drift apart silently.
* The mean is what one process would have estimated from all ranks' batches (for running
  means exactly, for running variances up to the spread between ranks' means), and it is
  bitwise the same on every rank afterwards, so replicas stay identical where the replicators
  keep the parameters identical.
* Averaging only on steps that exchange keeps the schedule of the slow link: DiLoCo or
  ``replicate_every`` runs pay nothing on their local steps. Buffers are small (a BatchNorm
  layer holds two vectors of its width), so the cost on an exchanging step is one short
  message.

Integer buffers (``num_batches_tracked``) are left alone: every replica counts the same
forward passes, so they agree without traffic. ``buffers="none"`` keeps every buffer local.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from .transport import CommStats, all_reduce_bytes

BUFFER_POLICIES = ("mean", "none")


class BufferSync:
    """Averages floating-point buffers over ``group`` in one all-reduce per dtype."""

    def __init__(self, buffers: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None
                 ) -> None:
        self.all_buffers = list(buffers)
        self.buffers = [b for b in self.all_buffers if b.is_floating_point() and b.numel()]
        self.group = group
        self.stats = CommStats()
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1

    @torch.no_grad()
    def __call__(self) -> None:
        """Average the buffers (collective over the group; every rank must call it)."""
        self.stats.begin_step()
        if self.world <= 1 or not self.buffers:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in self.buffers:
            by_dtype.setdefault(b.dtype, []).append(b)
        for bufs in by_dtype.values():
            flat = torch.cat([b.reshape(-1) for b in bufs])
            dist.all_reduce(flat, group=self.group)
            flat.div_(self.world)
            torch._foreach_copy_(bufs, [v.view_as(b) for v, b in
                                        zip(flat.split([b.numel() for b in bufs]), bufs)])
            n = all_reduce_bytes(flat.numel(), flat.element_size(), self.world)
            self.stats.record(n, n, 0.0)

    def __len__(self) -> int:
        return len(self.buffers)
