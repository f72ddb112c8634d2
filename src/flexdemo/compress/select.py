"""Per-block top-k selection by magnitude.

For large blocks a two-stage search is exact and several times cheaper than ``torch.topk``
over whole blocks: view each block of ``n`` entries as ``s = 8`` rows of ``g = n / s`` entries and
call entry ``j`` of every row *group* ``j`` (a strided group of ``s`` entries). Keep the ``k``
groups with the largest maximum (a vectorised max over rows), then the top ``k`` among those
groups' ``k * s`` entries. Every top-k entry lies in a kept group: if its group were dropped,
``k`` kept groups would each hold a larger entry. The result is the true top-k, up to the
order of ties. On a CPU the ``k`` groups are found the same way among the group maxima
(supergroups of ``s`` groups) where there are enough of them: there ``torch.topk`` costs about
a microsecond per row plus the row's length, so three searches over 64, 128 and 128 entries
(64 x 64 blocks, ``k = 16``) take about 60% of the time of two over 512 and 128 (other
devices keep two searches, as measured).
"""

from __future__ import annotations

import torch

_ROWS = 8


def topk_indices(magnitude: torch.Tensor, k: int, scratch=None, slot: int = 0,
                 nested: bool = False) -> torch.Tensor:
    """Indices ``(blocks, k)`` of the ``k`` largest entries of each row of ``magnitude``
    (``scratch``: a :class:`~flexdemo.compress.dct.Scratch` whose slots from ``slot`` on hold
    the group maxima and the candidates, so that no large temporary is allocated per call;
    ``nested``: ``magnitude`` holds group maxima, searched in two stages only on a CPU)."""
    nb, n = magnitude.shape
    if not 1 <= k <= n:
        raise ValueError(f"topk must be in [1, {n}] for blocks of {n} elements, got {k}")
    groups = n // _ROWS
    if n % _ROWS or groups < 4 * k or (nested and magnitude.device.type != "cpu"):
        return torch.topk(magnitude, k, dim=1, sorted=False).indices
    rows = magnitude.view(nb, _ROWS, groups)
    offsets = torch.arange(_ROWS, device=magnitude.device) * groups
    if scratch is None:
        gmax = rows.amax(dim=1)
        top_groups = topk_indices(gmax, k, nested=True)  # (nb, k)
        cand = (top_groups.unsqueeze(2) + offsets).view(nb, k * _ROWS)
    else:
        gmax = scratch.get(slot, nb * groups, magnitude.dtype, magnitude.device).view(nb, groups)
        torch.amax(rows, dim=1, out=gmax)
        top_groups = topk_indices(gmax, k, scratch, slot + 1, nested=True)
        cand = torch.add(top_groups.unsqueeze(2), offsets, out=scratch.get(
            slot, nb * k * _ROWS, torch.int64, magnitude.device).view(nb, k, _ROWS))
        cand = cand.view(nb, k * _ROWS)
    sel = torch.topk(magnitude.gather(1, cand), k, dim=1, sorted=False).indices
    return cand.gather(1, sel)


