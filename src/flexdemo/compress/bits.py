"""Pack non-negative integers of ``bits`` bits each into bytes, and back.

The layout is a little-endian bit stream: bit ``j`` of value ``i`` is stream bit ``i*bits + j``,
and stream bit ``8p + q`` is bit ``q`` of byte ``p``. Two equivalent implementations produce it:

* **words** (the fast path): ``g = lcm(bits, 8) / bits`` values fill exactly ``lcm / 8`` bytes,
  so they are summed into one int64 word and the word is split into bytes (``O(count)`` work).
  It applies when ``lcm(bits, 8) <= 56``, which covers 1-8, 10, 12, 14, 16, 20, 24, 28 and 32
  bits
  (the index widths of 2-D chunks up to 64 x 64 and of 1-D chunks up to 2^14 included).
* **stream** (any width up to 32): one byte per bit, then 8 bits per byte (``O(count * bits)``).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch


def packed_nbytes(count: int, bits: int) -> int:
    """Bytes that ``count`` values of ``bits`` bits occupy when packed."""
    return math.ceil(count * bits / 8)


def _word_layout(bits: int, method: str = "auto") -> tuple[int, int] | None:
    """``(values per word, bytes per word)`` when ``method`` takes the word path, else None."""
    if not 1 <= bits <= 32:
        raise ValueError(f"bits must be in [1, 32], got {bits}")
    if method not in ("auto", "words", "stream"):
        raise ValueError(f"method must be 'auto', 'words' or 'stream', got {method!r}")
    span = math.lcm(bits, 8)
    if method == "stream" or (span > 56 and method == "auto"):
        return None
    if span > 56:
        raise ValueError(f"the word path does not cover {bits}-bit values")
    return span // bits, span // 8


@lru_cache(maxsize=64)
def _shifts(n: int, step: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64, device=device) * step


def _pad_to(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if x.numel() == n else torch.cat([x, x.new_zeros(n - x.numel())])


def pack_bits(values: torch.Tensor, bits: int, out: torch.Tensor | None = None,
              method: str = "auto") -> torch.Tensor:
    """Pack the flat non-negative ``values`` (each ``< 2**bits``) into a uint8 tensor (into
    ``out[:nbytes]`` when given). ``method``: "auto", "words" or "stream" (same bytes)."""
    layout = _word_layout(bits, method)
    v = values.reshape(-1).to(torch.int64)
    count = v.numel()
    nbytes = packed_nbytes(count, bits)
    if layout is not None:
        g, nb = layout
        words = math.ceil(count / g)
        grouped = _pad_to(v, words * g).view(words, g)
        word = (grouped << _shifts(g, bits, v.device)).sum(dim=1, keepdim=True)
        packed = ((word >> _shifts(nb, 8, v.device)) & 0xFF).to(torch.uint8).view(-1)
    else:
        stream = ((v.unsqueeze(1) >> _shifts(bits, 1, v.device)) & 1).reshape(-1)
        stream = _pad_to(stream, nbytes * 8).view(nbytes, 8)
        packed = (stream << _shifts(8, 1, v.device)).sum(dim=1).to(torch.uint8)
    packed = packed[:nbytes]
    if out is None:
        return packed
    out[:nbytes].copy_(packed)
    return out[:nbytes]


def unpack_bits(data: torch.Tensor, bits: int, count: int, method: str = "auto") -> torch.Tensor:
    """The ``count`` values of ``bits`` bits packed in the uint8 tensor ``data`` (int64).

    ``data`` may have leading dimensions ``(..., bytes)``: each row is unpacked on its own, all
    rows in the same ops, giving ``(..., count)``.
    """
    layout = _word_layout(bits, method)
    nbytes = packed_nbytes(count, bits)
    if data.shape[-1] < nbytes:
        raise ValueError(f"{data.shape[-1]} bytes cannot hold {count} values of {bits} bits")
    lead = data.shape[:-1]
    raw = data[..., :nbytes].to(torch.int64)
    if layout is not None:
        g, nb = layout
        words = math.ceil(nbytes / nb)
        raw = _pad_last(raw, words * nb).view(*lead, words, nb)
        word = (raw << _shifts(nb, 8, raw.device)).sum(dim=-1, keepdim=True)
        vals = (word >> _shifts(g, bits, raw.device)) & ((1 << bits) - 1)
        return vals.view(*lead, words * g)[..., :count]
    stream = ((raw.unsqueeze(-1) >> _shifts(8, 1, raw.device)) & 1).view(*lead, nbytes * 8)
    stream = stream[..., : count * bits].reshape(*lead, count, bits)
    return (stream << _shifts(bits, 1, raw.device)).sum(dim=-1)


def _pad_last(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` zero-padded to ``n`` entries along its last dimension."""
    if x.shape[-1] == n:
        return x
    return torch.cat([x, x.new_zeros(*x.shape[:-1], n - x.shape[-1])], dim=-1)
