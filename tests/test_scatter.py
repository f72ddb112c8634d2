"""The quantised reduce-scatter exchange (FullReplicator(reduce="scatter")): the mean, its
bytes (flat in the group size), and one outcome on every replica for bad input.
Bitwise equality with real gloo processes (2 and 4 ranks) is in tests/test_simulate.py."""

from __future__ import annotations

import math

import pytest
import torch

from flexdemo.compress.quant import ValueCodec
from flexdemo.replicate import CorruptPayloadError, FullReplicator, NonFiniteGradientError
from flexdemo.simulate import run_replicas
from flexdemo.transport import InProcessHub

SHAPES = [torch.Size([37, 5]), torch.Size([11]), torch.Size([3, 3])]


def inputs(r: int, shapes=SHAPES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + r)
    return [torch.randn(s, generator=g) * (1 + i) for i, s in enumerate(shapes)]


def exchange(world: int, values: str = "int4", reduce: str = "scatter", block: int = 16,
             before=None, shapes=SHAPES) -> list:
    """One exchange of ``inputs(r)`` on ``world`` in-process replicas: per replica, its
    outputs (or the exception it raised) and its replicator."""
    hub = InProcessHub(world, timeout=30)

    def work(r):
        rep = FullReplicator(values=values, block=block, reduce=reduce)
        rep.setup(shapes, torch.device("cpu"), hub.transport(r))
        grads = inputs(r, shapes)
        if before is not None:
            before(r, rep, grads)
        try:
            return rep(grads, [0.1] * len(shapes), 0), rep
        except (NonFiniteGradientError, CorruptPayloadError) as e:
            return e, rep

    return run_replicas(hub, work)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_replica_gets_the_same_mean_within_two_roundings(world):
    out = exchange(world)
    flat = [torch.cat([t.reshape(-1) for t in o]) for o, _ in out]
    assert all(torch.equal(flat[0], f) for f in flat[1:])  # bitwise, every replica
    parts = [torch.cat([t.reshape(-1) for t in inputs(r)]) for r in range(world)]
    mean = torch.stack(parts).mean(0)
    codec = ValueCodec("int4", 16)
    first = torch.stack([codec.max_error(p) for p in parts]).mean(0)  # each rank's rounding
    second = codec.max_error(mean.abs() + first)  # the owner's rounding of the mean
    err = (flat[0] - mean).abs()
    assert (err <= first + second + 1e-6).all(), (err - first - second).max()
    assert err.max() > 0  # it is quantised


def test_bytes_are_flat_in_the_group_size_and_counted():
    sent = {}
    for world in (2, 4):
        for reduce in ("gather", "scatter"):
            out = exchange(world, reduce=reduce, shapes=[torch.Size([64, 64])])
            for _, rep in out:
                assert rep.stats.last_bytes_sent == rep.stats.last_bytes_received \
                    == rep.exchange_bytes()
            sent[world, reduce] = out[0][1].stats.last_bytes_sent
    gathered_payload = sent[2, "gather"]  # one peer: one payload
    assert sent[4, "gather"] == 3 * gathered_payload
    # two rounds of (n-1)/n payloads: at most two payloads (plus headers and padding)
    assert sent[4, "scatter"] < 2 * gathered_payload * 1.1
    assert sent[4, "scatter"] < 0.6 * sent[4, "gather"]


def test_a_nonfinite_input_raises_on_every_replica():
    def nan_on_2(r, rep, grads):
        if r == 2:
            grads[1][3] = float("nan")

    for err, _ in exchange(4, before=nan_on_2):
        assert isinstance(err, NonFiniteGradientError) and err.ranks == [2] and err.step == 0


def test_a_corrupt_chunk_names_its_sender_on_every_replica():
    def corrupt_on_1(r, rep, grads):
        if r != 1:
            return
        encode, calls = rep.codec.encode, []

        def encode_then_break(x, out):  # rank 1 sends a NaN scale in the chunk rank 3 owns
            encode(x, out)
            calls.append(1)
            if len(calls) == 4:
                out[:4].view(torch.float32).fill_(float("nan"))

        rep.codec.encode = encode_then_break

    for err, _ in exchange(4, before=corrupt_on_1):
        assert isinstance(err, CorruptPayloadError), err
        assert "corrupt payload from rank 1" in str(err) and "non-finite" in str(err)


