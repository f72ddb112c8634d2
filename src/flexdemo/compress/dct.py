"""Blocked orthonormal DCT-II on a tensor's real shape, as batched matrix products.

Two layouts are used:

* **block layout** ``(num_blocks, block_numel)``: each block's coefficients contiguous, row
  major within the block. Momentum lives here, and per-block top-k runs on it.
* **image layout** ``(padded_rows, padded_cols)``: coefficient ``(u, v)`` of block ``(i, j)``
  sits at ``(i*cr + u, j*cc + v)``. Decoding scatters sparse coefficients straight into this
  layout, so the inverse transform needs no permutation.

The forward transform into block layout fuses the momentum update:
``out = beta * out + alpha * DCT(x)`` in a single ``addmm_``. With ``compute_dtype=bfloat16``
the two products of the forward transform run in bf16 (fp32 accumulation inside the product,
bf16 rounding of the input, the intermediate and the result: about 2^-8 relative error per
coefficient) and the result is added to the fp32 ``out``; on hardware with native bf16 products
(recent GPUs, CPUs with AVX512-BF16 or AMX) this is several times faster. The inverse
transforms always run in fp32. Scratch memory is reused across calls (large CPU allocations
page-fault on every touch otherwise).
"""

from __future__ import annotations

import math

import torch

from .chunking import ChunkPlan

_BASIS: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}
_WIDE = 64  # blocks at least this wide and tall are transformed by whole-group products
# fp32 on CPU: the first forward product runs over panels of about this many columns
_PANEL = 51 * 64


