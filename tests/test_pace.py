"""Replicas of different speeds (issue 55): DiLoCo's ``pace=`` lets each replica sync after its
own number of inner steps, and weighs the mean of the pseudo-gradients by each replica's steps
or tokens.

In-process replicas run in threads over an :class:`~flexdemo.transport.InProcessHub`, each its
own training loop (its own number of steps), as processes would; the fp32 comparisons use an
all-reduce that adds in rank order (:class:`dist_util.RankOrder`) so that a dense reference
can add alike. Tolerances, where the reference computes otherwise: fp32 (unit roundoff
``2**-24``); a weighted mean ``sum_i c_i x_i / n`` against ``sum_i w_i x_i / W`` in float64
rounds ``n + 2`` times per value (the factor, each product, each sum, the division), so it
stays within ``(n + 2) 2**-23`` of ``sum_i |w_i x_i| / W``."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from dist_util import RankOrder, run_as_torchrun, run_world
from pace_workers import (
    CASES,
    LR,
    PERIODS,
    SECONDS,
    FakeClock,
    VirtualClock,
    dense_reference,
    gloo_pace_worker,
    loss_of,
    model_fn,
    paced_run,
    params,
    train,
    weighted_mean,
)
from pace_workers import H as GLOO_H
from torch import nn

from flexdemo import DeToNATION, DiLoCoReplicator, Pace, SimulatedReplicas
from flexdemo.replicate import make_replicator, step_counts
from flexdemo.replicate.pace import first_period
from flexdemo.simulate import run_replicas
from flexdemo.transport import InProcessHub

PRESETS = ["diloco", "diloco-avg", "muloco", "muloco-int4", "sparseloco", "sparseloco-dct"]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------- counts from speeds
@pytest.mark.parametrize("H, slow", [(1, [1, 1]), (4, [3, 1]), (10, [9, 3]), (30, [30, 10])])
def test_counts_from_speeds(H, slow):
    """Speeds 1, 1, 1, 1/3 (seconds per step 1, 1, 1, 3): the slow one takes k = round(H /
    3) steps, the others the period's time k x 3 (H = 4: 3 and 1, every period 3 s, where H
    and 1 would leave the slow replica waiting a quarter of it); one more than 2H times
    slower takes 1 and the fastest H; equal speeds take H."""
    assert step_counts([1.0, 1.0, 1.0, 3.0], H) == [slow[0]] * 3 + [slow[1]]
    assert step_counts([0.5, 0.25], H) == [max(1, round(H / 2)), H]
    assert step_counts([1.0, 1000.0], H) == [H, 1]
    assert step_counts([2.0, 2.0], H) == [H, H]
    # the rounding lands on the fast replica: 9 slow steps of 3.3 s (29.7 s), 30 fast ones
    assert step_counts([1.0, 3.3], 30) == [30, 9]
    assert step_counts([1.0, 3.15], 30) == [32, 10]  # 31.5 s


def test_measured_counts_are_the_same_on_every_rank():
    """``measured_counts``: every rank's seconds per step all-gathered, the same counts back."""
    from flexdemo.replicate import measured_counts

    hub = InProcessHub(3, timeout=30)
    out = run_replicas(hub, lambda r: measured_counts([0.2, 0.1, 0.3][r], 6, hub.transport(r)))
    assert out == [[3, 6, 2]] * 3