@pytest.mark.parametrize("kwargs, words", [
    ({"values": "fp32", "reduce": "scatter"}, "quantised values"),
    ({"values": "int4", "reduce": "scatter", "on_bad_peer": "drop"}, "needs reduce='gather'"),
    ({"values": "int4", "reduce": "ring"}, "'gather' or 'scatter'"),
])
def test_settings_that_cannot_work_are_refused_in_one_line(kwargs, words):
    with pytest.raises(ValueError, match=words) as e:
        FullReplicator(**kwargs)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------- owner error feedback
QUANTISED = ["bf16", "fp16", "int8", "int4", "int3", "int2", "stat3", "stat2", "stat1"]


def two_steps(world: int, before=None, **kw) -> list:
    """Two reduce-scatter exchanges of ``inputs(r)`` (the second scaled by 0.5 and shifted)
    on ``world`` in-process replicas: per replica its outputs (flat, or the error it
    raised), its replicator and the owner's residual after each step."""
    hub = InProcessHub(world, timeout=30)

    def work(r):
        rep = FullReplicator(block=16, reduce="scatter", **kw)
        rep.setup(SHAPES, torch.device("cpu"), hub.transport(r))
        outs, owner = [], []
        for step in range(2):
            grads = [g * (1.0 - 0.5 * step) + 0.1 * step for g in inputs(r)]
            if before is not None:
                before(r, step, grads)
            try:
                outs.append(torch.cat([t.reshape(-1) for t in rep(grads, [1.0] * 3, step)]))
            except NonFiniteGradientError as e:
                outs.append(e)
            owner.append(None if rep.owner_residual is None else rep.owner_residual.clone())
        return outs, rep, owner

    return run_replicas(hub, work)


def owner_reference(values: str, world: int, decay: float, steps: int = 2) -> list:
    """By hand, per owner: ``mean + decay * residual`` coded again, the residual what that
    coding lost (zero past the values), the first coding plain (no replica feedback)."""
    codec = ValueCodec(values, 16)
    total = sum(s.numel() for s in SHAPES)
    chunk = math.ceil(math.ceil(total / world) / 16) * 16

    def coded(x: torch.Tensor) -> torch.Tensor:
        buf = torch.zeros(codec.nbytes(x.numel()), dtype=torch.uint8)
        codec.encode(x, buf)
        return codec.decode(buf, x.numel())

    res = [torch.zeros(chunk) for _ in range(world)]
    out = []
    for step in range(steps):
        padded = torch.zeros(world, world * chunk)
        for r in range(world):
            padded[r, :total] = torch.cat([(g * (1.0 - 0.5 * step) + 0.1 * step).reshape(-1)
                                           for g in inputs(r)])
        for c in range(world):
            parts = [coded(padded[r, c * chunk:(c + 1) * chunk]) for r in range(world)]
            mean = parts[0].clone()
            for p in parts[1:]:  # rank order
                mean.add_(p)
            mean.div_(world).add_(res[c], alpha=decay)
            res[c] = mean - coded(mean)
            res[c][max(0, total - c * chunk):].zero_()
        out.append([r.clone() for r in res])
    return out


@pytest.mark.parametrize("values", QUANTISED)
def test_owner_error_feedback_keeps_what_the_owners_coding_lost(values):
    """Every quantised format: the owner codes ``mean + decay * residual`` and keeps what
    that coding lost (by hand, exactly; zero past the values); every replica decodes the
    same bits at every step; the first step (an empty residual) is the plain exchange's,
    the second differs; not a byte more is sent."""
    world, decay = 3, 0.5
    fed = two_steps(world, values=values, owner_error_feedback=decay)
    plain = two_steps(world, values=values, owner_error_feedback=None)
    want = owner_reference(values, world, decay)
    for r, (outs, rep, owner) in enumerate(fed):
        assert rep.residual is None and rep.owner_decay == decay
        assert rep.owner_residual is not None and rep.owner_residual.numel() == rep._scatter.chunk
        for step in range(2):
            assert torch.equal(outs[step], fed[0][0][step])  # bitwise, every replica
            torch.testing.assert_close(owner[step], want[step][r], rtol=0, atol=1e-6)
        assert rep.stats.bytes_sent == plain[r][1].stats.bytes_sent == 2 * rep.exchange_bytes()
        assert rep.stats.bytes_received == plain[r][1].stats.bytes_received
        assert rep.payload_bytes() == plain[r][1].payload_bytes()
    assert torch.equal(fed[0][0][0], plain[0][0][0])
    assert plain[0][1].owner_residual is None
    assert not torch.equal(fed[0][0][1], plain[0][0][1])  # the residual went in
    for _, _, owner in fed:
        assert owner[1].abs().max() > 0


