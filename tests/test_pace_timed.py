"""DiLoCo's timed pace (``pace="timed"``): after the first period each replica ends its period
on its own clock when the period's time is up, and the mean weighs the steps each took.

On a virtual clock (:func:`pace_workers.adaptive_run` with ``mode="timed"``, H = 10): ranks 0
and 1 take 1 s a step, rank 2 3 s. The speeds are gathered after MEASURE_TIMED (4) steps; from
then on a period lasts the fastest replica's H steps, 10 s (the first period's rest counted
from the decision, which every replica leaves together, as 4 s in): ranks 0 and 1 end after
10 steps (another would end 0.5 s past it), rank 2 after 6 in the first period (4 + 2: 4 s +
6 s) and 3 in the others (9 s; a 4th would end 2 s past it, more than half of its 3 s
step)."""

from __future__ import annotations

import pytest
import torch
from dist_util import RankOrder, run_world
from pace_workers import adaptive_run, dense_reference, timed_sharded_worker

from flexdemo import Pace, SimulatedReplicas
from flexdemo.replicate.pace import MEASURE, MEASURE_TIMED, make_pace
from flexdemo.simulate import run_replicas
from flexdemo.transport import InProcessHub

SECONDS = [1.0, 1.0, 3.0]
PERIODS = 4
STEPS = [[10, 10, 6]] + [[10, 10, 3]] * (PERIODS - 1)


def _timed(periods: int = PERIODS, state: list | None = None, seconds=None) -> list[dict]:
    hub = InProcessHub(3, timeout=60)
    secs = seconds or (lambda r, p: SECONDS[r])
    return run_replicas(hub, lambda r: adaptive_run(
        r, 3, RankOrder(hub, r), periods=periods, mode="timed", seconds=secs,
        state=None if state is None else state[r]))


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_timed_settings():
    pace = Pace("timed")
    assert pace.timed and pace.adaptive and pace.given is None and not pace.lockstep
    assert repr(pace).startswith("Pace(counts='timed'")
    assert pace.settings()[-2:] == ("adaptive", "timed") and pace.measure == MEASURE_TIMED
    assert Pace("adaptive").measure == MEASURE
    copied = make_pace(pace, fragments=1, tau=0, keep_unsent=False)
    assert copied is not None and copied.timed
    with pytest.raises(ValueError, match="without counts"):
        Pace([3, 3], timed=True)


def test_periods_end_on_each_clock_and_the_mean_weighs_the_steps_taken():
    """Every replica syncs at the same syncs; the steps each took per period are the clock's
    (gathered: ``steps_done``), the replicas are bitwise identical after each sync, and the
    parameters are the bits of the dense reference with those steps. Bytes: the exchanges',
    one float64 per replica at the early decision, two (seconds and steps) at each sync."""
    out = _timed()
    for o in out:
        assert o["steps_done"] == [sum(p[r] for p in STEPS) for r in range(3)]
        assert [j for j, _, _ in o["after"]] == list(range(1, PERIODS + 1))
        assert o["sent"] == PERIODS * o["payload"] + 2 * 8 + PERIODS * 2 * 16
    assert [o["steps"] for o in out] == [sum(p[r] for p in STEPS) for r in range(3)]
    for j in range(PERIODS):
        for o in out[1:]:
            assert _equal(o["after"][j][2], out[0]["after"][j][2]), j
    ref = dense_reference(STEPS)
    for r in range(3):
        assert _equal(out[r]["params"], ref[r]), r


def test_a_replica_that_slows_down_ends_its_period_on_time():
    """Rank 2 slows from 3 s to 5 s a step in period 3: it ends that period after 2 steps
    (10 s; its last measured 3 s per step allowed a 3rd only until 8.5 s), not after the 3
    its predicted count says, so nobody waits for it; from the next period it is counted at 5 s."""
    out = _timed(seconds=lambda r, p: 5.0 if r == 2 and p >= 3 else SECONDS[r])
    steps = [[10, 10, 6], [10, 10, 3], [10, 10, 2], [10, 10, 2]]
    for o in out:
        assert o["steps_done"] == [sum(p[r] for p in steps) for r in range(3)]
    ref = dense_reference(steps)
    for r in range(3):
        assert _equal(out[r]["params"], ref[r]), r


def test_a_timed_run_resumes_bitwise():
    """Saved after sync 2 and loaded: the period's time and this replica's seconds per step
    come back with the state, and the run continues bitwise as the uninterrupted one."""
    whole = _timed()
    half = _timed(periods=2)
    resumed = _timed(state=[h["state"] for h in half])
    for r in range(3):
        assert _equal(resumed[r]["params"], whole[r]["params"]), r


def test_simulated_replicas_refuse_a_timed_pace():
    sim = SimulatedReplicas(torch.nn.Linear(4, 2), lambda m, x: m(x).square().mean(),
                            replicas=2, replicator="diloco",
                            replicator_kwargs={"inner_steps": 4, "pace": "timed"},
                            optimizer="adamw")
    with pytest.raises(ValueError, match="own clock"):
        sim.step([torch.randn(2, 4), torch.randn(2, 4)])


@pytest.mark.multiprocess
def test_a_timed_pace_refuses_replicas_of_several_ranks():
    """2 gloo ranks, each replica's DiLoCo over a group of 1 rank (as for a replica sharded
    over both): a timed pace would let each rank end the period on its own clock; refused."""
    for out in run_world(timed_sharded_worker, 2):
        assert "one rank per replica" in out and "\n" not in out
