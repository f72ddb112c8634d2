"""Muon's Newton-Schulz orthogonalisation over stacks of same-shape matrices.

:func:`newton_schulz` is the iteration of ``torch.optim._muon._zeropower_via_newtonschulz``
(bf16, a tall matrix worked on as its transpose, the Frobenius norm clamped at ``eps``, then
``steps`` quintic updates ``X <- a X + (b G + c G G) X`` with ``G = X X^T``), written with
batched matmuls so that ``n`` matrices of one shape take one call per matmul instead of ``n``.
:func:`orthogonalise` groups a list of matrices by shape and runs each group as one stack.

On CPU (torch 2.13, oneDNN) the batched result is bitwise torch's per-matrix one: every matrix
keeps the memory layout torch gives it (a tall one is a transposed view of its stack, as
torch's ``.T`` is of the matrix). A tall matrix is therefore not stacked with wide ones of its
transposed shape: made contiguous, its product rounds differently (one bf16 step at 768 x 3072).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# how MuonAdamW orthogonalises its matrices: one batched call per shape, or torch's per matrix
NS_MODES = ("batched", "per_matrix")
#: the precision the batched iterations compute in (MuonAdamW's ``ns_dtype``): bf16 as torch
#: does, or fp32 (inputs and results stay bf16)
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
#: the least entries the default bound on a batch of whole matrices allows on CUDA (16 MiB in
#: fp32; MuonAdamW's ``ns_batch_numel``), and off CUDA (:data:`NS_BATCH_MIN`)
NS_BATCH_NUMEL = 1 << 22
NS_BATCH_MIN = 1 << 20

Coefficients = tuple[float, float, float]


def ns_compute_dtype(ns_dtype: str, device: torch.device) -> torch.dtype:
    """The dtype the batched iterations compute in for MuonAdamW's ``ns_dtype`` on
    ``device``: ``"auto"`` is fp32 on the CPU (most CPUs multiply bf16 far slower than fp32)
    and bf16 elsewhere (a GPU's tensor cores)."""
    if ns_dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return NS_DTYPES[ns_dtype]


def newton_schulz(x: torch.Tensor, coefficients: Coefficients, steps: int,
                  eps: float) -> torch.Tensor:
    """Orthogonalise each matrix of ``x`` (``n x rows x cols``); bf16, shape of ``x``.

    The result of a tall stack (``rows > cols``) is a transposed view, as torch's is. ``x``
    is left as it is (:func:`newton_schulz_` works in a contiguous bf16 copy)."""
    _check(x, steps)
    return newton_schulz_(torch.empty(x.shape, dtype=torch.bfloat16, device=x.device).copy_(x),
                          coefficients, steps, eps)


def newton_schulz_(x: torch.Tensor, coefficients: Coefficients, steps: int,
                   eps: float, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """:func:`newton_schulz` of a contiguous bf16 stack ``x``, which it overwrites.

    The iterations write into ``x``'s storage and one buffer of its size, plus the two
    ``n x r x r`` products (``r``: the shorter side), one of them in the spare buffer when
    the matrices are square: the same kernels and layouts as allocating each result, so the
    same bits, in 3 stacks' bytes (square) or 2 plus the products. The result lives in one of
    the two buffers.

    ``dtype=torch.float32`` computes the iterations in fp32 copies of a few matrices at a
    time (:func:`_newton_schulz_wide_`) and writes the result, rounded to bf16, into ``x``'s
    storage: not torch's bits, but on a CPU without bf16 matrix units (AVX2) 10-20x faster
    than bf16 there. Its workspace is that of one part, not of the stack."""
    _check(x, steps)
    if x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise ValueError("newton_schulz_ takes a contiguous bf16 stack (it works in place)")
    if dtype not in NS_DTYPES.values():
        raise ValueError(f"dtype must be torch.bfloat16 or torch.float32, got {dtype}")
    if dtype != x.dtype:
        return _newton_schulz_wide_(x, coefficients, steps, eps, dtype)
    n, rows, cols = x.shape
    tall = rows > cols
    y = x.mT if tall else x
    r, k = y.shape[1:]
    y.div_(y.norm(dim=(1, 2), keepdim=True).clamp(min=eps))  # spectral norm <= 1
    if not steps:
        return x
    buffers = (x.view(n, r, k), torch.empty_like(x).view(n, r, k))  # contiguous
    gram = None if r == k else x.new_empty(n, r, r)
    y = _iterate_alternating_(y, buffers, coefficients, steps, gram)
    return y.mT if tall else y


def _iterate_alternating_(y: torch.Tensor, buffers: tuple[torch.Tensor, torch.Tensor],
                          coefficients: Coefficients, steps: int,
                          gram: torch.Tensor | None = None) -> torch.Tensor:
    """The iterations from ``y`` (``n x r x k``, ``r <= k``), each iterate written into the one
    of ``buffers`` (two ``n x r x k`` views) that does not hold the last; returns the last.
    The Gram product goes into ``gram``, or (square, ``gram=None``) into that spare buffer,
    spent before the iterate overwrites it."""
    a, b, c = coefficients
    n, r, _ = y.shape
    poly = y.new_empty(n, r, r)
    for step in range(steps):
        spare = buffers[(step + 1) % 2]  # the buffer y is not in
        g = torch.bmm(y, y.mT, out=spare if gram is None else gram)
        torch.baddbmm(g, g, g, beta=b, alpha=c, out=poly)
        y = torch.baddbmm(y, poly, y, beta=a, out=spare)  # square: over the spent gram
    return y


def _newton_schulz_wide_(x: torch.Tensor, coefficients: Coefficients, steps: int,
                         eps: float, dtype: torch.dtype) -> torch.Tensor:
    """:func:`newton_schulz_` computing in ``dtype`` (wider than bf16): a few matrices at a
    time (at most :data:`WIDE_PART_NUMEL` entries, or one matrix), each part's copy iterated
    in place (:func:`_iterate_in_place_`) and its result rounded into the part's bytes of
    ``x``, laid out as the bf16 path leaves it. The workspace is that of one part."""
    n, rows, cols = x.shape
    tall = rows > cols
    r, k = min(rows, cols), max(rows, cols)
    per = max(1, WIDE_PART_NUMEL // (r * k))
    out = x.view(n, r, k)  # part i's result fills exactly the bytes its input came from
    for i in range(0, n, per):
        work = x[i:i + per].to(dtype)
        work.div_(work.norm(dim=(1, 2), keepdim=True).clamp(min=eps))  # spectral norm <= 1
        y = work.mT if tall else work
        if steps:
            out[i:i + per].copy_(_iterate_in_place_(y, coefficients, steps))
        else:
            x[i:i + per].copy_(work)
        del work, y  # before the next part's copy is made
    if not steps:
        return x
    return out.mT if tall else out


#: the most entries one part of :func:`_newton_schulz_wide_` takes (1 MB in fp32)
WIDE_PART_NUMEL = 1 << 18


def _iterate_in_place_(y: torch.Tensor, coefficients: Coefficients,
                       steps: int) -> torch.Tensor:
    """The iterations on the normalised ``n x r x k`` stack ``y`` (``r <= k``); returns the
    last iterate. Square: each new iterate goes over the spent Gram product (3 stacks'
    bytes). Otherwise it overwrites ``y`` in blocks of ``r`` columns (a block's new columns
    need only its old ones and the step's ``r x r`` polynomial), each computed in the spent
    Gram product's buffer: ``y`` and the two ``r x r`` products, nothing more."""
    n, r, k = y.shape
    if r == k:
        return _iterate_alternating_(y, (y, y.new_empty(n, r, r)), coefficients, steps)
    a, b, c = coefficients
    poly = y.new_empty(n, r, r)
    gram = y.new_empty(n, r, r)
    for _ in range(steps):
        torch.bmm(y, y.mT, out=gram)
        torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=poly)
        for j in range(0, k, r):  # the Gram product is spent: its buffer takes each block
            cols = y[:, :, j:j + r]
            block = gram[:, :, :cols.shape[2]]
            torch.baddbmm(cols, poly, cols, beta=a, out=block)
            cols.copy_(block)
    return y


def _check(x: torch.Tensor, steps: int) -> None:
    if x.ndim != 3:
        raise ValueError(f"newton_schulz takes a stack of matrices (n, rows, cols), got shape "
                         f"{tuple(x.shape)}")
    if steps >= 100:
        raise ValueError(f"ns_steps must be below 100 (torch's limit), got {steps}")


def default_batch_numel(shapes: Sequence[Sequence[int]], device: torch.device) -> int:
    """MuonAdamW's default ``ns_batch_numel``: the entries of the largest matrix, at least
    :data:`NS_BATCH_MIN` (:data:`NS_BATCH_NUMEL` on CUDA). A batch's buffers (at most 4 bf16
    copies of it, 3 when square) are then about what the largest matrix needs alone, and
    small matrices still share a call."""
    floor = NS_BATCH_NUMEL if torch.device(device).type == "cuda" else NS_BATCH_MIN
    return max([floor] + [math.prod(s) for s in shapes])


def shape_groups(shapes: Sequence[Sequence[int]]) -> list[list[int]]:
    """Indices of ``shapes`` grouped by equal shape, groups in order of first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(shapes):
        groups.setdefault(tuple(s), []).append(i)
    return list(groups.values())


def stack_bf16(mats: Sequence[torch.Tensor]) -> torch.Tensor:
    """``mats`` (one shape) as one contiguous bf16 stack: a single cast-and-copy."""
    out = torch.empty((len(mats), *mats[0].shape), dtype=torch.bfloat16,
                      device=mats[0].device)
    torch._foreach_copy_(list(out.unbind(0)), list(mats))
    return out


def orthogonalise(mats: Sequence[torch.Tensor], coefficients: Coefficients, steps: int,
                  eps: float, mode: str = "batched",
                  groups: list[list[int]] | None = None,
                  dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """Newton-Schulz of every matrix of ``mats`` (bf16 results, in order).

    ``mode="batched"`` runs each shape group (``groups``, by default :func:`shape_groups`) as
    one stack, computing in ``dtype`` (:func:`newton_schulz_`); ``"per_matrix"`` calls
    torch's function once per matrix (bf16 only)."""
    if mode == "per_matrix" and dtype != torch.bfloat16:
        raise ValueError("ns_mode 'per_matrix' is torch's bf16 function; an fp32 "
                         "Newton-Schulz needs ns_mode='batched'")
    if mode == "per_matrix":
        from torch.optim._muon import _zeropower_via_newtonschulz

        return [_zeropower_via_newtonschulz(m, coefficients, steps, eps) for m in mats]
    if mode != "batched":
        raise ValueError(f"ns_mode must be one of {NS_MODES}, got {mode!r}")
    out: list = [None] * len(mats)
    for idx in groups if groups is not None else shape_groups([m.shape for m in mats]):
        done = newton_schulz_(stack_bf16([mats[i] for i in idx]), coefficients, steps, eps,
                              dtype)
        for i, r in zip(idx, done.unbind(0)):
            out[i] = r
    return out
