"""The int3 / int2 dense codecs and the statistical codebooks (stat3 / stat2 / stat1, dense and
sparse blocks) of flexdemo.compress.quant and flexdemo.compress.blocks."""

import math

import pytest
import torch

from flexdemo.compress.bits import pack_bits, unpack_bits
from flexdemo.compress.blocks import BlockValueCodec
from flexdemo.compress.quant import ValueCodec

SENTINEL = 0xA5
DENSE = ["int2", "int3", "stat1", "stat2", "stat3"]
STATS = ["stat1", "stat2", "stat3"]
BITS = {"int2": 2, "int3": 3, "stat1": 1, "stat2": 2, "stat3": 3}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _dense_nbytes(fmt, n, block):
    b, bits = math.ceil(n / block), BITS[fmt]
    if fmt.startswith("int"):
        return math.ceil(bits * n / 8) + 4 * b
    return 2 * 2 ** bits * b + math.ceil(bits * n / 8)


def _encode_dense(codec, x, extra=16):
    """The payload of ``x`` in a sentinel-filled buffer; checks nothing past nbytes is written."""
    nb = codec.nbytes(x.numel())
    buf = torch.full((nb + extra,), SENTINEL, dtype=torch.uint8)
    codec.encode(x, buf)
    assert bool((buf[nb:] == SENTINEL).all()), "bytes written past nbytes"
    return buf


def _encode_blocks(codec, vals, extra=16):
    b, k = vals.shape
    nb = codec.nbytes(b, k)
    buf = torch.full((nb + extra,), SENTINEL, dtype=torch.uint8)
    sent = codec.encode(vals, buf)
    assert bool((buf[nb:] == SENTINEL).all()), "bytes written past nbytes"
    return buf, sent


# ---------------------------------------------------------------------- sparse blocks
@pytest.mark.parametrize("fmt", STATS)
@pytest.mark.parametrize("b,k", [(1, 1), (5, 1), (1, 7), (6, 7), (3, 64), (40, 64)])
def test_block_stat_round_trip_and_size(fmt, b, k):
    codec = BlockValueCodec(fmt)
    bits = BITS[fmt]
    assert codec.nbytes(b, k) == 2 * 2 ** bits * b + math.ceil(bits * b * k / 8)
    vals = torch.randn(b, k, generator=_gen(b * 100 + k)) * 3 + 1
    buf, sent = _encode_blocks(codec, vals)
    assert sent.shape == (b, k) and sent.dtype == torch.float32
    assert torch.equal(sent, codec.decode(buf, b, k))  # what we subtract is what peers see
    # leading dims: one row per peer, decoded at once
    n = codec.nbytes(b, k)
    rows = torch.zeros(3, n + (-n % 8) + 8, dtype=torch.uint8)
    sents = [codec.encode(torch.randn(b, k, generator=_gen(r)), rows[r, :n]) for r in range(3)]
    assert torch.equal(codec.decode(rows[:, :n], b, k), torch.stack(sents))
    # every value decodes to a bin mean: within the block's range
    lo, hi = vals.amin(1, keepdim=True), vals.amax(1, keepdim=True)
    slack = vals.abs().amax(1, keepdim=True) * 2 ** -8
    assert bool(((sent >= lo - slack) & (sent <= hi + slack)).all())


@pytest.mark.parametrize("fmt", STATS)
@pytest.mark.parametrize("k", [1, 7, 64])
def test_block_stat_constant_and_zero_blocks(fmt, k):
    codec = BlockValueCodec(fmt)
    consts = torch.tensor([0.0, 1.5, -3.0, 0.1, 1e-20, -7e5])
    vals = consts[:, None].expand(-1, k).contiguous()
    buf, sent = _encode_blocks(codec, vals)
    assert torch.equal(sent, vals.to(torch.bfloat16).float())
    assert torch.equal(codec.decode(buf, *vals.shape), sent)
    zeros = torch.zeros(4, k)
    assert torch.equal(_encode_blocks(codec, zeros)[1], zeros)


def _reference_codes(v, bits, spread=2.0):
    """Each value's bin, by the definition, with a plain loop (float64)."""
    levels = 2 ** bits
    vs = [float(a) for a in v]
    mu = sum(vs) / len(vs)
    sd = math.sqrt(sum((a - mu) ** 2 for a in vs) / len(vs))
    edges = [mu + spread * sd * (2 * j / levels - 1) for j in range(1, levels)]
    codes = [sum(a >= e for e in edges) for a in vs]
    near = min(abs(a - e) for a in vs for e in edges) if sd > 0 else math.inf
    return codes, near, sd


