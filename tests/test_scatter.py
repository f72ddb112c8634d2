"""The quantised reduce-scatter exchange (FullReplicator(reduce="scatter")): the mean, its
bytes (flat in the group size), and one outcome on every replica for bad input.
Bitwise equality with real gloo processes (2 and 4 ranks) is in tests/test_simulate.py."""

from __future__ import annotations

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
