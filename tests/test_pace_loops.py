"""DiLoCo with a pace (replicas of different speeds) under the loops people write: every order
of zero_grad, forward, backward and step, ``count_tokens`` anywhere before the step, and a
NaN/Inf in the middle of a period under each order.

The replicas run :func:`pace_loop_workers.loop_run` (H = 4, ``Pace([4, 4, 2])``: replica 2
syncs after 2 inner steps, the others after 4; AdamW inner steps, three periods), each in its
own thread over an :class:`~flexdemo.transport.InProcessHub` whose all-reduce adds in rank
order (:class:`dist_util.RankOrder`), so that a dense reference can add alike; one test runs
them as gloo processes. The loop the pace was first tested with (forward, backward,
count_tokens, step, zero_grad: ``STANDARD``) is the one every other order is held to.

The fault path (the module docstring of :mod:`flexdemo.replicate.diloco`): a replica whose
gradient is NaN/Inf skips that inner step alone; under ``nonfinite="raise"`` its next
pseudo-gradient is marked non-finite, so every replica raises ``NonFiniteGradientError`` at
that sync (its own step there: the replicas' step numbers differ under a pace), takes no outer
step and restarts from the global parameters; under ``"skip"`` the sync goes on (the bad step
was skipped on its replica alone). A NaN parameter makes the pseudo-gradient itself non-finite:
that sync is dropped on every replica under either policy (under ``"skip"`` each counts it as
a skipped step and none raises)."""

from __future__ import annotations

import functools

import pytest
import torch
from dist_util import RankOrder, run_world
from pace_loop_workers import (
    COUNTS,
    FAULTS,
    ORDERS,
    PERIODS,
    STANDARD,
    TOKENS,
    gloo_loop_worker,
    loop_run,
    reference,
)
from pace_workers import dense_reference

from flexdemo.simulate import run_replicas
from flexdemo.transport import InProcessHub

STEPS = [PERIODS * k for k in COUNTS]  # 12, 12, 6
SPOTS_BEFORE_STEP = ("first", "after-forward", "after-backward")


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[float]:
    return [(x - y).abs().max().item() for x, y in zip(a, b)]


@functools.cache
def _run(order: str, spot: str = "after-backward", weights: str = "tokens",
         nonfinite: str = "raise", fault: str | None = None, rank_order: bool = True,
         tau: int = 0) -> tuple[dict, ...]:
    """Every replica's :func:`loop_run` (cached per xdist worker: the standard loop's run is
    shared by the tests that compare with it)."""
    hub = InProcessHub(3, timeout=60)
    return tuple(run_replicas(hub, lambda r: loop_run(
        r, RankOrder(hub, r) if rank_order else hub.transport(r), order, spot=spot,
        weights=weights, nonfinite=nonfinite, fault=fault, tau=tau)))


def _sync_steps(rank: int) -> list[int]:
    """The step after which replica ``rank`` takes each sync (from step 0)."""
    return [(j + 1) * COUNTS[rank] - 1 for j in range(PERIODS)]


def _check_identical_after_each_sync(out: tuple[dict, ...]) -> None:
    """Every replica took every sync, each at its own step, and all hold the same bits after
    each one."""
    for r, res in enumerate(out):
        assert [s["sync"] for s in res["syncs"]] == list(range(1, PERIODS + 1)), r
        assert [s["step"] for s in res["syncs"]] == _sync_steps(r), r
        assert res["steps"] == STEPS[r] and res["stray"] == [], r
        for j, s in enumerate(res["syncs"]):
            assert _equal(s["params"], out[0]["syncs"][j]["params"]), (r, j)


# ---------------------------------------------------------------------- every loop order
@pytest.mark.timeout(60)
@pytest.mark.parametrize("spot", SPOTS_BEFORE_STEP)
@pytest.mark.parametrize("order", list(ORDERS))
def test_every_loop_order_is_the_standard_loops_bits(order, spot):
    """Weights by reported tokens (100, 300, 200 per step), ``count_tokens`` first in the
    iteration, after the forward pass or after the backward pass, in each order of zero_grad:
    every replica is bitwise the standard loop's (forward, backward, count_tokens, step,
    zero_grad) after each sync and at the end, bitwise the dense weighted reference (the one
    of tests/test_pace.py), and the replicas are identical after each sync."""
    out = _run(order, spot)
    _check_identical_after_each_sync(out)
    std = _run(*STANDARD)
    ref = dense_reference([COUNTS] * PERIODS, tokens=TOKENS)
    for r in range(3):
        for j in range(PERIODS):
            assert _equal(out[r]["syncs"][j]["params"], std[r]["syncs"][j]["params"]), (r, j)
        assert _equal(out[r]["params"], std[r]["params"]), r
        assert _equal(out[r]["params"], ref[r]), (r, _diff(out[r]["params"], ref[r]))
    assert all(res["skipped"] == 0 for res in out)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("order", list(ORDERS))
