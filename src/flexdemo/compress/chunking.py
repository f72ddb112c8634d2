"""Chunk planning: how a tensor is cut into DCT blocks.

A dimension of size ``d`` with target edge ``t`` gets:

* ``d`` itself when ``d <= t`` (one chunk, no padding);
* otherwise the divisor of ``d`` in ``[t/2, 2t]`` closest to ``t`` (in ratio; ties go to
  the smaller one), so the tensor tiles exactly;
* otherwise (no such divisor: a prime, say) an edge of ``t`` with ``d`` zero-padded up to the
  next multiple of ``t``. A chunk never collapses to 1 element; padding costs a little compute
  and a few coefficients of bandwidth, and the padded area is cropped on decode.

``rule="divisor"`` (SparseLoCo's chunking) takes instead the largest divisor of ``d`` up to
``t`` (``d`` itself when ``d <= t``): never padded, at the cost of small chunks where ``d`` has
no divisor near ``t`` (a prime gets chunks of 1).

Matrices (and higher-rank tensors, flattened to ``(shape[0], rest)``) are cut into 2-D blocks;
vectors into 1-D chunks. FSDP2 shards whole rows on dim 0, so a rank plans its local shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def choose_chunk(dim: int, target: int) -> tuple[int, int]:
    """Return ``(chunk, padded_dim)`` for one dimension of size ``dim``."""
    if target < 1:
        raise ValueError(f"chunk target must be >= 1, got {target}")
    if dim < 1:
        raise ValueError(f"cannot chunk an empty dimension (size {dim})")
    if dim <= target:
        return dim, dim
    lo, hi = max(1, (target + 1) // 2), 2 * target
    best = None
    for c in range(lo, min(hi, dim) + 1):
        if dim % c == 0:
            score = abs(math.log(c / target))
            if best is None or score < best[0] - 1e-12:
                best = (score, c)
    if best is not None:
        return best[1], dim
    return target, -(-dim // target) * target


@dataclass(frozen=True)
class ChunkPlan:
    """How one (local) tensor is blocked for the DCT.

    ``shape2d`` is the tensor viewed as a matrix (vectors: one row). ``chunk`` is the block edge
    per dimension (1 for the row dimension of a vector), ``padded`` the zero-padded matrix shape.
    """

    shape: tuple[int, ...]
    shape2d: tuple[int, int]
    chunk: tuple[int, int]
    padded: tuple[int, int]

    @property
    def is_1d(self) -> bool:
        return self.chunk[0] == 1 and self.shape2d[0] == 1

    @property
    def needs_padding(self) -> bool:
        return self.padded != self.shape2d

    @property
    def block_numel(self) -> int:
        return self.chunk[0] * self.chunk[1]

    @property
    def num_blocks(self) -> int:
        return (self.padded[0] // self.chunk[0]) * (self.padded[1] // self.chunk[1])

    @property
    def grid(self) -> tuple[int, int]:
        return self.padded[0] // self.chunk[0], self.padded[1] // self.chunk[1]

    @property
    def numel(self) -> int:
        return self.shape2d[0] * self.shape2d[1]

    @property
    def padded_numel(self) -> int:
        return self.padded[0] * self.padded[1]


def largest_divisor(dim: int, target: int) -> int:
    """The largest divisor of ``dim`` that is at most ``target``."""
    if dim < 1 or target < 1:
        raise ValueError(f"need dim >= 1 and target >= 1, got {dim} and {target}")
    return next(c for c in range(min(dim, target), 0, -1) if dim % c == 0)


CHUNK_RULES = ("near", "divisor")


def plan_chunks(shape: tuple[int, ...] | list[int], target: int = 64,
                rule: str = "near") -> ChunkPlan:
    """Plan the DCT blocks of a tensor of ``shape`` for block edge ``target`` (``rule``: see
    the module)."""
    if rule not in CHUNK_RULES:
        raise ValueError(f"chunk rule must be one of {CHUNK_RULES}, got {rule!r}")
    if rule == "divisor":
        shape = tuple(int(s) for s in shape)
        if math.prod(shape) == 0:
            raise ValueError(f"cannot plan chunks for an empty tensor of shape {shape}")
        rows, cols = (1, math.prod(shape)) if len(shape) <= 1 else (shape[0],
                                                                    math.prod(shape[1:]))
        chunk = (1 if len(shape) <= 1 else largest_divisor(rows, target),
                 largest_divisor(cols, target))
        return ChunkPlan(shape, (rows, cols), chunk, (rows, cols))
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    if numel == 0:
        raise ValueError(f"cannot plan chunks for an empty tensor of shape {shape}")
    if len(shape) <= 1:
        c, p = choose_chunk(numel, target)
        return ChunkPlan(shape, (1, numel), (1, c), (1, p))
    rows, cols = shape[0], numel // shape[0]
    cr, pr = choose_chunk(rows, target)
    cc, pc = choose_chunk(cols, target)
    return ChunkPlan(shape, (rows, cols), (cr, cc), (pr, pc))
