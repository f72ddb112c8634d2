"""The compact wire format: bit packing, value codecs, payload sizes, payload validation."""

import math
import warnings

import pytest
import torch
from torch import nn

from flexdemo import DeToNATION
from flexdemo.compress.bits import pack_bits, packed_nbytes, unpack_bits
from flexdemo.compress.blocks import BLOCK_FORMATS, BlockValueCodec
from flexdemo.replicate import CorruptPayloadError, DeMoReplicator


@pytest.mark.parametrize("bits", [1, 2, 3, 7, 8, 12, 13, 16, 31])
def test_bit_packing_exact(bits):
    torch.manual_seed(bits)
    v = torch.randint(0, 2 ** bits, (997,))
    packed = pack_bits(v, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(997, bits)
    assert torch.equal(unpack_bits(packed, bits, 997), v)


@pytest.mark.parametrize("bits", range(1, 33))
def test_word_and_stream_packing_agree(bits):
    """The fast word path writes exactly the bytes of the bit-stream definition."""
    torch.manual_seed(bits)
    for count in (1, 5, 96, 997):
        v = torch.randint(0, 2 ** bits, (count,))
        stream = pack_bits(v, bits, method="stream")
        assert torch.equal(pack_bits(v, bits), stream)
        assert torch.equal(unpack_bits(stream, bits, count), v)
        assert torch.equal(unpack_bits(stream, bits, count, method="stream"), v)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_block_codecs(fmt):
    torch.manual_seed(0)
    vals = torch.randn(40, 32)
    codec = BlockValueCodec(fmt)
    buf = torch.zeros(codec.nbytes(40, 32), dtype=torch.uint8)
    sent = codec.encode(vals, buf)
    assert torch.equal(sent, codec.decode(buf, 40, 32))  # what we subtract is what peers see
    err = (sent - vals).abs()
    mx = vals.abs().amax(1, keepdim=True)
    if fmt.endswith("-tensor"):  # one codebook for all the values: within their largest
        mx = vals.abs().amax()
    if fmt.startswith("stat"):  # bin means (tests/test_codebook.py): a bin may straddle zero
        assert bool((sent.abs() <= mx * (1 + 2 ** -7)).all())
        return
    assert bool(((torch.sign(sent) == torch.sign(vals)) | (sent == 0)).all())  # no sign flips
    if fmt == "fp32":
        assert torch.equal(sent, vals)
    elif fmt in ("bf16", "fp16"):
        assert bool((err <= vals.abs() * 2 ** -8 + 1e-12).all())
    elif fmt == "int8":
        assert bool((err <= mx / 254 * 1.01 + mx * 2 ** -8).all())
    elif fmt == "int2":
        lo = vals.abs().amin(1, keepdim=True)
        assert bool((err <= (mx - lo) / 4 * 1.02 + mx * 2 ** -7).all())
    else:
        assert torch.allclose(sent.abs(), vals.abs().mean(1, keepdim=True).expand_as(vals),
                              rtol=2 ** -7)


def _rep(**kw):
    rep = DeMoReplicator(**kw)
    rep.setup([torch.Size([128, 192]), torch.Size([192]), torch.Size([7, 9])],
              torch.device("cpu"), None)
    return rep


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_payload_bytes_formula(fmt):
    rep = _rep(values=fmt, topk=32)
    codec = BlockValueCodec(fmt)
    expected = 32  # header
    # the 128x192 matrix: 6 blocks of 64x64, 32 indices of 12 bits each
    expected += math.ceil(6 * 32 * 12 / 8 / 8) * 8 + math.ceil(codec.nbytes(6, 32) / 8) * 8
    # the batch of small tensors: 192 + 63 = 255 entries -> (4, 64): one block of 256 (8 bits)
    expected += math.ceil(32 * 8 / 8 / 8) * 8 + math.ceil(codec.nbytes(1, 32) / 8) * 8
    assert rep.payload_bytes() == expected


_MIXED = [(128, 192), (192,), (7, 9), (131, 70), (256, 128), (300,), (64, 64), (65,)]


def _run_mixed(steps=4, **kw):
    """Outputs and momentum of a replicator on mixed shapes (groups of several tensors,
    padded tensors, small ones), with some gradients missing at step 2."""
    torch.manual_seed(0)
    rep = DeMoReplicator(**kw)
    rep.setup([torch.Size(s) for s in _MIXED], torch.device("cpu"), None)
    outs = []
    for step in range(steps):
        grads = [torch.randn(s) for s in _MIXED]
        if step == 2:
            grads[0] = grads[3] = None
        outs.append([None if g is None else g.clone()
                     for g in rep(grads, [1e-2] * len(_MIXED), step)])
    return rep, outs


@pytest.mark.parametrize("values", ["int2", "fp32"])
def test_grouped_and_per_tensor_encoding_agree(values):
    """Tensors with the same block size are selected and coded as one matrix: the same bits
    as coding each on its own."""
    grouped, a = _run_mixed(values=values)
    single, b = _run_mixed(values=values, bucket=False)
    assert len(grouped.groups) < len(single.groups) == len(single.units)
    for x, y in zip(a, b):
        assert all((p is None and q is None) or torch.equal(p, q) for p, q in zip(x, y))
    assert all(torch.equal(p, q) for p, q in zip(grouped.delta, single.delta))


def test_missing_gradient_keeps_momentum_in_a_group():
    rep, _ = _run_mixed(steps=2)
    before = [d.clone() for d in rep.delta]
    grads = [torch.randn(s) for s in _MIXED]
    grads[4] = None  # shares its group (64 x 64 blocks) with tensors that have gradients
    out = rep(grads, [1e-2] * len(_MIXED), 2)
    u = next(u for u in rep.units if u.members == [4])
    assert sum(1 for v in rep.units if v.group == u.group) > 1
    assert out[4] is None and torch.equal(rep.delta[rep.units.index(u)], before[rep.units.index(u)])
    assert not torch.equal(rep.delta[0], before[0])


def test_bf16_transform_stays_close_to_fp32():
    """With every coefficient kept, the output is the gradient itself, through a bf16 forward
    transform and an fp32 inverse: within bf16 rounding."""
    _, fast = _run_mixed(sign=False, values="fp32", transform_dtype="bf16", topk=64, chunk=8,
                         decay=0.0, scale_by_lr=False, steps=1)
    torch.manual_seed(0)
    grads = [torch.randn(s) for s in _MIXED]
    for g, out in zip(grads, fast[0]):
        assert float((out - g).norm()) <= 2 ** -7 * float(g.norm())
        assert not torch.equal(out, g)
    with pytest.raises(ValueError, match="transform_dtype"):
        DeMoReplicator(transform_dtype="fp8")


def test_presets_reach_the_byte_targets():
    """B/param for a 2-replica exchange of a GPT-like set of shapes."""
    d = 384
    shapes = [(256, d), (128, d)]
    for _ in range(6):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d),
                   (4 * d,), (d, 4 * d), (d,)]
    shapes += [(d,), (d,), (256, d)]
    numel = sum(math.prod(s) for s in shapes)
    for kw, target in (({"topk": 16, "values": "int2"}, 0.01),
                       ({"topk": 4, "values": "sign"}, 0.003)):
        rep = DeMoReplicator(**kw)
        rep.setup([torch.Size(s) for s in shapes], torch.device("cpu"), None)
        assert rep.payload_bytes() / numel <= target, kw


