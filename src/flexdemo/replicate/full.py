"""Dense replicators: Full (average the gradient) and NoReplication."""

from __future__ import annotations

import torch

from ..comm import all_gather, all_reduce_sum
from ..compress.quant import ValueCodec
from .base import (
    HEADER_BYTES,
    NonFiniteGradientError,
    Replicator,
    all_finite,
    check_flags,
    check_headers,
    presence_code,
    write_header,
)


class FullReplicator(Replicator):
    """Average the whole input over the group: one bucketed exchange per step.

    ``values`` is the wire format: ``"fp32"`` (default) sums in one fp32 all-reduce (with the
    mesh's replicate group this is hybrid-sharded data parallelism, HSDP); ``"bf16"``,
    ``"fp16"``, ``"int8"`` and ``"int4"`` (a scale per ``block`` values, see
    :mod:`flexdemo.compress.quant`) all-gather every rank's encoded bucket and decode the mean
    in rank order, in fp32, identically on every replica (a low-precision all-reduce would
    round partial sums differently per algorithm). Steps that the schedule skips pass the
    input through unchanged.

    :meth:`start` launches the collective asynchronously and :meth:`finish` completes it.
    """

    name = "full"

    def __init__(self, values: str = "fp32", block: int = 128, **schedule) -> None:
        super().__init__(**schedule)
        self.codec = ValueCodec(values, block)  # validates
        self.values = values

    def extra_repr(self) -> str:
        return "" if self.values == "fp32" else f"values={self.values!r}"

    def _setup_state(self) -> None:
        self._sizes = [s.numel() for s in self._shapes]
        self._total = sum(self._sizes)
        if self.values == "fp32":
            self._bucket = torch.zeros(self._total + 2 * self.world, dtype=torch.float32,
                                       device=self.device)
        else:
            self._flat = torch.zeros(self._total, dtype=torch.float32, device=self.device)
            nbytes = HEADER_BYTES + self.codec.nbytes(self._total)
            nbytes += -nbytes % 8  # rows of the gathered tensor stay 8-byte aligned
            self._bucket = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)

    def payload_bytes(self) -> int:
        """Bytes this rank contributes to one exchange (flags and headers included)."""
        return self._bucket.numel() * self._bucket.element_size()

    def _fill(self, flat: torch.Tensor, grads, bad: bool) -> None:
        off = 0
        for g, size in zip(grads, self._sizes):
            seg = flat[off: off + size]
            if g is None or bad:
                seg.zero_()
            else:
                seg.copy_(g.reshape(-1))
            off += size

    def _scatter(self, flat: torch.Tensor, grads) -> None:
        off = 0
        for g, size in zip(grads, self._sizes):
            if g is not None:
                g.copy_(flat[off: off + size].view_as(g))
            off += size

    def start(self, grads, lrs, step):
        self.stats.begin_step()
        comm = self.communicates(step) and self.world > 1
        if comm:
            self.stats.steps_replicated += 1
        return self._start(grads, step, comm)

    def finish(self, pending):
        return self._finish(pending)

    def replicate(self, grads, lrs, step, communicate):
        return self._finish(self._start(grads, step, communicate))

    def _start(self, grads, step, communicate):
        present = [g for g in grads if g is not None]
        bad = not all_finite(present)
        if not communicate:
            if bad:
                raise NonFiniteGradientError(self.name, [self.rank], step)
            return ("local", grads)
        code = presence_code(grads)
        n = self.world
        if self.values == "fp32":
            buf = self._bucket
            flat, trailer = buf[: self._total], buf[self._total:]
            self._fill(flat, grads, bad)
            trailer.zero_()
            trailer[self.rank] = float(bad)
            trailer[n + self.rank] = float(code)
            handle = all_reduce_sum(buf, self.group, self.stats, async_op=True)
        else:
            self._fill(self._flat, grads, bad)
            write_header(self._bucket, step, bad, code)
            self.codec.encode(self._flat, self._bucket[HEADER_BYTES:])
            handle = all_gather(self._bucket, self.group, self.stats, async_op=True)
        return ("exchange", grads, handle, step, code)

    def _finish(self, pending):
        if pending[0] == "local":
            return pending[1]
        _, grads, handle, step, code = pending
        n = self.world
        if self.values == "fp32":
            buf = handle.wait()
            trailer = buf[self._total:].tolist()
            check_flags(self.name, trailer[:n], trailer[n:], code, step)
            flat = buf[: self._total].div_(n)
        else:
            gathered = handle.wait()
            check_headers(self.name, gathered, step, code)
            flat = self._flat
            flat.zero_()
            for r in range(gathered.shape[0]):  # rank order: every replica sums alike
                flat.add_(self.codec.decode(gathered[r, HEADER_BYTES:], self._total))
            flat.div_(n)
        self._scatter(flat, grads)
        return grads


class NoReplication(Replicator):
    """Send nothing: each replica trains on its own gradients (replicas drift apart)."""

    name = "none"

    def replicate(self, grads, lrs, step, communicate):
        if not all_finite([g for g in grads if g is not None]):
            raise NonFiniteGradientError(self.name, [self.rank], step)
        return grads
