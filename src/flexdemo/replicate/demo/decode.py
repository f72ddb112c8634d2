"""Decoding: sparse ``(index, value)`` coefficients of a group's blocks back to blocks of the
parameters' domain through the inverse transform, and the peers' mean (then ``sign()``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .checks import check_payloads, unpack_group
from .layout import BlockLayout, Group, Segment, block_positions

SENDERS_SLOT = 11  # the scratch slot of the per-coefficient count of senders


def dense_inverse(lay: BlockLayout, g: Group, s: Segment, parts: list, n: int,
                  div: int | torch.Tensor | None = None, senders: bool = False,
                  scales: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse DCT of the blocks of segment ``s`` from sparse ``(idx, values)`` parts
    (summed in order, divided by ``div``, default ``n``, when ``n > 1``; ``senders``: each
    coefficient divided by the number of parts that sent it a non-zero value instead, or by
    the sum of their ``scales``, one per part), as ``(blocks, cr, cc)``."""
    w, bn = lay.work, g.block_numel
    nb = s.rows.stop - s.rows.start
    numel = nb * bn  # the coefficients in the segment's rows of the staging buffer (free
    # once encoded), where the inverse's second product writes ``out`` or its copy (blocks
    # of one row: one product, from ``z``)
    rows = g.xh.view(-1)[s.rows.start * bn: s.rows.stop * bn] if g.chunk[0] > 1 else w.z
    coef = rows[:numel].view(nb, bn).zero_()
    for idx, vals in parts:  # rank order: every replica sums alike
        coef.scatter_add_(1, idx, vals)
    if senders:  # the count (or the scales' sum, in rank order): alike on every replica
        count = lay.scratch.get(SENDERS_SLOT, numel, torch.float32, lay.device)
        count = count.view(nb, g.block_numel).zero_()
        for r, (idx, vals) in enumerate(parts):
            sent = (vals != 0).to(torch.float32)
            count.scatter_add_(1, idx, sent if scales is None else sent.mul_(scales[r]))
        # a coefficient no one sent divides its zero by 1 (weighted counts may be below 1)
        coef.div_(count.clamp_(min=1.0) if scales is None else count.masked_fill_(count == 0, 1))
    elif n > 1:
        coef.div_(n if div is None else div)
    out = lay.blocks_out(g, s)
    g.dct.inverse(coef, out, w.z[:numel])
    return out


def blocks_into_image(lay: BlockLayout, g: Group, s: Segment, blocks: torch.Tensor) -> None:
    """Blocks of an image-staged segment into its rows of the output image (where they are
    not already there)."""
    if s.inv is not None:
        cc = g.chunk[1]
        torch.index_select(blocks.view(-1, cc), 0, s.inv,
                           out=lay.out_image(g, s.image_part, s.padded).view(-1, cc))


def decode_mean(lay: BlockLayout, g: Group, idx: torch.Tensor, vals: torch.Tensor, *,
                sign: bool, kept: tuple[torch.Tensor, torch.Tensor] | None = None,
                senders: bool = False, scales: torch.Tensor | None = None) -> None:
    """The mean over the peers of their ``(peers, blocks, k)`` coefficients, through the
    inverse DCT and (``sign``) ``sign()``, into the layout's output views. ``kept``:
    ``(keep, count)`` from :func:`~.checks.kept_peers`, the peers left out are zeroed on the
    device and the sum is divided by ``count`` (the same bits as the mean of the kept peers
    alone: zeros add exactly). ``senders``: each coefficient is the mean over the peers that
    sent it a non-zero value (the sum divided by their count, or by the sum of their
    ``scales``, ``(peers,)``, when given; always the dense path).

    A few coefficients per block (``m <= (cr + cc) / 4`` over all peers) are decoded
    sparsely; more go through a dense coefficient matrix. The choice depends only on
    shapes and the number of peers, so all replicas take the same path and get the same
    bits.
    """
    n, (cr, cc) = idx.shape[0], g.chunk
    m = idx.shape[-1] * n  # k per peer, or the shared slots (world * ceil(k / world))
    div: int | torch.Tensor = n
    if kept is not None:
        keep, count = kept
        keep = keep.view(n, 1, 1)
        idx, vals = torch.where(keep, idx, 0), torch.where(keep, vals, 0.0)
        div = count.clamp(min=1)
    for s in g.segments:
        if n and not s.padded and not senders and 4 * m <= cr + cc:
            nb = s.rows.stop - s.rows.start
            i, v = idx[:, s.rows], vals[:, s.rows]
            if n > 1:  # (blocks, peers * k) in rank order
                i = i.permute(1, 0, 2).reshape(nb, m)
                v = v.permute(1, 0, 2).reshape(nb, m) / div
            else:
                i, v = i[0], v[0]
            out = lay.blocks_out(g, s)
            left = lay.scratch.get(5, nb * m * cr, torch.float32, lay.device)
            right = lay.scratch.get(6, nb * m * cc, torch.float32, lay.device)
            g.dct.inverse_sparse(i, v, out, left, right)
        else:
            out = dense_inverse(lay, g, s, [(idx[r, s.rows], vals[r, s.rows])
                                            for r in range(n)], n, div, senders, scales)
        if sign:
            out.sign_()
        if not s.direct:
            blocks_into_image(lay, g, s, out)