def _payloads(rep, n=2):
    grads = [torch.randn(128, 192), torch.randn(192), torch.randn(7, 9)]
    buf = rep.send_buffers[0]
    rep.encode_payload(grads, [1e-2] * 3, 0, buf)
    return grads, torch.stack([buf.clone() for _ in range(n)])


def test_corrupt_payloads_are_named():
    torch.manual_seed(0)
    for corrupt, match in (
        (lambda u, row: row[u.val_off: u.val_off + 4].view(torch.float32).fill_(float("nan")),
         "non-finite value"),
        (lambda u, row: row[0:8].view(torch.int64).fill_(123), "bad magic"),
        (lambda u, row: row[8:16].view(torch.int64).fill_(7), "payload for step 7"),
        (lambda u, row: row[u.idx_off: u.idx_off + 3].fill_(0), "repeated index"),
    ):
        rep = _rep(values="fp32")
        grads, gathered = _payloads(rep)
        corrupt(rep.groups[0], gathered[1])
        with pytest.raises(CorruptPayloadError, match=f"rank 1 .*{match}"):
            rep._decode(gathered, grads, 0, rep_code(grads))


def rep_code(grads):
    from flexdemo.replicate.agreement import presence_code
    return presence_code(grads)


def test_index_out_of_range_is_caught():
    rep = DeMoReplicator(topk=4, chunk=8)
    rep.setup([torch.Size([8, 12])], torch.device("cpu"), None)  # blocks of 8x12=96: 7 bits
    grads = [torch.randn(8, 12)]
    rep.encode_payload(grads, [1.0], 0, rep.send_buffers[0])
    gathered = torch.stack([rep.send_buffers[0].clone()] * 2)
    u = rep.groups[0]
    gathered[1, u.idx_off: u.val_off] = 0xFF  # every index 127 >= 96
    with pytest.raises(CorruptPayloadError, match="rank 1 .*out of range"):
        rep._decode(gathered, grads, 0, rep_code(grads))


