"""DeMo: decoupled momentum, replicated as the top-k DCT coefficients of each block.

Per parameter and step: ``delta = decay * delta + s * grad`` (``s`` is the learning rate when
``scale_by_lr``, else 1); take the blocked orthonormal DCT of ``delta``; keep the ``topk``
largest-magnitude coefficients of every block; subtract what is sent from ``delta`` (error
feedback); all-gather the (index, value) pairs of all parameters in one bucket; decode the true
mean over the replicas (sum in replica order, divided by the group size: every replica computes
the same bits); optionally apply ``sign()``. ``transform="none"`` keeps the blocks but skips
the DCT: plain per-block top-k with error feedback.

The DCT is linear and orthonormal, so where the blocks tile the tensor exactly ``delta`` is kept
in the transform domain: the momentum update is fused into the forward transform and error
feedback zeroes coefficients, with no inverse transform. Tensors that need padding keep
``delta`` in the parameter's own domain (error feedback then decodes what was sent), so the
padding never holds momentum.

Wire format (issue-5 codecs extend it): a 32-byte header (magic, step, non-finite flag,
presence code), then per parameter the block-local indices (int16 when a block has at most
32768 elements, else int32) and the values (``value_dtype``, fp32 by default), each 8-byte
aligned.
"""

from __future__ import annotations

import torch

from ..comm import all_gather
from ..compress import BlockDCT, Scratch, plan_chunks, topk_indices
from .base import (
    HEADER_BYTES,
    Replicator,
    all_finite,
    check_headers,
    presence_code,
    write_header,
)

_VALUE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _align(n: int) -> int:
    return (n + 7) // 8 * 8


