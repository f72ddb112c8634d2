"""DiLoCo's filling pace (``pace="fill"``): the slowest replica takes its count, the others
take steps until it arrives (a one-number all-reduce each replica launches without waiting),
and the mean weighs the steps each took.

Three gloo processes (:func:`pace_workers.fill_worker`, H = 10): each step sleeps 10 ms on
ranks 0 and 1 and 30 ms on rank 2. The first decision (after 4 steps, read on a virtual
clock: 1 s and 3 s a step) gives the counts [9, 9, 3] and the first period's [10, 10, 6];
rank 2, the fewest steps, ends each period after its count, the others after whatever real
time allowed. The assertions are on counted steps, never on seconds."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from dist_util import kill_and_hear, reap, run_world, spawn_ranks
from pace_workers import FILL_H, dense_reference, fill_worker, timed_sharded_worker

from flexdemo import DiLoCoReplicator, Pace, SimulatedReplicas
from flexdemo.replicate.pace import (
    MEASURE_TIMED,
    capped_steps,
    fill_counts,
    make_pace,
    peer_speeds,
    peer_steps,
)
from flexdemo.transport import all_reduce_bytes

PERIODS = 4


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_fill_settings():
    pace = Pace("fill")
    assert pace.fill and pace.adaptive and not pace.timed and pace.given is None
    assert repr(pace).startswith("Pace(counts='fill'")
    assert pace.settings()[-2:] == ("adaptive", "fill") and pace.measure == MEASURE_TIMED
    copied = make_pace(pace, fragments=1, tau=0, keep_unsent=False)
    assert copied is not None and copied.fill
    with pytest.raises(ValueError, match="without counts"):
        Pace([3, 3], fill=True)
    with pytest.raises(ValueError, match="timed or fills"):
        Pace(timed=True, fill=True)
    with pytest.raises(ValueError, match="'fill'"):
        make_pace("filled", fragments=1, tau=0, keep_unsent=False)


def test_fill_counts():
    """The slowest (fewest steps; the lowest rank among equals) takes the most steps whose
    period ends before the fastest's H-th: floor(H x its steps / the most); the others the
    steps that fit in that period, at most H; after a period in which a faster replica
    reached H, at most the given count."""
    assert fill_counts([90, 90, 21], 30) == [30, 30, 7]  # 30 x 21 / 90 = 7.0
    assert fill_counts([88, 90, 20], 30) == [26, 27, 6]  # 6.67: floor; 6 x 88 / 20 = 26.4
    assert fill_counts([40, 40, 40], 10) == [10, 10, 10]  # equal speeds: H, rank 0 binds
    assert fill_counts([90, 90, 21], 30, at_most=5) == [21, 21, 5]  # 5 x 90 / 21 = 21.4
    assert fill_counts([300, 2], 30) == [30, 1]  # at least 1


def test_a_peer_s_steps_are_bounded():
    """What a peer reports as its steps in a period (a gathered float) counts within [1,
    most]: a huge, infinite, negative or NaN figure neither outweighs a period's most steps
    nor stops the sync (the timed pace's bound is 2H, the filling pace's H)."""
    hostile = [float("nan"), float("inf"), -float("inf"), 1e18, -5.0, 0.0, 3.7, 10.0]
    assert peer_steps(hostile, 10) == [1, 10, 1, 10, 1, 1, 3, 10]
    # the steps a capped replica would have taken: within [its steps, 4H]
    assert peer_speeds(hostile, [4] * 8, 40) == [4.0, 40.0, 4.0, 40.0, 4.0, 4.0, 4.0, 10.0]


def test_a_capped_replica_reports_the_steps_it_would_have_taken():
    """A faster replica that reached H = 10 steps 2 s into the period (after 4 taken with the
    others before the clock started at 0.5 s) and waited until 3.5 s: its 6 timed steps took
    1.5 s, so by 3.5 s it would have taken 4 + 6 x 3 / 1.5 = 16; no time measured: its steps."""
    assert capped_steps(10, 4, 0.5, 2.0, 3.5) == 16.0
    assert capped_steps(10, 0, 1.0, 1.0, 2.0) == 10.0  # (no time before the cap)
    assert capped_steps(10, 0, 0.0, 2.0, 1.0) == 10.0  # (a clock that went back)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_faster_replicas_fill_the_slowest_ones_period():
    """Every rank syncs at the same syncs and is bitwise identical after each; the slowest
    replica takes exactly its count in each period (6 in the first, its count in force after
    it), the faster ones more (as many as fit, at most H), and the parameters are the dense
    reference's with the steps each took (gathered at the syncs), to gloo's order of sums.
    Bytes: the exchanges', one float64 per replica at the first decision and at each sync,
    and each replica's arrival (one fp32 all-reduced) per period."""
    out = run_world(fill_worker, 3, PERIODS)
    done = [[0, 0, 0]] + [list(a[1]) for a in out[0]["after"]]
    steps = [[b - a for a, b in zip(x, y)] for x, y in zip(done, done[1:])]
    for o in out:
        assert len(o["after"]) == PERIODS and [list(a[1]) for a in o["after"]] == done[1:]
        assert o["in_force"] == out[0]["in_force"]
    assert [o["steps"] for o in out] == done[-1]
    assert out[0]["in_force"][0] == [10, 10, 6]  # the first decision, on the virtual clock
    for period, force in zip(steps, out[0]["in_force"]):
        binding = min(range(3), key=lambda i: (force[i], i))
        assert binding == 2 and period[2] == force[2], (steps, out[0]["in_force"])
        assert all(1 <= k <= FILL_H for k in period)
    assert sum(s[0] for s in steps) > sum(s[2] for s in steps)  # 3x faster: more steps
    for j in range(PERIODS):
        for o in out[1:]:
            assert _equal(o["after"][j][2], out[0]["after"][j][2]), j
    # gloo sums the three scaled pseudo-gradients in its own order (the reference in rank
    # order): at most 2 roundings of the largest term apart per sync, carried by the outer
    # Nesterov momentum (0.9: at most 10 times) over 4 syncs: 80 fp32 steps at the
    # parameters' scale
    ref = dense_reference(steps)
    eps = torch.finfo(torch.float32).eps
    for r in range(3):
        for a, b in zip(out[r]["params"], ref[r]):
            torch.testing.assert_close(a, b, rtol=0, atol=80 * eps * b.abs().max().item())
    arrival = all_reduce_bytes(1, 4, 3)  # one fp32 all-reduced over 3 ranks
    for o in out:
        assert o["sent"] == (PERIODS * o["payload"] + 2 * 8 + PERIODS * 2 * 16
                             + PERIODS * arrival)


