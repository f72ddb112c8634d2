"""Dense replicators: Full (average the gradient) and NoReplication."""

from __future__ import annotations

import torch

from ..comm import all_reduce_sum
from .base import NonFiniteGradientError, Replicator, all_finite, check_flags, presence_code


class FullReplicator(Replicator):
    """Average the gradient over the group in one bucketed fp32 all-reduce per step.

    With the group of the mesh's replicate dimension this is hybrid-sharded data parallelism
    (HSDP) with full synchronisation.
    """

    name = "full"

    def _setup_state(self) -> None:
        self._sizes = [s.numel() for s in self._shapes]
        self._total = sum(self._sizes)
        self._bucket = torch.zeros(self._total + 2 * self.world, dtype=torch.float32,
                                   device=self.device)

    def replicate(self, grads, lrs, step, communicate):
        present = [g for g in grads if g is not None]
        bad = not all_finite(present)
        if not communicate:
            if bad:
                raise NonFiniteGradientError(self.name, [self.rank], step)
            return grads
        buf, n = self._bucket, self.world
        flat, trailer = buf[: self._total], buf[self._total:]
        code = presence_code(grads)
        off = 0
        for g, size in zip(grads, self._sizes):
            seg = flat[off: off + size]
            if g is None or bad:
                seg.zero_()
            else:
                seg.copy_(g.reshape(-1))
            off += size
        trailer.zero_()
        trailer[self.rank] = float(bad)
        trailer[n + self.rank] = float(code)
        all_reduce_sum(buf, self.group, self.stats)
        t = trailer.tolist()
        check_flags(self.name, t[:n], t[n:], code, step)
        flat.div_(n)
        off = 0
        for g, size in zip(grads, self._sizes):
            if g is not None:
                g.copy_(flat[off: off + size].view_as(g))
            off += size
        return grads


class NoReplication(Replicator):
    """Send nothing: each replica trains on its own gradients (replicas drift apart)."""

    name = "none"

    def replicate(self, grads, lrs, step, communicate):
        if not all_finite([g for g in grads if g is not None]):
            raise NonFiniteGradientError(self.name, [self.rank], step)
        return grads