def clip_to_median_norm(decoded: Sequence, good: list[int] | None,
                        kept: tuple[torch.Tensor, torch.Tensor] | None = None) -> Sequence:
    """The decoded ``(idx, vals)`` of every group with each peer's values scaled down to the
    median of the peers' norms where its own norm is larger (one norm per peer over all its
    groups, taken on the coefficients: the transform is orthonormal, so it is the norm in the
    parameters' domain). The median is over the peers that enter the mean (``good``, or
    ``kept`` decided on the device), the mean of the two middle norms for an even count;
    computed on the device, the same bits on every replica."""
    parts = [d for d in decoded if d is not None]
    if not parts:
        return decoded
    norms = torch.stack([v.square().flatten(1).sum(1) for _, v in parts]).sum(0).sqrt()
    n = norms.shape[0]
    keep = kept[0] if kept is not None else None
    if keep is None and good is not None and len(good) < n:
        keep = torch.zeros(n, dtype=torch.bool, device=norms.device)
        keep[good] = True
    if keep is None:
        srt = norms.sort().values
        median = (srt[(n - 1) // 2] + srt[n // 2]) / 2
    else:
        srt = torch.where(keep, norms, torch.inf).sort().values
        count = keep.sum().clamp(min=1)
        middle = torch.stack([(count - 1) // 2, count // 2])
        median = srt.gather(0, middle).mean()
    factor = torch.where(norms > median, median / norms, torch.ones_like(norms))
    return [None if d is None else (d[0], d[1] * factor.view(-1, 1, 1)) for d in decoded]


class ScaledPayloads(Sequence):
    """Decoded payloads (a list, or a :class:`~.checks.GroupPayloads` that unpacks a group
    when asked) with every peer's values scaled by its factor ``(peers,)`` (the bound on a
    peer's part), group by group as asked (a copy of the values)."""

    def __init__(self, decoded: Sequence, factors: torch.Tensor) -> None:
        self.decoded, self.factors = decoded, factors

    def __len__(self) -> int:
        return len(self.decoded)

    def __getitem__(self, gi):
        d = self.decoded[gi]
        return None if d is None else (d[0], d[1] * self.factors.view(-1, 1, 1))


def write_own(lay: BlockLayout, staging, codec, own: torch.Tensor, plan, outs) -> None:
    """This rank's payload ``own`` (its bucket) decoded as the peers decode it (one peer, no
    ``sign``) into the tensors ``outs`` present in ``plan``."""
    _, decoded = check_payloads(own.unsqueeze(0), lay.groups, codec, plan)
    for gi, g in enumerate(lay.groups):
        pieces, views = plan.write[gi]
        if pieces and decoded[gi] is not None:
            decode_mean(lay, g, *decoded[gi], sign=False)
            staging.write_back(outs, pieces, views)


def add_back_own(add_to_momentum: Callable, groups: list[Group], codec, own: torch.Tensor,
                 plan) -> None:
    """Add this rank's payload ``own`` (its bucket, as the peers decode it) back to its
    momentum (``add_to_momentum(g, idx, pos, vals, sign=1.0)``), group by group: undoes the
    error feedback of an exchange that was not applied. Rebuilt from the bytes sent (the
    values the encode fed back, the same bits), so the encode keeps nothing for it."""
    rows = own.unsqueeze(0)
    for gi, g in enumerate(groups):
        if plan.group_on[gi]:
            idx, vals = unpack_group(rows, g, codec)
            add_to_momentum(g, idx[0], block_positions(g.coef.shape, idx[0]), vals[0],
                            sign=1.0)
