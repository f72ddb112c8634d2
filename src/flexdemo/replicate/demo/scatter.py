"""DeMo's sparse mean by reduce-scatter (``reduce="scatter"``): bytes per rank flat in the
group size.

The gathered exchange sends every rank's whole payload to every rank, ``n - 1`` payloads per
rank. Here the blocks of every group are cut among ``n`` *owners*: owner ``c`` owns blocks
``[c p, (c + 1) p)`` of each group, ``p = ceil(blocks / n)`` (the last owners may own fewer or
none; the missing blocks are padding that is sent but never written).

1. **Encode.** The encode stage, selection and error feedback are those of the gathered path;
   only the packing differs: each group's selected indices and values are packed into ``n``
   equal-size *parts*, part ``c`` holding the blocks owner ``c`` owns, each behind a copy of
   the bucket's header (step, non-finite flag, presence code). The values are coded per part;
   every value codec codes block by block, and error feedback subtracts the values as the
   owners decode them.
2. **Reduce.** One all-to-all delivers to each owner the ``n`` senders' parts. The owner checks
   them (:func:`~.checks.check_payloads`: header, index range, repeats, finite values), sums
   their coefficients into dense blocks in rank order and divides (``mean="senders"``: by the
   number of senders of each coefficient, ``"replicas"``: by ``n``), keeps the top ``topk`` of
   each block of that mean, codes them with the same codec and packs them behind its verdict on
   every sender. What this second selection drops is dropped: no owner keeps state.
3. **Gather.** The owners' parts are all-gathered; every rank checks them, reads the owners'
   verdicts (the step's one read of the device) and raises the error the gathered path raises
   (:class:`NonFiniteGradientError` with the flagged ranks, :class:`CorruptPayloadError` naming
   the sender), or decodes every owner's part as one peer's payload (the mean is taken) through
   the inverse transform and ``sign()`` into the gradients. Every rank decodes the same bytes,
   so every rank gets the same bits.

With a bound on each peer's part (:mod:`~flexdemo.replicate.bound`) an owner scales down a
sender's part of its blocks whose norm is over the multiple of the median of the parts' norms
(with 2 ranks: of its own part's), on the device, before the sum; and every rank scales down
an owner's part whose norm is over the multiple of the norm of what it sent that owner (a
garbage mean from a hostile owner). Both ride in the step's one read.

Per rank ``n - 1`` parts are sent and ``n - 1`` owner parts received, each about ``1 / n`` of
a payload: at most about two payloads whatever ``n`` (plus a header and a 24-byte verdict per
sender in each owner part). The reduce and gather stages run eagerly (no CUDA graphs).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from ...compress.bits import pack_bits, packed_nbytes
from ...compress.blocks import BlockValueCodec
from ...compress.select import topk_indices
from ...transport import (
    CommStats,
    all_gather,
    all_gather_bytes,
    all_to_all_bytes,
    all_to_all_equal,
)
from ..agreement import HEADER_BYTES, MAGIC, align8, header_problems, write_header
from ..bound import PeerBound, float_bits, from_bits
from .checks import check_payloads, describe_problem, good_peers
from .decode import decode_mean
from .layout import BlockLayout, Group
from .staging import Staging, StepPlan

VERDICT = 3  # int64 per sender in an owner's part: status, value, presence code
SUM_SLOT, AUX_SLOT, TOPK_SLOT = 12, 13, 14  # the layout's scratch slots of the owner's mean


@dataclass
class PartGroup:
    """One group's segments in a part (group-like for :func:`~.checks.check_payloads`)."""

    blocks: int  # blocks per part (whole parts: padding included)
    k: int
    bits: int
    block_numel: int
    idx_off: int
    val_off: int
    end: int

    @property
    def n_sel(self) -> int:
        return self.blocks * self.k


def _segments(groups: list[Group], per: list[int], codec: BlockValueCodec,
              start: int) -> tuple[list[PartGroup], int]:
    """Each group's ``per`` blocks packed from byte ``start`` on; the parts and their end."""
    out, off = [], start
    for g, p in zip(groups, per):
        idx_off = off
        off = align8(off + packed_nbytes(p * g.k, g.bits))
        val_off = off
        off = align8(off + codec.nbytes(p, g.k))
        out.append(PartGroup(p, g.k, g.bits, g.block_numel, idx_off, val_off, off))
    return out, off


