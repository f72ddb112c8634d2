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
            out.view(_FLOAT[self.fmt]).copy_(x)
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
        """The fp32 values (``n`` of them) encoded in the uint8 tensor ``data``."""
        if self.fmt in _FLOAT:
            return data[: self.nbytes(n)].view(_FLOAT[self.fmt]).float()
        blocks = math.ceil(n / self.block)
        ncodes = n if self.fmt == "int8" else math.ceil(n / 2)
        scale = data[: 4 * blocks].view(torch.float32)
        body = data[4 * blocks: 4 * blocks + ncodes]
        if self.fmt == "int8":
            codes = body.view(torch.int8).float()
        else:
            u = torch.stack([body & 0xF, body >> 4], dim=1).view(-1)[:n]
            codes = u.float() - 8.0
        full = torch.zeros(blocks * self.block, dtype=torch.float32, device=data.device)
        full[:n] = codes
        return (full.view(blocks, self.block) * scale[:, None]).view(-1)[:n]

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
