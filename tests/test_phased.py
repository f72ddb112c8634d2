"""PhasedReplicator and the DeMo warm-up: one replicator, then another with its momentum."""

import copy

import pytest
import torch
from torch import nn

import flexdemo
from flexdemo import DeMoReplicator, FullReplicator, PhasedReplicator, SimulatedReplicas
from flexdemo.replicate import demo_warmup

SHAPES = [torch.Size(s) for s in [(64, 64), (40, 70), (9,), (3, 5)]]


def setup(rep):
    rep.setup(SHAPES, torch.device("cpu"), None)
    return rep


def grads_at(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) for s in SHAPES]


def test_warmup_is_the_dense_demo_then_the_sparse_one_with_its_momentum():
    phased = setup(demo_warmup(warmup_topk=8, warmup_steps=2, topk=4, chunk=8))
    dense = setup(DeMoReplicator(topk=8, chunk=8))
    sparse = setup(DeMoReplicator(topk=4, chunk=8))
    assert phased.payload_bytes() == dense.payload_bytes() > sparse.payload_bytes()
    for step in range(5):
        ref = dense if step < 2 else sparse
        if step == 2:  # the hand-over: the sparse phase starts from the dense one's momentum
            for mine, theirs in zip(sparse.delta, dense.delta):
                mine.copy_(theirs)
        lrs = [0.01] * len(SHAPES)
        out = phased(grads_at(step), lrs, step)
        want = ref(grads_at(step), lrs, step)
        assert all(torch.equal(a, b) for a, b in zip(out, want)), step
        assert all(torch.equal(a, b) for a, b in zip(phased.delta, ref.delta)), step
    assert phased.first is None and phased.payload_bytes() == sparse.payload_bytes()


def test_delayed_phases_of_one_setting_are_one_delayed_demo():
    """Overlapped exchanges through the switch: two phases of the same setting give the bits of
    one delayed replicator (the second applies nothing itself at the switch step: the first's
    exchange in flight is applied then, and the momentum carries over)."""
    phased = setup(PhasedReplicator(DeMoReplicator(topk=4, chunk=8, overlap="delayed"),
                                    DeMoReplicator(topk=4, chunk=8, overlap="delayed"), 3))
    one = setup(DeMoReplicator(topk=4, chunk=8, overlap="delayed"))
    lrs = [0.01] * len(SHAPES)
    for step in range(7):
        out, want = phased(grads_at(step), lrs, step), one(grads_at(step), lrs, step)
        assert all(torch.equal(a, b) for a, b in zip(out, want)), step
        assert all(torch.equal(a, b) for a, b in zip(phased.delta, one.delta)), step
    assert phased.first is None


def test_delayed_warmup_applies_the_dense_exchange_at_the_switch():
    phased = setup(demo_warmup(warmup_topk=8, warmup_steps=2, topk=4, chunk=8,
                               overlap="delayed"))
    dense = setup(DeMoReplicator(topk=8, chunk=8, overlap="delayed"))
    sparse = setup(DeMoReplicator(topk=4, chunk=8, overlap="delayed"))
    lrs = [0.01] * len(SHAPES)
    for step in range(6):
        out = phased(grads_at(step), lrs, step)
        if step < 2:
            want = dense(grads_at(step), lrs, step)
        elif step == 2:  # dense's exchange of step 1 is applied; sparse launches step 2's
            for mine, theirs in zip(sparse.delta, dense.delta):
                mine.copy_(theirs)
            want = dense(grads_at(step), lrs, step)
            assert all(not g.any() for g in sparse(grads_at(step), lrs, step))
        else:
            want = sparse(grads_at(step), lrs, step)
        assert all(torch.equal(a, b) for a, b in zip(out, want)), step
        assert any(g.any() for g in out) == (step > 0), step