def test_every_loop_order_weighted_by_steps(order):
    """Weights by steps (nothing reported): each order is bitwise the dense reference weighted
    4 : 4 : 2, and differs from the token-weighted run (the weights reach the mean)."""
    out = _run(order, weights="steps")
    _check_identical_after_each_sync(out)
    ref = dense_reference([COUNTS] * PERIODS)
    for r in range(3):
        assert _equal(out[r]["params"], ref[r]), (r, _diff(out[r]["params"], ref[r]))
    assert not _equal(out[0]["params"], _run(*STANDARD)[0]["params"])


@pytest.mark.timeout(60)
def test_tokens_counted_after_the_step_go_to_the_next_period():
    """The control for the tests above (they would see tokens counted in the wrong period): a
    step's tokens go in before that step's ``opt.step()``. Counted after it, the tokens of the
    step that syncs reach the next period's weight: the first period weighs ``(k_i - 1) t_i``,
    the later ones ``k_i t_i`` (the last step's tokens weigh nothing); bitwise that reference,
    not the standard loop's."""
    out = _run("zero-last", "after-step")
    _check_identical_after_each_sync(out)
    shifted = [[(k - 1) * t for k, t in zip(COUNTS, TOKENS)]] + [
        [k * t for k, t in zip(COUNTS, TOKENS)]] * (PERIODS - 1)
    ref = reference(COUNTS, PERIODS, shifted)
    for r in range(3):
        assert _equal(out[r]["params"], ref[r]), (r, _diff(out[r]["params"], ref[r]))
    assert not _equal(out[0]["params"], _run(*STANDARD)[0]["params"])


# ---------------------------------------------------------------------- a fault mid-period
def _expected(fault: str, nonfinite: str) -> dict:
    """What the docstring of :mod:`flexdemo.replicate.diloco` says ``fault`` leads to under
    ``nonfinite``: the inner steps skipped, the period dropped (if any), the sync's outcome
    and each replica's ``skipped_steps``."""
    kind, bad, step = FAULTS[fault]
    k = COUNTS[bad]
    period = step // k
    last = (period + 1) * k - 1  # the bad replica's step that syncs
    # a NaN gradient: that step alone; a NaN parameter: every step of it until the sync
    nan = [step] if kind == "grad" else list(range(step, last + 1))
    dropped = nonfinite == "raise" or kind == "param"  # the pseudo-gradient is non-finite
    skipped = [0] * 3
    if nonfinite == "raise":
        # the steps skipped locally, the sync's own step too (it raises there, counted first)
        skipped[bad] = len(nan)
    else:
        skipped[bad] = len(nan)
        if dropped:  # every replica counts the dropped sync as a skipped step (the bad
            # replica's step there is among its NaN steps, counted once)
            skipped = [s + (r != bad) for r, s in enumerate(skipped)]
    return {"skip": {(bad, s) for s in nan}, "dropped": {period} if dropped else set(),
            "sync": period + 1, "raised": [bad] if nonfinite == "raise" else None,
            "moved": not dropped, "skipped": skipped}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_nonfinite_value_mid_period_is_one_outcome_at_one_sync(fault, nonfinite, order):
    """A NaN gradient (or parameter) on one replica in period 2, under each loop order and
    policy: every replica meets it at the same sync (sync 2; steps 7, 7 and 3), with the same
    outcome there: under ``"raise"`` each raises ``NonFiniteGradientError`` naming the bad
    replica (and its loop goes on), takes no outer step and restarts from the global
    parameters; under ``"skip"`` none raises, the sync is taken (a NaN gradient: its step was
    skipped on its replica alone) or dropped on every replica (a NaN parameter). Every other
    sync is taken, the replicas are identical after each, and the run ends bitwise the
    standard loop's under the same fault and the dense reference of what was skipped and
    dropped (the weights of a period are its reported tokens, skipped steps included)."""
    want = _expected(fault, nonfinite)
    out = _run(order, nonfinite=nonfinite, fault=fault)
    _check_identical_after_each_sync(out)
    for r, res in enumerate(out):
        for s in res["syncs"]:
            bad = s["sync"] == want["sync"]
            assert s["raised"] == (want["raised"] if bad else None), (r, s["sync"])
            assert s["moved"] == (want["moved"] if bad else True), (r, s["sync"])
        assert res["skipped"] == want["skipped"][r], (r, res["skipped"], want["skipped"])
    std = _run(*STANDARD, nonfinite=nonfinite, fault=fault)
    weights = [[k * t for k, t in zip(COUNTS, TOKENS)]] * PERIODS
    ref = reference(COUNTS, PERIODS, weights, skip=want["skip"], dropped=want["dropped"])
    for r in range(3):
        assert _equal(out[r]["params"], std[r]["params"]), r
        assert _equal(out[r]["params"], ref[r]), (r, _diff(out[r]["params"], ref[r]))
    if want["dropped"]:  # after the dropped sync: the global parameters of the sync before
        j = want["sync"] - 1
        assert _equal(out[0]["syncs"][j]["params"], out[0]["syncs"][j - 1]["params"])
    clean = _run(*STANDARD)
    assert not _equal(out[0]["params"], clean[0]["params"])  # the fault changed the run