def test_owner_error_feedback_true_follows_the_replicas_decay():
    """``True`` takes error_feedback's decay under reduce='scatter', and is off without
    error feedback or under the gather; the default is off."""
    world = 3
    fed = two_steps(world, values="stat1", error_feedback=0.9, owner_error_feedback=True)
    plain = two_steps(world, values="stat1", error_feedback=0.9, owner_error_feedback=False)
    for (outs, rep, owner), (p_outs, p_rep, _) in zip(fed, plain):
        assert rep.owner_decay == 0.9 and p_rep.owner_decay is None
        assert torch.equal(outs[0], p_outs[0]) and not torch.equal(outs[1], p_outs[1])
        assert torch.equal(outs[1], fed[0][0][1])
        assert owner[1].abs().max() > 0
        assert rep.state_tensor_keys == ("residual", "owner_residual")
        assert p_rep.state_tensor_keys == ("residual",)
    assert FullReplicator(values="int4", reduce="scatter", error_feedback=0.9).owner_decay \
        is None  # the default: off
    assert FullReplicator(values="int4", reduce="scatter", owner_error_feedback=True
                          ).owner_decay is None  # no error_feedback to follow
    assert FullReplicator(values="int4", error_feedback=0.9).owner_decay is None  # gather
    assert FullReplicator(values="int4", reduce="scatter",
                          owner_error_feedback=0.5).owner_decay == 0.5
    assert "owner_error_feedback=0.5" in repr(
        FullReplicator(values="int4", reduce="scatter", error_feedback=0.9,
                       owner_error_feedback=0.5))


def test_a_failed_step_leaves_the_owners_residual_as_it_was():
    def nan_at_step_1_on_rank_1(r, step, grads):
        if r == 1 and step == 1:
            grads[0][0, 0] = float("nan")

    out = two_steps(3, before=nan_at_step_1_on_rank_1, values="int2",
                    owner_error_feedback=0.9)
    for outs, _rep, owner in out:
        assert isinstance(outs[1], NonFiniteGradientError) and outs[1].ranks == [1]
        assert owner[0].abs().max() > 0 and torch.equal(owner[1], owner[0])


@pytest.mark.parametrize("kwargs, words", [
    ({"values": "int4", "owner_error_feedback": 0.9}, "reduce='scatter'"),
    ({"values": "fp32", "owner_error_feedback": 0.9}, "reduce='scatter'"),
    ({"values": "int4", "reduce": "scatter", "owner_error_feedback": 1.5}, "a decay in"),
    ({"values": "int4", "reduce": "scatter", "owner_error_feedback": "on"}, "a decay in"),
])
def test_owner_error_feedback_settings_that_cannot_work_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=words) as e:
        FullReplicator(**kwargs)
    assert "\n" not in str(e.value)


def test_owner_residual_is_saved_loaded_and_reset():
    """In the state (per rank, a DCP tensor key), counted as persistent state, loaded back
    exactly, refused when the state lacks it, zeroed for a joiner."""
    out = two_steps(2, values="int2", error_feedback=0.9, owner_error_feedback=True)
    rep = out[1][1]
    sd = rep.state_dict()
    assert torch.equal(sd["owner_residual"][0], rep.owner_residual)
    assert "owner_residual" in rep.tensor_state_keys()
    assert any(t is rep.owner_residual for t in rep.state_tensors())
    hub = InProcessHub(2, timeout=30)

    def load(r):
        other = FullReplicator(values="int2", block=16, reduce="scatter", error_feedback=0.9,
                               owner_error_feedback=True)
        other.setup(SHAPES, torch.device("cpu"), hub.transport(r))
        other.load_state_dict(out[r][1].state_dict())
        assert torch.equal(other.owner_residual, out[r][1].owner_residual)
        with pytest.raises(ValueError, match="no owner error-feedback residual"):
            other.load_state_dict({k: v for k, v in sd.items() if k != "owner_residual"})
        other.reset_replica_state()
        return other.owner_residual.abs().max()

    assert all(m == 0 for m in run_replicas(hub, load))
