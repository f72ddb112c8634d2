"""DeMo's sparse reduce-scatter (DeMoReplicator(reduce="scatter")): the same bits on every
replica, the exact mean against a dense reference, bytes exact and flat in the group size, one
outcome on every replica for bad input, and DiLoCo's exchange through it."""

from __future__ import annotations

import pytest
import torch
from frontier_util import batch, loss_fn, tiny_model
from sparse_exchange_util import EXACT, MIXED, PLAIN, K, blocks, grads_of, outcome, unblocks
from sparse_exchange_util import exchange as exchange_by

from flexdemo import SimulatedReplicas
from flexdemo.replicate import CorruptPayloadError, DeMoReplicator, NonFiniteGradientError

SPARSELOCO = {"topk": 64, "chunk": 64, "values": "stat2", "transform": "none", "decay": 0.95,
              "mean": "senders"}


def exchange(world: int, shapes=EXACT, before=None, reduce: str = "scatter", **kw) -> list:
    """:func:`sparse_exchange_util.exchange`, by reduce-scatter unless ``reduce`` says."""
    return exchange_by(world, shapes, before, reduce=reduce, **kw)





def keep_topk(b: torch.Tensor) -> torch.Tensor:
    """The top-K entries of every row of ``b`` by magnitude, the rest zero."""
    keep = torch.zeros_like(b, dtype=torch.bool).scatter_(1, b.abs().topk(K, dim=1).indices,
                                                          True)
    return torch.where(keep, b, 0.0)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("kw", [{"topk": K, "chunk": 8},  # DCT, int2 values, sign()
                                {**SPARSELOCO, "topk": K, "chunk": 8, "sign": False}],
                         ids=["default", "sparseloco"])
def test_every_replica_gets_bitwise_the_same_update(world, kw):
    out = exchange(world, MIXED, **kw)
    for o, _ in out:
        assert all(torch.equal(a, b) for a, b in zip(out[0][0], o))
    assert any(t.abs().sum() > 0 for t in out[0][0])


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("mean", ["senders", "replicas"])
def test_the_update_is_the_topk_of_the_mean_of_the_senders_topk(world, mean):
    out = exchange(world, mean=mean, **PLAIN)
    reselected = False
    for i, shape in enumerate(EXACT):
        cr, cc = out[0][1].units[i].plan.chunk
        sent = [keep_topk(blocks(grads_of(r, EXACT)[i], cr, cc)) for r in range(world)]
        total = torch.zeros_like(sent[0])
        for s in sent:  # rank order, as the owner sums
            total += s
        if mean == "senders":
            count = sum((s != 0).float() for s in sent)
            total = total / count.clamp(min=1.0)
        else:
            total = total / world
        reselected |= bool(((total != 0).sum(1) > K).any())  # the owner's selection drops some
        want = unblocks(keep_topk(total), shape, cr, cc)
        for r in range(world):
            assert torch.equal(out[r][0][i], want), (world, mean, i, r)
    assert reselected


def test_a_group_of_one_is_the_gathered_step():
    (scatter_out, rep), = exchange(1, MIXED, topk=K, chunk=8)
    (gather_out, _), = exchange(1, MIXED, reduce="gather", topk=K, chunk=8)
    assert all(torch.equal(a, b) for a, b in zip(scatter_out, gather_out))
    assert rep.exchange_bytes() == 0 and rep.stats.last_bytes_sent == 0