def test_counts_and_pace_settings_are_checked():
    with pytest.raises(ValueError, match="seconds per step"):
        step_counts([1.0, 0.0], 4)
    with pytest.raises(ValueError, match="inner_steps"):
        step_counts([1.0], 0)
    with pytest.raises(ValueError, match="integers >= 1"):
        Pace([4, 0])
    with pytest.raises(ValueError, match="weights"):
        Pace(weights="bytes")
    for kw in ({"fragments": 2}, {"keep_unsent": True, "exchange_kwargs": {"values": "int8"}}):
        with pytest.raises(ValueError, match="needs fragments=1 and keep_unsent=False"):
            DiLoCoReplicator(4, pace=[4, 2], **kw)
    with pytest.raises(ValueError, match="'fixed', 'adaptive', 'timed' or 'fill'"):
        DiLoCoReplicator(4, pace="sometimes")
    with pytest.raises(ValueError, match="tolerance"):
        Pace(adaptive=True, tolerance=1.5)
    hub = InProcessHub(2, timeout=30)

    def build(r, pace=(4, 2, 1)):
        DeToNATION(model_fn().parameters(), DiLoCoReplicator(4, pace=list(pace)),
                   group=hub.transport(r))
    with pytest.raises(ValueError, match="name 3 replicas, the group has 2"):
        run_replicas(hub, build)
    with pytest.raises(ValueError, match="reduce='gather' only"):
        run_replicas(hub, lambda r: DeToNATION(
            model_fn().parameters(), make_replicator("sparseloco", pace=[4, 2], exchange_kwargs={
                "reduce": "scatter"}), group=hub.transport(r)))
    with pytest.raises(ValueError, match="other settings"):  # ranks built with other counts
        run_replicas(hub, lambda r: build(r, (4, 2) if r == 0 else (4, 3)))
    assert "pace=" in DiLoCoReplicator(4, pace=[4, 2]).fault_tolerance_problem()


# ---------------------------------------------------------------------- in-process runs
def run_paced(world: int, replicator, counts: list[int], periods: int,
              tokens: list[int] | None = None, rank_order: bool = True,
              base: str = "adamw") -> list[list[torch.Tensor]]:
    """Every replica's parameters after ``periods`` periods of ``counts[r]`` steps of
    ``replicator()``, each replica in its own thread."""
    hub = InProcessHub(world, timeout=60)

    def work(r):
        model = model_fn()
        group = RankOrder(hub, r) if rank_order else hub.transport(r)
        opt = DeToNATION(model.parameters(), replicator(), base=base, lr=LR, group=group)
        train(model, opt, r, periods * counts[r], None if tokens is None else tokens[r])
        return params(model)

    return run_replicas(hub, work)


