"""Per-block top-k selection by magnitude."""

from __future__ import annotations

import torch


def topk_indices(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``(blocks, k)`` of the ``k`` largest entries of each row of ``magnitude``.

    (A two-stage search over group maxima was measured slower than ``torch.topk`` on CPU.)
    """
    n = magnitude.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"topk must be in [1, {n}] for blocks of {n} elements, got {k}")
    return torch.topk(magnitude, k, dim=1, sorted=False).indices
