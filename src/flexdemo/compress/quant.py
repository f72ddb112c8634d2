"""Value codecs for dense exchanges: fp32, bf16, fp16, int8, int4, int3 and int2 with a scale
per block, and stat3 / stat2 / stat1 with a statistical codebook per block.

Integer formats are symmetric: each block of ``block`` values (the last one may be shorter)
is scaled by ``s = max|x| / q`` (``q`` = 127 for int8, 7 for int4, 3 for int3, 1 for int2),
rounded to the nearest integer (ties to even) and stored; the scale travels as fp32. Round-trip
error per value is at most ``s / 2``, i.e. ``max|x| / 254`` (int8), ``max|x| / 14`` (int4),
``max|x| / 6`` (int3) or ``max|x| / 2`` (int2) of its block. bf16 and fp16 round each value
(relative error at most 2^-8 and 2^-11; fp16 overflows beyond 65504). int4 codes are packed two
per byte; int3 and int2 codes, offset by ``q``, are packed at 3 and 2 bits with
:func:`~.bits.pack_bits`. Layout: the scales first (fp32, so a segment that starts 4-byte
aligned stays aligned), then the codes.

Statistical codebooks (stat3, stat2, stat1: ``B`` = 3, 2 or 1 bits, ``L = 2**B`` bins): per
block of values with mean ``mu`` and population standard deviation ``sd``, the ``L - 1`` bin
edges are ``mu + Z sd (2j / L - 1)``, ``j = 1 .. L-1`` (``Z`` = ``spread`` = 2; values beyond
fall in the end bins; stat1's one edge is the block mean); each value's code is its bin, and a
bin decodes to the mean of the block's values in it (an empty one to its centre). The
codebooks (bf16, ``L`` per block) come first, then the codes packed at ``B`` bits.
``stat2-tensor`` is MuLoCo's and SparseLoCo's form: one codebook per tensor (4 bins of
``6 sd / 4`` around the tensor's mean, asymmetric edges, fp32 bin means:
:func:`~.codebook.tensor_codebook`), ``16 S + ceil(2n/8)`` bytes for ``S`` tensors.

Payload size in bytes for ``n`` values: fp32 ``4n``, bf16/fp16 ``2n``, int8 ``n + 4b``,
int4 ``ceil(n/2) + 4b``, int3 ``ceil(3n/8) + 4b``, int2 ``ceil(2n/8) + 4b``, stat3
``16b + ceil(3n/8)``, stat2 ``8b + ceil(2n/8)``, stat1 ``4b + ceil(n/8)`` with
``b = ceil(n / block)`` blocks (stat1 at block 256: 0.140625 bytes per value).

Each format is one class registered in :data:`VALUE_CODECS`; ``ValueCodec(fmt)`` builds the
registered one, so adding a format is one class and one table entry. The codecs of DeMo's
sparse blocks are in :mod:`.blocks`.
"""

from __future__ import annotations

import math

import torch

from .bits import pack_bits, packed_nbytes, unpack_bits
from .codebook import stat_codebook, tensor_codebook


# ---------------------------------------------------------------------- dense values
class ValueCodec:
    """Encode a flat fp32 tensor into bytes and back; ``ValueCodec(fmt, block)`` builds the
    codec of a format of :data:`FORMATS` (registered in :data:`VALUE_CODECS`)."""

    fmt = ""
    #: the sizes of the tensors laid end to end in the values, for a format with a codebook
    #: per tensor (set by the exchange; the others ignore it)
    segments: list[int] | None = None

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
        buf: torch.Tensor | None = getattr(self, "_buf", None)
        if buf is None or buf.numel() < numel or buf.device != torch.device(device):
            buf = torch.empty(numel, dtype=torch.float32, device=device)
            self._buf: torch.Tensor | None = buf
        return buf[:numel]

    def release(self) -> None:
        """Drop the :meth:`workspace` buffer (the next call makes a new one): for a codec
        used rarely, such as a DiLoCo sync's, so that it is not held between uses."""
        self._buf = None

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