def _panels(n: int, target: int = _PANEL) -> int:
    """The number of equal panels ``n`` columns split into: the divisor of ``n`` whose panel
    width is nearest ``target`` (on a log scale); 1 where ``n < 2 * target``."""
    if n < 2 * target:
        return 1
    divisors = {d for i in range(1, math.isqrt(n) + 1) if n % i == 0 for d in (i, n // i)}
    return min((d for d in divisors if d > 1), key=lambda d: abs(math.log(n / d / target)))


def dct_matrix(n: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Orthonormal DCT-II matrix ``D`` (``n x n``): ``D @ x`` transforms a column vector."""
    device = torch.device("cpu") if device is None else torch.device(device)
    key = (n, dtype, device)
    basis = _BASIS.get(key)
    if basis is None:
        k = torch.arange(n, dtype=torch.float64)
        m = torch.cos(math.pi * (2 * k[None, :] + 1) * k[:, None] / (2 * n)) * math.sqrt(2.0 / n)
        m[0] /= math.sqrt(2.0)
        basis = m.to(dtype=dtype, device=device).contiguous()
        _BASIS[key] = basis
    return basis


class Scratch:
    """Reusable flat scratch buffers, one per slot, grown on demand."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, slot: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (slot, dtype, device)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._bufs[key] = buf
        return buf[:numel]

    def clear(self) -> None:
        """Drop every buffer (the next :meth:`get` makes a new one)."""
        self._bufs.clear()


class BlockDCT:
    """The blocked DCT of one tensor plan on one device (``basis="identity"``: no transform,
    for plain per-block top-k)."""

    def __init__(self, plan: ChunkPlan, device=None, dtype: torch.dtype = torch.float32,
                 scratch: Scratch | None = None, basis: str = "dct",
                 compute_dtype: torch.dtype | None = None) -> None:
        if basis not in ("dct", "identity"):
            raise ValueError(f"basis must be 'dct' or 'identity', got {basis!r}")
        compute_dtype = dtype if compute_dtype is None else compute_dtype
        if compute_dtype not in (dtype, torch.bfloat16, torch.float16):
            raise ValueError(f"compute_dtype must be {dtype}, bfloat16 or float16, "
                             f"got {compute_dtype}")
        self.compute_dtype = compute_dtype
        self.plan = plan
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.dtype = dtype
        self.scratch = scratch if scratch is not None else Scratch()
        cr, cc = plan.chunk
        if basis == "dct":
            self.dr = dct_matrix(cr, dtype, self.device)
            self.dc = dct_matrix(cc, dtype, self.device)
        else:  # plain blocks: the same machinery with the identity as "transform"
            self.dr = torch.eye(cr, dtype=dtype, device=self.device)
            self.dc = torch.eye(cc, dtype=dtype, device=self.device)
        self.dc_t = self.dc.t()
        self.dr_t = self.dr.t()
        self._dr_fwd = self.dr.to(compute_dtype)
        self._dc_t_fwd = self.dc_t.to(compute_dtype)
        nbr, nbc = plan.grid
        pr, pc = plan.padded
        # image position of block b's coefficient l: base[b] + lut[l]
        bi = torch.arange(nbr, device=self.device).repeat_interleave(nbc)
        bj = torch.arange(nbc, device=self.device).repeat(nbr)
        self._base = (bi * cr * pc + bj * cc).contiguous()
        loc = torch.arange(cr * cc, device=self.device)
        self._lut = ((loc // cc) * pc + loc % cc).contiguous()

    # ---------------------------------------------------------------- helpers
    def _padded_input(self, x2d: torch.Tensor, slot: int) -> torch.Tensor:
        p = self.plan
        if not p.needs_padding:
            return x2d if x2d.dtype == self.dtype else x2d.to(self.dtype)
        buf = self.scratch.get(slot, p.padded_numel, self.dtype, self.device).view(p.padded)
        buf.zero_()
        buf[: p.shape2d[0], : p.shape2d[1]].copy_(x2d)
        return buf

    def image_index(self, idx: torch.Tensor) -> torch.Tensor:
        """Map block-local indices ``(num_blocks, k)`` to flat image-layout positions."""
        return (self._base[:, None] + self._lut[idx.long()]).reshape(-1)

    # ---------------------------------------------------------------- forward
    def encode_into(self, x: torch.Tensor, out: torch.Tensor, alpha: float = 1.0,
                    beta: float = 0.0) -> torch.Tensor:
        """``out = beta*out + alpha*DCT(x)`` with ``out`` in block layout ``(blocks, numel)``."""
        p = self.plan
        cr, cc = p.chunk
        nbr, nbc = p.grid
        pr, pc = p.padded
        ct = self.compute_dtype
        xp = self._padded_input(x.reshape(p.shape2d), slot=0)
        if ct != self.dtype:
            xc = self.scratch.get(0, p.padded_numel, ct, self.device).view(pr, pc)
            xp = xc.copy_(xp.reshape(pr, pc))
        if cr == 1:
            blocks = xp.reshape(-1, cc)
        else:
            y = self.scratch.get(1, p.padded_numel, ct, self.device).view(nbr, cr, pc)
            torch.matmul(self._dr_fwd, xp.reshape(nbr, cr, pc), out=y)
            perm = self.scratch.get(0, p.padded_numel, ct, self.device)
            perm = perm.view(nbr, nbc, cr, cc)
            perm.copy_(y.view(nbr, cr, nbc, cc).transpose(1, 2))
            blocks = perm.view(-1, cc)
        if ct == self.dtype:
            out.view(-1, cc).addmm_(blocks, self.dc_t, beta=beta, alpha=alpha)
            return out
        z = self.scratch.get(1, p.padded_numel, ct, self.device).view(-1, cc)
        torch.mm(blocks, self._dc_t_fwd, out=z)
        flat = out.view(-1, cc)
        if beta == 0:
            flat.copy_(z)
            if alpha != 1:
                flat.mul_(alpha)
        else:
            flat.mul_(beta).add_(z, alpha=alpha)
        return out

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """DCT of ``x`` in block layout (a new tensor)."""
        p = self.plan
        out = torch.empty(p.num_blocks, p.block_numel, dtype=self.dtype, device=self.device)
        return self.encode_into(x, out)

    # ---------------------------------------------------------------- inverse
    def decode_image(self, image: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Inverse DCT of an image-layout coefficient tensor, cropped to the tensor's shape.

        ``image`` (padded shape, flat or 2-D) is used as scratch and overwritten. With ``out``
        (contiguous, same dtype, no padding) the result is written there directly.
        """
        p = self.plan
        cr, cc = p.chunk
        nbr = p.grid[0]
        pr, pc = p.padded
        direct = (out if out is not None and not p.needs_padding and out.dtype == self.dtype
                  and out.is_contiguous() else None)  # the result is written there
        z = self.scratch.get(1, p.padded_numel, self.dtype, self.device)
        if cr == 1:
            target = direct.view(-1, cc) if direct is not None else z.view(-1, cc)
            torch.mm(image.reshape(-1, cc), self.dc, out=target)
        else:
            torch.mm(image.reshape(-1, cc), self.dc, out=z.view(-1, cc))
            target = (direct.view(nbr, cr, pc) if direct is not None
                      else image.reshape(nbr, cr, pc))
            torch.matmul(self.dr_t, z.view(nbr, cr, pc), out=target)
        if direct is not None:
            return direct
        res = target.view(pr, pc)[: p.shape2d[0], : p.shape2d[1]]
        if out is None:
            return res.reshape(p.shape).clone()
        out.copy_(res.reshape(p.shape))
        return out

    def decode_sparse(self, idx: torch.Tensor, vals: torch.Tensor,
                      out: torch.Tensor) -> torch.Tensor:
        """Inverse DCT of ``m`` coefficients per block, written into ``out`` (the tensor's
        shape, contiguous, same dtype).

        ``idx`` and ``vals`` are ``(num_blocks, m)`` (repeated indices add up). Each block is
        rebuilt as ``sum_t vals_t * outer(Dr[u_t], Dc[v_t])`` in one batched product: ``m``
        multiply-adds per entry against ``cr + cc`` for the dense inverse, so it is the cheaper
        path for a few coefficients per block. Equal inputs give equal bits.
        """
        p = self.plan
        if p.needs_padding:
            raise ValueError("decode_sparse needs blocks that tile the tensor exactly")
        cr, cc = p.chunk
        nbr, nbc = p.grid
        nb, m = idx.shape
        left = self.scratch.get(5, nb * m * cr, self.dtype, self.device).view(nb, m, cr)
        torch.index_select(self.dr, 0, (idx // cc).reshape(-1), out=left.view(-1, cr))
        left.mul_(vals.unsqueeze(2))
        right = self.scratch.get(6, nb * m * cc, self.dtype, self.device).view(nb, m, cc)
        torch.index_select(self.dc, 0, (idx % cc).reshape(-1), out=right.view(-1, cc))
        blocks = self.scratch.get(1, p.padded_numel, self.dtype, self.device)
        blocks = blocks.view(nb, cr, cc)
        torch.bmm(left.transpose(1, 2), right, out=blocks)
        out.view(nbr, cr, nbc, cc).copy_(blocks.view(nbr, nbc, cr, cc).transpose(1, 2))
        return out

    def blocks_to_image(self, blocks: torch.Tensor) -> torch.Tensor:
        """Block layout -> image layout (a new tensor)."""
        p = self.plan
        cr, cc = p.chunk
        nbr, nbc = p.grid
        image = torch.empty(p.padded, dtype=blocks.dtype, device=blocks.device)
        image.view(nbr, cr, nbc, cc).copy_(blocks.reshape(nbr, nbc, cr, cc).transpose(1, 2))
        return image

    def decode(self, blocks: torch.Tensor) -> torch.Tensor:
        """Inverse DCT of block-layout coefficients, back to the tensor's shape."""
        return self.decode_image(self.blocks_to_image(blocks))


def block_rows(plan: ChunkPlan) -> torch.Tensor:
    """For each row of ``chunk[1]`` entries of the block layout (block ``b``, in-block row
    ``u``, in block order), the index of the same row in the padded image viewed as rows of
    ``chunk[1]`` entries. A permutation of ``range(padded_numel // chunk[1])``."""
    cr, cc = plan.chunk
    nbr, nbc = plan.grid
    bi = torch.arange(nbr).view(nbr, 1, 1)
    bj = torch.arange(nbc).view(1, nbc, 1)
    u = torch.arange(cr).view(1, 1, cr)
    return ((bi * cr + u) * nbc + bj).reshape(-1)


def _accumulate(target: torch.Tensor, z: torch.Tensor, alpha: float, beta: float) -> None:
    """``target = beta * target + alpha * z`` (``beta == 0``: ``target`` is not read), in the
    order of operations the fp32 fused products are checked against bitwise."""
    if beta == 0:
        target.copy_(z)
        if alpha != 1:
            target.mul_(alpha)
        return
    if beta != 1:
        target.mul_(beta)
    target.add_(z, alpha=alpha)


class BatchedDCT:
    """The blocked DCT of many ``cr x cc`` blocks at once, in block layout ``(blocks, cr*cc)``.

    The same products, in the same order, as :class:`BlockDCT` applies per tensor (rows first,
    then columns; the inverse columns first, then rows), batched over the blocks of every tensor
    that shares the block shape. ``compute_dtype=bfloat16`` runs the forward products in bf16
    as :class:`BlockDCT` does.
    """

    def __init__(self, chunk: tuple[int, int], device=None, basis: str = "dct",
                 compute_dtype: torch.dtype = torch.float32) -> None:
        if basis not in ("dct", "identity"):
            raise ValueError(f"basis must be 'dct' or 'identity', got {basis!r}")
        self.cr, self.cc = chunk
        self.device = torch.device("cpu") if device is None else torch.device(device)
        make = dct_matrix if basis == "dct" else (
            lambda n, dtype, device: torch.eye(n, dtype=dtype, device=device))
        self.dr = make(self.cr, torch.float32, self.device)
        self.dc = make(self.cc, torch.float32, self.device)
        self.dr_t, self.dc_t = self.dr.t(), self.dc.t()
        self.compute_dtype = compute_dtype
        self._dr_fwd = self.dr.to(compute_dtype)
        self._dc_t_fwd = self.dc_t.to(compute_dtype)
        # small blocks: products per block (batched), so that a block's bits do not depend on
        # how many blocks are transformed together (BLAS picks other kernels for few rows)
        self.per_block = min(self.cr, self.cc) < _WIDE
        # columns -> panels of the first product and the basis expanded to them
        self._panels: dict[int, tuple[int, torch.Tensor | None]] = {}

    def rows(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """First forward product ``Dr @ block`` for blocks stored row-major across blocks,
        ``x`` ``(cr, blocks, cc)`` (contiguous, in the compute dtype): the matrix product
        ``Dr @ x.view(cr, blocks * cc)`` into ``out``; blocks of one row need none.

        fp32 on CPU runs it as one batched product over equal panels of about :data:`_PANEL`
        columns (read and written in place through strided views; a panel need not hold
        whole blocks): the same bits as the whole-group product (each entry is the same
        ``cr``-term dot product) in about 15% less time on one thread for groups of a thousand
        64 x 64 blocks or more, where the whole product's contracted dimension is strided by
        the whole group's width. bf16 products and CUDA keep the one product."""
        cr = self.cr
        if cr == 1:
            return x
        nb = x.shape[1]
        if self.per_block:
            blocks = torch.bmm(self._dr_fwd.expand(nb, cr, cr), x.permute(1, 0, 2))
            out.copy_(blocks.permute(1, 0, 2))
            return out
        n = x.numel() // cr
        panels = self._panels.get(n)
        if panels is None:  # (count, basis expanded to it), once per group width
            count = _panels(n) if self.device.type == "cpu" else 1
            basis = self._dr_fwd.expand(count, cr, cr) if count > 1 else None
            panels = self._panels[n] = (count, basis)
        count, basis = panels
        if (basis is None or self.compute_dtype != torch.float32 or not x.is_contiguous()
                or not out.is_contiguous()):
            torch.mm(self._dr_fwd, x.view(cr, n), out=out.view(cr, n))
            return out
        width = n // count  # panel p: columns [p * width, (p + 1) * width) of every row
        torch.bmm(basis, x.as_strided((count, cr, width), (width, n, 1)),
                  out=out.as_strided((count, cr, width), (width, n, 1)))
        return out

    def cols_into(self, y: torch.Tensor, coef: torch.Tensor, blocks: slice,
                  alpha: float | torch.Tensor, beta: float,
                  scratch: torch.Tensor | None = None,
                  wide: torch.Tensor | None = None) -> None:
        """``coef = beta * coef + alpha * (y @ Dc^T)`` on the ``blocks`` of ``y`` (from
        :meth:`rows`) and ``coef``, both ``(cr, blocks, cc)`` (``scratch``: room for the
        bf16 product; ``wide``: fp32 room as large, where it is widened before it is added,
        the same bits as a mixed-precision add without its temporary: on a CPU a fresh
        model-sized temporary costs more than the product). ``alpha`` may be a 0-d device
        tensor (a step size that changes between replays of a CUDA graph): it then scales the
        ``cc x cc`` basis instead of the product, the same value up to rounding at no extra
        pass over ``coef``."""
        cc, nb = self.cc, coef.shape[1]
        whole = blocks.start == 0 and blocks.stop == nb
        dc_t, dc_t_fwd = self.dc_t, self._dc_t_fwd
        if isinstance(alpha, torch.Tensor):
            dc_t = dc_t * alpha
            dc_t_fwd = dc_t if self.compute_dtype == torch.float32 else (
                self.dc_t * alpha).to(self.compute_dtype)
            alpha = 1.0
        if self.per_block:
            target = coef[:, blocks].permute(1, 0, 2)
            part = y[:, blocks].permute(1, 0, 2)
            basis = dc_t if self.compute_dtype == torch.float32 else dc_t_fwd
            basis = basis.expand(part.shape[0], cc, cc)
            if self.compute_dtype == torch.float32:
                target.baddbmm_(part, basis, beta=beta, alpha=alpha)
                return
            _accumulate(target, torch.bmm(part, basis), alpha, beta)
            return
        if self.compute_dtype == torch.float32:
            if whole:
                coef.view(-1, cc).addmm_(y.reshape(-1, cc), dc_t, beta=beta, alpha=alpha)
            elif coef.is_cuda:  # a run of blocks: a product per coefficient row, in place
                coef[:, blocks].baddbmm_(y[:, blocks], dc_t.expand(self.cr, cc, cc),
                                         beta=beta, alpha=alpha)
            else:  # a run of blocks: made contiguous, one product (the whole group's bits), back
                part = coef[:, blocks].contiguous()
                part.view(-1, cc).addmm_(y[:, blocks].reshape(-1, cc), dc_t, beta=beta,
                                         alpha=alpha)
                coef[:, blocks] = part
            return
        part = y[:, blocks]
        assert scratch is not None, "a low-precision product needs scratch"
        z = scratch[: part.numel()].view(part.shape)
        torch.matmul(part, dc_t_fwd, out=z)
        if wide is not None:
            z = wide[: part.numel()].view(part.shape).copy_(z)
        _accumulate(coef[:, blocks], z, alpha, beta)

    def inverse(self, coef: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> None:
        """Blocks ``out`` ``(blocks, cr, cc)`` from their coefficients ``coef``
        ``(blocks, cr*cc)`` (columns first, then rows; ``scratch`` as large as ``out``)."""
        nb = coef.shape[0]
        if self.cr == 1:
            torch.mm(coef.view(-1, self.cc), self.dc, out=out.view(-1, self.cc))
            return
        z = torch.mm(coef.view(-1, self.cc), self.dc, out=scratch.view(-1, self.cc))
        torch.matmul(self.dr_t, z.view(nb, self.cr, self.cc), out=out)

    def inverse_sparse(self, idx: torch.Tensor, vals: torch.Tensor, out: torch.Tensor,
                       left: torch.Tensor, right: torch.Tensor) -> None:
        """Blocks ``out`` ``(blocks, cr, cc)`` from ``m`` coefficients per block (``idx`` and
        ``vals`` ``(blocks, m)``; repeated indices add up): ``sum_t vals_t outer(Dr[u_t],
        Dc[v_t])`` in one batched product. ``left``/``right``: scratch of ``blocks*m*cr`` and
        ``blocks*m*cc`` entries."""
        nb, m = idx.shape
        lf = left.view(nb, m, self.cr)
        torch.index_select(self.dr, 0, (idx // self.cc).reshape(-1), out=lf.view(-1, self.cr))
        lf.mul_(vals.unsqueeze(2))
        rt = right.view(nb, m, self.cc)
        torch.index_select(self.dc, 0, (idx % self.cc).reshape(-1), out=rt.view(-1, self.cc))
        torch.bmm(lf.transpose(1, 2), rt, out=out)
