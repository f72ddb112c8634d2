"""The statistical codebooks of :mod:`.quant` (dense stat3 / stat2 / stat1) and :mod:`.blocks`
(sparse, the same): per row of values, bins over ``mean ± spread * std`` (one bit: two bins
split at the mean), each decoded to the mean of its members (:func:`stat_codebook`); and
per tensor, the form of MuLoCo's and SparseLoCo's 2-bit values, ``L`` bins of ``6 std / L``
around the mean (:func:`tensor_codebook`: the ``"stat2-tensor"`` format)."""

from __future__ import annotations

import math

import torch


def stat_codebook(v: torch.Tensor, count: torch.Tensor, n: int, bits: int,
                   spread: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The statistical codebook of the rows of ``v`` (fp32 ``(b, w)``, contiguous): its first
    ``n`` entries (row-major) are values, ``count`` per row, and the rest zero padding (then
    overwritten). Returns the codes (int64 ``(b, w)``: each value's bin) and the fp32 bin means
    ``(b, L)`` (an empty bin: its centre); the padding takes no part in either."""
    b, w = v.shape
    levels = 1 << bits
    flat = v.view(-1)
    mu = v.sum(1) / count
    if n < b * w:  # padding at the mean: no weight in the deviations
        flat[n:].copy_(mu[-1:].expand(b * w - n))
    half = (v.var(1, correction=0) * (w / count)).sqrt_() * spread  # Z * sd
    codes = torch.zeros(b, w, dtype=torch.int64, device=v.device)
    for j in range(1, levels):  # the L - 1 edges
        codes += v >= (mu + half * (2 * j / levels - 1))[:, None]
    offset = torch.arange(b, device=v.device)[:, None] * levels
    index = codes.add_(offset).view(-1)[:n]  # (block, bin), undone below
    sums = v.new_zeros(b * levels).scatter_add_(0, index, flat[:n])
    hits = v.new_zeros(b * levels).scatter_add_(0, index, v.new_ones(1).expand(n))
    codes.sub_(offset)
    centre = (torch.arange(levels, device=v.device) * 2 + 1) / levels - 1
    centre = mu[:, None] + half[:, None] * centre
    means = torch.where(hits > 0, sums / hits.clamp_min(1), centre.view(-1))
    return codes, means.view(b, levels)


#: the range of the per-tensor codebook in standard deviations: MuLoCo's and SparseLoCo's
#: published 6-sigma range (``L`` bins of ``6 sd / L`` each, centred on the mean)
TENSOR_SIGMAS = 6.0


def tensor_codebook(v: torch.Tensor, bits: int,
                    sigmas: float = TENSOR_SIGMAS) -> tuple[torch.Tensor, torch.Tensor]:
    """One statistical codebook for all of ``v`` (fp32, any shape), the form of MuLoCo's and
    SparseLoCo's 2-bit values: with ``mu`` the mean, ``c = v - mu``, ``sd = |c| / sqrt(n -
    1)`` and the bin width ``s = sigmas * sd / L`` (``L = 2**bits``; ``s = 1`` where it is 0
    or not finite), each value's code is ``round(c / s + L / 2)`` clamped to ``[0, L - 1]``
    (ties to even; so the edges sit at ``(j - L/2 - 1/2) s``, ``j = 1 .. L-1``, asymmetric
    about the mean), and bin ``j`` decodes to ``mu`` plus the mean of ``c`` over its members
    (an empty bin, never decoded: ``mu``). Returns the codes (int64, ``v``'s shape) and the
    ``L`` fp32 bin values. The mean, the norm and the bins' sums are taken in fp64 and
    rounded once to fp32, so the codebook does not depend on the order of the values (the
    top-k selection's order, a peer's layout): the same values give the same bits."""
    levels = 1 << bits
    n = v.numel()
    flat = v.reshape(-1)
    mu = flat.double().mean().float() if n else v.new_zeros(())
    c = flat - mu
    sd = c.double().norm() / math.sqrt(n - 1) if n > 1 else c.new_zeros((), dtype=torch.float64)
    s = (sd * sigmas / levels).float()
    s = torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))
    codes = (c / s + levels // 2).round_().clamp_(0, levels - 1).to(torch.int64)
    sums = torch.zeros(levels, dtype=torch.float64, device=v.device).scatter_add_(
        0, codes, c.double())
    hits = torch.zeros(levels, dtype=torch.float64, device=v.device).scatter_add_(
        0, codes, torch.ones(1, dtype=torch.float64, device=v.device).expand(n))
    means = (sums / hits.clamp_min(1)).float() + mu
    return codes.view(v.shape), means