class _BlockedValues(ValueCodec):
    """A format coded per block of :attr:`block` values (the last one may be shorter)."""

    def room(self, n: int) -> int:
        return math.ceil(n / self.block) * self.block

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (flat) copied into the :meth:`workspace` as whole blocks, zero padded: the
        codes are computed in place there."""
        n = x.numel()
        buf = self.workspace(self.room(n), x.device)
        buf[:n].copy_(x)
        buf[n:].zero_()
        return buf.view(-1, self.block)


class _IntValues(_BlockedValues):
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

    def decode_into(self, data: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        blocks = math.ceil(n / self.block)
        scale = data[: 4 * blocks].view(torch.float32)
        self._codes_into(data[4 * blocks: 4 * blocks + self._codes_bytes(n)], n, out[:n])
        # the whole blocks scaled in place (the tail past ``n`` is scratch, never read)
        out[: blocks * self.block].view(blocks, self.block).mul_(scale[:, None])
        return out[:n]

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


class _PackedIntValues(_IntValues):
    """Codes offset by ``qmax`` and packed at :attr:`bits` bits each (:func:`pack_bits`)."""

    bits = 2

    def _codes_bytes(self, n: int) -> int:
        return packed_nbytes(n, self.bits)

    def _write_codes(self, codes: torch.Tensor, body: torch.Tensor) -> None:
        pack_bits(codes.add_(self.qmax), self.bits, body)  # codes: the workspace, in place

    def _read_codes(self, body: torch.Tensor, n: int) -> torch.Tensor:
        return unpack_bits(body, self.bits, n).float() - self.qmax

    def _codes_into(self, body: torch.Tensor, n: int, out: torch.Tensor) -> None:
        _unpack_into(body, self.bits, n, out)
        out.sub_(self.qmax)


class _Int3Values(_PackedIntValues):
    qmax, bits = 3, 3


class _Int2Values(_PackedIntValues):
    qmax, bits = 1, 2


class _StatValues(_BlockedValues):
    """A statistical codebook per block (:func:`~.codebook.stat_codebook`): ``L`` bf16 bin means per
    block first, then the codes packed at :attr:`bits` bits."""

    bits = 2
    spread = 2.0

    def _book_bytes(self, n: int) -> int:
        return 2 * (1 << self.bits) * math.ceil(n / self.block)

    def nbytes(self, n: int) -> int:
        return self._book_bytes(n) + packed_nbytes(n, self.bits)

    def _codebook(self, padded: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes and fp32 bin means of the zero-padded blocks ``padded`` (its tail is
        overwritten) holding ``n`` values."""
        count = padded.new_full((padded.shape[0],), float(self.block))
        if count.numel():
            count[-1] = n - (padded.shape[0] - 1) * self.block
        return stat_codebook(padded, count, n, self.bits, self.spread)

    def encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        n = x.numel()
        book = self._book_bytes(n)
        codes, means = self._codebook(self._padded(x), n)
        out[:book].view(torch.bfloat16).copy_(means.view(-1))
        pack_bits(codes.view(-1)[:n], self.bits, out[book: self.nbytes(n)])

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        lead, blocks, book = data.shape[:-1], math.ceil(n / self.block), self._book_bytes(n)
        means = data[..., :book].view(torch.bfloat16).float().view(*lead, blocks, -1)
        codes = unpack_bits(data[..., book: self.nbytes(n)], self.bits, n)
        full = codes.new_zeros(*lead, blocks * self.block)
        full[..., :n] = codes
        out = torch.gather(means, -1, full.view(*lead, blocks, self.block))
        return out.view(*lead, blocks * self.block)[..., :n]

    def decode_into(self, data: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
        blocks, book = math.ceil(n / self.block), self._book_bytes(n)
        means = data[:book].view(torch.bfloat16).float().view(blocks, -1)
        # uint8 codes (a quarter of the values' memory), then one pass per bin
        codes = torch.zeros(blocks * self.block, dtype=torch.uint8, device=data.device)
        _unpack_into(data[book: self.nbytes(n)], self.bits, n, codes[:n])
        codes = codes.view(blocks, self.block)
        vals = out[: blocks * self.block].view(blocks, self.block)  # the tail is scratch
        vals.copy_(means[:, :1].expand(blocks, self.block))
        for j in range(1, means.shape[1]):
            torch.where(codes == j, means[:, j: j + 1], vals, out=vals)
        return out[:n]

    def max_error(self, x: torch.Tensor) -> torch.Tensor:
        """Per block: the largest ``|x - m|`` over its values (``m``: the fp32 mean of the
        value's bin, as :meth:`encode` computes it) plus ``2^-7 max|x|`` of the block (the bf16
        rounding of ``m`` is at most ``2^-8 |m| <= 2^-8 max|x|``; doubled as room for fp32
        bin sums added in another order). A bound, not the exact error."""
        n = x.numel()
        blocks = math.ceil(n / self.block)
        padded = torch.zeros(blocks * self.block, dtype=torch.float32, device=x.device)
        padded[:n] = x
        codes, means = self._codebook(padded.view(blocks, self.block), n)
        err = torch.zeros_like(padded)
        err[:n] = (x - torch.gather(means, 1, codes).view(-1)[:n]).abs()
        mag = torch.zeros_like(padded)
        mag[:n] = x.abs()
        bound = err.view(blocks, -1).amax(1) + mag.view(blocks, -1).amax(1) * 2.0 ** -7
        return bound.repeat_interleave(self.block)[:n]


class _Stat3Values(_StatValues):
    bits = 3


class _Stat2Values(_StatValues):
    bits = 2


class _Stat1Values(_StatValues):
    """Two bins split at the block mean, each decoded to the mean of its values."""

    bits = 1


class _TensorStat2Values(ValueCodec):
    """One statistical codebook per tensor (:func:`~.codebook.tensor_codebook`, the form of
    MuLoCo's 2-bit values): the values are the tensors :attr:`segments` (their sizes, set by
    the exchange; None: one tensor) laid end to end; the ``L`` fp32 bin values of every
    tensor first, then the codes packed at 2 bits. ``block`` is not used (the block is the
    tensor); the exchange sends the whole model in one bucket."""

    bits = 2

    def _sizes(self, n: int) -> list[int]:
        sizes = [n] if self.segments is None else self.segments
        if sum(sizes) != n:
            raise ValueError(f"{self.fmt}: {n} values, but the tensors hold {sum(sizes)} (one "
                             "codebook per tensor needs the whole model in one bucket)")
        return sizes

    def _book_bytes(self, n: int) -> int:
        return 4 * (1 << self.bits) * len(self._sizes(n))

    def nbytes(self, n: int) -> int:
        return self._book_bytes(n) + packed_nbytes(n, self.bits)

    def encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        n, book = x.numel(), self._book_bytes(x.numel())
        books = out[:book].view(torch.float32).view(-1, 1 << self.bits)
        codes = torch.empty(n, dtype=torch.int64, device=x.device)
        off = 0
        for t, size in enumerate(self._sizes(n)):
            c, m = tensor_codebook(x[off: off + size], self.bits)
            codes[off: off + size], books[t] = c, m
            off += size
        pack_bits(codes, self.bits, out[book: self.nbytes(n)])

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        lead, book, sizes = data.shape[:-1], self._book_bytes(n), self._sizes(n)
        levels = 1 << self.bits
        books = data[..., :book].view(torch.float32).reshape(*lead, -1)  # (..., S * L)
        codes = unpack_bits(data[..., book: self.nbytes(n)], self.bits, n)
        seg = torch.repeat_interleave(torch.arange(len(sizes), device=data.device) * levels,
                                      torch.tensor(sizes, device=data.device))
        return torch.gather(books, -1, codes + seg)

    def max_error(self, x: torch.Tensor) -> torch.Tensor:
        """Exact: ``|x - decode(encode(x))|`` (the codebook's bin values are fp32)."""
        out = torch.zeros(self.nbytes(x.numel()), dtype=torch.uint8, device=x.device)
        self.encode(x.reshape(-1).float(), out)
        return (x.reshape(-1) - self.decode(out, x.numel())).abs()


VALUE_CODECS: dict[str, type[ValueCodec]] = {
    "fp32": _Fp32Values, "bf16": _Bf16Values, "fp16": _Fp16Values,
    "int8": _Int8Values, "int4": _Int4Values, "int3": _Int3Values, "int2": _Int2Values,
    "stat3": _Stat3Values, "stat2": _Stat2Values, "stat1": _Stat1Values,
    "stat2-tensor": _TensorStat2Values,
}
FORMATS = tuple(VALUE_CODECS)


def _unpack_into(body: torch.Tensor, bits: int, n: int, out: torch.Tensor) -> None:
    """The ``n`` codes of ``bits`` bits packed in the 1-D ``body`` (:func:`pack_bits`' layout)
    into ``out`` (any dtype), with temporaries smaller than ``out``: each word of
    ``lcm(bits, 8)`` bits is assembled as int32 and split into its codes."""
    span = math.lcm(bits, 8)
    per, nb = span // bits, span // 8  # codes and bytes per word
    m = n // per
    if m:
        raw = body[: m * nb].view(m, nb)
        word = raw[:, 0].to(torch.int32)
        for i in range(1, nb):
            word |= raw[:, i].to(torch.int32) << (8 * i)
        cols = out[: m * per].view(m, per)
        for j in range(per):
            cols[:, j].copy_((word >> (bits * j)) & ((1 << bits) - 1))
    if n > m * per:  # the last, partial word
        out[m * per: n].copy_(unpack_bits(body[m * nb:], bits, n - m * per))
