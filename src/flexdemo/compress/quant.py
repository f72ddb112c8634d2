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
"""

from __future__ import annotations

import math

import torch

from .bits import pack_bits, unpack_bits

FORMATS = ("fp32", "bf16", "fp16", "int8", "int4")
_FLOAT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_QMAX = {"int8": 127, "int4": 7}


class ValueCodec:
    """Encode a flat fp32 tensor into bytes and back, in one of :data:`FORMATS`."""

    def __init__(self, fmt: str = "fp32", block: int = 128) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown value format {fmt!r}; choose one of {FORMATS}")
        if not isinstance(block, int) or block < 2:
            raise ValueError(f"quantisation block must be an integer >= 2, got {block!r}")
        self.fmt, self.block = fmt, block

    def nbytes(self, n: int) -> int:
        """Encoded size of ``n`` values."""
        if self.fmt in _FLOAT:
            return n * _FLOAT[self.fmt].itemsize
        blocks = math.ceil(n / self.block)
        codes = n if self.fmt == "int8" else math.ceil(n / 2)
        return codes + 4 * blocks

    def encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Write the encoding of the flat fp32 ``x`` into the uint8 tensor ``out``."""
        n = x.numel()
        if self.fmt in _FLOAT:
            out[: self.nbytes(n)].view(_FLOAT[self.fmt]).copy_(x)  # out may hold padding
            return
        blocks = math.ceil(n / self.block)
        padded = torch.zeros(blocks * self.block, dtype=torch.float32, device=x.device)
        padded[:n] = x
        padded = padded.view(blocks, self.block)
        qmax = _QMAX[self.fmt]
        scale = padded.abs().amax(dim=1) / qmax
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round(padded / safe[:, None]).clamp_(-qmax, qmax).to(torch.int8).view(-1)
        codes = codes[:n]
        ncodes = n if self.fmt == "int8" else math.ceil(n / 2)
        out[: 4 * blocks].view(torch.float32).copy_(scale)
        body = out[4 * blocks: 4 * blocks + ncodes]
        if self.fmt == "int8":
            body.view(torch.int8).copy_(codes)
        else:
            u = (codes.to(torch.int16) + 8).to(torch.uint8)
            if n % 2:
                u = torch.cat([u, torch.full((1,), 8, dtype=torch.uint8, device=u.device)])
            body.copy_(u[0::2] | (u[1::2] << 4))

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        """The fp32 values (``n`` of them) encoded in the uint8 tensor ``data``.

        ``data`` may have leading dimensions (e.g. one row per rank of a gathered exchange):
        every row is decoded at once and the result has shape ``(*leading, n)``."""
        lead = data.shape[:-1]
        if self.fmt in _FLOAT:
            return data[..., : self.nbytes(n)].view(_FLOAT[self.fmt]).float()
        blocks = math.ceil(n / self.block)
        ncodes = n if self.fmt == "int8" else math.ceil(n / 2)
        scale = data[..., : 4 * blocks].view(torch.float32)
        body = data[..., 4 * blocks: 4 * blocks + ncodes]
        if self.fmt == "int8":
            codes = body.view(torch.int8).float()
        else:
            u = torch.stack([body & 0xF, body >> 4], dim=-1).reshape(*lead, 2 * ncodes)
            codes = u[..., :n].float() - 8.0
        full = torch.zeros(*lead, blocks * self.block, dtype=torch.float32, device=data.device)
        full[..., :n] = codes
        out = full.view(*lead, blocks, self.block) * scale[..., None]
        return out.view(*lead, blocks * self.block)[..., :n]

    def max_error(self, x: torch.Tensor) -> torch.Tensor:
        """The documented bound on ``|x - decode(encode(x))|`` per value of ``x``."""
        if self.fmt in _FLOAT:
            rel = {"fp32": 0.0, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11}[self.fmt]
            return x.abs() * rel
        n = x.numel()
        blocks = math.ceil(n / self.block)
        padded = torch.zeros(blocks * self.block, dtype=torch.float32, device=x.device)
        padded[:n] = x.abs()
        bound = padded.view(blocks, self.block).amax(1) / (2 * _QMAX[self.fmt])
        return bound.repeat_interleave(self.block)[:n]


BLOCK_FORMATS = ("fp32", "bf16", "fp16", "int8", "int2", "sign")


