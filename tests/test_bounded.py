"""Bounded contributions (flexdemo.replicate.bound): one hostile replica of 2 or 3 scales
everything it encodes by 1e6 (its values; a quantised payload's scales with them) in DeMo, the
dense int4 exchange (gathered and reduce-scatter) and the sparse exchange (gathered with
either mean, by block owners, over shared indices): the honest replicas' loss stays within 2x
of the clean run's, and the clip is counted and named once on stderr. Honest runs keep their
bits with the bound on. In-process replicas (flexdemo.SimulatedReplicas): the same
replicators and bytes as gloo processes."""

from __future__ import annotations

import re

import frontier_util
import pytest
import torch
from frontier_util import loss_fn
from torch import nn

from flexdemo import SimulatedReplicas
from flexdemo.replicate import DeMoReplicator, FullReplicator, make_replicator
from flexdemo.replicate.bound import PeerBound, check_peer_bound

SCALE = 1e6
TEACHER = torch.randn(64, 64, generator=torch.Generator().manual_seed(7)) / 8


def tiny_model() -> nn.Module:
    torch.manual_seed(0)  # every run starts from the same weights
    return frontier_util.tiny_model()


def batch(r: int, step: int):
    g = torch.Generator().manual_seed(1000 * r + step)
    x = torch.randn(16, 64, generator=g)
    return x, torch.tanh(x @ TEACHER)


EVAL = batch(99, 0)
H = {"inner_steps": 5}
# (replicator, its settings, base optimizer, lr)
MULOCO = ("muloco-int4", H, "adamw", 1e-2)  # int4 by reduce-scatter, outer Nesterov 0.7 / 0.6
SPARSE = ("sparseloco-dct", H, "adamw", 1e-2)  # DCT top-64 of 4096, stat2 values, gathered
SMALL_BLOCKS = {"chunk": 16, "topk": 8}  # 16 blocks per weight: every owner owns some
CASES = {
    "demo": ("demo", {}, "sgd", 1e-2),
    "demo-delayed": ("demo", {"overlap": "delayed"}, "sgd", 1e-2),
    "int4-gather": ("muloco-int4", {**H, "exchange_kwargs": {"reduce": "gather"}}, "adamw", 1e-2),
    "int4-scatter": MULOCO,
    "sparse": SPARSE,
    "sparse-senders": ("sparseloco-dct", {**H, "exchange": "topk", "exchange_kwargs": {
        "topk": 64, "chunk": 64, "values": "stat2", "decay": 0.95, "mean": "senders"}},
        "adamw", 1e-2),
    "sparse-scatter": ("sparseloco-dct", {**H, "exchange_kwargs": {"reduce": "scatter",
                                                               **SMALL_BLOCKS}}, "adamw", 1e-2),
    "sparse-shared": ("sparseloco-dct", {**H, "exchange_kwargs": {"reduce": "shared",
                                                              **SMALL_BLOCKS}}, "adamw", 1e-2),
}


def codecs(opt) -> list:
    """The value codecs of an optimizer's exchanges (DiLoCo's, or the replicator's own)."""
    out = []
    for rep in opt.replicators:
        for r in (rep, *rep.inner_replicators()):
            if isinstance(r, (FullReplicator, DeMoReplicator)):
                out.append(r.codec)
    return out


def hostile(codec, only=None) -> None:
    """Make ``codec`` encode its input times 1e6 (what it returns, the values it will be
    decoded to, is scaled back: the sender's own error feedback stays sane); ``only(out)``:
    only into those buffers."""
    encode = codec.encode

    def scaled(x, out, *args):
        if only is not None and not only(out):
            return encode(x, out, *args)
        seen = encode(x * SCALE, out, *args)
        return None if seen is None else seen / SCALE

    codec.encode = scaled