@pytest.mark.parametrize("world,counts", [(2, [4, 2]), (3, [4, 1, 3])])
def test_unequal_counts_are_the_dense_weighted_reference_bitwise(world, counts):
    """Three periods of DiLoCo (AdamW inner steps, Nesterov outer step) with replicas of
    different counts: every replica ends at the bits of the reference that scales each
    pseudo-gradient by ``w_i n / W`` and sums in rank order, and within fp32 tolerance of
    ``sum_i w_i delta_i / W``."""
    periods = 3
    ours = run_paced(world, lambda: DiLoCoReplicator(4, pace=Pace(counts)), counts, periods)
    ref = dense_reference([counts] * periods)
    for r in range(world):
        assert _equal(ours[r], ref[r]), (r, [(a - b).abs().max().item()
                                            for a, b in zip(ours[r], ref[r])])
    math = dense_reference([counts] * periods, exact=False)
    for a, b in zip(ours[0], math[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    unweighted = dense_reference([counts] * periods, tokens=[1.0 / k for k in counts])
    assert not _equal(ours[0], unweighted[0])  # the weights change the result


@pytest.mark.parametrize("world", [2, 3])
def test_tokens_weigh_the_mean(world):
    """``weights="tokens"``: each replica reports its tokens per step (``opt.count_tokens``);
    the mean is weighted by the tokens since the last sync (all-gathered: 8 bytes per replica
    per sync), bitwise the reference."""
    counts = [4, 2, 3][:world]
    tokens = [100, 300, 50][:world]
    periods = 2
    ours = run_paced(world, lambda: DiLoCoReplicator(4, pace=Pace(counts, weights="tokens")),
                     counts, periods, tokens)
    ref = dense_reference([counts] * periods, tokens=tokens)
    for r in range(world):
        assert _equal(ours[r], ref[r])


@pytest.mark.parametrize("world", [2, 3])
def test_the_weighted_mean_is_within_fp32_of_the_exact_one(world):
    """One mean of random tensors: ``sum_i c_i x_i / n`` (fp32, what the fp32 exchange
    computes) within ``(n + 2) 2**-23 sum_i |w_i x_i| / W`` of ``sum_i w_i x_i / W``."""
    g = torch.Generator().manual_seed(world)
    xs = [[torch.randn(1000, generator=g) * (r + 1)] for r in range(world)]
    w = [7.0, 1.0, 3.0][:world]
    got = weighted_mean(xs, w, exact=True)[0]
    want = sum(wi * x[0].double() for wi, x in zip(w, xs)) / sum(w)
    bound = (world + 2) * 2.0 ** -23 * sum(wi * x[0].double().abs()
                                            for wi, x in zip(w, xs)) / sum(w)
    assert bool(((got.double() - want).abs() <= bound).all())


def simulated(world: int, replicator_of, periods: int) -> SimulatedReplicas:
    """``SimulatedReplicas`` of ``world`` replicas, replica ``r`` with ``replicator_of(r)``
    (AdamW inner steps), stepped until ``periods`` syncs, each replica on its own batches
    (those of :func:`pace_workers.train`)."""
    sim = SimulatedReplicas(
        model_fn, lambda m, b: loss_of(m, b[0], b[1]), replicas=world,
        optimizer_fn=lambda ps, g: DeToNATION(ps, replicator_of(g.rank), base="adamw", lr=LR,
                                              group=g))
    pace = sim.optimizers[0].replicators[0].pace
    while pace.synced < periods:
        sim.step([(r, sim.optimizers[r].steps) for r in range(world)])
    return sim


def test_simulated_replicas_step_each_replica_to_its_sync():
    """``SimulatedReplicas`` with counts [4, 4, 2]: a step advances the replicas with steps
    left before their sync (the slow one waits with its sync left), then all sync together;
    after 3 periods bitwise the replicas run in threads, each its own loop (the same ring-order
    all-reduce), and within fp32 tolerance of the dense weighted reference."""
    counts, periods = [4, 4, 2], 3
    sim = SimulatedReplicas(model_fn, lambda m, b: loss_of(m, b[0], b[1]), replicas=3,
                            replicator=DiLoCoReplicator(4, pace=Pace(counts)),
                            optimizer="adamw", lr=LR)
    seen = []
    for _ in range(periods * 4):
        seen.append(sim.stepping())
        losses = sim.step([(r, sim.optimizers[r].steps) for r in range(3)])
        assert len(losses) == 3 and bool(torch.stack(losses).isfinite().all())
    assert seen[:4] == [[True] * 3, [True, True, False], [True, True, False], [True] * 3]
    assert [o.steps for o in sim.optimizers] == [12, 12, 6] and sim.identical()
    threads = run_paced(3, lambda: DiLoCoReplicator(4, pace=Pace(counts)), counts, periods,
                        rank_order=False)
    for r in range(3):
        assert _equal(params(sim.models[r]), threads[r]), r
    ref = dense_reference([counts] * periods, exact=False)
    for a, b in zip(params(sim.models[0]), ref[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_simulated_replicas_without_a_pace_step_in_lockstep():
    """Equal counts (and no pace) step every replica every time: the bits as before."""
    out = []
    for pace in (None, Pace([2, 2])):
        sim = SimulatedReplicas(model_fn, lambda m, b: loss_of(m, b[0], b[1]), replicas=2,
                                replicator=DiLoCoReplicator(2, pace=pace), optimizer="adamw",
                                lr=LR)
        for s in range(4):
            assert sim.stepping() == [True, True]
            sim.step([(0, s), (1, s)])
        assert sim.identical()
        out.append(params(sim.models[0]))
    assert _equal(out[0], out[1])


def _select(e: torch.Tensor) -> torch.Tensor:
    """SparseLoCo's selection (as tests/test_parity.py's reference): chunks whose sides are the
    largest divisors up to 64 of the tensor's, the top ``round(64 * chunk / 4096)`` (at least
    1) of each by magnitude; a 0/1 mask."""
    def side(d: int) -> int:
        return max(c for c in range(1, min(d, 64) + 1) if d % c == 0)
    m = e.reshape(1, -1) if e.dim() == 1 else e.reshape(e.shape[0], -1)
    rows, cols = m.shape
    cr, cc = (1 if e.dim() == 1 else side(rows)), side(cols)
    k = max(1, round(64 * cr * cc / 4096))
    chunks = m.reshape(rows // cr, cr, cols // cc, cc).permute(0, 2, 1, 3).reshape(-1, cr * cc)
    mask = torch.zeros_like(chunks).scatter_(1, chunks.abs().topk(k, dim=1).indices, 1.0)
    return mask.reshape(rows // cr, cols // cc, cr, cc).permute(0, 2, 1, 3).reshape(e.shape)


@pytest.mark.parametrize("world", [2, 3])
def test_the_weighted_mean_over_senders_is_the_dense_one(world):
    """SparseLoCo's mean over the senders with inputs scaled by ``c_i`` (what DiLoCo's pace
    does) and :attr:`peer_scales` set: each coordinate is ``sum_i c_i x_i / sum_i c_i`` over
    the replicas that sent it, bitwise a dense reference summing in rank order; a coordinate
    only a light replica sent is its value, not diluted (no division by 1)."""
    from flexdemo import DeMoReplicator

    shapes = [torch.Size(s) for s in [(128, 64), (100, 128), (100,)]]
    hub = InProcessHub(world, timeout=30)
    common = [torch.randn(s, generator=torch.Generator().manual_seed(i))
              for i, s in enumerate(shapes)]
    xs = [[c + torch.randn(c.shape, generator=torch.Generator().manual_seed(9 + 10 * r + i))
           for i, c in enumerate(common)] for r in range(world)]
    w = [5.0, 1.0, 2.0][:world]
    scales = torch.tensor([wi * world / sum(w) for wi in w], dtype=torch.float64).float()

    def work(r):
        rep = DeMoReplicator(topk=64, chunk=64, chunking="divisor", small="separate",
                             transform="none", values="fp32", decay=0.0, sign=False,
                             scale_by_lr=False, mean="senders")
        rep.setup(shapes, torch.device("cpu"), hub.transport(r))
        rep.peer_scales = scales
        return [t.clone() for t in rep([x * scales[r] for x in xs[r]], [1.0] * 3, 0)]

    out = run_replicas(hub, work)
    light = False
    for i in range(len(shapes)):
        total, count = torch.zeros(shapes[i]), torch.zeros(shapes[i])
        for r in range(world):
            mask = _select(xs[r][i])
            total += xs[r][i] * scales[r] * mask
            count += mask * scales[r]
        want = total / torch.where(count == 0, 1.0, count)
        light |= bool(((count > 0) & (count < 1)).any())
        for r in range(world):
            assert torch.equal(out[r][i], want), (i, r)
    assert light  # some coordinate only a replica of weight below the mean sent


# ---------------------------------------------------------------------- every preset
@pytest.mark.parametrize("name", PRESETS)
def test_equal_weights_are_todays_bits(name):
    """Equal counts (weights by steps: nothing scaled, nothing exchanged) and equal reported
    tokens (factors exactly 1) give the bits of the preset without a pace, on 2 replicas,
    over two syncs (error feedback carried through one)."""
    H, periods = 2, 2
    counts = [H, H]
    plain = run_paced(2, lambda: make_replicator(name, inner_steps=H), counts, periods,
                      rank_order=False)
    steps = run_paced(2, lambda: make_replicator(name, inner_steps=H, pace=Pace(counts)),
                      counts, periods, rank_order=False)
    tokens = run_paced(2, lambda: make_replicator(
        name, inner_steps=H, pace=Pace(counts, weights="tokens")), counts, periods,
        tokens=[64, 64], rank_order=False)
    for r in range(2):
        assert _equal(plain[r], steps[r]) and _equal(plain[r], tokens[r]), (name, r)
    assert not _equal(plain[0], params(model_fn()))  # it trained


class _Linear(nn.Module):
    """One 64 x 64 matrix whose loss ``(P * G).sum()`` has the gradient ``G``: with SGD at lr
    1, ``k`` steps move a replica by exactly ``-k G``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(64, 64))


_V = torch.randn(64, 64, generator=torch.Generator().manual_seed(5))


def _pulled_mean(name: str, tokens: list[int]) -> torch.Tensor:
    """The mean of the pseudo-gradients of 2 replicas, one moving by ``+2 V`` and one by
    ``-2 V`` in a period of 2 steps, weighed by ``tokens`` (plain averaging outer step: the
    global parameters move by minus the mean)."""
    hub = InProcessHub(2, timeout=60)

    def work(r):
        model = _Linear()
        rep = make_replicator(name, inner_steps=2, outer_lr=1.0, outer_momentum=0.0,
                              pace=Pace([2, 2], weights="tokens"))
        opt = DeToNATION(model.parameters(), rep, base="sgd", lr=1.0, group=hub.transport(r))
        grad = _V if r == 0 else -_V
        for _ in range(2):
            (model.weight * grad).sum().backward()
            opt.count_tokens(tokens[r])
            opt.step()
            opt.zero_grad()
        return model.weight.detach().clone()

    out = run_replicas(hub, work)
    assert torch.equal(out[0], out[1])
    return -out[0]  # P0 = 0: the global parameters moved by minus the mean


@pytest.mark.parametrize("name", PRESETS)
def test_weights_pull_the_mean_toward_the_heavier_replica(name):
    """Replicas moving by ``+2 V`` and ``-2 V``: with tokens 3 : 1 the weighted mean is ``+V``
    (the fp32 exchanges to rounding), with 1 : 3 ``-V``, with 1 : 1 zero; the compressed
    exchanges keep that direction, measured as the projection on ``V`` of what they send."""
    proj = {}
    for label, tokens in (("first", [3, 1]), ("equal", [1, 1]), ("second", [1, 3])):
        mean = _pulled_mean(name, tokens)
        proj[label] = float((mean * _V).sum() / (_V * _V).sum())
        if name.startswith("diloco"):
            want = {"first": 1.0, "equal": 0.0, "second": -1.0}[label] * _V
            torch.testing.assert_close(mean, want, rtol=0, atol=1e-5)
    assert proj["first"] > 0 > proj["second"], (name, proj)
    assert proj["first"] > proj["equal"] + 0.5 * proj["first"], (name, proj)
    assert proj["second"] < proj["equal"] + 0.5 * proj["second"], (name, proj)


# ---------------------------------------------------------------------- fixed mode, resume
def _fixed(r: int) -> DiLoCoReplicator:
    return DiLoCoReplicator(4, pace=Pace(clock=FakeClock([1.0, 1.0, 3.0][r])))


def test_fixed_mode_measures_then_resumes_bitwise():
    """Fixed mode on 3 replicas (the third 3x slower on its clock): the first period takes 4
    steps everywhere and measures, then counts [3, 3, 1] (a period of 3 s everywhere). Saved
    at a sync boundary (after 2 periods), rebuilt, loaded (nothing measured again) and run 2
    more periods: bitwise the uninterrupted 4 periods, the dense reference's bits too."""
    world = 3
    hub = InProcessHub(world, timeout=60)

    def first(r, periods):
        model = model_fn()
        opt = DeToNATION(model.parameters(), _fixed(r), base="adamw", lr=LR,
                         group=RankOrder(hub, r))
        train(model, opt, r, 4)
        counts = opt.replicators[0].pace.counts
        train(model, opt, r, (periods - 1) * counts[r])
        return (params(model), counts, copy.deepcopy(model.state_dict()),
                copy.deepcopy(opt.state_dict()))

    whole = run_replicas(hub, lambda r: first(r, 4))
    half = run_replicas(hub, lambda r: first(r, 2))
    counts = whole[0][1]
    assert counts == [3, 3, 1] and all(w[1] == counts for w in whole)

    def resumed(r):
        model = model_fn()
        rep = DiLoCoReplicator(4, pace=Pace(clock=lambda: 1 / 0))  # never read
        opt = DeToNATION(model.parameters(), rep, base="adamw", lr=LR,
                         group=RankOrder(hub, r))
        model.load_state_dict(half[r][2])
        opt.load_state_dict(half[r][3])
        assert rep.pace.counts == counts and rep.pace.since == 0
        train(model, opt, r, 2 * counts[r])
        return params(model)

    again = run_replicas(hub, resumed)
    ref = dense_reference([[4, 4, 4]] + [counts] * 3)
    for r in range(world):
        assert _equal(again[r], whole[r][0]), r
        assert _equal(whole[r][0], ref[r]), r
        assert _equal(whole[r][0], whole[0][0])  # identical after the last sync


def test_a_measurement_cut_short_is_timed_from_the_resume():
    """A whole-period measurement (H at most ``measure``) loaded in the middle of the first
    period: each replica times the steps after its first one since the resume, and the counts
    are decided at the sync from those."""
    hub = InProcessHub(2, timeout=60)

    def work(r):
        model = model_fn()
        clock = VirtualClock()
        rep = DiLoCoReplicator(4, pace=Pace(clock=clock))
        opt = DeToNATION(model.parameters(), rep, base="adamw", lr=LR, group=hub.transport(r))
        for step in range(4):
            if step == 1:
                opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # the timing restarts
            clock.now += [1.0, 2.0][r] * (10 if step == 0 else 1)  # its first step is slow
            train(model, opt, r, 1)
        return rep.pace.counts, rep.pace.changes

    for counts, changes in run_replicas(hub, work):
        assert counts == [4, 2] and changes == [(1, [4, 2])]


def test_first_period_steps():
    """After ``measure`` steps everywhere, the rest of the first period takes the fastest
    replica's ``H - measure`` steps of time on every replica, at least one step each."""
    assert first_period([1.0, 1.0, 3.0], 12, 4) == [12, 12, 4 + 3]
    assert first_period([1.0, 2.0], 30, 8) == [30, 8 + 11]
    assert first_period([1.0, 100.0], 30, 8) == [30, 9]  # one step at least, then its sync
    assert first_period([1.0, 1.0], 30, 8) == [30, 30]


def test_fixed_mode_decides_after_measure_steps_and_refines_at_the_first_sync():
    """H = 12, ``measure=4``, on a virtual clock: replica 2 three times slower throughout,
    replica 0 twice as slow in its first 4 steps only (a start-up). The counts [6, 12, 4] are
    decided after every replica's 4th step (the median of steps 2 to 4), the first period then
    takes [4 + 4, 12, 4 + 3] steps, and at the first sync the steps after the decision give
    [12, 12, 4], fixed from then on: two all-gathers of 8 bytes per replica. The run is the
    dense reference of those periods bitwise, and resumes bitwise from a checkpoint taken in
    the middle of the first period (the refinement timed from the first step after the
    resume); with ``measure >= H`` the whole first period is timed and decided at its sync."""
    world, h = 3, 12

    def seconds(r: int, step: int) -> float:
        return 2.0 if r == 0 and step < 4 else SECONDS[r]

    def run(r, steps, state=None, measure=4):
        model = model_fn()
        clock = VirtualClock()
        rep = DiLoCoReplicator(h, pace=Pace(measure=measure, clock=clock))
        opt = DeToNATION(model.parameters(), rep, base="adamw", lr=LR, group=RankOrder(hub, r))
        if state is not None:
            model.load_state_dict(state[0])
            opt.load_state_dict(state[1])
        seen = []
        for _ in range(steps[r]):
            clock.now += seconds(r, opt.steps)  # this step's forward and backward
            train(model, opt, r, 1)
            seen.append((rep.pace.counts, rep.pace.period, rep.syncs[0]))
        return (params(model), seen, opt.bytes_sent, rep.exchange_bytes(), rep.pace.changes,
                (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())))

    hub = InProcessHub(world, timeout=60)
    periods = [[8, 12, 7], [12, 12, 4], [12, 12, 4]]
    totals = [sum(p[r] for p in periods) for r in range(world)]
    whole = run_replicas(hub, lambda r: run(r, totals))
    for r in range(world):
        _, seen, sent, payload, changes, _ = whole[r]
        assert seen[2][0] is None and seen[3][:2] == ([6, 12, 4], [8, 12, 7])
        assert changes == [(0, [6, 12, 4]), (1, [12, 12, 4])]
        assert seen[-1][2] == 3 and sent == 3 * payload + 2 * 2 * 8
    ref = dense_reference(periods)
    for r in range(world):
        assert _equal(whole[r][0], ref[r]), r
    # a checkpoint after the decision, in the middle of the first period (step 5 of each)
    half = run_replicas(hub, lambda r: run(r, [5] * world))
    rest = run_replicas(hub, lambda r: run(r, [t - 5 for t in totals], half[r][5]))
    for r in range(world):
        assert _equal(rest[r][0], whole[r][0]), r
        assert rest[r][4] == whole[r][4]
    # measure >= H: the whole first period is timed (steps 2 to 12), the counts decided at
    # its sync; replica 0's start-up is in its mean: 14 s over 11 steps, 12 x 11 / 14 = 9.4
    late = run_replicas(hub, lambda r: run(r, [h] * world, measure=h))
    assert all(o[1][h - 2][0] is None and o[1][h - 1][0] == [9, 12, 4] for o in late)


def test_fixed_mode_keeps_h_for_speeds_within_the_tolerance():
    """Replicas 5% apart (a count of 29 of 30, within 10% of it): a measured pace keeps H at
    both decisions, nothing is recorded, and the run is DiLoCo without a pace bit for bit
    (the two all-gathers of 8 bytes per replica are its only cost)."""
    h, world = 30, 2
    hub = InProcessHub(world, timeout=60)

    def work(r, pace):
        model = model_fn()
        clock = VirtualClock()
        rep = DiLoCoReplicator(h, pace=Pace(clock=clock) if pace else None)
        opt = DeToNATION(model.parameters(), rep, base="adamw", lr=LR, group=RankOrder(hub, r))
        for _ in range(2 * h):
            clock.now += [1.0, 1.05][r]
            train(model, opt, r, 1)
        return params(model), opt.bytes_sent, None if rep.pace is None else rep.pace.changes

    paced = run_replicas(hub, lambda r: work(r, True))
    plain = run_replicas(hub, lambda r: work(r, False))
    for r in range(world):
        assert paced[r][2] == [] and _equal(paced[r][0], plain[r][0]), r
        assert paced[r][1] == plain[r][1] + 2 * 8


def test_an_early_measurement_cut_short_times_the_rest_of_the_period():
    """Loaded before the decision (the measurement restarts): the replicas time the rest of
    the period and decide at its sync instead."""
    hub = InProcessHub(2, timeout=60)

    def work(r):
        model = model_fn()
        rep = DiLoCoReplicator(8, pace=Pace(measure=4, clock=FakeClock([1.0, 2.0][r])))
        opt = DeToNATION(model.parameters(), rep, base="adamw", lr=LR, group=hub.transport(r))
        train(model, opt, r, 2)
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # the measurement restarts
        train(model, opt, r, 2)
        at_decision = rep.pace.counts
        train(model, opt, r, 4)
        return at_decision, rep.pace.counts, rep.pace.changes

    for at_decision, after_sync, changes in run_replicas(hub, work):
        assert at_decision is None and after_sync == [8, 4] and changes == [(1, [8, 4])]


# ---------------------------------------------------------------------- gloo processes
@pytest.mark.multiprocess
def test_three_gloo_processes_of_different_speeds(one_thread):
    """3 gloo processes in fixed mode, rank 2 three times slower on its clock: counts
    [6, 6, 2] measured in the first period; 18, 18 and 10 steps. Every rank ends bitwise
    identical after the last sync, bitwise the same replicas in one process (all-reduce in
    gloo's ring order), and within fp32 tolerance of the dense weighted reference (fp32
    exchange) or of int4's rounding (int4 reduce-scatter, weighted by reported tokens)."""
    results = run_world(gloo_pace_worker, 3, timeout=120)
    for name, (kw, weights, tokens) in CASES.items():
        got = [res[name] for res in results]
        assert all(g["counts"] == [6, 6, 2] for g in got), name
        assert [g["steps"] for g in got] == [18, 18, 10], name
        for g in got[1:]:
            assert _equal(g["params"], got[0]["params"]), name
        hub = InProcessHub(3, timeout=60)
        local = run_replicas(hub, lambda r, hub=hub, kw=kw, weights=weights, tokens=tokens:
                             paced_run(r, 3, hub.transport(r), kw, weights,
                                       None if tokens is None else tokens[r]))
        for r in range(3):
            assert _equal(local[r]["params"], got[r]["params"]), (name, r)
            assert local[r]["sent"] == got[r]["sent"], (name, r)
        if name == "fp32":  # one process, the replicas stepped to their syncs in turn
            sim = simulated(3, lambda r: DiLoCoReplicator(
                GLOO_H, pace=Pace(clock=FakeClock(SECONDS[r]))), PERIODS)
            assert [o.steps for o in sim.optimizers] == [18, 18, 10]
            for r in range(3):
                assert _equal(params(sim.models[r]), got[r]["params"]), r
        ref = dense_reference([[6, 6, 6]] + [[6, 6, 2]] * (PERIODS - 1), tokens=tokens,
                              exact=False)
        tol = 1e-5 if kw is None else 2e-2  # int4: a step of 1/7 of a block's largest value
        for a, b in zip(got[0]["params"], ref[0]):
            torch.testing.assert_close(a, b, rtol=0, atol=tol)
        # the seconds per step, all-gathered once; the tokens at every sync
        extra = 2 * 8 + (0 if weights == "steps" else PERIODS * 2 * 8)
        assert got[0]["sent"] == PERIODS * got[0]["payload"] + extra, name
    assert SECONDS[2] == 3 * SECONDS[0]


@pytest.mark.multiprocess
def test_the_docs_example_runs_on_two_processes(tmp_path):
    """docs/diloco.md's example, as written, on 2 ranks (torchrun's variables): rank 0 takes
    12 steps and rank 1 6 in three syncs, both with counts [4, 2]."""
    from test_docs import ROOT, snippets

    text = (ROOT / "docs" / "diloco.md").read_text()
    found = [s for s in snippets(ROOT / "docs" / "diloco.md")
             if s.mode == "torchrun" and "Pace(" in s.code]
    assert len(found) == 1 and "## Replicas of different speeds" in text
    script = tmp_path / "pace.py"
    script.write_text(found[0].code)
    outs = run_as_torchrun(script, 2, tmp_path)
    for out, steps in zip(outs, (12, 6)):
        assert re.search(rf"^{steps} \[4, 2\] \d+$", out, re.M), out


@pytest.mark.multiprocess
def test_a_sharded_replica_takes_one_pace(one_thread):
    """2 replicas of 2 ranks each (a replica sharded as FSDP shards it): one rank of replica 1
    is 3x slower, which only its own replicate group sees. Every rank of the job takes the
    replica's slowest rank's speed (counts [6, 2] everywhere, so a replica's ranks step alike)
    and the replica's summed tokens as its weight (the same factors on all four ranks)."""
    from pace_workers import sharded_pace_worker

    results = run_world(sharded_pace_worker, 4, timeout=120)
    assert [r["counts"] for r in results] == [[6, 2]] * 4
    assert [r["steps"] for r in results] == [6 + 6 + 6, 6 + 6 + 6, 6 + 2 + 2, 6 + 2 + 2]
    assert all(r["factors"] == results[0]["factors"] for r in results)
    # tokens per period: replica 0 (10 + 30) x its steps, replica 1 (20 + 20) x its steps
    last = results[0]["factors"][-1]
    w = [40 * 6, 40 * 2]
    assert last == pytest.approx([2 * w[0] / sum(w), 2 * w[1] / sum(w)], rel=1e-6)
