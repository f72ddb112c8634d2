"""DeMo: decoupled momentum, replicated as the top-k DCT coefficients of each block.

Per tensor and step: ``delta = decay * delta + s * grad`` (``s`` is the learning rate when
``scale_by_lr``, else 1); take the blocked orthonormal DCT of ``delta``; keep the ``topk``
largest-magnitude coefficients of every block; subtract what is sent (as the peers will decode
it) from ``delta`` (error feedback); all-gather the (index, value) pairs of all tensors in one
bucket; decode the true mean over the replicas (sum in replica order, divided by the number of
contributions: every replica computes the same bits); optionally apply ``sign()``.
``transform="none"`` keeps the blocks but skips the DCT: plain per-block top-k.
``transform_dtype="bf16"`` runs the forward transform's products in bf16 (about 2^-8 relative
error per coefficient, several times faster where the hardware has bf16 products); the
momentum, the values and the inverse transform stay fp32.

The DCT is linear and orthonormal, so where the blocks tile the tensor exactly ``delta`` is kept
in the transform domain: the momentum update is fused into the forward transform and error
feedback subtracts coefficients, with no inverse transform. Tensors that need padding keep
``delta`` in the parameter's own domain, so the padding never holds momentum.

**Small tensors.** With ``small="batch"`` (default) every 1-D tensor and every tensor with
fewer than ``small_numel`` entries (default ``chunk * chunk``) is concatenated, in parameter
order, into one vector viewed as ``(rows, chunk)`` and compressed as one matrix: the same
``topk`` of ``chunk x chunk`` density as the large weights, instead of ``topk`` of ``chunk``
per 1-D chunk (at the defaults 32 of 64: more bytes than dense fp32). ``small="separate"``
compresses each tensor on its own.

**Groups.** Tensors whose blocks have the same size (and so the same ``k``) form a group: their
coefficients live in one ``(blocks, block entries)`` matrix, so selection, coding, packing and
the checks of received payloads run once per group rather than once per tensor (all of them
work block by block, so the bits are those of coding each tensor alone).

**Wire format** (one bucket per step): a 32-byte header (magic and version, step, non-finite
flag, presence code); then per group the block-local indices of all its blocks packed at
``ceil(log2(block entries))`` bits (12 for 64 x 64 blocks) and their values in the ``values``
format of :class:`~flexdemo.compress.quant.BlockValueCodec` (``fp32``, ``bf16``, ``fp16``,
``int8`` with a scale per block, ``int2``, or ``sign`` with a magnitude per block), each
segment 8-byte aligned. :meth:`payload_bytes` is the exact size.

**Collectives.** ``bucket=True``: one all-gather per step; ``False``: every tensor is its own
group and has its own all-gather, plus one for the header (for comparison).
``overlap="delayed"`` launches each step's all-gather asynchronously and applies it one step
later, so the exchange runs behind the next forward and backward: the update applied at step
``t`` is the replicas' mean of what they sent at step ``t - 1`` (zero at step 0). Default
``"none"``: the update of step ``t`` is applied at ``t``.

**Untrusted payloads.** Every received payload is checked: header (magic, version, step),
indices in range and unique within a block, values finite. A bad payload raises
:class:`CorruptPayloadError` naming the sending rank (``on_bad_peer="raise"``, default), or
with ``on_bad_peer="drop"`` that peer's contribution is left out of the step's mean on every
replica, with a warning and the counter ``dropped_payloads``.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..comm import Pending, all_gather
from ..compress import BlockDCT, ChunkPlan, Scratch, plan_chunks, topk_indices
from ..compress.bits import pack_bits, packed_nbytes, unpack_bits
from ..compress.quant import BLOCK_FORMATS, BlockValueCodec
from .base import (
    HEADER_BYTES,
    MAGIC,
    Replicator,
    all_finite,
    check_flags,
    presence_code,
    write_header,
)


class CorruptPayloadError(RuntimeError):
    """A peer sent a payload that does not decode to a valid update."""

    def __init__(self, name: str, rank: int, global_rank: int, step: int, reason: str) -> None:
        super().__init__(
            f"{name}: corrupt payload from rank {global_rank} (rank {rank} of the group) at "
            f"step {step}: {reason}. A faulty peer or a version mismatch; construct the "
            "replicator with on_bad_peer='drop' to leave such payloads out")
        self.rank, self.global_rank, self.step, self.reason = rank, global_rank, step, reason


PRESETS: dict[str, dict] = {
    "default": {},
    "aggressive": {"topk": 4, "values": "sign"},   # about 0.002 bytes per parameter per step
    "original": {"topk": 32, "values": "fp32"},     # DeMo's defaults, full-precision values
}


_TRANSFORM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _align(n: int) -> int:
    return (n + 7) // 8 * 8


def _has_grad(u: _Unit, grads) -> bool:
    """Whether any tensor of unit ``u`` has a gradient this step."""
    return any(grads[i] is not None for i in u.members)


@dataclass
class _Unit:
    """One compressed tensor: a large parameter, or the batch of small ones."""

    members: list[int]
    sizes: list[int]
    plan: ChunkPlan
    transform: BlockDCT
    k: int
    delta: torch.Tensor | None = None  # set when its group is built
    group: int = 0
    rows: slice = field(default_factory=lambda: slice(0, 0))  # its blocks in the group
    flat: torch.Tensor | None = field(default=None, repr=False)


@dataclass
class _Group:
    """Units with the same block size and ``k``: selected, coded and checked as one matrix of
    blocks, and sent as one index segment and one value segment."""

    units: list[_Unit]
    k: int
    coef: torch.Tensor  # (blocks, block_numel): the momentum of unpadded units, in place
    idx_off: int = 0
    val_off: int = 0
    end: int = 0

    @property
    def blocks(self) -> int:
        return self.coef.shape[0]

    @property
    def block_numel(self) -> int:
        return self.coef.shape[1]

    @property
    def bits(self) -> int:
        """Width of a packed block-local index."""
        return max(1, math.ceil(math.log2(self.block_numel)))

    @property
    def n_sel(self) -> int:
        return self.blocks * self.k


class DeMoReplicator(Replicator):
    """DeMo replication (DCT top-k of a decoupled momentum, with error feedback).

    Defaults: 16 of the 4096 coefficients of each 64 x 64 block, values as ``int2`` — about
    0.008 bytes per parameter per step, chosen from ``benchmarks/bench_wire.py`` (loss within
    2% of fp32 values at topk 32, which sends 5.5x more). :data:`PRESETS` names other settings.
    """

    name = "demo"

    def __init__(self, topk: int = 16, chunk: int = 64, decay: float = 0.999, *,
                 sign: bool = True, scale_by_lr: bool = True, values: str = "int2",
                 transform: str = "dct", transform_dtype: str = "fp32", small: str = "batch",
                 small_numel: int | None = None,
                 bucket: bool = True, overlap: str = "none", on_bad_peer: str = "raise",
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
        if values not in BLOCK_FORMATS:
            raise ValueError(f"values must be one of {BLOCK_FORMATS}, got {values!r}")
        if transform not in ("dct", "none"):
            raise ValueError(f"transform must be 'dct' or 'none' (plain top-k per block), "
                             f"got {transform!r}")
        if transform_dtype not in _TRANSFORM_DTYPES:
            raise ValueError(f"transform_dtype must be one of {sorted(_TRANSFORM_DTYPES)}, "
                             f"got {transform_dtype!r}")
        if small not in ("batch", "separate"):
            raise ValueError(f"small must be 'batch' or 'separate', got {small!r}")
        if small_numel is not None and (not isinstance(small_numel, int) or small_numel < 0):
            raise ValueError(f"small_numel must be an integer >= 0, got {small_numel!r}")
        if overlap not in ("none", "delayed"):
            raise ValueError(f"overlap must be 'none' or 'delayed', got {overlap!r}")
        if overlap == "delayed" and (not bucket or self.replicate_every != 1
                                     or self.skip_every):
            raise ValueError("overlap='delayed' needs bucket=True and a replicator that "
                             "communicates every step (replicate_every=1, skip_every=0)")
        if on_bad_peer not in ("raise", "drop"):
            raise ValueError(f"on_bad_peer must be 'raise' or 'drop', got {on_bad_peer!r}")
        self.topk, self.chunk, self.decay = topk, chunk, float(decay)
        self.sign, self.scale_by_lr, self.values = sign, scale_by_lr, values
        self.transform, self.transform_dtype, self.small = transform, transform_dtype, small
        self.small_numel = chunk * chunk if small_numel is None else small_numel
        self.bucket, self.overlap, self.on_bad_peer = bucket, overlap, on_bad_peer
        self.codec = BlockValueCodec(values)
        self.dropped_payloads = 0

    @classmethod
    def preset(cls, name: str, **overrides) -> DeMoReplicator:
        """A replicator from a named preset (:data:`PRESETS`), with settings overridden."""
        if name not in PRESETS:
            raise ValueError(f"unknown DeMo preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def extra_repr(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v, d in (
            ("transform", self.transform, "dct"),
            ("transform_dtype", self.transform_dtype, "fp32"),
            ("small", self.small, "batch"), ("bucket", self.bucket, True),
            ("overlap", self.overlap, "none")) if v != d)
        return (f"topk={self.topk}, chunk={self.chunk}, decay={self.decay}, "
                f"values={self.values!r}, sign={self.sign}{extra}")

    # ------------------------------------------------------------------ set-up
    def _is_small(self, shape: torch.Size) -> bool:
        return self.small == "batch" and (len(shape) <= 1 or shape.numel() < self.small_numel)

    def _make_unit(self, members: list[int], shape: tuple[int, ...]) -> _Unit:
        plan = plan_chunks(shape, self.chunk)
        k = min(self.topk, plan.block_numel)
        basis = "dct" if self.transform == "dct" else "identity"
        ct = _TRANSFORM_DTYPES[self.transform_dtype] if basis == "dct" else torch.float32
        t = BlockDCT(plan, self.device, scratch=self.scratch, basis=basis, compute_dtype=ct)
        sizes = [self._shapes[i].numel() for i in members]
        return _Unit(members, sizes, plan, t, k)

    def _make_groups(self) -> list[_Group]:
        """Group the units by (block size, k), in unit order; with ``bucket=False`` every unit
        is its own group (one collective each)."""
        keyed: dict = {}
        for j, u in enumerate(self.units):
            key = (u.plan.block_numel, u.k) if self.bucket else j
            keyed.setdefault(key, []).append(u)
        groups = []
        for members in keyed.values():
            n, k = members[0].plan.block_numel, members[0].k
            blocks = sum(u.plan.num_blocks for u in members)
            coef = torch.zeros(blocks, n, dtype=torch.float32, device=self.device)
            g = _Group(members, k, coef)
            row = 0
            for u in members:
                u.group, u.rows = len(groups), slice(row, row + u.plan.num_blocks)
                row += u.plan.num_blocks
                # tensors that tile into blocks keep their momentum in the transform domain,
                # in the group's matrix; padded ones in their own domain (the padding never
                # holds momentum) and use their rows of the matrix for fresh coefficients
                u.delta = (torch.zeros(u.plan.shape2d, dtype=torch.float32, device=self.device)
                           if u.plan.needs_padding else coef[u.rows])
            groups.append(g)
        return groups

    def _setup_state(self) -> None:
        self.scratch = Scratch()
        small = [i for i, s in enumerate(self._shapes) if s.numel() and self._is_small(s)]
        self.units: list[_Unit] = []
        for i, s in enumerate(self._shapes):
            if s.numel() and i not in small:
                self.units.append(self._make_unit([i], tuple(s)))
        if small:
            total = sum(self._shapes[i].numel() for i in small)
            rows = math.ceil(total / self.chunk)
            unit = self._make_unit(small, (rows, self.chunk))
            unit.flat = torch.zeros(rows * self.chunk, dtype=torch.float32, device=self.device)
            self.units.append(unit)
        self.groups = self._make_groups()
        off = HEADER_BYTES
        for g in self.groups:
            g.idx_off = off
            off = _align(off + packed_nbytes(g.n_sel, g.bits))
            g.val_off = off
            off = _align(off + self.codec.nbytes(g.blocks, g.k))
            g.end = off
        self.bucket_bytes = off
        nbuf = 2 if self.overlap == "delayed" else 1
        self._buckets = [torch.zeros(off, dtype=torch.uint8, device=self.device)
                         for _ in range(nbuf)]
        self._inflight = None  # delayed mode: (step, handle or gathered, sent)

    @property
    def delta(self) -> list[torch.Tensor]:
        """The momentum buffers, one per unit (large tensor, or the small-tensor batch)."""
        return [u.delta for u in self.units]

    def payload_bytes(self) -> int:
        """Bytes this rank contributes to one exchange (header and alignment included)."""
        return self.bucket_bytes

    # ------------------------------------------------------------------ encode
    def _unit_input(self, u: _Unit, grads) -> torch.Tensor | None:
        if u.flat is None:
            return grads[u.members[0]]
        if not _has_grad(u, grads):
            return None
        off = 0
        for i, size in zip(u.members, u.sizes):
            seg = u.flat[off: off + size]
            if grads[i] is None:
                seg.zero_()
            else:
                seg.copy_(grads[i].reshape(-1))
            off += size
        u.flat[off:].zero_()  # the padding tail (it held the last output)
        return u.flat

    def _transform(self, u: _Unit, x: torch.Tensor, lr: float, coef: torch.Tensor) -> None:
        """Momentum update; the unit's DCT coefficients land in ``coef`` (its group rows)."""
        plan, t = u.plan, u.transform
        scale = lr if self.scale_by_lr else 1.0
        if plan.needs_padding:
            u.delta.mul_(self.decay).add_(x.reshape(plan.shape2d), alpha=scale)
            t.encode_into(u.delta, coef)
        else:  # coef is the momentum itself: decay and add the new transform in one product
            t.encode_into(x, coef, alpha=scale, beta=self.decay)

    def _encode(self, g: _Group, inputs: list, lrs, buf: torch.Tensor):
        """Momentum update, selection, packing and error feedback of one group; returns the
        sent (idx, values), both ``(blocks, k)``. Inactive units (no gradient) keep their
        momentum and send zeros."""
        for u, x in zip(g.units, inputs):
            if x is not None:
                self._transform(u, x, lrs[u.members[0]], g.coef[u.rows])
        mag = self.scratch.get(4, g.coef.numel(), torch.float32, self.device)
        idx = topk_indices(torch.abs(g.coef, out=mag.view_as(g.coef)), g.k)
        vals = g.coef.gather(1, idx)
        for u, x in zip(g.units, inputs):
            if x is None:
                vals[u.rows] = 0.0
        pack_bits(idx, g.bits, buf[g.idx_off: g.val_off])
        sent = self.codec.encode(vals, buf[g.val_off: g.end])
        self._feedback(g, idx, sent, sign=-1.0)
        return idx, sent

    def _feedback(self, g: _Group, idx: torch.Tensor, vals: torch.Tensor, sign: float) -> None:
        """Add ``sign * sent`` to the momentum (sign -1: error feedback, +1: undo it)."""
        g.coef.scatter_add_(1, idx, vals if sign > 0 else -vals)  # padded units: scratch rows
        for u in g.units:
            plan, t = u.plan, u.transform
            if not plan.needs_padding:
                continue
            img = self.scratch.get(2, plan.padded_numel, torch.float32, self.device).zero_()
            img.index_add_(0, t.image_index(idx[u.rows]), vals[u.rows].reshape(-1))
            u.delta.add_(t.decode_image(img).reshape(plan.shape2d), alpha=sign)

    def _fill(self, grads, lrs, step: int, buf: torch.Tensor):
        """Encode every group into ``buf``; returns the per-group sent (idx, values), or None
        for groups without gradients (and for all groups when a gradient is not finite)."""
        present = [g for g in grads if g is not None]
        bad = not all_finite(present)
        code = presence_code(grads)
        write_header(buf, step, bad, code)
        sent: list = []
        for g in self.groups:
            inputs = [None if bad else self._unit_input(u, grads) for u in g.units]
            if all(x is None for x in inputs):
                buf[g.idx_off: g.end].zero_()
                sent.append(None)
                continue
            sent.append(self._encode(g, inputs, lrs, buf))
        return sent, code

    # ------------------------------------------------------------------ exchange
    def _exchange(self, buf: torch.Tensor) -> torch.Tensor:
        if self.bucket:
            return all_gather(buf, self.group, self.stats)
        n = self.world
        out = torch.empty(n, buf.numel(), dtype=buf.dtype, device=buf.device)
        out[:, :HEADER_BYTES] = all_gather(buf[:HEADER_BYTES].clone(), self.group, self.stats)
        for g in self.groups:  # one per tensor (bucket=False makes a group of each unit)
            out[:, g.idx_off: g.end] = all_gather(buf[g.idx_off: g.end].clone(), self.group,
                                                  self.stats)
        return out

    # ------------------------------------------------------------------ decode
    def _check_header(self, row: torch.Tensor, step: int) -> str | None:
        magic, st = row[:16].view(torch.int64).tolist()
        if magic != MAGIC:
            return f"bad magic/version {magic:#x} (expected {MAGIC:#x})"
        if st != step:
            return f"payload for step {st}"
        return None

    def _check_body(self, row: torch.Tensor, active: list[bool]):
        """Decode one peer's groups; returns (idx, values) per group (None where no unit of
        the group has a gradient), or the reason the payload is bad."""
        decoded: list = []
        for g, on in zip(self.groups, active):
            if not on:
                decoded.append(None)
                continue
            idx = unpack_bits(row[g.idx_off: g.val_off], g.bits, g.n_sel).view(-1, g.k)
            if (1 << g.bits) > g.block_numel and int(idx.max()) >= g.block_numel:
                return (f"index {int(idx.max())} out of range for blocks of "
                        f"{g.block_numel} entries")
            srt = idx.sort(dim=1).values
            if bool((srt[:, 1:] == srt[:, :-1]).any()):
                return "repeated index within a block"
            vals = self.codec.decode(row[g.val_off: g.end], g.blocks, g.k)
            if not bool(torch.isfinite(vals).all()):
                return "non-finite value"
            decoded.append((idx, vals))
        return decoded

    def _bad_peer(self, r: int, step: int, reason: str) -> None:
        global_rank = (dist.get_global_rank(self.group, r)
                       if dist.is_initialized() and self.world > 1 else r)
        if self.on_bad_peer == "raise":
            raise CorruptPayloadError(self.name, r, global_rank, step, reason)
        self.dropped_payloads += 1
        warnings.warn(f"{self.name}: dropped the payload of rank {global_rank} at step {step}: "
                      f"{reason}", RuntimeWarning, stacklevel=3)

    def _decode(self, gathered: torch.Tensor, grads, step: int, code: int) -> None:
        n = gathered.shape[0]
        heads = gathered[:, :HEADER_BYTES].contiguous().view(torch.int64).view(n, 4).tolist()
        peers = []
        for r in range(n):
            reason = self._check_header(gathered[r], step)
            if reason is None:
                peers.append(r)
            else:
                self._bad_peer(r, step, reason)
        check_flags(self.name, [heads[r][2] if r in peers else 0 for r in range(n)],
                    [heads[r][3] if r in peers else code for r in range(n)], code, step)
        active = [any(_has_grad(u, grads) for u in g.units) for g in self.groups]
        good = []
        for r in peers:
            res = self._check_body(gathered[r], active)
            if isinstance(res, str):
                self._bad_peer(r, step, res)
            else:
                good.append(res)
        for u in self.units:
            if not _has_grad(u, grads):
                continue
            parts = [(dec[u.group][0][u.rows], dec[u.group][1][u.rows]) for dec in good]
            self._write_output(u, self._mean(u, parts, grads), grads)

    def _mean(self, u: _Unit, parts: list, grads) -> torch.Tensor:
        """The mean of the peers' (idx, values) of unit ``u``, decoded to its matrix shape.

        A few coefficients per block (``m <= (cr + cc) / 4`` over all peers) are decoded
        sparsely; more go through a coefficient image and the dense inverse transform. The
        choice depends only on shapes and the number of peers, so all replicas take the same
        path and get the same bits.
        """
        plan, t = u.plan, u.transform
        g = grads[u.members[0]]
        if u.flat is not None:
            out = u.flat.view(plan.shape2d)
        elif g.dtype == torch.float32 and g.is_contiguous():
            out = g.view(plan.shape2d)  # decode straight into the gradient
        else:
            out = self.scratch.get(7, plan.numel, torch.float32, self.device).view(plan.shape2d)
        m = u.k * len(parts)
        if parts and not plan.needs_padding and 4 * m <= sum(plan.chunk):
            idx = torch.cat([p[0] for p in parts], dim=1)
            vals = torch.cat([p[1] for p in parts], dim=1)
            if len(parts) > 1:
                vals = vals / len(parts)
            return t.decode_sparse(idx, vals, out)
        img = self.scratch.get(2, plan.padded_numel, torch.float32, self.device).zero_()
        for idx, vals in parts:  # rank order: every replica sums alike
            img.index_add_(0, t.image_index(idx), vals.reshape(-1))
        if len(parts) > 1:
            img.div_(len(parts))
        return t.decode_image(img, out=out)

    def _write_output(self, u: _Unit, out: torch.Tensor, grads) -> None:
        if self.sign:
            out.sign_()
        flat, off = out.reshape(-1), 0
        for i, size in zip(u.members, u.sizes):
            g = grads[i]
            if g is not None and g.data_ptr() != flat.data_ptr() + off * flat.element_size():
                g.copy_(flat[off: off + size].view_as(g))
            off += size

    # ------------------------------------------------------------------ step
    def replicate(self, grads, lrs, step, communicate):
        if self.overlap == "delayed":
            return self._replicate_delayed(grads, lrs, step)
        buf = self._buckets[0]
        sent, code = self._fill(grads, lrs, step, buf)
        gathered = self._exchange(buf) if communicate else buf.unsqueeze(0)
        try:
            self._decode(gathered, grads, step, code)
        except Exception:
            for g, s in zip(self.groups, sent):
                if s is not None:
                    self._feedback(g, s[0], s[1], sign=1.0)
            raise
        return grads

    def _replicate_delayed(self, grads, lrs, step):
        buf = self._buckets[step % 2]
        _, code = self._fill(grads, lrs, step, buf)
        handle = all_gather(buf, self.group, self.stats, async_op=True)
        previous, self._inflight = self._inflight, (step, handle, code)
        if previous is None:
            for g in grads:
                if g is not None:
                    g.zero_()
            return grads
        prev_step, prev_handle, prev_code = previous
        gathered = prev_handle.wait() if isinstance(prev_handle, Pending) else prev_handle
        self._decode(gathered, grads, prev_step, prev_code)
        return grads

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["delta"] = [d.clone() for d in self.delta]
        sd["dropped_payloads"] = self.dropped_payloads
        if self._inflight is not None:
            step, handle, code = self._inflight
            gathered = handle.wait() if isinstance(handle, Pending) else handle
            self._inflight = (step, gathered, code)
            sd["inflight"] = {"step": step, "gathered": gathered.clone(), "code": code}
        return sd

    def load_state_dict(self, state: dict) -> None:
        deltas = state["delta"]
        if len(deltas) != len(self.units):
            raise ValueError(f"{self.name}: state holds {len(deltas)} momentum buffers, this "
                             f"replicator has {len(self.units)} (another model or settings?)")
        for i, (u, theirs) in enumerate(zip(self.units, deltas)):
            if theirs is None or tuple(theirs.shape) != tuple(u.delta.shape):
                raise ValueError(f"{self.name}: momentum {i} has shape "
                                 f"{None if theirs is None else tuple(theirs.shape)}, "
                                 f"expected {tuple(u.delta.shape)} (another model or mesh?)")
        super().load_state_dict(state)
        for u, theirs in zip(self.units, deltas):
            u.delta.copy_(theirs)
        self.dropped_payloads = int(state.get("dropped_payloads", 0))
        inflight = state.get("inflight")
        self._inflight = None if inflight is None else (
            int(inflight["step"]), inflight["gathered"].to(self.device), int(inflight["code"]))
