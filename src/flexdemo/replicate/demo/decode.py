"""Decoding: sparse ``(index, value)`` coefficients of a group's blocks back to blocks of the
parameters' domain through the inverse transform, and the peers' mean (then ``sign()``)."""

from __future__ import annotations

import torch

from .layout import BlockLayout, Group, Segment


def dense_inverse(lay: BlockLayout, g: Group, s: Segment, parts: list, n: int,
                  div: int | torch.Tensor | None = None) -> torch.Tensor:
    """Inverse DCT of the blocks of segment ``s`` from sparse ``(idx, values)`` parts
    (summed in order, divided by ``div``, default ``n``, when ``n > 1``), as
    ``(blocks, cr, cc)``."""
    w = lay.work
    nb = s.rows.stop - s.rows.start
    numel = nb * g.block_numel
    coef = w.x[:numel].view(nb, g.block_numel).zero_()
    for idx, vals in parts:  # rank order: every replica sums alike
        coef.scatter_add_(1, idx, vals)
    if n > 1:
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
                sign: bool, kept: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """The mean over the peers of their ``(peers, blocks, k)`` coefficients, through the
    inverse DCT and (``sign``) ``sign()``, into the layout's output views. ``kept``:
    ``(keep, count)`` from :func:`~.checks.kept_peers`, the peers left out are zeroed on the
    device and the sum is divided by ``count`` (the same bits as the mean of the kept peers
    alone: zeros add exactly).

    A few coefficients per block (``m <= (cr + cc) / 4`` over all peers) are decoded
    sparsely; more go through a dense coefficient matrix. The choice depends only on
    shapes and the number of peers, so all replicas take the same path and get the same
    bits.
    """
    n, (cr, cc) = idx.shape[0], g.chunk
    m = g.k * n
    div: int | torch.Tensor = n
    if kept is not None:
        keep, count = kept
        keep = keep.view(n, 1, 1)
        idx, vals = torch.where(keep, idx, 0), torch.where(keep, vals, 0.0)
        div = count.clamp(min=1)
    for s in g.segments:
        if n and not s.padded and 4 * m <= cr + cc:
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
                                            for r in range(n)], n, div)
        if sign:
            out.sign_()
        if not s.direct:
            blocks_into_image(lay, g, s, out)
