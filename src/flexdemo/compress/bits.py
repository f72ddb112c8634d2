"""Pack non-negative integers of ``bits`` bits each into bytes, and back (little-endian bits)."""

from __future__ import annotations

import math

import torch


def packed_nbytes(count: int, bits: int) -> int:
    """Bytes that ``count`` values of ``bits`` bits occupy when packed."""
    return math.ceil(count * bits / 8)


def pack_bits(values: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack the flat non-negative ``values`` (each ``< 2**bits``) into a uint8 tensor."""
    if not 1 <= bits <= 32:
        raise ValueError(f"bits must be in [1, 32], got {bits}")
    v = values.reshape(-1).to(torch.int64)
    count = v.numel()
    nbytes = packed_nbytes(count, bits)
    shifts = torch.arange(bits, device=v.device)
    stream = ((v.unsqueeze(1) >> shifts) & 1).to(torch.uint8).reshape(-1)
    pad = nbytes * 8 - stream.numel()
    if pad:
        stream = torch.cat([stream, stream.new_zeros(pad)])
    weights = (1 << torch.arange(8, device=v.device)).to(torch.uint8)
    packed = (stream.view(nbytes, 8) * weights).sum(dim=1, dtype=torch.uint8)
    if out is None:
        return packed
    out[:nbytes].copy_(packed)
    return out[:nbytes]


def unpack_bits(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The ``count`` values of ``bits`` bits packed in the uint8 tensor ``data`` (int64)."""
    nbytes = packed_nbytes(count, bits)
    if data.numel() < nbytes:
        raise ValueError(f"{data.numel()} bytes cannot hold {count} values of {bits} bits")
    raw = data[:nbytes]
    stream = ((raw.unsqueeze(1) >> torch.arange(8, device=raw.device)) & 1).reshape(-1)
    stream = stream[: count * bits].view(count, bits).to(torch.int64)
    return (stream << torch.arange(bits, device=raw.device)).sum(dim=1)
