"""DeMo's sparse mean over one shared index set (``reduce="shared"``): an all-reduce-compatible
exchange whose bytes per rank are flat in the group size.

The gathered exchange sends every rank's indices and values to every rank; the reduce-scatter
(:mod:`.scatter`) sums the ranks' different index sets by block owner and selects again. Here
every rank sends values at the *same* indices, so the values can be averaged slot by slot:

1. **Indices.** Each of the ``n`` ranks takes the top ``ceil(k / n)`` coefficients of every
   block of its own momentum (after the momentum update) and the index lists are all-gathered
   behind each rank's header (step, non-finite flag, presence code): per block the shared set
   is the ``n`` lists side by side in rank order, ``n ceil(k / n)`` slots. A coefficient that
   two ranks picked takes the first of its slots; the later ones are *repeats*, masked out of
   every value decoded (the same mask on every rank: it comes from the shared indices).
2. **Values.** Every rank reads its momentum at the shared slots, codes the values of the
   blocks that owner ``c`` owns (blocks ``[c p, (c + 1) p)`` of each group, ``p = ceil(blocks /
   n)``) into part ``c`` and subtracts from its momentum exactly what it sent, as decoded
   (error feedback: what it did not send stays there). One all-to-all delivers to each owner
   the ``n`` ranks' parts; the owner sums the decoded values in rank order, divides by ``n``
   and codes the mean again with the same codec (a second rounding, not fed back: no owner
   state), behind its verdict on every sender (finite values). The owners' parts are
   all-gathered and every rank decodes the same bytes: bitwise the same mean everywhere.
3. **Judgement.** One read of the device per step: the senders' index headers and index checks
   and the owners' verdicts. A flagged or corrupt sender raises as in the gathered path
   (:class:`NonFiniteGradientError`, :class:`CorruptPayloadError`), after which the caller
   adds back what it sent.

With a bound on each peer's part (:mod:`~flexdemo.replicate.bound`) an owner scales down a
sender's values whose norm is over the multiple of the median of the senders' norms (with 2
ranks: of its own values'), on the device, before the sum; every rank scales down an owner's
part whose norm is over the multiple of the norm of the values it sent that owner. Both ride in
the step's one read.

Per rank: the index all-gather sends and receives ``(n - 1)`` lists of ``ceil(k / n)`` indices
per block (about one payload's indices whatever ``n``, plus a 32-byte header per peer), the
all-to-all and the all-gather of the values ``(n - 1) / n`` of a value payload each. Where
the index lists overlap, fewer than ``k`` distinct coefficients move per block.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ...compress.bits import pack_bits, packed_nbytes, unpack_bits
from ...compress.blocks import BlockValueCodec
from ...transport import (
    CommStats,
    all_gather,
    all_gather_bytes,
    all_to_all_bytes,
    all_to_all_equal,
)
from ..agreement import HEADER_BYTES, align8
from ..bound import PeerBound, float_bits, from_bits
from .checks import NONFINITE, RANGE, REPEAT, good_peers
from .decode import decode_mean
from .layout import BlockLayout, Group
from .scatter import sent_norms
from .staging import Sent, Staging, StepPlan


def _offsets(sizes: list[int], start: int) -> tuple[list[tuple[int, int]], int]:
    """Consecutive 8-byte-aligned segments of ``sizes`` bytes from ``start``; and their end."""
    out, off = [], start
    for s in sizes:
        out.append((off, off + s))
        off = align8(off + s)
    return out, off



def positions(idx: torch.Tensor, g: Group) -> torch.Tensor:
    """Flat positions in ``g.coef`` ``(cr, blocks, cc)`` of block-local indices
    ``(blocks, m)``."""
    cc, nb = g.chunk[1], g.blocks
    block = torch.arange(nb, device=idx.device).unsqueeze(1) * cc
    return (idx // cc) * (nb * cc) + block + idx % cc


class SharedIndices:
    """The buffers and stages of one replicator's shared-index exchange over ``world`` ranks
    (see the module; one per group size: buffers keep their addresses, so a CUDA graph of the
    encode stays valid)."""

    def __init__(self, layout: BlockLayout, codec: BlockValueCodec, world: int, *,
                 name: str) -> None:
        groups, device, n = layout.groups, layout.device, world
        self.layout, self.codec, self.world, self.name, self.groups = (
            layout, codec, world, name, groups)
        self.index = {id(g): gi for gi, g in enumerate(groups)}
        self.share = [math.ceil(g.k / n) for g in groups]  # indices per block from each rank
        self.slots = [n * s for s in self.share]  # the shared set's slots per block
        self.per = [math.ceil(g.blocks / n) for g in groups]  # blocks per owner
        self.idx_seg, idx_end = _offsets(
            [packed_nbytes(g.blocks * s, g.bits) for g, s in zip(groups, self.share)],
            HEADER_BYTES)
        self.val_seg, part_end = _offsets(
            [codec.nbytes(p, m) for p, m in zip(self.per, self.slots)], 0)
        self.verdict_end = 8 * n  # an owner's part: a word per sender (its values' fault)
        self.own_seg, reply_end = _offsets(
            [codec.nbytes(p, m) for p, m in zip(self.per, self.slots)], self.verdict_end)

        def u8(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.uint8, device=device)

        self.bucket = u8(layout.bucket_bytes)  # the encode stage's header (segments unused)
        self.indices = u8(idx_end)  # this rank's header and index lists: what it sends
        self.send, self.recv = u8(n, max(part_end, 8)), u8(n, max(part_end, 8))
        self.reply = u8(reply_end)  # this rank's owner part
        self.pad_vals = [torch.zeros(n * p, m, device=device)
                         for p, m in zip(self.per, self.slots)]
        # per group, the squared norm of the values this rank sent each owner
        self.sent_squares = [torch.zeros(n, device=device) for _ in groups]
        # the step's shared sets (indices, first occurrences, checks) and what this rank sent
        self.step_sets: list = []
        self.last: list[Sent | None] = []
        self.gathered = self.indices.unsqueeze(0)
        self.rank = 0

    def payload_bytes(self) -> int:
        """Bytes this rank puts on the wire per exchange: its index lists, ``n`` value parts
        and its owner part."""
        return self.indices.numel() + self.send.numel() + self.reply.numel()

    def exchange_bytes(self) -> int:
        """Bytes sent (and received) per rank: the index all-gather, the all-to-all of the
        values and the all-gather of the owners' parts."""
        n = self.world
        return (all_gather_bytes(self.indices.numel(), n)
                + all_to_all_bytes(self.send.numel(), n)
                + all_gather_bytes(self.reply.numel(), n))

    # ------------------------------------------------------------------ indices
    def k_of(self, g: Group) -> int:
        """How many coefficients of each block of ``g`` this rank picks: ``ceil(k / n)``."""
        return self.share[self.index[id(g)]]

    def pack(self, g: Group, idx: torch.Tensor, vals: torch.Tensor) -> None:
        """Group ``g``'s picked ``(blocks, ceil(k / n))`` indices into this rank's index
        list (its values are sent once the shared set is known: nothing is fed back yet)."""
        a, b = self.idx_seg[self.index[id(g)]]
        pack_bits(idx, g.bits, self.indices[a: b])

    def shared_set(self, gathered: torch.Tensor, g: Group, gi: int):
        """Group ``g``'s shared slots from the gathered index lists: the block-local indices
        ``(blocks, slots)`` (the ranks' lists side by side in rank order), the mask of first
        occurrences (float), and per sender its check ``(reason, largest index)``."""
        n, s, (a, b) = self.world, self.share[gi], self.idx_seg[gi]
        idx = unpack_bits(gathered[:, a: b], g.bits, g.blocks * s).view(n, g.blocks, s)
        why = torch.zeros(n, dtype=torch.int64, device=idx.device)
        top = idx.flatten(1).amax(1)
        if s > 1:
            srt = idx.sort(dim=2).values
            why = torch.where((srt[..., 1:] == srt[..., :-1]).flatten(1).any(1), REPEAT, why)
        if (1 << g.bits) > g.block_numel:  # a packed index can exceed the block
            why = torch.where(top >= g.block_numel, RANGE, why)
            idx = idx.clamp(max=g.block_numel - 1)  # in range (the step raises)
        shared = idx.permute(1, 0, 2).reshape(g.blocks, n * s)
        srt, order = shared.sort(dim=1, stable=True)
        later = torch.zeros_like(shared, dtype=torch.bool)
        later.scatter_(1, order[:, 1:], srt[:, 1:] == srt[:, :-1])
        return shared, (~later).to(torch.float32), (why, top)

    # ------------------------------------------------------------------ values
    def share_values(self, plan: StepPlan, rank: int, transport, stats: CommStats,
                     add_to_momentum: Callable) -> list[Sent | None]:
        """All-gather the index lists (behind this rank's header), then this rank's values at
        the shared slots into the owners' parts, each subtracted from its momentum as the
        owners decode it (``add_to_momentum(g, idx, pos, vals, sign=-1.0)``). Returns per
        group what was sent ``(indices, positions, values)``, or None."""
        self.rank = rank
        self.indices[:HEADER_BYTES].copy_(self.bucket[:HEADER_BYTES])
        self.gathered = gathered = all_gather(self.indices, transport, stats)
        bad = self.bucket[:HEADER_BYTES].view(torch.int64)[2] != 0  # zeros from a bad input
        sent: list[Sent | None] = []
        self.step_sets = []
        for gi, g in enumerate(self.groups):
            if not plan.group_on[gi]:
                sent.append(None)
                self.step_sets.append(None)
                continue
            shared, first, check = self.shared_set(gathered, g, gi)
            pos = positions(shared, g)
            vals = g.coef.view(-1).index_select(0, pos.view(-1)).view(pos.shape)
            vals = torch.where(bad, 0.0, vals)
            for rows in plan.off_rows[gi]:  # units without a gradient send zeros
                vals[rows] = 0.0
            seen = self.pack_values(g, gi, vals, first)
            add_to_momentum(g, shared, pos, seen, sign=-1.0)  # what it sent leaves
            sent.append((shared, pos, seen))
            self.step_sets.append((shared, first, check))
        self.last = sent
        return sent

    def pack_values(self, g: Group, gi: int, vals: torch.Tensor,
                    first: torch.Tensor) -> torch.Tensor:
        """This rank's ``(blocks, slots)`` values into the owners' parts; returns them as the
        owners decode them, repeats zeroed."""
        per, pad = self.per[gi], self.pad_vals[gi]
        pad[: g.blocks].copy_(vals)
        a, b = self.val_seg[gi]
        seen = torch.empty_like(pad)
        for c in range(self.world):  # the codecs code block by block: one call per part
            rows = slice(c * per, (c + 1) * per)
            seen[rows] = self.codec.encode(pad[rows], self.send[c, a: b])
        seen[: g.blocks].mul_(first)
        torch.sum(seen.view(self.world, -1).square(), 1, out=self.sent_squares[gi])
        return seen[: g.blocks]

    def _owner_part(self, plan: StepPlan,
                    bound: PeerBound | None = None) -> torch.Tensor | None:
        """This rank's owner part: its verdict on every sender (non-finite values) and the
        coded mean of its blocks. With ``bound``: each sender's values scaled by its factor
        first (1 within the bound: the same bits); returns each sender's norm and factor as
        int64 words (fp64 bits) to read."""
        n, rank = self.world, self.rank
        bad = torch.zeros(n, dtype=torch.int64, device=self.recv.device)
        parts: list = []
        squares = torch.zeros(n, device=self.recv.device)
        for gi, per in enumerate(self.per):
            sets = self.step_sets[gi]
            if sets is None:
                parts.append(None)
                continue
            m, (a, b) = self.slots[gi], self.val_seg[gi]
            vals = self.codec.decode(self.recv[:, a: b], per, m)  # (senders, per, slots)
            first = sets[1][rank * per: (rank + 1) * per]
            if first.shape[0] < per:  # padding blocks past the group's end
                first = torch.cat([first, first.new_zeros(per - first.shape[0], m)])
            vals = vals * first
            finite = torch.isfinite(vals).flatten(1).all(1)
            bad = torch.where(finite, bad, NONFINITE)
            vals = torch.where(finite.view(n, 1, 1), vals, 0.0)  # bad senders leave nothing
            if bound is not None:
                squares += vals.square().flatten(1).sum(1)
            parts.append(vals)
        factors = None if bound is None else bound.factors_on_device(
            squares.sqrt(), rank, bad == 0)
        for gi, vals in enumerate(parts):
            if vals is None:
                continue
            if factors is not None:  # a sender over the bound scaled down to the median
                vals = vals * factors.view(n, 1, 1)
            total = vals[0].clone()
            for r in range(1, n):  # rank order
                total.add_(vals[r])
            c, d = self.own_seg[gi]
            self.codec.encode(total.div_(n), self.reply[c: d])
        self.reply[: self.verdict_end].view(torch.int64).copy_(bad)
        if factors is None:
            return None
        return torch.cat([float_bits(squares.sqrt()), float_bits(factors)])

    # ------------------------------------------------------------------ the step
    def exchange(self, plan: StepPlan, step: int, transport, stats: CommStats,
                 bad_peer: Callable[[int, int, str], None], *, rank: int = 0,
                 bound: PeerBound | None = None) -> list:
        """After :meth:`share_values`: the all-to-all of the values, this rank's owner part,
        the all-gather of the owners' parts and the judgement (raises through ``bad_peer``
        on every rank alike). Returns per group the mean's ``(blocks, slots)`` values at the
        shared slots, or None. ``bound``: the bound on each sender's values and on each
        owner's part (or None); ``rank`` is this rank (set by :meth:`share_values`)."""
        bound = bound if bound is not None and bound.on else None
        all_to_all_equal(self.recv, self.send, transport, stats)
        owned = self._owner_part(plan, bound)
        replies = all_gather(self.reply, transport, stats)
        n, gathered = self.world, self.gathered
        dev = gathered.device
        heads = gathered[:, :HEADER_BYTES].contiguous().view(torch.int64).view(n, 4)
        reason = which = top = torch.zeros(n, dtype=torch.int64, device=dev)
        for gi in reversed(range(len(self.groups))):  # the first bad group names the reason
            if self.step_sets[gi] is None:
                continue
            why, big = self.step_sets[gi][2]
            hit = why != 0
            reason, which = torch.where(hit, why, reason), torch.where(hit, gi, which)
            top = torch.where(hit, big, top)
        said = replies[:, : self.verdict_end].contiguous().view(torch.int64).amax(0)
        reason = torch.where((reason == 0) & (said != 0), said, reason)
        out: list = []
        finite = torch.ones(n, dtype=torch.bool, device=dev)
        squares = torch.zeros(n, device=dev)
        for gi in range(len(self.groups)):
            if self.step_sets[gi] is None:
                out.append(None)
                continue
            c, d = self.own_seg[gi]
            vals = self.codec.decode(replies[:, c: d], self.per[gi], self.slots[gi])
            finite &= torch.isfinite(vals).flatten(1).all(1)
            if bound is not None:
                squares += vals.square().flatten(1).sum(1)
            out.append(vals)
        words = [] if owned is None else [  # its senders' norms and factors, the owners'
            owned, float_bits(squares.sqrt()),  # norms, the norms of what it sent each
            float_bits(sent_norms(self.sent_squares, [s is not None for s in self.step_sets]))]
        rows = torch.cat([torch.cat([heads, torch.stack([reason, which, top], 1)], 1).view(-1),
                          finite.to(torch.int64), *words]).tolist()  # the step's one read
        good_peers([rows[7 * r: 7 * r + 7] for r in range(n)], step, plan.code,
                   name=self.name, group=transport, groups=self.groups, bad_peer=bad_peer)
        for c, ok in enumerate(rows[7 * n: 8 * n]):
            if not ok:
                bad_peer(c, step, "its reduced part is non-finite")
        scale = None
        if bound is not None:
            norms, factors, theirs, mine = (from_bits(rows[8 * n + n * i: 8 * n + n * (i + 1)])
                                            for i in range(4))
            bound.report(norms, factors, n, step=step, transport=transport)
            clip = bound.own_limit(theirs, mine, self.rank, step=step, transport=transport,
                                   what="reduced part")
            if clip:
                scale = torch.tensor([clip.get(c, 1.0) for c in range(n)],
                                     device=dev).view(n, 1, 1)
        for gi, g in enumerate(self.groups):  # the owners' parts at the shared slots
            if out[gi] is not None:
                vals = out[gi] if scale is None else out[gi] * scale
                out[gi] = vals.reshape(-1, self.slots[gi])[: g.blocks] * self.step_sets[gi][1]
        return out

    def write_mean(self, mean: list, plan: StepPlan, grads, staging: Staging, *,
                   sign: bool) -> None:
        """The mean from :meth:`exchange` (one "peer": no division) at the shared slots
        through the inverse transform and ``sign`` into the gradients present (``plan``)."""
        self._decode(mean, plan, grads, staging, sign)

    def sent_into(self, plan: StepPlan, outs, staging: Staging) -> None:
        """What this rank sent at its last exchange, as decoded, into ``outs``."""
        self._decode([None if s is None else s[2] for s in self.last], plan, outs, staging,
                     False)

    def _decode(self, vals: list, plan: StepPlan, outs, staging: Staging, sign: bool) -> None:
        for gi, g in enumerate(self.groups):
            pieces, views = plan.write[gi]
            last = self.last[gi] if gi < len(self.last) else None
            if pieces and vals[gi] is not None and last is not None:
                decode_mean(self.layout, g, last[0].unsqueeze(0), vals[gi].unsqueeze(0),
                            sign=sign)
                staging.write_back(outs, pieces, views)