def run(case: str, replicas: int, *, bad: int | None = None, bound=8.0, steps: int = 30,
        only=None) -> SimulatedReplicas:
    """``steps`` steps of ``case`` on ``replicas`` replicas, replica ``bad`` hostile."""
    name, kw, optimizer, lr = CASES[case]
    kw = dict(kw)
    if name == "demo":
        kw["peer_bound"] = bound
    else:
        kw["exchange_kwargs"] = {**kw.get("exchange_kwargs", {}), "peer_bound": bound}
    sim = SimulatedReplicas(tiny_model, loss_fn, replicas=replicas, replicator=name,
                            optimizer=optimizer, lr=lr, seed=0, replicator_kwargs=kw)
    if bad is not None:
        for codec in codecs(sim.optimizers[bad]):
            hostile(codec, only(sim.optimizers[bad]) if only is not None else None)
    for step in range(steps):
        sim.step([batch(r, step) for r in range(replicas)])
    return sim


def eval_loss_of(model: nn.Module) -> float:
    with torch.no_grad():
        return loss_fn(model, EVAL).item()


def eval_loss(sim: SimulatedReplicas, r: int) -> float:
    return eval_loss_of(sim.models[r])


def clipped(sim: SimulatedReplicas) -> list[int]:
    return [s["clipped_contributions"] for s in sim.last_step_stats()]


LINE = re.compile(r"flexdemo: \w+: replica (\d+)'s (contribution|reduced \w+) had norm \S+ at "
                  r"step \d+, \S+x over the bound \(8 x [^)]*\): scaled down to .*; further "
                  r"clips are counted in last_step_stats\(\)\['clipped_contributions'\]")


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_replica_is_clipped(case, replicas, capsys):
    clean = run(case, replicas)
    capsys.readouterr()
    bad = replicas - 1
    sim = run(case, replicas, bad=bad)
    err = capsys.readouterr().err
    honest = range(replicas - 1)
    for r in honest:  # within 2x of the clean run (unbounded: 1e9 and more, or 1.3x DeMo's)
        assert eval_loss(sim, r) < 2 * eval_loss(clean, r), (r, eval_loss(sim, r))
    counts = clipped(sim)
    assert all(counts[r] > 0 for r in honest), counts
    assert clipped(clean) == [0] * replicas
    lines = [m for m in map(LINE.match, err.splitlines()) if m]
    assert any(int(m.group(1)) == bad for m in lines), err
    assert len(lines) <= replicas, err  # once per replica (the hostile one may see itself)
    if replicas == 3 and "scatter" not in case and "shared" not in case:
        # gathered, the median of 3: every replica, the hostile one too, sees the same parts
        # and clips alike (block owners bound a reduced chunk by the receiver's own part)
        assert len({tuple(p.tolist()) for p in (torch.cat([q.flatten() for q in m.parameters()])
                                                 for m in sim.models)}) == 1


@pytest.mark.parametrize("case", ["demo", "int4-gather", "int4-scatter", "sparse"])
def test_without_the_bound_the_hostile_replica_wins(case):
    """The attack of the test above, unbounded: what the bound prevents."""
    clean, sim = run(case, 3), run(case, 3, bad=2, bound=None)
    assert eval_loss(sim, 0) > 1.2 * eval_loss(clean, 0)
    assert clipped(sim) == [0, 0, 0]


@pytest.mark.parametrize("case", ["int4-scatter", "sparse-scatter"])
def test_a_hostile_owner_s_reduced_chunk_is_clipped(case, capsys):
    """Replica 2 sends honest parts but scales the reduced chunk it owns: every other replica
    bounds that chunk by its own part there."""

    def only_the_mean(opt):
        ex = opt.replicators[0].exchanges[0]
        reply = ex._scatter._mean if hasattr(ex, "_scatter") else ex._scattered().reply
        lo, hi = reply.data_ptr(), reply.data_ptr() + reply.numel()
        return lambda out: lo <= out.data_ptr() < hi

    clean = run(case, 3)
    capsys.readouterr()
    sim = run(case, 3, bad=2, only=only_the_mean)
    err = capsys.readouterr().err
    for r in (0, 1):
        assert eval_loss(sim, r) < 2 * eval_loss(clean, r)
        assert clipped(sim)[r] > 0
    assert "replica 2's reduced " in err and "own part's norm there" in err


