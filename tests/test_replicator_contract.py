"""The contract every registered replicator keeps, on 2 gloo ranks (one spawn for all):
identical replicas, a state round trip, bytes equal to its formula, non-finite agreement.
And the cost of a step: ops that do not grow with the number of tensors, one host read."""

import pytest
import torch
from contract_workers import COUNTED, STEPS, contract_worker, count_worker
from dist_util import run_world

from flexdemo.replicate import REPLICATORS

DILOCO = ("diloco", "diloco-avg", "muloco", "sparseloco", "muloco-int4",
          "sparseloco-dct")  # the named presets are DiLoCo settings


@pytest.fixture(scope="module")
def contract():
    return run_world(contract_worker, 2)


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(REPLICATORS))
def test_replicas_identical(contract, name):
    a, b = (res[name]["shards"] for res in contract)
    if name == "none":  # different data, no exchange: replicas drift apart
        assert not _same(a, b)
    else:  # (DiLoCo: the last step run is a sync)
        assert _same(a, b), f"{name}: replicas differ"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(REPLICATORS))
def test_state_round_trip_gives_the_same_next_step(contract, name):
    for res in contract:
        assert res[name]["resumed_same"], f"{name}: resumed step differs"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(REPLICATORS))
def test_bytes_follow_the_formula(contract, name):
    for res in contract:
        r = res[name]
        if name in DILOCO:  # H=2: one sync after every odd step
            expected = [r["exchange_bytes"] if s % 2 else 0 for s in range(STEPS)]
        else:
            expected = [b if c else 0 for b, c in zip(r["formula"], r["communicates"])]
        assert r["sent"] == expected
        if name == "demo-warmup":  # the denser phase sends more
            assert r["formula"][0] == r["formula"][2] > r["formula"][3] == r["formula"][-1]
        assert (r["exchange_bytes"] == 0) == (name == "none")


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(REPLICATORS))
def test_nonfinite_agreement(contract, name):
    raised = [res[name]["raised"] for res in contract]
    if name == "none":  # nobody waits on a replica that exchanges nothing
        assert raised == [None, (STEPS + 1, [1])]
    else:  # (DiLoCo: step STEPS + 1 ends with a sync, which reports the withheld step)
        assert raised == [(STEPS + 1, [1])] * 2


@pytest.fixture(scope="module")
def counts():
    return run_world(count_worker, 2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(COUNTED))
def test_ops_per_step_do_not_grow_with_tensors(counts, name):
    for res in counts:
        small, large = res[name, 2], res[name, 8]
        assert large["tensors"] == small["tensors"] + 12
        assert large["ops"] == small["ops"], (name, small, large)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(COUNTED))
def test_one_host_read_per_step(counts, name):
    # DiLoCo reads its inner step's flag (to skip a NaN step before the base optimizer
    # moves) and, on a step that completes a sync, the exchange's agreement as well
    limit = 2 if name in ("diloco", "diloco-int4") else 1
    for res in counts:
        for layers in (2, 8):
            assert res[name, layers]["syncs"] <= limit, (name, res[name, layers])
