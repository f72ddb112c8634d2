"""DiLoCo's adaptive pace (issue 55): the speeds measured at every sync on a virtual clock,
the counts changed past a tolerance, every rank alike at the same sync.

The replicas run :func:`pace_workers.adaptive_run`: H = 10, tolerance 0.15, rank 1 10% slower
throughout (a count of 9: one step off its 10, within the bound of 15% of 9: alone it changes
nothing), rank 2 three times slower in periods 3 and 4. The counts change at sync 3 to
[9, 8, 3] (the new counts of every replica taken together: the period is the slow replica's
3 steps of 3 s) and back at sync 5 to [10, 9, 10]. The clock is advanced by the training
loop only (no real time is read, nothing is timed)."""

from __future__ import annotations

import pytest
import torch
from dist_util import RankOrder, run_world
from pace_workers import (
    ADAPTIVE_COUNTS,
    ADAPTIVE_H,
    ADAPTIVE_PERIODS,
    LR,
    adaptive_run,
    dense_reference,
    gloo_adaptive_worker,
    loss_of,
    model_fn,
    params,
)

from flexdemo import DeToNATION, DiLoCoReplicator, Pace
from flexdemo.replicate import adapted_counts
from flexdemo.replicate.pace import MEASURE, make_pace
from flexdemo.simulate import run_replicas
from flexdemo.transport import InProcessHub

CHANGES = [(3, [9, 8, 3]), (5, [10, 9, 10])]
STEPS = [sum(c[r] for c in ADAPTIVE_COUNTS) for r in range(3)]  # 58, 55, 46


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------- the decision
def test_hysteresis_changes_the_counts_past_the_bound_only():
    """The counts change when some replica's new count ``k`` differs from its current one by
    more than ``tolerance * k`` (its share of the period's time); then every count takes its
    new value."""
    H = 100
    assert adapted_counts([100, 100], [1.0, 1.08], H, 0.1) is None  # 93: 7 <= 9.3
    assert adapted_counts([100, 100], [1.0, 1.2], H, 0.1) == [100, 83]  # 17 > 8.3
    assert adapted_counts([100, 83], [1.0, 1.1], H, 0.1) is None  # 91: 8 <= 9.1
    assert adapted_counts([100, 83], [1.0, 1.0], H, 0.1) == [100, 100]  # recovered
    assert adapted_counts([100, 100, 50], [1.0, 1.05, 1.0], H, 0.1) == [100, 95, 100]
    assert adapted_counts([10, 10], [1.0, 1.1], 10, 0.0) == [10, 9]  # tolerance 0: any change
    assert adapted_counts([10, 10], [1.0, 1.1], 10, 0.15) is None  # 1 step is not > 1.35
    # relative to the replica's own count: 2 steps off a slow replica's 8 are 25% of the
    # period's time (a bound of 10% of H, 3 steps, would keep them); 1 off 29 is 3.4%
    assert adapted_counts([30, 10], [1.0, 3.9], 30, 0.1) == [31, 8]  # 2 > 0.8
    assert adapted_counts([30, 30], [1.0, 1.05], 30, 0.1) is None  # 29: 1 <= 2.9


def test_adaptive_settings():
    pace = Pace("adaptive")
    assert pace.adaptive and pace.given is None and pace.tolerance == 0.1
    assert repr(pace) == "Pace(counts='adaptive', weights='steps', tolerance=0.1)"
    assert not Pace([4, 4], adaptive=True).lockstep and Pace([4, 4]).lockstep
    assert "adaptive=True" in repr(Pace([4, 2], adaptive=True))
    assert Pace("fixed").settings() == Pace().settings() == (
        "counts", None, "weights", "steps", "measure", MEASURE, "tolerance", 0.1)
    assert Pace(adaptive=True, tolerance=0.2).settings()[-3:] == ("tolerance", 0.2, "adaptive")
    assert Pace([4, 2]).settings() == ("counts", [4, 2], "weights", "steps")
    assert repr(Pace()) == "Pace(counts='fixed', weights='steps', tolerance=0.1)"
    copied = make_pace(Pace(adaptive=True, tolerance=0.3), fragments=1, tau=0,
                       keep_unsent=False)
    assert copied is not None and copied.adaptive and copied.tolerance == 0.3
    assert DiLoCoReplicator(4, pace="adaptive").pace.adaptive
    for bad in (-0.1, 1.0, True, "0.1"):
        with pytest.raises(ValueError, match="tolerance"):
            Pace(adaptive=True, tolerance=bad)


# ---------------------------------------------------------------------- in-process runs
def _adaptive(world: int = 3, rank_order: bool = True, **kw) -> list[dict]:
    hub = InProcessHub(world, timeout=60)
    return run_replicas(hub, lambda r: adaptive_run(
        r, world, RankOrder(hub, r) if rank_order else hub.transport(r), **kw))


