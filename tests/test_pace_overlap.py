"""A DiLoCo sync overlapped with the next inner steps (``tau > 0``, ``keep_overlap=True``), with
and without a pace (issue 55): each replica launches its sync at the end of its period,
takes ``tau`` more steps while the exchange is in flight, then applies the outer step and
moves to the new global parameters plus the steps it took since the launch.

In-process replicas run in threads over an :class:`~flexdemo.transport.InProcessHub` whose
all-reduce adds in rank order (:class:`dist_util.RankOrder`), so the written-out reference
(:func:`pace_workers.overlap_reference`) adds alike and the comparisons are bitwise. The gloo
run (three processes sleeping 10/10/30 ms a step, a filling pace) asserts counted steps,
never seconds."""

from __future__ import annotations

import copy

import pytest
import torch
from dist_util import RankOrder, run_world
from pace_workers import (
    FILL_H,
    LR,
    fill_worker,
    loss_of,
    model_fn,
    overlap_delays,
    overlap_reference,
    params,
    train,
)

from flexdemo import DeToNATION, DiLoCoReplicator, Pace, SimulatedReplicas
from flexdemo.replicate.pace import make_pace
from flexdemo.simulate import run_replicas
from flexdemo.transport import InProcessHub, all_reduce_bytes

H, TAU = 5, 2


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _replicator(counts: list[int] | None) -> DiLoCoReplicator:
    return DiLoCoReplicator(H, tau=TAU, keep_overlap=True,
                            pace=None if counts is None else Pace(counts))


def _replica(hub: InProcessHub, r: int, counts: list[int] | None):
    """Replica ``r``'s model, replicator and optimizer over ``hub`` (sums in rank order)."""
    model = model_fn()
    rep = _replicator(counts)
    opt = DeToNATION(model.parameters(), rep, base="adamw", lr=LR, group=RankOrder(hub, r))
    return model, rep, opt


def _run(world: int, counts: list[int] | None, periods: int) -> list[dict]:
    """Every replica after ``periods`` periods (its count of steps each, H without a pace)
    and a settle of the last sync."""
    hub = InProcessHub(world, timeout=60)

    def work(r):
        model, rep, opt = _replica(hub, r, counts)
        train(model, opt, r, periods * (H if counts is None else counts[r]))
        in_flight = bool(rep.pending)
        rep.settle()
        return {"params": params(model), "global": [g.clone() for g in rep.global_params],
                "in_flight": in_flight, "steps": opt.steps}

    return run_replicas(hub, work)


@pytest.mark.parametrize("world,counts", [(2, None), (2, [5, 3]), (3, [4, 5, 3])])
def test_overlapped_syncs_are_the_written_out_reference_bitwise(world, counts):
    """Three periods with each sync applied after each replica's share of TAU steps (TAU
    without a pace; the mean weighted by steps with one): every replica ends at the
    reference's bits, the replicas equal after the last sync is settled."""
    periods = 3
    out = _run(world, counts, periods)
    given = [counts or [H] * world] * periods
    ref = overlap_reference(given, overlap_delays(given, TAU, H))
    for r in range(world):
        assert out[r]["in_flight"], "the last sync was in flight when the loop ended"
        assert _equal(out[r]["params"], ref[r]), r
        assert _equal(out[r]["params"], out[0]["params"]) and _equal(out[r]["global"],
                                                                     out[r]["params"])


def test_a_sync_in_flight_resumes_bitwise():
    """A checkpoint taken while a sync is in flight (right after its launch) stores its
    result and where each replica stood at the launch; a fresh run loaded from it ends at the
    bits of the run that saved it."""
    counts, periods, world = [5, 3], 3, 2
    cut = list(counts)  # right after the first sync's launch: in flight on both

    def whole(hub, r, saved):
        model, rep, opt = _replica(hub, r, counts)
        train(model, opt, r, cut[r])
        assert rep.pending, "a sync in flight at the checkpoint"
        saved[r] = (params(model), copy.deepcopy(opt.state_dict()))
        train(model, opt, r, periods * counts[r] - cut[r])
        rep.settle()
        return params(model)

    def resumed(hub, r, saved):
        model, rep, opt = _replica(hub, r, counts)
        with torch.no_grad():
            for p, q in zip(model.parameters(), saved[r][0]):
                p.copy_(q)
        opt.load_state_dict(saved[r][1])
        assert rep.pending and opt.steps == cut[r]
        train(model, opt, r, periods * counts[r] - cut[r])
        rep.settle()
        return params(model)

    saved: dict[int, tuple] = {}
    hub = InProcessHub(world, timeout=60)
    first = run_replicas(hub, lambda r: whole(hub, r, saved))
    hub = InProcessHub(world, timeout=60)
    again = run_replicas(hub, lambda r: resumed(hub, r, saved))
    for r in range(world):
        assert _equal(first[r], again[r]), r