def topk_blocks_rowmajor(coef: torch.Tensor, k: int, mag: torch.Tensor,
                         scratch) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`topk_indices` of the blocks of ``coef`` stored row-major across blocks,
    ``(cr, blocks, cc)``: returns the block-local indices ``(blocks, k)`` (``u * cc + v``) and
    the flat positions of those entries in ``coef``.

    The same selection, in the same order, as :func:`topk_indices` on the blocks laid out one
    per row: the groups of the two-stage search (entries ``j`` of the 8 row slices of a block)
    are rows ``u, u + cr/8, ...`` of the block, so their maxima are one reduction over the
    leading dimension, and no copy of the blocks into rows is needed. ``mag`` receives
    ``|coef|``; ``scratch`` (a :class:`~flexdemo.compress.dct.Scratch`) holds the group
    maxima.
    """
    cr, nb, cc = coef.shape
    n = cr * cc
    if not 1 <= k <= n:
        raise ValueError(f"topk must be in [1, {n}] for blocks of {n} elements, got {k}")
    groups = n // _ROWS
    if cr % _ROWS or groups < 4 * k:  # one copy into rows, then the plain search
        rows = mag.view(nb, cr, cc)
        torch.abs(coef.permute(1, 0, 2), out=rows)
        idx = topk_indices(rows.view(nb, n), k, scratch)
    else:
        torch.abs(coef, out=mag.view_as(coef))
        per = scratch.get(0, nb * groups, coef.dtype, coef.device)
        gm = torch.amax(mag.view(_ROWS, cr // _ROWS, nb, cc), dim=0,
                        out=per.view(cr // _ROWS, nb, cc))
        gmax = scratch.get(1, nb * groups, coef.dtype, coef.device).view(nb, cr // _ROWS, cc)
        gmax.copy_(gm.permute(1, 0, 2))
        top_groups = topk_indices(gmax.view(nb, groups), k, scratch, 3, nested=True)
        return _best_of_groups(mag, top_groups, cr, nb, cc, k, scratch)
    return idx, _positions(idx, nb, cc)


def _best_of_groups(mag: torch.Tensor, top: torch.Tensor, cr: int, nb: int, cc: int,
                    k: int, scratch=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` entries of ``mag`` ``(cr, nb, cc)`` among the ``_ROWS`` candidates of
    each of the ``top`` groups ``(nb, k)``: block-local indices and flat positions
    (``scratch``: room for the candidates' indices, reused across calls)."""
    groups = cr * cc // _ROWS
    # candidate r of group j is entry r * groups + j of the block: row r * cr/8 + j // cc
    steps = torch.arange(_ROWS, device=mag.device)
    n = nb * k * _ROWS
    if scratch is None:
        cand = (top.unsqueeze(2) + steps * groups).view(nb, k * _ROWS)
        at = (_positions(top, nb, cc).unsqueeze(2)
              + steps * (cr // _ROWS * nb * cc)).view(nb, k * _ROWS)
    else:  # into reused buffers: a fresh large temporary page-faults on every call on a CPU
        both = scratch.get(2, 2 * n, torch.int64, mag.device)  # (topk_indices: 3 and up)
        cand = torch.add(top.unsqueeze(2), steps * groups,
                         out=both[:n].view(nb, k, _ROWS)).view(nb, k * _ROWS)
        at = torch.add(_positions(top, nb, cc).unsqueeze(2), steps * (cr // _ROWS * nb * cc),
                       out=both[n:].view(nb, k, _ROWS)).view(nb, k * _ROWS)
    # a gather of the flat view: the values of ``torch.take``, about 2.5x faster on a CPU
    cands = mag.view(-1).index_select(0, at.view(-1)).view(at.shape)
    sel = torch.topk(cands, k, dim=1, sorted=False).indices
    return cand.gather(1, sel), at.gather(1, sel)


def _positions(idx: torch.Tensor, nb: int, cc: int) -> torch.Tensor:
    """Flat positions in a ``(cr, nb, cc)`` tensor of block-local indices ``(nb, m)``."""
    block = torch.arange(nb, device=idx.device).unsqueeze(1) * cc
    return (idx // cc) * (nb * cc) + block + idx % cc


def select_rowmajor(coef: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`topk_blocks_rowmajor` as one pure function (no scratch, no ``out=``), for
    ``torch.compile``; needs ``cr % 8 == 0`` and ``cr * cc / 8 >= 4 k``. Same results."""
    cr, nb, cc = coef.shape
    groups = cr * cc // _ROWS
    mag = torch.abs(coef)
    gmax = torch.amax(mag.view(_ROWS, cr // _ROWS, nb, cc), dim=0).permute(1, 0, 2)
    top = topk_indices(gmax.reshape(nb, groups), k, nested=True)
    return _best_of_groups(mag, top, cr, nb, cc, k)
