"""The statistical codebook of :mod:`.quant` (dense stat3 / stat2 / stat1) and :mod:`.blocks`
(sparse, the same): per row of values, bins over ``mean ± spread * std`` (one bit: two bins
split at the mean), each decoded to the mean of its members."""

from __future__ import annotations

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