def test_drop_bad_peer_uses_the_others():
    torch.manual_seed(0)
    rep = _rep(on_bad_peer="drop", sign=False)
    grads, gathered = _payloads(rep, n=3)
    u = rep.groups[0]
    gathered[2, u.val_off: u.val_off + 4].view(torch.float32).fill_(float("inf"))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        rep._decode(gathered, grads, 0, rep_code(grads))
    assert rep.dropped_payloads == 1 and "dropped the payload of rank 2" in str(w[0].message)
    # the mean of the two identical good payloads equals the decode of one of them
    torch.manual_seed(0)
    ref = _rep(sign=False)
    g1, one = _payloads(ref, n=1)
    ref._decode(one, g1, 0, rep_code(g1))
    assert all(torch.allclose(a, b) for a, b in zip(grads, g1))


def test_delayed_overlap_applies_one_step_late_and_learns():
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    y = x[:, :1] * 2 - x[:, 1:2]

    def run(overlap):
        torch.manual_seed(1)
        m = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        opt = DeToNATION(m.parameters(), DeMoReplicator(topk=4, chunk=8, overlap=overlap),
                         lr=3e-3)
        first, losses = [p.detach().clone() for p in m.parameters()], []
        for s in range(150):
            loss = (m(x) - y).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if s == 0:
                unchanged = all(torch.equal(a, b) for a, b in zip(first, m.parameters()))
        return losses, unchanged

    losses, unchanged = run("delayed")
    assert unchanged  # nothing to apply at step 0
    assert losses[-1] < 0.3 * losses[0]
    plain, unchanged_plain = run("none")
    assert not unchanged_plain


def test_delayed_state_round_trip():
    import copy

    def make():
        torch.manual_seed(1)
        m = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        return m, DeToNATION(m.parameters(), DeMoReplicator(topk=4, chunk=8,
                                                            overlap="delayed"), lr=3e-3)

    x = torch.randn(64, 8)
    m, opt = make()
    for _ in range(3):
        m(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    m2, opt2 = make()
    m2.load_state_dict(m.state_dict())
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    for mm, oo in ((m, opt), (m2, opt2)):
        for _ in range(3):
            mm(x).pow(2).mean().backward()
            oo.step()
            oo.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))


@pytest.mark.parametrize("bits", [1, 2, 7, 12, 13])
def test_unpack_rows_at_once(bits):
    """Rows of packed data (one per peer) unpack in the same ops, each as on its own."""
    torch.manual_seed(bits)
    vals = torch.randint(0, 2 ** bits, (3, 101))
    rows = torch.stack([pack_bits(v, bits) for v in vals])
    assert torch.equal(unpack_bits(rows, bits, 101), vals)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_block_codec_decodes_rows_at_once(fmt):
    torch.manual_seed(1)
    codec = BlockValueCodec(fmt)
    n = codec.nbytes(6, 5)
    rows = torch.zeros(3, (n + 7) // 8 * 8 + 8, dtype=torch.uint8)  # aligned, as gathered
    sent = [codec.encode(torch.randn(6, 5), rows[r, :n]) for r in range(3)]
    assert torch.equal(codec.decode(rows[:, :n], 6, 5), torch.stack(sent))


def test_a_value_format_is_one_registry_entry(monkeypatch):
    """A format registered in BLOCK_CODECS is usable by DeMo with no other edit."""
    from flexdemo.compress import blocks

    class Halves(blocks._FloatBlocks):  # fp16 under another name
        dtype = torch.float16

    monkeypatch.setitem(blocks.BLOCK_CODECS, "halves", Halves)
    codec = BlockValueCodec("halves")
    assert isinstance(codec, Halves) and codec.fmt == "halves"
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    rep = DeMoReplicator(values="halves")
    opt = DeToNATION(model.parameters(), rep, lr=0.1)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    assert rep.payload_bytes() > 0 and all(torch.isfinite(p).all() for p in model.parameters())
    with pytest.raises(ValueError, match="unknown value format 'nope'"):
        BlockValueCodec("nope")