def test_simulated_replicas_refuse_a_filling_pace():
    sim = SimulatedReplicas(torch.nn.Linear(4, 2), lambda m, x: m(x).square().mean(),
                            replicas=2, replicator="diloco",
                            replicator_kwargs={"inner_steps": 4, "pace": "fill"},
                            optimizer="adamw")
    with pytest.raises(ValueError, match="pace='fill'") as info:
        sim.step([torch.randn(2, 4), torch.randn(2, 4)])
    assert "\n" not in str(info.value)


def test_fault_tolerance_refuses_a_filling_pace():
    rep = DiLoCoReplicator(4, pace="fill")
    problem = rep.fault_tolerance_problem()
    assert problem is not None and "pace='adaptive'" in problem and "\n" not in problem


@pytest.mark.multiprocess
def test_a_filling_pace_refuses_replicas_of_several_ranks():
    """2 gloo ranks, each replica's DiLoCo over a group of 1 rank (as for a replica sharded
    over both): the ranks of one replica would see the slowest arrive after different steps;
    refused in one line."""
    for out in run_world(timed_sharded_worker, 2, "fill"):
        assert "one rank per replica" in out and "pace='fill'" in out and "\n" not in out


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
@pytest.mark.parametrize("killed,overlap", [(2, ""), (1, ""), (1, ", tau=1, keep_overlap=true")],
                         ids=["the-slowest", "a-faster-one", "a-faster-one-overlapped"])
def test_a_killed_replica_ends_a_filling_run_naming_it(tmp_path, killed, overlap):
    """`flexdemo train`, three replicas at a filling pace (H=4), rank 2 slowed 3x: a replica
    killed mid-run (the slowest, whose arrival the others are filling for, or a faster one,
    whose arrival the slowest waits for; with each sync overlapped by a step, too) ends the
    run on every survivor with one line naming it, no traceback (a hang guard of 120 s, not
    a speed test)."""
    out = tmp_path / "run"
    procs = spawn_ranks(3, [
        "train", str(ROOT / "configs" / "gpt.toml"), "task.model=tiny",
        "task.corpus_bytes=200000", "train.batch=4", "train.warmup=2", "train.eval_every=4",
        "train.eval_batches=1", "train.tensorboard=false", "train.threads=0",
        "train.progress=false", "strategy.replicator=diloco-avg", "strategy.optimizer=adamw",
        "strategy.lr=1e-3", f"strategy.replicator_kwargs={{inner_steps=4, pace=\"fill\"{overlap}}}",
        "train.steps=4000", "train.slowdown=3.0", "train.slow_ranks=[2]",
        f"train.out={out}"])
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 12):
            assert all(p.poll() is None for p in procs), procs[0].communicate()[0]
            assert time.monotonic() < deadline, "the run made no progress"
            time.sleep(0.05)
        kill_and_hear(procs, killed)
    finally:
        reap(procs)