@pytest.mark.parametrize("case", ["demo", "demo-delayed", "int4-gather", "int4-scatter",
                                  "sparse", "sparse-senders", "sparse-scatter",
                                  "sparse-shared"])
def test_honest_runs_keep_their_bits(case):
    on, off = run(case, 3, steps=12), run(case, 3, bound=None, steps=12)
    for a, b in zip(on.models, off.models):
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q)
    assert clipped(on) == [0, 0, 0]


STEPS_GLOO = 15


@pytest.mark.multiprocess
def test_gloo_processes_clip_as_the_simulation_does():
    """Three gloo processes, replica 2 hostile, MuLoCo's reduce-scatter: the honest ranks
    clip, name it once and end with the in-process simulation's bits."""
    from bounded_workers import hostile_muloco_worker
    from dist_util import run_world

    got = run_world(hostile_muloco_worker, 3, 2)
    sim = run("int4-scatter", 3, bad=2, steps=STEPS_GLOO)
    clean = run("int4-scatter", 3, steps=STEPS_GLOO)
    for r in (0, 1):
        assert got[r]["eval"] < 2 * eval_loss(clean, r)
        assert got[r]["clipped"] == clipped(sim)[r] > 0
        assert len([m for m in map(LINE.match, got[r]["err"].splitlines()) if m]) == 1
        for p, q in zip(got[r]["params"], sim.models[r].parameters()):
            assert torch.equal(p, q)


def test_two_peers_each_against_its_own_norm():
    """With 2 replicas the base is the receiver's own part: the hostile replica's view
    clips nothing, the honest one clips the hostile part (scaled down to its own norm)."""
    bound = PeerBound(8.0, "full")
    assert bound.judge([1.0, 9.0], [0, 1], 0, step=0, transport=None) == {1: 1.0 / 9.0}
    assert bound.judge([1.0, 9.0], [0, 1], 1, step=0, transport=None) == {}
    assert bound.judge([1.0, 7.9], [0, 1], 0, step=0, transport=None) == {}
    assert bound.judge([0.0, 9.0], [0, 1], 0, step=0, transport=None) == {}  # zero base
    three = bound.judge([1.0, 2.0, 17.0], [0, 1, 2], 0, step=0, transport=None)
    assert three == {2: 2.0 / 17.0}  # over 8 x the median: scaled down to the median
    assert bound.clipped == 2
    norms = torch.tensor([1.0, 2.0, 17.0])
    assert bound.factors_on_device(norms, 0).tolist() == pytest.approx([1.0, 1.0, 2.0 / 17.0])
    keep = torch.tensor([True, False, True])  # two kept: the own norm's base
    assert bound.factors_on_device(norms, 0, keep).tolist() == pytest.approx(
        [1.0, 1.0, 1.0 / 17.0])


@pytest.mark.parametrize("bad", [1.0, 0.5, -2, float("nan"), float("inf"), "8", True])
def test_bad_settings_are_one_line(bad):
    for build in (lambda: FullReplicator(values="int4", peer_bound=bad),
                  lambda: DeMoReplicator(peer_bound=bad),
                  lambda: make_replicator("muloco-int4", exchange_kwargs={"peer_bound": bad})):
        with pytest.raises(ValueError, match=r"^peer_bound must be None or False \(off\) or a "
                                             r"number > 1 [^\n]*got") as e:
            build()
        assert "\n" not in str(e.value)


def test_settings_reach_the_exchanges():
    assert check_peer_bound(None) is None and check_peer_bound(False) is None
    assert check_peer_bound(16) == 16.0
    assert FullReplicator(values="int4").bound.multiple == 8.0
    assert FullReplicator().bound.multiple is None  # fp32 sums inside the all-reduce
    assert "peer_bound" not in repr(FullReplicator(values="int4"))
    assert "peer_bound=None" in repr(FullReplicator(values="int4", peer_bound=None))
    assert "peer_bound=16.0" in repr(DeMoReplicator(peer_bound=16))
    muloco = make_replicator("muloco-int4", exchange_kwargs={"peer_bound": 12})
    assert muloco.exchange.bound.multiple == 12.0
    assert make_replicator("sparseloco-dct").exchange.bound.multiple == 8.0