class BlockValueCodec:
    """Values of sparse blocks, ``(blocks, k)``: a format and (for some) scales per block.

    * ``fp32`` / ``bf16`` / ``fp16``: each value rounded to the type;
    * ``int8``: a bf16 scale ``s = max|v| / 127`` per block, codes ``round(v / s)``;
    * ``int2``: per block bf16 ``lo = min|v|`` and ``hi = max|v|``; each value is its sign and
      one magnitude bit, decoded as ``lo + (hi - lo) / 4`` or ``lo + 3 (hi - lo) / 4``;
    * ``sign``: one bit per value and a bf16 magnitude per block, the mean ``|v|``.

    Bytes for ``b`` blocks of ``k`` values: fp32 ``4bk``, bf16/fp16 ``2bk``, int8 ``bk + 2b``,
    int2 ``ceil(2bk/8) + 4b``, sign ``ceil(bk/8) + 2b``. Scales come first. Decoding is
    elementwise arithmetic, identical on every replica.
    """

    def __init__(self, fmt: str = "fp32") -> None:
        if fmt not in BLOCK_FORMATS:
            raise ValueError(f"unknown value format {fmt!r}; choose one of {BLOCK_FORMATS}")
        self.fmt = fmt

    def nbytes(self, blocks: int, k: int) -> int:
        n = blocks * k
        return {"fp32": 4 * n, "bf16": 2 * n, "fp16": 2 * n, "int8": n + 2 * blocks,
                "int2": math.ceil(2 * n / 8) + 4 * blocks,
                "sign": math.ceil(n / 8) + 2 * blocks}[self.fmt]

    def encode(self, vals: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write ``vals`` (fp32 ``(blocks, k)``) into ``out`` (uint8); return the decoded values
        (what the peers will see)."""
        b, k = vals.shape
        f = self.fmt
        if f in _FLOAT:
            out[: self.nbytes(b, k)].view(_FLOAT[f]).view(b, k).copy_(vals)
            return vals.to(_FLOAT[f]).float()
        mag = vals.abs()
        neg = vals < 0
        # the decoded values are built from the codes with the same arithmetic as decode()
        if f == "int8":
            scale = (mag.amax(1) / 127).to(torch.bfloat16)
            out[: 2 * b].view(torch.bfloat16).copy_(scale)
            s = scale.float()
            safe = torch.where(s > 0, s, torch.ones_like(s))
            codes = torch.round(vals / safe[:, None]).clamp_(-127, 127).to(torch.int8)
            out[2 * b: 2 * b + b * k].view(torch.int8).copy_(codes.view(-1))
            return codes.float() * s[:, None]
        if f == "int2":
            lo_hi = torch.stack([mag.amin(1), mag.amax(1)], dim=1).to(torch.bfloat16)
            out[: 4 * b].view(torch.bfloat16).copy_(lo_hi.view(-1))
            lh = lo_hi.float()
            big = mag >= (lh[:, :1] + lh[:, 1:]) / 2
            pack_bits(neg.to(torch.int64) | (big.to(torch.int64) << 1), 2, out[4 * b:])
            return _int2_values(lh, big, neg)
        m = mag.mean(1).to(torch.bfloat16)  # sign
        out[: 2 * b].view(torch.bfloat16).copy_(m)
        pack_bits(neg, 1, out[2 * b:])
        m = m.float()[:, None]
        return torch.where(neg, -m, m)

    def decode(self, data: torch.Tensor, b: int, k: int) -> torch.Tensor:
        """The fp32 values ``(..., blocks, k)`` encoded in ``data`` (uint8 ``(..., bytes)``:
        leading dimensions, e.g. one row per peer, are decoded together)."""
        f, lead = self.fmt, data.shape[:-1]
        if f in _FLOAT:
            return data[..., : self.nbytes(b, k)].view(_FLOAT[f]).view(*lead, b, k).float()
        if f == "int8":
            s = data[..., : 2 * b].view(torch.bfloat16).float()
            codes = data[..., 2 * b: 2 * b + b * k].view(torch.int8).view(*lead, b, k).float()
            return codes * s.unsqueeze(-1)
        if f == "int2":
            lh = data[..., : 4 * b].view(torch.bfloat16).float().view(*lead, b, 2)
            codes = unpack_bits(data[..., 4 * b:], 2, b * k).view(*lead, b, k)
            return _int2_values(lh, (codes >> 1) == 1, (codes & 1) == 1)
        m = data[..., : 2 * b].view(torch.bfloat16).float().unsqueeze(-1)
        neg = unpack_bits(data[..., 2 * b:], 1, b * k).view(*lead, b, k) == 1
        return torch.where(neg, -m, m)


def _int2_values(lh: torch.Tensor, big: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """int2 values from per-block ``(lo, hi)`` and the magnitude and sign bits."""
    frac = torch.where(big, 0.75, 0.25)
    mag = lh[..., :1] + (lh[..., 1:] - lh[..., :1]) * frac
    return torch.where(neg, -mag, mag)
