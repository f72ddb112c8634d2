"""Every replicator reaches the same outcome on every rank, in the same step (2 gloo ranks).

A NaN gradient on rank 1: under ``nonfinite="raise"`` every rank raises at the same step (for
steps that exchange nothing, at the next exchange); under ``"skip"`` the replicas stay bitwise
identical. Quantised Full payloads are checked like DeMo's: a bad one is named or dropped.
"""

import pytest
import torch
from agreement_workers import NONFINITE_CASES, corrupt_worker, nonfinite_worker
from dist_util import run_world

# where every rank must raise, per case (the NaN is on rank 1 at step 3)
RAISE_STEP = {"full-every2": 4, "demo-every2": 4,  # step 3 exchanges nothing: step 4 tells
              "diloco-full": 5, "diloco-demo": 5,  # the next sync, after step 5
              "diloco-stream": 4}  # fragment 1 launched after step 3, applied after step 4


@pytest.fixture(scope="module")
def nonfinite():
    return run_world(nonfinite_worker, 2)


def _same(a, b, which=None):
    which = range(len(a)) if which is None else which
    return all(torch.equal(a[i], b[i]) for i in which)


@pytest.mark.parametrize("name", [n for n in NONFINITE_CASES if n != "none"])
def test_raise_on_every_rank_at_the_same_step(nonfinite, name):
    step = RAISE_STEP.get(name, 3)
    for res in nonfinite:
        raised = res[name, "raise"]["raised"]
        assert [(s, r) for s, r, _ in raised] == [(step, [1])], (name, raised)
        assert "non-finite" in raised[0][2]


@pytest.mark.parametrize("name", [n for n in NONFINITE_CASES if n != "none"])
def test_skip_keeps_replicas_identical(nonfinite, name):
    r0, r1 = (res[name, "skip"] for res in nonfinite)
    assert r0["raised"] == [] and r1["raised"] == []
    assert r0["finite"] and r1["finite"]
    if not name.endswith("every2"):  # (local steps let replicas drift in any case)
        # DiLoCo: the fragment synced by the last step (streaming: fragment 0; else all)
        which = r0["synced"] if name == "diloco-stream" else None
        assert _same(r0["shards"], r1["shards"], which), f"{name}: replicas differ"
    if name.startswith("diloco") or name.endswith("every2"):
        # the NaN step exchanged nothing: only rank 1 knew of it and skipped it alone
        assert (r0["skipped"], r1["skipped"]) == (0, 1)
    else:
        assert (r0["skipped"], r1["skipped"]) == (1, 1)


def test_diloco_bad_parameters_drop_the_sync_everywhere(nonfinite):
    """An Inf parameter on rank 1 (finite gradients) makes a non-finite pseudo-gradient: every
    rank raises at the sync, or skips it and restarts from the global parameters."""
    for res in nonfinite:
        raised = res["diloco-param", "raise"]["raised"]
        assert [(s, r) for s, r, _ in raised] == [(5, [1])]
    r0, r1 = (res["diloco-param", "skip"] for res in nonfinite)
    assert r0["finite"] and r1["finite"] and _same(r0["shards"], r1["shards"])
    # rank 0 skipped the dropped sync; rank 1 also its inner steps 4 and 5, whose gradients
    # the Inf parameter made NaN (it skipped them alone)
    assert (r0["skipped"], r1["skipped"]) == (1, 2)


def test_none_keeps_the_outcome_local(nonfinite):
    """No exchange, nobody waits: rank 1 raises (or skips) alone and rank 0 trains on."""
    r0, r1 = (res["none", "raise"] for res in nonfinite)
    assert r0["raised"] == [] and [(s, r) for s, r, _ in r1["raised"]] == [(3, [1])]
    r0, r1 = (res["none", "skip"] for res in nonfinite)
    assert (r0["skipped"], r1["skipped"]) == (0, 1)


@pytest.fixture(scope="module")
def corrupt():
    return run_world(corrupt_worker, 2)


@pytest.mark.parametrize("case", ["int8-nan-scale", "fp16-overflow"])
def test_bad_quantised_payload_is_named_on_every_rank(corrupt, case):
    for res in corrupt:
        step, global_rank, msg = res[case, "raise"]["caught"]
        assert (step, global_rank) == (1, 1) and "corrupt payload from rank 1" in msg
        assert "non-finite value" in msg
        if case == "fp16-overflow":
            assert "65504" in msg


@pytest.mark.parametrize("case", ["int8-nan-scale", "fp16-overflow"])
def test_bad_quantised_payload_is_dropped_on_every_rank(corrupt, case):
    r0, r1 = (res[case, "drop"] for res in corrupt)
    assert r0["caught"] is None and r1["caught"] is None
    assert r0["dropped"] == r1["dropped"] == 1
    assert r0["finite"] and r1["finite"] and _same(r0["shards"], r1["shards"])
