"""Value codecs for dense exchanges: fp32, bf16, fp16, int8 and int4 with a scale per block.

Integer formats are symmetric: each block of ``block`` values (the last one may be shorter)
is scaled by ``s = max|x| / q`` (``q`` = 127 for int8, 7 for int4), rounded to the nearest
integer (ties to even) and stored; the scale travels as fp32. Round-trip error per value is
at most ``s / 2``, i.e. ``max|x| / 254`` (int8) or ``max|x| / 14`` (int4) of its block. bf16
and fp16 round each value (relative error at most 2^-8 and 2^-11; fp16 overflows beyond
65504). int4 codes are packed two per byte. Layout: the scales first (fp32, so a segment that
starts 4-byte aligned stays aligned), then the codes.

Payload size in bytes for ``n`` values: fp32 ``4n``, bf16/fp16 ``2n``, int8 ``n + 4b``,
int4 ``ceil(n/2) + 4b`` with ``b = ceil(n / block)`` blocks.

Each format is one class registered in :data:`VALUE_CODECS` (dense) or :data:`BLOCK_CODECS`
(sparse blocks); ``ValueCodec(fmt)`` / ``BlockValueCodec(fmt)`` build the registered one, so
adding a format is one class and one table entry.
"""

from __future__ import annotations

import math

import torch

from .bits import pack_bits, unpack_bits