class DeMoReplicator(Replicator):
    """DeMo replication (DCT top-k of a decoupled momentum, with error feedback)."""

    name = "demo"

    def __init__(self, topk: int = 32, chunk: int = 64, decay: float = 0.999, *,
                 sign: bool = True, scale_by_lr: bool = True,
                 value_dtype: torch.dtype = torch.float32, transform: str = "dct",
                 **schedule) -> None:
        super().__init__(**schedule)
        if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
            raise ValueError(f"topk must be an integer >= 1, got {topk!r}")
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 2:
            raise ValueError(f"chunk must be an integer >= 2 (a block edge), got {chunk!r}")
        if topk > chunk * chunk:
            raise ValueError(f"topk={topk} exceeds the {chunk}x{chunk}={chunk * chunk} "
                             "coefficients of a block; lower topk or raise chunk")
        if not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must be a number in [0, 1], got {decay!r}")
        if transform not in ("dct", "none"):
            raise ValueError(f"transform must be 'dct' or 'none' (plain top-k per block), "
                             f"got {transform!r}")
        self.transform = transform
        if value_dtype not in _VALUE_DTYPES:
            raise ValueError(f"value_dtype must be one of {_VALUE_DTYPES}, got {value_dtype!r}")
        self.topk, self.chunk, self.decay = topk, chunk, float(decay)
        self.sign, self.scale_by_lr, self.value_dtype = sign, scale_by_lr, value_dtype

    def extra_repr(self) -> str:
        return f"topk={self.topk}, chunk={self.chunk}, decay={self.decay}, sign={self.sign}"

    # ------------------------------------------------------------------ state
    def _setup_state(self) -> None:
        self.scratch = Scratch()
        self.plans, self.transforms, self.ks, self.delta = [], [], [], []
        self.segments = []  # (idx_off, idx_dtype, val_off) per parameter, or None
        off = HEADER_BYTES
        vsize = torch.empty(0, dtype=self.value_dtype).element_size()
        for shape in self._shapes:
            if shape.numel() == 0:
                for lst in (self.plans, self.transforms, self.ks, self.delta, self.segments):
                    lst.append(None)
                continue
            plan = plan_chunks(shape, self.chunk)
            k = min(self.topk, plan.block_numel)
            idx_dtype = torch.int16 if plan.block_numel <= 32768 else torch.int32
            n_sel = plan.num_blocks * k
            idx_off = off
            off = _align(off + n_sel * (2 if idx_dtype == torch.int16 else 4))
            val_off = off
            off = _align(off + n_sel * vsize)
            self.plans.append(plan)
            self.transforms.append(BlockDCT(
                plan, self.device, scratch=self.scratch,
                basis="dct" if self.transform == "dct" else "identity"))
            self.ks.append(k)
            dshape = plan.shape2d if plan.needs_padding else (plan.num_blocks, plan.block_numel)
            self.delta.append(torch.zeros(dshape, dtype=torch.float32, device=self.device))
            self.segments.append((idx_off, idx_dtype, val_off))
        self.bucket_bytes = off
        self._bucket = torch.zeros(off, dtype=torch.uint8, device=self.device)

    def payload_bytes(self) -> int:
        """Bytes this rank contributes to one exchange (header included)."""
        return self.bucket_bytes

    def _views(self, buf: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx_off, idx_dtype, val_off = self.segments[i]
        plan, k = self.plans[i], self.ks[i]
        n_sel = plan.num_blocks * k
        isz = 2 if idx_dtype == torch.int16 else 4
        vsz = torch.empty(0, dtype=self.value_dtype).element_size()
        idx = buf[idx_off: idx_off + n_sel * isz].view(idx_dtype).view(plan.num_blocks, k)
        val = buf[val_off: val_off + n_sel * vsz].view(self.value_dtype).view(plan.num_blocks, k)
        return idx, val

    # ------------------------------------------------------------------ step
    def _encode(self, i: int, g: torch.Tensor, lr: float):
        """Momentum update, selection, error feedback; returns (idx, transmitted values)."""
        plan, t, delta = self.plans[i], self.transforms[i], self.delta[i]
        scale = lr if self.scale_by_lr else 1.0
        if plan.needs_padding:
            delta.mul_(self.decay).add_(g.reshape(plan.shape2d), alpha=scale)
            coef = self.scratch.get(3, plan.padded_numel, torch.float32, self.device)
            coef = t.encode_into(delta, coef.view(plan.num_blocks, plan.block_numel))
        else:
            coef = t.encode_into(g, delta, alpha=scale, beta=self.decay)
        mag = self.scratch.get(4, coef.numel(), torch.float32, self.device).view_as(coef)
        idx = topk_indices(torch.abs(coef, out=mag), self.ks[i])
        vals = coef.gather(1, idx)
        if self.value_dtype != torch.float32:
            vals = vals.to(self.value_dtype).float()
        self._feedback(i, idx, vals, sign=-1.0)
        return idx, vals

    def _feedback(self, i: int, idx: torch.Tensor, vals: torch.Tensor, sign: float) -> None:
        """Add ``sign * sent`` to delta (sign -1: error feedback, +1: undo it)."""
        plan, t, delta = self.plans[i], self.transforms[i], self.delta[i]
        if not plan.needs_padding:
            delta.scatter_add_(1, idx, vals if sign > 0 else -vals)
            return
        img = self.scratch.get(2, plan.padded_numel, torch.float32, self.device).zero_()
        img.index_add_(0, t.image_index(idx), vals.reshape(-1))
        delta.add_(t.decode_image(img).reshape(plan.shape2d), alpha=sign)

    def replicate(self, grads, lrs, step, communicate):
        present = [g for g in grads if g is not None]
        bad = not all_finite(present)
        code = presence_code(grads)
        buf = self._bucket
        write_header(buf, step, bad, code)
        sent: list = []
        for i, g in enumerate(grads):
            if self.plans[i] is None:
                sent.append(None)
                continue
            idx_v, val_v = self._views(buf, i)
            if g is None or bad:
                idx_v.zero_()
                val_v.zero_()
                sent.append(None)
                continue
            idx, vals = self._encode(i, g, lrs[i])
            idx_v.copy_(idx)
            val_v.copy_(vals)
            sent.append((idx, vals))
        if communicate:
            gathered = all_gather(buf, self.group, self.stats)
        else:
            gathered = buf.unsqueeze(0)
        n = gathered.shape[0]
        try:
            check_headers(self.name, gathered, step, code)
        except Exception:
            for i, s in enumerate(sent):
                if s is not None:
                    self._feedback(i, s[0], s[1], sign=1.0)
            raise
        for i, g in enumerate(grads):
            if g is None or self.plans[i] is None:
                continue
            plan, t = self.plans[i], self.transforms[i]
            img = self.scratch.get(2, plan.padded_numel, torch.float32, self.device).zero_()
            for r in range(n):
                idx_r, val_r = self._views(gathered[r], i)
                img.index_add_(0, t.image_index(idx_r), val_r.reshape(-1).float())
            if n > 1:
                img.div_(n)
            t.decode_image(img, out=g)
            if self.sign:
                g.sign_()
        return grads

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["delta"] = [None if d is None else d.clone() for d in self.delta]
        return sd

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        deltas = state["delta"]
        if len(deltas) != len(self.delta):
            raise ValueError(f"{self.name}: state holds {len(deltas)} momentum buffers, "
                             f"this optimizer has {len(self.delta)} parameters")
        for i, (mine, theirs) in enumerate(zip(self.delta, deltas)):
            if mine is not None and (theirs is None or tuple(theirs.shape) != tuple(mine.shape)):
                raise ValueError(f"{self.name}: momentum {i} has shape "
                                 f"{None if theirs is None else tuple(theirs.shape)}, "
                                 f"expected {tuple(mine.shape)} (another model or mesh?)")
        for mine, theirs in zip(self.delta, deltas):
            if mine is not None:
                mine.copy_(theirs)