def _check_bin_means(v, codes, decoded, bits):
    """Each bin decodes to the (bf16-rounded) mean of its members; codes as the definition."""
    ref, near, sd = _reference_codes(v, bits)
    assert near > 1e-4 * sd  # the seed keeps values off the edges: the bins are unambiguous
    assert codes == ref
    for j in set(ref):
        members = [float(a) for a, c in zip(v, ref) if c == j]
        mean = sum(members) / len(members)
        got = {float(d) for d, c in zip(decoded, ref) if c == j}
        assert len(got) == 1
        assert abs(got.pop() - mean) <= abs(mean) * 2 ** -8 + 1e-7


@pytest.mark.parametrize("fmt", STATS)
def test_block_stat_bins_decode_to_their_mean(fmt):
    codec, bits = BlockValueCodec(fmt), BITS[fmt]
    b, k = 4, 24
    vals = torch.randn(b, k, generator=_gen(7)) * torch.tensor([[1.0], [0.01], [50.0], [3.0]])
    buf, sent = _encode_blocks(codec, vals)
    book = 2 * 2 ** bits * b
    codes = unpack_bits(buf[book:], bits, b * k).view(b, k)
    for r in range(b):
        _check_bin_means(vals[r], codes[r].tolist(), sent[r], bits)


def test_block_stat2_beats_int2_on_gaussian_data():
    vals = torch.randn(64, 64, generator=_gen(3))
    mse = {}
    for fmt in ("int2", "stat2", "stat3"):
        _, sent = _encode_blocks(BlockValueCodec(fmt), vals)
        mse[fmt] = float((sent - vals).pow(2).mean())
    assert mse["stat3"] < mse["stat2"] < mse["int2"]
    assert mse["stat2"] < 0.14  # near Lloyd-Max's 0.1175 for 4 levels of a unit Gaussian


# ---------------------------------------------------------------------- dense values
@pytest.mark.parametrize("fmt", DENSE)
@pytest.mark.parametrize("n,block", [(1, 64), (5, 64), (64, 64), (100, 64), (1001, 64),
                                     (37, 16), (7, 2)])
def test_dense_round_trip_size_and_bound(fmt, n, block):
    codec = ValueCodec(fmt, block)
    assert codec.nbytes(n) == _dense_nbytes(fmt, n, block)
    x = torch.randn(n, generator=_gen(n)) * 5
    buf = _encode_dense(codec, x)
    y = codec.decode(buf, n)
    assert y.shape == (n,) and y.dtype == torch.float32
    assert bool(((x - y).abs() <= codec.max_error(x) + 1e-12).all())
    assert torch.equal(codec.decode(buf, n), y)  # deterministic
    out = torch.full((codec.room(n) + 2,), float("nan"))  # stale contents are overwritten
    got = codec.decode_into(buf, n, out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, y)


@pytest.mark.parametrize("fmt", DENSE)
@pytest.mark.parametrize("n", [37, 48, 1])
def test_dense_decodes_rows_at_once(fmt, n):
    codec = ValueCodec(fmt, 16)
    width = codec.nbytes(n) + 5
    width += -width % 8  # padded and 8-byte aligned rows, like gathered buckets
    rows = torch.zeros(3, width, dtype=torch.uint8)
    for r in range(3):
        codec.encode(torch.randn(n, generator=_gen(r)), rows[r])
    both = codec.decode(rows, n)
    assert both.shape == (3, n)
    for r in range(3):
        assert torch.equal(both[r], codec.decode(rows[r], n))
    peers = rows.view(3, 1, width).expand(3, 2, width)  # two leading dims
    assert torch.equal(codec.decode(peers, n), both[:, None].expand(3, 2, n))


@pytest.mark.parametrize("fmt,qmax", [("int2", 1), ("int3", 3)])
def test_dense_int_bound_is_half_a_step(fmt, qmax):
    codec = ValueCodec(fmt, 16)
    x = torch.randn(40, generator=_gen(1))
    bound = codec.max_error(x)
    blocks = torch.nn.functional.pad(x.abs(), (0, 8)).view(3, 16).amax(1) / (2 * qmax)
    assert torch.equal(bound, blocks.repeat_interleave(16)[:40])


@pytest.mark.parametrize("fmt,qmax", [("int2", 1), ("int3", 3)])
@pytest.mark.parametrize("n", [1, 3, 7, 13, 21, 101])
def test_dense_int_codes_packed_with_pack_bits(fmt, qmax, n):
    """Odd counts: the codes are pack_bits' bytes at 2 / 3 bits, and come back exactly."""
    codec, bits = ValueCodec(fmt, 8), BITS[fmt]
    codes = torch.randint(-qmax, qmax + 1, (n,), generator=_gen(n))
    codes[::8] = qmax  # every block's scale is exactly 0.5
    x = codes.float() * 0.5
    buf = _encode_dense(codec, x)
    b = math.ceil(n / 8)
    body = buf[4 * b: codec.nbytes(n)]
    assert torch.equal(body, pack_bits(codes + qmax, bits))
    assert torch.equal(unpack_bits(body, bits, n), codes + qmax)
    assert torch.equal(codec.decode(buf, n), x)
    out = torch.empty(codec.room(n))
    assert torch.equal(codec.decode_into(buf, n, out), x)