def _check_run(out: list[dict]) -> None:
    """Every rank changed its counts at the same syncs to the same counts, the replicas were
    bitwise identical after every sync, and the bytes are the exchanges' plus one float64
    per replica and sync, and one more in the first period (its early decision, after
    MEASURE of its H = 10 steps)."""
    assert [o["steps"] for o in out] == STEPS
    for o in out:
        assert o["changes"] == CHANGES
        assert [(j, k) for j, k, _ in o["after"]] == [
            (j, ADAPTIVE_COUNTS[j] if j < ADAPTIVE_PERIODS else [10, 9, 10])
            for j in range(1, ADAPTIVE_PERIODS + 1)]
        assert MEASURE < ADAPTIVE_H
        assert o["sent"] == ADAPTIVE_PERIODS * (o["payload"] + 2 * 8) + 2 * 8
    for j in range(ADAPTIVE_PERIODS):
        for o in out[1:]:
            assert _equal(o["after"][j][2], out[0]["after"][j][2]), j


def test_adaptive_counts_change_alike_and_are_the_dense_reference():
    """3 replicas in threads: the counts change at syncs 3 and 5 on every rank; the replicas
    are bitwise identical after each sync and end at the bits of the dense weighted
    reference run with the counts of each period."""
    out = _adaptive()
    _check_run(out)
    ref = dense_reference(ADAPTIVE_COUNTS)
    for r in range(3):
        assert _equal(out[r]["params"], ref[r]), r


def test_adaptive_resumes_with_the_counts_in_force():
    """Saved after sync 4 (counts [9, 8, 3] in force), rebuilt and loaded: the counts, the
    syncs and the changes come back, and the run continues bitwise as the uninterrupted one
    (the first period after the resume is timed from the end of its first step)."""
    whole = _adaptive()
    half = _adaptive(periods=4)
    assert [o["changes"] for o in half] == [CHANGES[:1]] * 3
    hub = InProcessHub(3, timeout=60)
    resumed = run_replicas(hub, lambda r: adaptive_run(r, 3, RankOrder(hub, r),
                                                       state=half[r]["state"]))
    for r in range(3):
        assert resumed[r]["loaded"] == ([9, 8, 3], 4, CHANGES[:1])
        assert resumed[r]["changes"] == CHANGES
        assert _equal(resumed[r]["params"], whole[r]["params"]), r


def test_equal_speeds_keep_h_and_todays_bits():
    """Speeds within the bound (rank 1 5% slower): the counts stay H at every sync, nothing
    changes, and the parameters are the bits of DiLoCo without a pace; the only cost is the
    seconds per step all-gathered at each sync and once in the first period (8 bytes per
    peer)."""
    periods = 3
    out = _adaptive(2, periods=periods, seconds=lambda r, p: [1.0, 1.05][r])
    hub = InProcessHub(2, timeout=60)

    def plain(r):
        model = model_fn()
        opt = DeToNATION(model.parameters(), DiLoCoReplicator(ADAPTIVE_H), base="adamw",
                         lr=LR, group=RankOrder(hub, r))
        for _ in range(periods * ADAPTIVE_H):
            loss_of(model, r, opt.steps).backward()
            opt.step()
            opt.zero_grad()
        return params(model), opt.bytes_sent

    ref = run_replicas(hub, plain)
    for r in range(2):
        assert out[r]["changes"] == [] and out[r]["steps"] == periods * ADAPTIVE_H
        assert [k for _, k, _ in out[r]["after"]] == [[10, 10]] * periods
        assert _equal(out[r]["params"], ref[r][0]), r
        assert out[r]["sent"] == ref[r][1] + (periods + 1) * 8  # + the first period's decision


def test_a_tolerance_of_zero_follows_every_change():
    """``tolerance=0``: rank 1's 10% is followed from the first decision, after MEASURE steps
    of the first period (recorded as sync 0: before the first sync)."""
    out = _adaptive(periods=1, tolerance=0.0)
    for o in out:
        assert o["changes"] == [(0, [10, 9, 10])]


# ---------------------------------------------------------------------- gloo processes
@pytest.mark.multiprocess
def test_three_gloo_processes_adapt_alike(one_thread):
    """3 gloo processes, each on its own virtual clock: every rank changes its counts at syncs
    3 and 5 to the same counts, the replicas are bitwise identical after every sync, the bytes
    are counted exactly, and the run is bitwise the same replicas in threads (all-reduce in
    gloo's ring order) and within fp32 tolerance of the dense reference."""
    got = run_world(gloo_adaptive_worker, 3, timeout=120)
    _check_run(got)
    local = _adaptive(rank_order=False)
    for r in range(3):
        assert _equal(local[r]["params"], got[r]["params"]), r
        assert local[r]["sent"] == got[r]["sent"], r
    ref = dense_reference(ADAPTIVE_COUNTS, exact=False)
    for a, b in zip(got[0]["params"], ref[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