def test_delayed_switch_hands_the_verdict_on():
    """A bad payload in flight at the switch is left out there and named the step after, by
    the second phase (the first one's verdict is judged a step late)."""
    phased = setup(demo_warmup(warmup_topk=8, warmup_steps=2, topk=4, chunk=8,
                               overlap="delayed"))
    lrs = [0.01] * len(SHAPES)
    for step in range(2):
        phased(grads_at(step), lrs, step)
    first = phased.first
    g = first.groups[0]
    first.inflight.sent.payloads.wait()[0, g.idx_off: g.val_off] = 0  # repeated indices, step 1
    assert all(not o.any() for o in phased(grads_at(2), lrs, 2))  # the switch: left out
    assert phased.first is None
    with pytest.raises(Exception, match="rank 0 .*step 1: repeated index"):
        phased(grads_at(3), lrs, 3)


@pytest.mark.parametrize("overlap,stop", [("none", 1), ("none", 3), ("delayed", 1),
                                          ("delayed", 2), ("delayed", 3)])
def test_state_round_trip_in_either_phase(overlap, stop):
    a = setup(demo_warmup(warmup_topk=8, warmup_steps=2, topk=4, chunk=8, overlap=overlap))
    lrs = [0.01] * len(SHAPES)
    for step in range(stop):
        a(grads_at(step), lrs, step)
    b = setup(demo_warmup(warmup_topk=8, warmup_steps=2, topk=4, chunk=8, overlap=overlap))
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    for step in range(stop, 5):
        out_a, out_b = a(grads_at(step), lrs, step), b(grads_at(step), lrs, step)
        assert all(torch.equal(x, y) for x, y in zip(out_a, out_b)), step


@pytest.mark.parametrize("overlap", ["none", "delayed"])
def test_replicas_stay_identical_through_the_switch(overlap):
    torch.manual_seed(0)

    def model():
        return nn.Sequential(nn.Linear(12, 64), nn.Tanh(), nn.Linear(64, 3))

    def loss_fn(m, b):
        return (m(b[0]) - b[1]).pow(2).mean()

    sim = SimulatedReplicas(model, loss_fn, replicas=2, replicator="demo-warmup",
                            replicator_kwargs={"warmup_topk": 32, "warmup_steps": 3,
                                               "topk": 4, "chunk": 16, "overlap": overlap},
                            optimizer="sgd", lr=0.01, seed=0)
    sent = []
    for step in range(6):
        g = torch.Generator().manual_seed(step)
        sim.step([(torch.randn(8, 12, generator=g), torch.randn(8, 3, generator=g))
                  for _ in range(2)])
        assert sim.identical(), step
        sent.append(sim.bytes_sent[0])
    per_step = [b - a for a, b in zip([0] + sent, sent)]
    assert per_step[0] == per_step[2] > per_step[3] == per_step[5] > 0


def test_bad_settings():
    with pytest.raises(ValueError, match="steps must be"):
        PhasedReplicator(DeMoReplicator(), DeMoReplicator(), -1)
    one = DeMoReplicator()
    with pytest.raises(ValueError, match="two instances"):
        PhasedReplicator(one, one, 3)
    with pytest.raises(ValueError, match="both overlap='delayed' or both overlap='none'"):
        PhasedReplicator(DeMoReplicator(overlap="delayed"), DeMoReplicator(), 3)
    with pytest.raises(ValueError, match="two DeMo phases"):
        PhasedReplicator(FullReplicator(), DeMoReplicator(overlap="delayed"), 3)
    with pytest.raises(ValueError, match="schedule"):
        PhasedReplicator(DeMoReplicator(replicate_every=2), DeMoReplicator(), 3)
    with pytest.raises(TypeError, match="Replicator instance"):
        PhasedReplicator("demo", DeMoReplicator(), 3)
    with pytest.raises(ValueError, match="warmup_topk"):
        demo_warmup(warmup_topk=0)
    with pytest.raises(ValueError, match="other layouts"):
        setup(PhasedReplicator(DeMoReplicator(chunk=8), DeMoReplicator(chunk=16), 2))


def test_by_name_through_the_optimizer():
    m = nn.Linear(8, 8)
    opt = flexdemo.DeToNATION(m.parameters(), "demo-warmup", base="sgd", lr=0.01)
    assert isinstance(opt.replicators[0], PhasedReplicator)
    for _ in range(3):
        m(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