def test_simulated_replicas_overlap_a_paced_sync():
    """``SimulatedReplicas`` with counts [5, 3] and TAU: each replica steps to its sync, the
    syncs applied TAU of its own steps later; the reference's bits after 3 periods."""
    counts, periods = [5, 3], 3
    sim = SimulatedReplicas(model_fn, lambda m, b: loss_of(m, b[0], b[1]), replicas=2,
                            replicator=_replicator(counts), optimizer="adamw", lr=LR)
    for _ in range(periods * H):
        sim.step([(r, sim.optimizers[r].steps) for r in range(2)])
    assert [o.steps for o in sim.optimizers] == [15, 9]
    for o in sim.optimizers:
        o.replicators[0].settle()
    given = [counts] * periods
    ref = overlap_reference(given, overlap_delays(given, TAU, H))
    for r in range(2):
        assert _equal(params(sim.models[r]), ref[r]), r


def test_overlap_settings_are_checked():
    with pytest.raises(ValueError, match="needs tau > 0 and alpha=0"):
        DiLoCoReplicator(4, keep_overlap=True)
    with pytest.raises(ValueError, match="needs tau > 0 and alpha=0"):
        DiLoCoReplicator(4, tau=1, alpha=0.5, keep_overlap=True)
    with pytest.raises(ValueError, match="needs keep_overlap=True"):
        DiLoCoReplicator(4, tau=1, pace="fill")
    with pytest.raises(ValueError, match="cannot overlap"):
        DiLoCoReplicator(4, tau=1, keep_overlap=True, pace="timed")
    with pytest.raises(ValueError, match="must exceed tau=2"):
        DiLoCoReplicator(4, tau=2, keep_overlap=True, pace=[4, 2])
    problem = DiLoCoReplicator(4, tau=1, keep_overlap=True, pace="adaptive"
                               ).fault_tolerance_problem()
    assert problem is not None and "keep_overlap" in problem and "\n" not in problem
    rep = DiLoCoReplicator(4, tau=1, keep_overlap=True, pace="fill")
    assert "keep_overlap=True" in repr(rep) and rep.pace is not None and rep.pace.overlap == 1


def test_measured_counts_are_at_least_tau_plus_one():
    """A count decided below tau + 1 (a replica far slower) is raised to it: its sync is
    applied before its next launch."""
    pace = make_pace(Pace("adaptive"), fragments=1, tau=3, keep_unsent=False,
                     keep_overlap=True)
    assert pace is not None
    pace.setup(10, 2, 0, torch.device("cpu"))
    pace._set_counts([10, 1])
    assert pace.counts == [10, 4] and pace.changes == [(0, [10, 4])]


@pytest.mark.multiprocess
def test_a_filling_pace_overlaps_its_syncs_on_gloo():
    """Three gloo processes (10/10/30 ms a step), a filling pace with each sync in flight
    over the next TAU of the fastest replica's steps (each replica applies it after its own
    share of them, recorded at the launch): the slowest takes exactly its count in each
    period, the others more than their delay and at most H; the global parameters are
    bitwise the same on every rank at each apply and every replica ends at them (the last
    sync settled); equal to the written-out reference with the steps and delays taken,
    within the fill test's bound (gloo sums in its own order: 2 roundings per sync, carried
    at most 10x by Nesterov 0.9, 4 syncs); bytes exact."""
    periods = 4
    out = run_world(fill_worker, 3, periods, TAU)
    done = [[0, 0, 0]] + [list(a[1]) for a in out[0]["after"]]
    steps = [[b - a for a, b in zip(x, y)] for x, y in zip(done, done[1:])]
    delays = [[o["delays"][j] for o in out] for j in range(periods - 1)]
    for o in out:
        assert [list(a[1]) for a in o["after"]] == done[1:]
        assert o["in_force"] == out[0]["in_force"]
        # applied at its own delay after each launch (the last by settle())
        assert [since for since, _ in o["applied"]] == o["delays"][:periods - 1]
    for j, (period, force) in enumerate(zip(steps, out[0]["in_force"])):
        binding = min(range(3), key=lambda i: (force[i], i))
        assert binding == 2 and period[2] == force[2], (steps, out[0]["in_force"])
        assert all(k <= FILL_H for k in period)
        assert j == 0 or all(k > d for k, d in zip(period, delays[j - 1]))
    # TAU of the fastest replica's H steps, in each replica's own: fewer for the slowest
    assert all(1 <= d[2] <= d[0] <= TAU for d in delays)
    for o in out[1:]:
        for (_, a), (_, b) in zip(o["applied"], out[0]["applied"]):
            assert _equal(a, b)
        assert _equal(o["params"], out[0]["params"]) and _equal(o["global"], o["params"])
    ref = overlap_reference(steps, delays)
    eps = torch.finfo(torch.float32).eps
    for a, b in zip(out[0]["params"], ref[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=80 * eps * b.abs().max().item())
    arrival = all_reduce_bytes(1, 4, 3)
    for o in out:
        assert o["sent"] == (periods * o["payload"] + 2 * 8 + periods * 2 * 16 + periods * arrival)