@pytest.mark.parametrize("fmt", DENSE)
@pytest.mark.parametrize("n", [3, 13, 101])
def test_dense_decode_into_matches_decode_on_any_payload(fmt, n):
    """Random payload bytes (finite scales / codebooks): both decodes read the same codes."""
    codec = ValueCodec(fmt, 8)
    buf = torch.randint(0, 256, (codec.nbytes(n),), dtype=torch.uint8, generator=_gen(n))
    head = 4 * math.ceil(n / 8) if fmt.startswith("int") else codec.nbytes(n) - math.ceil(
        BITS[fmt] * n / 8)
    if fmt.startswith("int"):
        buf[:head].view(torch.float32).copy_(torch.rand(head // 4, generator=_gen(0)))
    else:
        buf[:head].view(torch.bfloat16).copy_(torch.randn(head // 2, generator=_gen(0)))
    out = torch.full((codec.room(n),), float("nan"))
    assert torch.equal(codec.decode_into(buf, n, out), codec.decode(buf, n))


@pytest.mark.parametrize("fmt", STATS)
def test_dense_stat_constant_zero_and_short_last_block(fmt):
    codec = ValueCodec(fmt, 16)
    x = torch.cat([torch.full((16,), 2.5), torch.zeros(16), torch.full((5,), -0.75)])
    y = codec.decode(_encode_dense(codec, x), x.numel())
    assert torch.equal(y, x)  # bf16-exact constants come back exactly
    z = torch.zeros(21)
    assert torch.equal(codec.decode(_encode_dense(codec, z), 21), z)


@pytest.mark.parametrize("fmt", STATS)
@pytest.mark.parametrize("n", [20, 27, 32])
def test_dense_stat_blocks_as_the_block_codec(fmt, n):
    """Each block (the short last one too: its padding takes no part) is coded like the
    sparse-block codec codes it alone."""
    codec, sparse = ValueCodec(fmt, 16), BlockValueCodec(fmt)
    x = torch.randn(n, generator=_gen(n)) * 2 + 3  # off zero: padding with zeros would bias
    y = codec.decode(_encode_dense(codec, x), n)
    for start in range(0, n, 16):
        part = x[start: start + 16]
        _, alone = _encode_blocks(sparse, part.view(1, -1))
        assert torch.equal(y[start: start + 16], alone.view(-1))


@pytest.mark.parametrize("fmt", STATS)
def test_dense_stat_bins_decode_to_their_mean(fmt):
    codec, bits = ValueCodec(fmt, 16), BITS[fmt]
    n = 45
    x = torch.randn(n, generator=_gen(11)) * 4 - 1
    buf = _encode_dense(codec, x)
    y = codec.decode(buf, n)
    book = 2 * 2 ** bits * 3
    codes = unpack_bits(buf[book:], bits, n).tolist()
    for start in range(0, n, 16):
        stop = min(start + 16, n)
        _check_bin_means(x[start:stop], codes[start:stop], y[start:stop], bits)


def test_dense_stat2_beats_int2_on_gaussian_data():
    x = torch.randn(4096, generator=_gen(5))
    mse = {fmt: float((ValueCodec(fmt).decode(_encode_dense(ValueCodec(fmt), x), x.numel())
                       - x).pow(2).mean()) for fmt in ("int2", "stat2", "int3", "stat3")}
    assert mse["stat2"] < mse["int2"] and mse["stat3"] < mse["int3"] and mse["stat3"] < mse[
        "stat2"]


def test_new_formats_registered_and_sizes():
    assert ValueCodec("int3", 64).nbytes(101) == 38 + 2 * 4
    assert ValueCodec("int2", 64).nbytes(101) == 26 + 2 * 4
    assert ValueCodec("stat3", 64).nbytes(101) == 2 * 8 * 2 + 38
    assert ValueCodec("stat2", 64).nbytes(101) == 2 * 4 * 2 + 26
    assert ValueCodec("stat1", 64).nbytes(101) == 2 * 2 * 2 + 13  # 2 bf16 means + 1 bit
    assert ValueCodec("stat1", 256).nbytes(2560) == 10 * 4 + 320  # 0.140625 B per value
    assert BlockValueCodec("stat3").nbytes(5, 7) == 2 * 8 * 5 + 14
    assert BlockValueCodec("stat2").nbytes(5, 7) == 2 * 4 * 5 + 9
    assert BlockValueCodec("stat1").nbytes(5, 7) == 2 * 2 * 5 + 5
    assert ValueCodec("stat2").spread == BlockValueCodec("stat3").spread == 2.0


@pytest.mark.parametrize("n,block", [(45, 16), (256, 256), (1000, 128)])
def test_dense_stat1_splits_at_the_block_mean(n, block):
    """One bit per value: set where the value is at least its block's mean; two levels per
    block, the means of the values below and at-or-above it."""
    codec = ValueCodec("stat1", block)
    x = torch.randn(n, generator=_gen(n)) * 2 + 0.5
    buf = _encode_dense(codec, x)
    b = math.ceil(n / block)
    codes = unpack_bits(buf[4 * b: codec.nbytes(n)], 1, n)
    y = codec.decode(buf, n)
    for start in range(0, n, block):
        part, got = x[start: start + block], y[start: start + block]
        high = part >= part.mean()
        assert torch.equal(codes[start: start + block].bool(), high)
        for side in (high, ~high):
            level = got[side]
            assert torch.equal(level, level[:1].expand_as(level))
            torch.testing.assert_close(level[0], part[side].mean().to(torch.bfloat16).float())
    mse = float((y - x).pow(2).mean()) / 4  # x has variance 4
    assert mse < 0.38  # near Lloyd-Max's 0.3634 for 2 levels of a Gaussian


# ---------------------------------------------------------------------- one codebook per tensor
def test_tensor_codebook_edges_bins_and_order():
    """MuLoCo's and SparseLoCo's form: 4 bins of 1.5 std around the mean, so the edges sit at
    -2.25, -0.75 and +0.75 std (asymmetric), each bin decoded to the mean of its values;
    the same values in another order give the same bits (fp64 statistics)."""
    from flexdemo.compress.codebook import tensor_codebook

    x = torch.randn(5000, generator=_gen(3))
    codes, means = tensor_codebook(x, 2)
    mu, sd = x.double().mean(), x.double().std()
    z = (x.double() - mu) / sd
    want = (z >= -2.25).long() + (z >= -0.75).long() + (z >= 0.75).long()
    near = ((z.abs() - 0.75).abs() < 1e-4) | ((z + 2.25).abs() < 1e-4)  # rounding at an edge
    assert torch.equal(codes[~near], want[~near])
    for j in range(4):
        torch.testing.assert_close(means[j], x[codes == j].double().mean().float(), rtol=0,
                                   atol=1e-6)
    perm = torch.randperm(5000, generator=_gen(4))
    c2, m2 = tensor_codebook(x[perm], 2)
    assert torch.equal(m2, means) and torch.equal(c2, codes[perm])
    one_c, one_m = tensor_codebook(torch.tensor([3.5]), 2)  # one value: decoded exactly
    assert one_m[one_c].item() == 3.5


@pytest.mark.parametrize("n", [1, 7, 300])
def test_dense_and_sparse_stat2_tensor_sizes_and_round_trip(n):
    """``stat2-tensor``: 16 bytes of fp32 bin means per tensor, then 2 bits per value; the dense
    codec codes each of its tensors (segments) with its own codebook."""
    from flexdemo.compress.codebook import tensor_codebook

    codec = ValueCodec("stat2-tensor")
    codec.segments = [n, 2 * n]
    x = torch.randn(3 * n, generator=_gen(n))
    out = torch.zeros(codec.nbytes(3 * n), dtype=torch.uint8)
    assert out.numel() == 2 * 16 + math.ceil(2 * 3 * n / 8)
    codec.encode(x, out)
    got = codec.decode(out, 3 * n)
    for part, ref in zip(torch.split(got, [n, 2 * n]), torch.split(x, [n, 2 * n])):
        c, m = tensor_codebook(ref, 2)
        assert torch.equal(part, m[c])
    rows = torch.zeros(2, out.numel() + -out.numel() % 8, dtype=torch.uint8)  # aligned, as
    rows[:, : out.numel()] = out  # gathered payloads are
    assert torch.equal(codec.decode(rows[:, : out.numel()], 3 * n), torch.stack([got, got]))
    blocks = BlockValueCodec("stat2-tensor")
    v = torch.randn(n, 3, generator=_gen(n + 1))
    buf = torch.zeros(blocks.nbytes(n, 3), dtype=torch.uint8)
    assert buf.numel() == 16 + math.ceil(2 * 3 * n / 8)
    sent = blocks.encode(v, buf)
    c, m = tensor_codebook(v, 2)
    assert torch.equal(sent, m[c]) and torch.equal(blocks.decode(buf, n, 3), sent)