@pytest.mark.timeout(60)
@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_an_overlapped_sync_meets_a_nan_gradient_alike_in_every_order(nonfinite, order):
    """Each sync overlapped by a step (tau=1, keep_overlap) and a NaN gradient on replica 0
    in period 2, under each loop order: the sync that carries it is judged where each
    replica applies it, a step after its launch (not at the launch: no error there). Under
    ``"raise"`` every replica raises once, naming replica 0, at that step (its loop goes on);
    under ``"skip"`` none raises. Every order ends bitwise the standard loop's under the
    same fault, the global parameters the same on every replica and every replica at them
    once the last sync is settled; the fault changed the run."""
    out = _run(order, nonfinite=nonfinite, fault="grad-fast-mid", tau=1)
    std = _run(*STANDARD, nonfinite=nonfinite, fault="grad-fast-mid", tau=1)
    for r, res in enumerate(out):
        assert all(s["raised"] is None for s in res["syncs"]), r
        # sync 2, launched after the replica's step 2k - 1, applied after step 2k
        assert res["stray"] == ([(2 * COUNTS[r], [0])] if nonfinite == "raise" else []), r
        assert _equal(res["params"], std[r]["params"]), r
        assert _equal(res["global"], out[0]["global"]) and _equal(res["params"],
                                                                   res["global"]), r
    assert not _equal(out[0]["params"], _run(*STANDARD, tau=1)[0]["params"])


# ---------------------------------------------------------------------- gloo processes
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_three_gloo_processes_meet_a_nan_at_one_sync_in_every_order(one_thread):
    """3 gloo processes, a NaN parameter on rank 0 in the middle of period 2 (a dropped sync
    under either policy), under each policy and loop order in turn: every rank meets it at
    sync 2 (steps 7, 7 and 3) with the same outcome (raised naming rank 0, or dropped without
    raising), the ranks are identical after each sync, and each order ends bitwise the others
    and the same replicas in one process (all-reduce in gloo's ring order)."""
    fault = "param-fast-mid"
    results = run_world(gloo_loop_worker, 3, fault, timeout=120)
    for nonfinite in ("raise", "skip"):
        want = _expected(fault, nonfinite)
        local = _run(STANDARD[0], nonfinite=nonfinite, fault=fault, rank_order=False)
        for order in ORDERS:
            got = tuple(res[nonfinite, order] for res in results)
            _check_identical_after_each_sync(got)
            for r, g in enumerate(got):
                where = (nonfinite, order, r)
                assert [(s["raised"], s["moved"]) for s in g["syncs"]] == [
                    (want["raised"], False) if s["sync"] == want["sync"] else (None, True)
                    for s in g["syncs"]], where
                assert g["skipped"] == want["skipped"][r], where
                assert _equal(g["params"], local[r]["params"]), where
