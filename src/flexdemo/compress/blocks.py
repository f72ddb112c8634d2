"""Value codecs for DeMo's sparse blocks, ``(blocks, k)`` values each: fp32, bf16, fp16, int8,
int2 (sign and one magnitude bit over ``[min|v|, max|v|]``), sign (a magnitude per block), and
stat3 / stat2 / stat1 (a statistical codebook per block, :mod:`.codebook`). Each format is one class
registered in :data:`BLOCK_CODECS`; ``BlockValueCodec(fmt)`` builds the registered one."""

from __future__ import annotations

import math

import torch

from .bits import pack_bits, packed_nbytes, unpack_bits
from .codebook import stat_codebook, tensor_codebook


class BlockValueCodec:
    """Values of sparse blocks, ``(blocks, k)``: a format and (for some) scales per block;
    ``BlockValueCodec(fmt)`` builds the codec of a format of :data:`BLOCK_FORMATS`
    (registered in :data:`BLOCK_CODECS`).

    * ``fp32`` / ``bf16`` / ``fp16``: each value rounded to the type;
    * ``int8``: a bf16 scale ``s = max|v| / 127`` per block, codes ``round(v / s)``;
    * ``int2``: per block bf16 ``lo = min|v|`` and ``hi = max|v|``; each value is its sign and
      one magnitude bit, decoded as ``lo + (hi - lo) / 4`` or ``lo + 3 (hi - lo) / 4``;
    * ``sign``: one bit per value and a bf16 magnitude per block, the mean ``|v|``;
    * ``stat3`` / ``stat2`` / ``stat1``: a statistical codebook per block (see the module):
      ``L`` = 8 / 4 / 2 bf16 bin means, the mean of the block's values in each bin of
      ``mu +- 2 sd`` (stat1: split at the block mean), and a 3 / 2 / 1-bit bin code per value;
    * ``stat2-tensor``: SparseLoCo's 2-bit values, one codebook per tensor
      (:func:`~.codebook.tensor_codebook`: 4 fp32 bin means over ``mu +- 3 sd``).

    Bytes for ``b`` blocks of ``k`` values: fp32 ``4bk``, bf16/fp16 ``2bk``, int8 ``bk + 2b``,
    int2 ``ceil(2bk/8) + 4b``, sign ``ceil(bk/8) + 2b``, stat3 ``16b + ceil(3bk/8)``, stat2
    ``8b + ceil(2bk/8)``, stat1 ``4b + ceil(bk/8)``, stat2-tensor ``16 + ceil(2bk/8)``. Scales
    (codebooks) come first. Decoding
    is elementwise arithmetic or a codebook look-up, identical on every replica; ``encode``
    returns the values the peers will decode, built from the codes with the same arithmetic as
    ``decode``.
    """

    fmt = ""

    def __new__(cls, fmt: str = "fp32"):
        if cls is BlockValueCodec:
            if fmt not in BLOCK_CODECS:
                raise ValueError(f"unknown value format {fmt!r}; choose one of {BLOCK_FORMATS}")
            cls = BLOCK_CODECS[fmt]
        return super().__new__(cls)

    def __init__(self, fmt: str = "fp32") -> None:
        self.fmt = fmt

    def nbytes(self, blocks: int, k: int) -> int:
        """Encoded size of ``blocks`` blocks of ``k`` values."""
        raise NotImplementedError

    def encode(self, vals: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write ``vals`` (fp32 ``(blocks, k)``) into ``out`` (uint8); return the decoded values
        (what the peers will see)."""
        raise NotImplementedError

    def decode(self, data: torch.Tensor, b: int, k: int) -> torch.Tensor:
        """The fp32 values ``(..., blocks, k)`` encoded in ``data`` (uint8 ``(..., bytes)``:
        leading dimensions, e.g. one row per peer, are decoded together)."""
        raise NotImplementedError


class _FloatBlocks(BlockValueCodec):
    dtype = torch.float32

    def nbytes(self, blocks: int, k: int) -> int:
        return blocks * k * self.dtype.itemsize

    def encode(self, vals: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        b, k = vals.shape
        out[: self.nbytes(b, k)].view(self.dtype).view(b, k).copy_(vals)
        return vals.to(self.dtype).float()

    def decode(self, data: torch.Tensor, b: int, k: int) -> torch.Tensor:
        lead = data.shape[:-1]
        return data[..., : self.nbytes(b, k)].view(self.dtype).view(*lead, b, k).float()


class _Fp32Blocks(_FloatBlocks):
    pass


class _Bf16Blocks(_FloatBlocks):
    dtype = torch.bfloat16


class _Fp16Blocks(_FloatBlocks):
    dtype = torch.float16


class _Int8Blocks(BlockValueCodec):
    def nbytes(self, blocks: int, k: int) -> int:
        return blocks * k + 2 * blocks

    def encode(self, vals: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        b, k = vals.shape
        scale = (vals.abs().amax(1) / 127).to(torch.bfloat16)
        out[: 2 * b].view(torch.bfloat16).copy_(scale)
        s = scale.float()
        safe = torch.where(s > 0, s, torch.ones_like(s))
        codes = torch.round(vals / safe[:, None]).clamp_(-127, 127).to(torch.int8)
        out[2 * b: 2 * b + b * k].view(torch.int8).copy_(codes.view(-1))
        return codes.float() * s[:, None]

    def decode(self, data: torch.Tensor, b: int, k: int) -> torch.Tensor:
        lead = data.shape[:-1]
        s = data[..., : 2 * b].view(torch.bfloat16).float()
        codes = data[..., 2 * b: 2 * b + b * k].view(torch.int8).view(*lead, b, k).float()
        return codes * s.unsqueeze(-1)


class _Int2Blocks(BlockValueCodec):
    def nbytes(self, blocks: int, k: int) -> int:
        return math.ceil(2 * blocks * k / 8) + 4 * blocks

    def encode(self, vals: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        b = vals.shape[0]
        mag, neg = vals.abs(), vals < 0
        lo_hi = torch.stack([mag.amin(1), mag.amax(1)], dim=1).to(torch.bfloat16)
        out[: 4 * b].view(torch.bfloat16).copy_(lo_hi.view(-1))
        lh = lo_hi.float()
        big = mag >= (lh[:, :1] + lh[:, 1:]) / 2
        pack_bits(neg.to(torch.int64) | (big.to(torch.int64) << 1), 2, out[4 * b:])
        return _int2_values(lh, big, neg)

    def decode(self, data: torch.Tensor, b: int, k: int) -> torch.Tensor:
        lead = data.shape[:-1]
        lh = data[..., : 4 * b].view(torch.bfloat16).float().view(*lead, b, 2)
        codes = unpack_bits(data[..., 4 * b:], 2, b * k).view(*lead, b, k)
        return _int2_values(lh, (codes >> 1) == 1, (codes & 1) == 1)


class _SignBlocks(BlockValueCodec):
    def nbytes(self, blocks: int, k: int) -> int:
        return math.ceil(blocks * k / 8) + 2 * blocks

    def encode(self, vals: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        b = vals.shape[0]
        neg = vals < 0
        m = vals.abs().mean(1).to(torch.bfloat16)
        out[: 2 * b].view(torch.bfloat16).copy_(m)
        pack_bits(neg, 1, out[2 * b:])
        m = m.float()[:, None]
        return torch.where(neg, -m, m)

    def decode(self, data: torch.Tensor, b: int, k: int) -> torch.Tensor:
        lead = data.shape[:-1]
        m = data[..., : 2 * b].view(torch.bfloat16).float().unsqueeze(-1)
        neg = unpack_bits(data[..., 2 * b:], 1, b * k).view(*lead, b, k) == 1
        return torch.where(neg, -m, m)


class _StatBlocks(BlockValueCodec):
    """A statistical codebook per block (:func:`~.codebook.stat_codebook`): ``L`` bf16 bin means per
    block first, then the codes packed at :attr:`bits` bits."""

    bits = 2
    spread = 2.0

    def nbytes(self, blocks: int, k: int) -> int:
        return 2 * (1 << self.bits) * blocks + packed_nbytes(blocks * k, self.bits)

    def encode(self, vals: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        b, k = vals.shape
        book = 2 * (1 << self.bits) * b
        v = vals.float().contiguous()
        codes, means = stat_codebook(v, v.new_full((b,), float(k)), b * k, self.bits,
                                      self.spread)
        means = means.to(torch.bfloat16)
        out[:book].view(torch.bfloat16).copy_(means.view(-1))
        pack_bits(codes, self.bits, out[book:])
        return torch.gather(means.float(), 1, codes)

    def decode(self, data: torch.Tensor, b: int, k: int) -> torch.Tensor:
        lead, book = data.shape[:-1], 2 * (1 << self.bits) * b
        means = data[..., :book].view(torch.bfloat16).float().view(*lead, b, -1)
        codes = unpack_bits(data[..., book:], self.bits, b * k).view(*lead, b, k)
        return torch.gather(means, -1, codes)


class _Stat3Blocks(_StatBlocks):
    bits = 3


class _Stat2Blocks(_StatBlocks):
    bits = 2


class _Stat1Blocks(_StatBlocks):
    bits = 1


class _TensorStat2Blocks(BlockValueCodec):
    """One statistical codebook for all the values it codes at once
    (:func:`~.codebook.tensor_codebook`, SparseLoCo's 2-bit values): its ``L`` fp32 bin values
    first, then the codes packed at 2 bits. DeMo's layout gives it one group per tensor
    (:attr:`per_tensor`), so the codebook is the tensor's."""

    bits = 2
    per_tensor = True

    def nbytes(self, blocks: int, k: int) -> int:
        return 4 * (1 << self.bits) + packed_nbytes(blocks * k, self.bits)

    def encode(self, vals: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        book = 4 * (1 << self.bits)
        codes, means = tensor_codebook(vals.float(), self.bits)
        out[:book].view(torch.float32).copy_(means)
        pack_bits(codes, self.bits, out[book:])
        return means[codes]

    def decode(self, data: torch.Tensor, b: int, k: int) -> torch.Tensor:
        lead, book = data.shape[:-1], 4 * (1 << self.bits)
        means = data[..., :book].view(torch.float32)
        codes = unpack_bits(data[..., book:], self.bits, b * k).view(*lead, b * k)
        return torch.gather(means, -1, codes).view(*lead, b, k)


BLOCK_CODECS: dict[str, type[BlockValueCodec]] = {
    "fp32": _Fp32Blocks, "bf16": _Bf16Blocks, "fp16": _Fp16Blocks,
    "int8": _Int8Blocks, "int2": _Int2Blocks, "sign": _SignBlocks,
    "stat3": _Stat3Blocks, "stat2": _Stat2Blocks, "stat1": _Stat1Blocks,
    "stat2-tensor": _TensorStat2Blocks,
}
BLOCK_FORMATS = tuple(BLOCK_CODECS)


def _int2_values(lh: torch.Tensor, big: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """int2 values from per-block ``(lo, hi)`` and the magnitude and sign bits."""
    frac = torch.where(big, 0.75, 0.25)
    mag = lh[..., :1] + (lh[..., 1:] - lh[..., :1]) * frac
    return torch.where(neg, -mag, mag)