class SparseScatter:
    """The buffers and stages of one replicator's reduce-scatter over ``world`` ranks (one per
    group size: buffers keep their addresses, so a CUDA graph of the encode stays valid)."""

    def __init__(self, layout: BlockLayout, codec: BlockValueCodec, world: int, *,
                 senders: bool, name: str) -> None:
        groups, bucket_bytes, device = layout.groups, layout.bucket_bytes, layout.device
        self.layout, self.senders, self.name = layout, senders, name
        self.groups, self.codec, self.world = groups, codec, world
        n = world
        self.per = [math.ceil(g.blocks / n) for g in groups]
        self.parts, self.part_bytes = _segments(groups, self.per, codec, HEADER_BYTES)
        # an owner's part: header, verdicts, then the segments of its blocks
        self.verdict_at, self.verdict_end = HEADER_BYTES, HEADER_BYTES + 8 * VERDICT * n
        self.owned, self.reply_bytes = _segments(groups, self.per, codec, self.verdict_end)
        self.index = {id(g): gi for gi, g in enumerate(groups)}

        def u8(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.uint8, device=device)

        self.bucket = u8(bucket_bytes)  # the encode stage's header (its segments go unused)
        self.send, self.recv = u8(n, self.part_bytes), u8(n, self.part_bytes)
        self.reply = u8(self.reply_bytes)  # this rank's owner part
        # every group's selection padded to n whole parts: padding blocks send indices 0..k-1
        # (distinct) and zeros
        self.pad_idx = [torch.arange(g.k, device=device).repeat(n * p, 1)
                        for g, p in zip(groups, self.per)]
        self.pad_vals = [torch.zeros(n * p, g.k, device=device)
                         for g, p in zip(groups, self.per)]
        # per group, the squared norm of what this rank sent each owner (written in place:
        # the encode may be a CUDA graph)
        self.sent_squares = [torch.zeros(n, device=device) for _ in groups]

    def payload_bytes(self) -> int:
        """Bytes this rank puts on the wire per exchange: ``n`` parts and its owner part."""
        return self.send.numel() + self.reply.numel()

    def exchange_bytes(self) -> int:
        """Bytes sent (and received) per rank: the all-to-all, then the all-gather."""
        return (all_to_all_bytes(self.send.numel(), self.world)
                + all_gather_bytes(self.reply.numel(), self.world))

    # ------------------------------------------------------------------ encode
    def pack(self, g: Group, idx: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        """Group ``g``'s selected ``(blocks, k)`` indices and values into its segment of every
        part; returns the values as the owners will decode them."""
        gi = self.index[id(g)]
        p, per, b, n = self.parts[gi], self.per[gi], g.blocks, self.world
        pad_idx, pad_vals = self.pad_idx[gi], self.pad_vals[gi]
        pad_idx[:b].copy_(idx)
        pad_vals[:b].copy_(vals)
        nbytes = per * g.k * g.bits // 8
        if nbytes * 8 == per * g.k * g.bits:  # whole bytes per part: one packing for all
            packed = pack_bits(pad_idx, g.bits).view(n, nbytes)
            self.send[:, p.idx_off: p.idx_off + nbytes].copy_(packed)
        else:
            for c in range(n):
                pack_bits(pad_idx[c * per: (c + 1) * per], g.bits,
                          self.send[c, p.idx_off: p.val_off])
        seen = torch.empty_like(pad_vals)
        for c in range(n):  # the codecs code block by block: one call per part
            rows = slice(c * per, (c + 1) * per)
            seen[rows] = self.codec.encode(pad_vals[rows], self.send[c, p.val_off: p.end])
        torch.sum(seen.view(n, -1).square(), 1, out=self.sent_squares[gi])
        return seen[:b]

    # ------------------------------------------------------------------ reduce
    def _owner_part(self, plan: StepPlan, step: int, rank: int,
                    bound: PeerBound | None) -> torch.Tensor | None:
        """This rank's owner part from the senders' parts in :attr:`recv`: its verdict on
        every sender and the top ``k`` of each owned block of their mean. With ``bound``:
        each sender's part scaled by its factor first (1 within the bound: the same bits);
        returns each sender's norm and factor as int64 words (fp64 bits) to read."""
        n, lay, senders = self.world, self.layout, self.senders
        found = check_payloads(self.recv, cast("list[Group]", self.parts), self.codec, plan,
                               norms=bound is not None)
        verdict, decoded = found[0], found[1]
        magic_bad, step_bad = verdict[:, 0] != MAGIC, verdict[:, 1] != step
        fault = torch.where(magic_bad, 1, torch.where(step_bad, 2, 0))
        value = torch.where(magic_bad, verdict[:, 0],
                            torch.where(step_bad, verdict[:, 1], verdict[:, 6]))
        status = fault + 4 * (verdict[:, 2] != 0) + 8 * verdict[:, 4] + 64 * verdict[:, 5]
        ok = (status == 0) & (verdict[:, 3] == plan.code)
        factors = None if bound is None else bound.factors_on_device(found[2], rank, ok)
        words = self.reply[self.verdict_at: self.verdict_end].view(torch.int64)
        words.view(n, VERDICT).copy_(torch.stack([status, value, verdict[:, 3]], 1))
        bad_mean = torch.zeros((), dtype=torch.bool, device=self.reply.device)
        for gi, (g, o) in enumerate(zip(self.groups, self.owned)):
            if decoded[gi] is None:  # no gradients in this group
                continue
            idx, vals = decoded[gi]  # (senders, per, k)
            bn, per = g.block_numel, self.per[gi]
            if (1 << g.bits) > bn:  # a bad sender's index stays in range (the step raises)
                idx = idx.clamp(max=bn - 1)
            vals = torch.where(ok.view(n, 1, 1), vals, 0.0)  # bad senders leave nothing
            if factors is not None:  # a sender over the bound scaled down to the median
                vals = vals * factors.view(n, 1, 1)
            total = lay.scratch.get(SUM_SLOT, per * bn, torch.float32, lay.device)
            total = total.view(per, bn).zero_()
            for r in range(n):  # rank order, as the gathered path sums
                total.scatter_add_(1, idx[r], vals[r])
            aux = lay.scratch.get(AUX_SLOT, per * bn, torch.float32, lay.device).view(per, bn)
            if senders:  # each coefficient over the senders that sent it (exact counts)
                aux.zero_()
                for r in range(n):
                    aux.scatter_add_(1, idx[r], (vals[r] != 0).to(torch.float32))
                total.div_(aux.clamp_(min=1.0))
            else:
                total.div_(n)
            top = topk_indices(torch.abs(total, out=aux), g.k, lay.scratch, TOPK_SLOT)
            mean = total.gather(1, top)
            finite = torch.isfinite(mean)
            bad_mean |= ~finite.all()
            pack_bits(top, g.bits, self.reply[o.idx_off: o.val_off])
            self.codec.encode(torch.where(finite, mean, 0.0), self.reply[o.val_off: o.end])
        write_header(self.reply, step, bad_mean, plan.code)  # its flag: a non-finite mean
        if factors is None:
            return None
        return torch.cat([float_bits(found[2]), float_bits(factors)])

    # ------------------------------------------------------------------ the step
    def exchange(self, plan: StepPlan, step: int, transport, stats: CommStats,
                 bad_peer: Callable[[int, int, str], None], *, rank: int = 0,
                 bound: PeerBound | None = None) -> list:
        """The all-to-all, this rank's owner part, the all-gather and the judgement (raises
        through ``bad_peer`` on every rank alike); returns per group the mean's
        ``(1, blocks, k)`` indices and values, or None for groups without gradients.
        ``rank``: this rank; ``bound``: the bound on each sender's part of its blocks and on
        each owner's part (or None)."""
        n = self.world
        bound = bound if bound is not None and bound.on else None
        self.send[:, :HEADER_BYTES].copy_(self.bucket[:HEADER_BYTES].expand(n, -1))
        all_to_all_equal(self.recv, self.send, transport, stats)
        owned = self._owner_part(plan, step, rank, bound)
        gathered = all_gather(self.reply, transport, stats)
        found = check_payloads(gathered, cast("list[Group]", self.owned), self.codec, plan,
                               norms=bound is not None)
        owners, decoded = found[0], found[1]
        said = gathered[:, self.verdict_at: self.verdict_end].contiguous()
        words = [] if owned is None else [  # its senders' norms and factors, the owners'
            owned, float_bits(found[2]),  # norms, the norms of what it sent each owner
            float_bits(sent_norms(self.sent_squares, plan.group_on))]
        rows = torch.cat([owners.reshape(-1), said.view(torch.int64).reshape(-1),
                          *words]).tolist()
        end = 7 * n + VERDICT * n * n
        self._judge(rows[:end], step, plan.code, transport, bad_peer)
        clip: dict[int, float] = {}
        if bound is not None:
            norms, factors, theirs, mine = (from_bits(rows[end + n * i: end + n * (i + 1)])
                                            for i in range(4))
            bound.report(norms, factors, n, step=step, transport=transport)
            clip = bound.own_limit(theirs, mine, rank, step=step, transport=transport,
                                   what="reduced part")
        scale = None if not clip else torch.tensor(
            [clip.get(c, 1.0) for c in range(n)], device=gathered.device).view(n, 1, 1)
        out: list = []
        for g, d in zip(self.groups, decoded):
            if d is None:
                out.append(None)
                continue
            idx, vals = d if scale is None else (d[0], d[1] * scale)
            idx, vals = (t.reshape(-1, g.k)[: g.blocks].unsqueeze(0) for t in (idx, vals))
            out.append((idx, vals))
        return out

    def write_mean(self, mean: list, plan: StepPlan, grads, staging: Staging, *,
                   sign: bool) -> None:
        """The mean from :meth:`exchange` (taken already: one "peer", no division) through
        the inverse transform and ``sign`` into the gradients present (``plan``)."""
        for gi, g in enumerate(self.groups):
            pieces, views = plan.write[gi]
            if pieces and mean[gi] is not None:
                decode_mean(self.layout, g, *mean[gi], sign=sign)
                staging.write_back(grads, pieces, views)

    def _judge(self, rows: list[int], step: int, code: int, transport,
               bad_peer: Callable[[int, int, str], None]) -> None:
        """Raise for a bad owner part or (as the gathered path) a bad sender; ``rows``: the
        owners' check rows (7 each), then their verdicts (``n`` senders of 3 each)."""
        n, w = self.world, 7
        owners = [rows[w * c: w * c + w] for c in range(n)]
        for c, problem in enumerate(header_problems([o[:4] for o in owners], step)):
            if problem is not None:
                bad_peer(c, step, f"its reduced part: {problem}")
        said = rows[w * n:]
        senders = []
        for r in range(n):  # each sender's worst verdict over the owners (the first of equals)
            views = [self._view(said[VERDICT * (c * n + r): VERDICT * (c * n + r + 1)], step)
                     for c in range(n)]
            senders.append(max(views, key=lambda v: _severity(v, step, code)))
        good_peers(senders, step, code, name=self.name, group=transport,
                   groups=self.groups, bad_peer=bad_peer)
        for c, o in enumerate(owners):
            if o[2]:
                bad_peer(c, step, "its reduced part is non-finite")
            if o[4]:
                bad_peer(c, step, "its reduced part: "
                             + describe_problem(o[4], o[5], o[6], self.groups))

    @staticmethod
    def _view(v: list[int], step: int) -> list[int]:
        """An owner's verdict ``(status, value, code)`` on a sender as a row of
        :data:`~.checks.VERDICT_COLUMNS`."""
        status, value, code = v
        fault = status & 3
        return [value if fault == 1 else MAGIC, value if fault == 2 else step,
                (status >> 2) & 1, code, (status >> 3) & 7, status >> 6,
                value if fault == 0 else 0]


def sent_norms(squares: list[torch.Tensor], on) -> torch.Tensor:
    """The norm of what this rank sent each owner: the root of the sum of the squared norms
    ``squares`` (one ``(owners,)`` tensor per group) of the groups ``on``."""
    parts = [sq for sq, o in zip(squares, on) if o]
    return torch.stack(parts).sum(0).sqrt() if parts else torch.zeros_like(squares[0])


def _severity(row: list[int], step: int, code: int) -> int:
    """How bad a verdict row is, in the order the gathered path judges: header, non-finite
    flag, presence code, body."""
    if row[0] != MAGIC or row[1] != step:
        return 4
    return 3 if row[2] else 2 if row[3] != code else 1 if row[4] else 0
