"""A flat layout worked bucket by bucket: the dense exchanges' bounded workspace.

:class:`~flexdemo.replicate.full.FlatLayout` lays tensors end to end in one flat buffer of the
model's size. :class:`FlatBuckets` cuts that same flat order into buckets of at most
``bucket_numel`` values and moves one bucket at a time between the tensors and a reused buffer
(fill, exchange, write back), so a dense exchange holds one bucket, whatever the model. Bucket
boundaries fall on multiples of ``align`` (a quantisation block): every block holds the same
values as in the whole layout, so it encodes to the same bits.
"""

from __future__ import annotations

import torch

from .demo.settings import CUDA_GROUPS, GROUP_NUMEL, resolve_group_numel


def check_bucket_numel(bucket_numel) -> None:
    """Raise a one-line ValueError for a bad ``bucket_numel`` setting."""
    if bucket_numel in (None, "auto"):
        return
    if not isinstance(bucket_numel, int) or isinstance(bucket_numel, bool) or bucket_numel < 1:
        raise ValueError(f"bucket_numel must be an integer >= 1 (values per bucket), 'auto' "
                         f"({GROUP_NUMEL} off CUDA; on it 1/{CUDA_GROUPS} of the model if "
                         f"larger) or None (the whole model in one bucket), got "
                         f"{bucket_numel!r}")


def resolve_bucket_numel(bucket_numel, device: torch.device, shapes: list[torch.Size],
                         align: int, parts: int | None = None) -> int | None:
    """Values per bucket (a multiple of ``align``), or None for one bucket of the whole
    model (``bucket_numel=None``, or a model that fits one bucket); ``parts``: "auto" is at
    most a ``parts``-th of the model (:func:`~.demo.settings.resolve_group_numel`)."""
    n = resolve_group_numel(bucket_numel, device, shapes, parts)
    total = sum(s.numel() for s in shapes)
    if n is None or n >= total:
        return None
    n = max(align, n - n % align)
    return None if n >= total else n


class FlatBuckets:
    """The flat order of tensors of ``shapes`` in buckets of at most ``numel`` values.

    Per bucket it keeps the views that move its values (whole tensors as shaped views of the
    bucket buffer; a tensor cut by a bucket boundary as a flat range), built once, so
    :meth:`fill` and :meth:`scatter` are a few batched copies per bucket."""

    def __init__(self, shapes: list[torch.Size], numel: int) -> None:
        self.shapes = [torch.Size(s) for s in shapes]
        self.sizes = [s.numel() for s in self.shapes]
        self.total = sum(self.sizes)
        self.numel = numel
        self.bounds = [(lo, min(lo + numel, self.total)) for lo in range(0, self.total, numel)]
        starts, off = [], 0
        for size in self.sizes:
            starts.append(off)
            off += size
        # per bucket: (tensor, offset in the bucket) of whole tensors, and
        # (tensor, start in the tensor, start in the bucket, length) of cut ones
        self.whole: list[list[tuple[int, int]]] = []
        self.cut: list[list[tuple[int, int, int, int]]] = []
        for lo, hi in self.bounds:
            whole, cut = [], []
            for i, (start, size) in enumerate(zip(starts, self.sizes)):
                a, b = max(lo, start), min(hi, start + size)
                if a >= b:
                    continue
                if a == start and b == start + size:
                    whole.append((i, start - lo))
                else:
                    cut.append((i, a - start, a - lo, b - a))
            self.whole.append(whole)
            self.cut.append(cut)
        self._plans: dict[tuple, tuple] = {}

    def __len__(self) -> int:
        return len(self.bounds)

    def _plan(self, b: int, grads: list, buf: torch.Tensor) -> tuple:
        """(present whole tensors, their views, views of the missing whole ones) of bucket
        ``b`` in ``buf`` (cached per pattern of missing tensors and buffer)."""
        key = (b, buf.data_ptr(), tuple(grads[i] is None for i, _ in self.whole[b]))
        plan = self._plans.get(key)
        if plan is None:
            views = [buf[o: o + self.sizes[i]].view(self.shapes[i]) for i, o in self.whole[b]]
            present = [i for i, _ in self.whole[b] if grads[i] is not None]
            plan = self._plans[key] = (
                present, [v for (i, _), v in zip(self.whole[b], views) if grads[i] is not None],
                [v for (i, _), v in zip(self.whole[b], views) if grads[i] is None])
        return plan

    @staticmethod
    def _flat(t: torch.Tensor) -> torch.Tensor:
        return t.view(-1) if t.is_contiguous() else t.reshape(-1)

    def fill(self, b: int, grads: list, buf: torch.Tensor) -> None:
        """Copy bucket ``b`` of ``grads`` (zeros for missing ones) into ``buf``'s front."""
        present, views, missing = self._plan(b, grads, buf)
        if present:
            torch._foreach_copy_(views, [grads[i] for i in present])
        if missing:
            torch._foreach_zero_(missing)
        for i, at, o, n in self.cut[b]:
            g = grads[i]
            if g is None:
                buf[o: o + n].zero_()
            else:
                buf[o: o + n].copy_(self._flat(g)[at: at + n])

    def scatter(self, b: int, grads: list, buf: torch.Tensor) -> None:
        """Write ``buf``'s front back into bucket ``b`` of the present ``grads``."""
        present, views, _ = self._plan(b, grads, buf)
        if present:
            torch._foreach_copy_([grads[i] for i in present], views)
        for i, at, o, n in self.cut[b]:
            g = grads[i]
            if g is None:
                continue
            if g.is_contiguous():
                g.view(-1)[at: at + n].copy_(buf[o: o + n])
            else:  # (rare: a strided gradient cut by a bucket boundary)
                flat = g.reshape(-1).clone()
                flat[at: at + n].copy_(buf[o: o + n])
                g.copy_(flat.view(g.shape))