# ---------------------------------------------------------------------- dense values
class ValueCodec:
    """Encode a flat fp32 tensor into bytes and back; ``ValueCodec(fmt, block)`` builds the
    codec of a format of :data:`FORMATS` (registered in :data:`VALUE_CODECS`)."""

    fmt = ""

    def __new__(cls, fmt: str = "fp32", block: int = 128):
        if cls is ValueCodec:
            if fmt not in VALUE_CODECS:
                raise ValueError(f"unknown value format {fmt!r}; choose one of {FORMATS}")
            cls = VALUE_CODECS[fmt]
        return super().__new__(cls)

    def __init__(self, fmt: str = "fp32", block: int = 128) -> None:
        if not isinstance(block, int) or block < 2:
            raise ValueError(f"quantisation block must be an integer >= 2, got {block!r}")
        self.fmt, self.block = fmt, block

    def nbytes(self, n: int) -> int:
        """Encoded size of ``n`` values."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Write the encoding of the flat fp32 ``x`` into the uint8 tensor ``out``."""
        raise NotImplementedError

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        """The fp32 values (``n`` of them) encoded in the uint8 tensor ``data``.

        ``data`` may have leading dimensions (e.g. one row per rank of a gathered exchange):
        every row is decoded at once and the result has shape ``(*leading, n)``."""
        raise NotImplementedError

    def decode_into(self, data: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        """:meth:`decode` of one payload (1-D ``data``) into the fp32 buffer ``out`` (at least
        :meth:`room` entries; its first ``n`` hold the values, the same bits as
        :meth:`decode`), with no temporary as large as the values; returns ``out[:n]``."""
        return out[:n].copy_(self.decode(data, n))

    def room(self, n: int) -> int:
        """Entries of the buffer :meth:`decode_into` needs for ``n`` values."""
        return n

    def workspace(self, numel: int, device: torch.device) -> torch.Tensor:
        """A reused fp32 buffer of ``numel`` entries on ``device`` (the codec's own, grown on
        demand: a fresh model-sized buffer page-faults on every call on a CPU); encoding with
        an int format uses it too, so a decode into it must follow the encode."""
        buf = getattr(self, "_buf", None)
        if buf is None or buf.numel() < numel or buf.device != torch.device(device):
            buf = self._buf = torch.empty(numel, dtype=torch.float32, device=device)
        return buf[:numel]

    def max_error(self, x: torch.Tensor) -> torch.Tensor:
        """The documented bound on ``|x - decode(encode(x))|`` per value of ``x``."""
        raise NotImplementedError


class _FloatValues(ValueCodec):
    """Each value rounded to a float type."""

    dtype = torch.float32
    rel_error = 0.0

    def nbytes(self, n: int) -> int:
        return n * self.dtype.itemsize

    def encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        out[: self.nbytes(x.numel())].view(self.dtype).copy_(x)  # out may hold padding

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        return data[..., : self.nbytes(n)].view(self.dtype).float()

    def decode_into(self, data: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        return out[:n].copy_(data[: self.nbytes(n)].view(self.dtype))

    def max_error(self, x: torch.Tensor) -> torch.Tensor:
        return x.abs() * self.rel_error


class _Fp32Values(_FloatValues):
    pass


class _Bf16Values(_FloatValues):
    dtype, rel_error = torch.bfloat16, 2.0 ** -8


class _Fp16Values(_FloatValues):
    dtype, rel_error = torch.float16, 2.0 ** -11


class _IntValues(ValueCodec):
    """Symmetric integer codes with an fp32 scale per block (scales first, then codes)."""

    qmax = 127

    def _codes_bytes(self, n: int) -> int:
        return n

    def nbytes(self, n: int) -> int:
        return self._codes_bytes(n) + 4 * math.ceil(n / self.block)

    def _write_codes(self, codes: torch.Tensor, body: torch.Tensor) -> None:
        """The integral fp32 ``codes`` into the payload's bytes."""
        body.view(torch.int8).copy_(codes)

    def _read_codes(self, body: torch.Tensor, n: int) -> torch.Tensor:
        return body.view(torch.int8).float()

    def _codes_into(self, body: torch.Tensor, n: int, out: torch.Tensor) -> None:
        """The codes of one payload as fp32 into ``out`` (``n`` entries)."""
        out.copy_(body.view(torch.int8))

    def room(self, n: int) -> int:
        return math.ceil(n / self.block) * self.block

    def decode_into(self, data: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        blocks = math.ceil(n / self.block)
        scale = data[: 4 * blocks].view(torch.float32)
        self._codes_into(data[4 * blocks: 4 * blocks + self._codes_bytes(n)], n, out[:n])
        # the whole blocks scaled in place (the tail past ``n`` is scratch, never read)
        out[: blocks * self.block].view(blocks, self.block).mul_(scale[:, None])
        return out[:n]

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (flat) copied into the :meth:`workspace` as whole blocks, zero padded: the
        codes are computed in place there."""
        n = x.numel()
        buf = self.workspace(self.room(n), x.device)
        buf[:n].copy_(x)
        buf[n:].zero_()
        return buf.view(-1, self.block)

    def encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        n = x.numel()
        padded = self._padded(x)
        blocks = padded.shape[0]
        low, high = torch.aminmax(padded, dim=1)  # max |x| per block, without an |x| pass
        scale = torch.maximum(high, -low) / self.qmax
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = padded.div_(safe[:, None]).round_().clamp_(-self.qmax, self.qmax)
        out[: 4 * blocks].view(torch.float32).copy_(scale)
        self._write_codes(codes.view(-1)[:n], out[4 * blocks: 4 * blocks + self._codes_bytes(n)])

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        lead = data.shape[:-1]
        blocks = math.ceil(n / self.block)
        scale = data[..., : 4 * blocks].view(torch.float32)
        codes = self._read_codes(data[..., 4 * blocks: 4 * blocks + self._codes_bytes(n)], n)
        full = torch.zeros(*lead, blocks * self.block, dtype=torch.float32, device=data.device)
        full[..., :n] = codes
        out = full.view(*lead, blocks, self.block) * scale[..., None]
        return out.view(*lead, blocks * self.block)[..., :n]

    def max_error(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        blocks = math.ceil(n / self.block)
        padded = torch.zeros(blocks * self.block, dtype=torch.float32, device=x.device)
        padded[:n] = x.abs()
        bound = padded.view(blocks, self.block).amax(1) / (2 * self.qmax)
        return bound.repeat_interleave(self.block)[:n]


class _Int8Values(_IntValues):
    qmax = 127


class _Int4Values(_IntValues):
    """int4 codes, offset by 8 and packed two per byte (low nibble first)."""

    qmax = 7

    def _codes_bytes(self, n: int) -> int:
        return math.ceil(n / 2)

    def _write_codes(self, codes: torch.Tensor, body: torch.Tensor) -> None:
        n = codes.numel()
        pairs = codes[: n // 2 * 2].view(-1, 2)  # byte = (low + 8) + 16 (high + 8), exact
        m = pairs.shape[0]
        high = pairs[:, 1].add_(8.0).mul_(16.0).add_(pairs[:, 0]).add_(8.0)
        body[:m].copy_(high)
        if n % 2:  # the last code alone, its high nibble 8 (a zero)
            body[m:].copy_(codes[n - 1:].add(8.0 + 16.0 * 8.0))

    def _read_codes(self, body: torch.Tensor, n: int) -> torch.Tensor:
        lead = body.shape[:-1]
        u = torch.stack([body & 0xF, body >> 4], dim=-1).reshape(*lead, 2 * body.shape[-1])
        return u[..., :n].float() - 8.0

    def _codes_into(self, body: torch.Tensor, n: int, out: torch.Tensor) -> None:
        pairs = out[: n // 2 * 2].view(-1, 2)  # low nibble first, then high
        m = pairs.shape[0]
        pairs[:, 0].copy_(body[:m] & 0xF)
        pairs[:, 1].copy_(body[:m] >> 4)
        if n % 2:
            out[n - 1:].copy_(body[m:] & 0xF)
        out.sub_(8.0)


VALUE_CODECS: dict[str, type[ValueCodec]] = {
    "fp32": _Fp32Values, "bf16": _Bf16Values, "fp16": _Fp16Values,
    "int8": _Int8Values, "int4": _Int4Values,
}
FORMATS = tuple(VALUE_CODECS)


# ---------------------------------------------------------------------- sparse blocks
class BlockValueCodec:
    """Values of sparse blocks, ``(blocks, k)``: a format and (for some) scales per block;
    ``BlockValueCodec(fmt)`` builds the codec of a format of :data:`BLOCK_FORMATS`
    (registered in :data:`BLOCK_CODECS`).

    * ``fp32`` / ``bf16`` / ``fp16``: each value rounded to the type;
    * ``int8``: a bf16 scale ``s = max|v| / 127`` per block, codes ``round(v / s)``;
    * ``int2``: per block bf16 ``lo = min|v|`` and ``hi = max|v|``; each value is its sign and
      one magnitude bit, decoded as ``lo + (hi - lo) / 4`` or ``lo + 3 (hi - lo) / 4``;
    * ``sign``: one bit per value and a bf16 magnitude per block, the mean ``|v|``.

    Bytes for ``b`` blocks of ``k`` values: fp32 ``4bk``, bf16/fp16 ``2bk``, int8 ``bk + 2b``,
    int2 ``ceil(2bk/8) + 4b``, sign ``ceil(bk/8) + 2b``. Scales come first. Decoding is
    elementwise arithmetic, identical on every replica; ``encode`` returns the values the
    peers will decode, built from the codes with the same arithmetic as ``decode``.
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


BLOCK_CODECS: dict[str, type[BlockValueCodec]] = {
    "fp32": _Fp32Blocks, "bf16": _Bf16Blocks, "fp16": _Fp16Blocks,
    "int8": _Int8Blocks, "int2": _Int2Blocks, "sign": _SignBlocks,
}
BLOCK_FORMATS = tuple(BLOCK_CODECS)


def _int2_values(lh: torch.Tensor, big: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """int2 values from per-block ``(lo, hi)`` and the magnitude and sign bits."""
    frac = torch.where(big, 0.75, 0.25)
    mag = lh[..., :1] + (lh[..., 1:] - lh[..., :1]) * frac
    return torch.where(neg, -mag, mag)