def test_bytes_are_exact_and_flat_in_the_group_size():
    shapes = [torch.Size([1024, 512])]  # 128 blocks of 64 x 64
    sent = {}
    for world in (2, 4, 8):
        for reduce in ("scatter", "gather"):
            out = exchange(world, shapes, reduce=reduce, **SPARSELOCO)
            for _, rep in out:
                assert rep.stats.last_bytes_sent == rep.stats.last_bytes_received \
                    == rep.exchange_bytes()
            rep = out[0][1]
            sent[world, reduce] = rep.stats.last_bytes_sent
            if reduce == "scatter":  # by hand: per block 64 12-bit indices, 2-bit codes and
                per = -(-128 // world)  # 4 bf16 bin means; parts of ``per`` blocks
                part = 32 + 96 * per + (8 * per + 16 * per)
                reply = part + 24 * world  # and the owner's verdict on every sender
                assert rep.payload_bytes() == world * part + reply
                assert rep.exchange_bytes() == (world - 1) * (part + reply)
    assert sent[8, "scatter"] <= 2 * sent[2, "scatter"]
    assert sent[8, "gather"] == 7 * sent[2, "gather"]
    assert sent[8, "scatter"] < sent[8, "gather"] / 3


# the bad-input cases of both reductions that are not a gather: the reduce-scatter and the
# shared index set (tests/test_sparse_shared.py) reach the gathered path's outcome
BY_OWNERS = pytest.mark.parametrize("reduce", ["scatter", "shared"])


@BY_OWNERS
def test_a_nonfinite_input_raises_on_every_replica_and_undoes_error_feedback(reduce):
    def nan_on_2(r, rep, grads):
        if r == 2:
            grads[1][3, 4] = float("nan")

    out = exchange(4, before=nan_on_2, reduce=reduce, **{**PLAIN, "decay": 0.9})
    for err, _ in out:
        assert isinstance(err, NonFiniteGradientError) and err.ranks == [2] and err.step == 0
    gathered = exchange(4, before=nan_on_2, reduce="gather", **{**PLAIN, "decay": 0.9})
    assert outcome(out) == outcome(gathered)
    for (_, a), (_, b) in zip(out, gathered):  # the momentum as after its update alone
        assert all(torch.equal(x, y) for x, y in zip(a.delta, b.delta))


@BY_OWNERS
def test_a_corrupt_part_names_its_sender_on_every_replica(reduce):
    def corrupt_on_1(r, rep, grads):
        if r != 1:
            return
        encode, calls = rep.codec.encode, []

        def encode_then_break(x, out):  # rank 1 sends a NaN in the part rank 3 owns
            vals = encode(x, out)
            calls.append(1)
            if len(calls) == 4:
                out[:4].view(torch.float32).fill_(float("nan"))
            return vals

        rep.codec.encode = encode_then_break

    out = exchange(4, before=corrupt_on_1, reduce=reduce, **PLAIN)
    for err, _ in out:
        assert isinstance(err, CorruptPayloadError), err
        assert err.rank == 1 and "non-finite value" in str(err)
        if reduce == "scatter":
            assert "corrupt payload from rank 1" in str(err)


@BY_OWNERS
def test_a_payload_for_another_step_raises_as_the_gathered_path(reduce):
    def late_2(r, rep, grads):
        return 1 if r == 2 else 0

    out = exchange(4, before=late_2, reduce=reduce, **PLAIN)
    assert all(isinstance(e, CorruptPayloadError) for e, _ in out)
    if reduce == "scatter":
        assert [e.rank for e, _ in out] == [2, 2, 0, 2]
    assert outcome(out) == outcome(exchange(4, before=late_2, reduce="gather", **PLAIN))


@pytest.mark.parametrize("kwargs, words", [
    ({"overlap": "delayed"}, "overlap='none'"),
    ({"bucket": False}, "needs bucket=True"),
    ({"on_bad_peer": "drop"}, "on_bad_peer='raise'"),
    ({"clip": "median"}, "clip='none'"),
])
def test_settings_that_cannot_scatter_are_refused_in_one_line(kwargs, words):
    with pytest.raises(ValueError, match=words) as e:
        DeMoReplicator(reduce="scatter", **kwargs)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="'gather'"):
        DeMoReplicator(reduce="ring")
    assert "reduce='scatter'" in repr(DeMoReplicator(reduce="scatter", sign=True))


def sim(seed: int = 0) -> SimulatedReplicas:
    torch.manual_seed(seed)
    return SimulatedReplicas(
        tiny_model, loss_fn, replicas=3, replicator="diloco", optimizer="adamw", lr=1e-2,
        seed=seed, replicator_kwargs={"inner_steps": 3, "outer_lr": 1.0, "exchange": "topk",
                                      "exchange_kwargs": {**SPARSELOCO, "reduce": "scatter"}})


def test_diloco_through_it_keeps_replicas_identical_and_resumes_bitwise(tmp_path):
    def run(s, steps):
        for t in steps:
            s.step([batch(r, t) for r in range(3)])

    a = sim()
    run(a, range(3))
    assert a.identical()
    ex = a.optimizers[0].replicators[0].exchanges[0]
    assert ex.reduce == "scatter" and a.bytes_sent == [ex.exchange_bytes()] * 3
    run(a, range(3, 4))
    assert not a.identical()
    torch.save(a.state_dict(), tmp_path / "sim.pt")
    run(a, range(4, 9))
    assert a.identical()
    b = sim(seed=5)
    b.load_state_dict(torch.load(tmp_path / "sim.pt", weights_only=False))
    run(b, range(4, 9))
    for ma, mb in zip(a.models, b.models):
        assert all(torch.equal(p, q) for p, q in zip(ma.parameters(), mb.parameters()))
    assert a.bytes_sent == b.bytes_sent and a.bytes_received == b.bytes_received
