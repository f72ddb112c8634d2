"""Multi-process tests: gloo on CPU, real process groups, 2 and 4 ranks."""

import pytest
import torch
from dist_util import replicas_by_shard, run_world
from dist_workers import (
    REPLICATORS,
    STEPS,
    chain_worker,
    hsdp_worker,
    nonfinite_worker,
    replicas_worker,
)

from flexdemo.transport import all_gather_bytes, all_reduce_bytes


@pytest.fixture(scope="module", params=[(2, 2), (4, 1)], ids=["hybrid2x2", "dp1x4"])
def layout_results(request):
    replicate, shard = request.param
    return replicate, shard, run_world(replicas_worker, 4, replicate, shard)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(REPLICATORS))
def test_replicas_stay_bitwise_identical(layout_results, name):
    replicate, shard, results = layout_results
    groups = replicas_by_shard(results, name)
    assert len(groups) == shard and all(len(g) == replicate for g in groups.values())
    for members in groups.values():
        first = members[0]["shards"]
        same = [all(torch.equal(a, b) for a, b in zip(first, m["shards"])) for m in members[1:]]
        if name == "none":  # different data and no exchange: replicas must drift apart
            assert not any(same)
        else:
            assert all(same), f"{name}: replicas of one shard differ"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(REPLICATORS))
def test_bytes_match_formula(layout_results, name):
    replicate, shard, results = layout_results
    n = replicate
    for res in results:
        r = res[name]
        if name == "demo":
            expected = all_gather_bytes(r["payload"], n)
        elif name == "full":
            expected = all_reduce_bytes(r["numel"] + 2 * n, 4, n)
        elif name == "none":
            expected = 0
        else:
            expected = all_reduce_bytes(r["payload"] // 4, 4, n)
        assert [s["bytes_sent"] for s in r["stats"]] == [expected] * STEPS
        assert [s["bytes_received"] for s in r["stats"]] == [expected] * STEPS
        collectives = 0 if name == "none" or n == 1 else 1
        assert [s["collectives"] for s in r["stats"]] == [collectives] * STEPS


@pytest.mark.multiprocess
def test_demo_beats_allreduce_bytes(layout_results):
    replicate, shard, results = layout_results
    r = results[0]
    assert r["demo"]["stats"][0]["bytes_sent"] < r["full"]["stats"][0]["bytes_sent"]


@pytest.mark.multiprocess
def test_schedule_fires_on_the_right_steps(layout_results):
    replicate, shard, results = layout_results
    for res in results:
        r = res["schedule"]
        sent = [s["bytes_sent"] for s in r["stats"]]
        expected = [all_gather_bytes(r["payload"], replicate) if s in (0, 4, 6) else 0
                    for s in range(8)]
        assert sent == expected


@pytest.mark.multiprocess
def test_local_steps_let_replicas_drift(layout_results):
    """Steps 1-3, 5 and 7 of the schedule are local, so replicas are no longer identical."""
    replicate, shard, results = layout_results
    groups = replicas_by_shard(results, "schedule")
    for members in groups.values():
        first = members[0]["shards"]
        for m in members[1:]:
            assert not all(torch.equal(a, b) for a, b in zip(first, m["shards"]))


@pytest.fixture(scope="module")
def hsdp():
    return run_world(hsdp_worker, 4)


@pytest.mark.multiprocess
def test_full_adamw_matches_fsdp_hsdp(hsdp):
    for res in hsdp:
        for a, b in zip(res["ref"], res["mine"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
def test_group_not_on_mesh_is_rejected(hsdp):
    for res in hsdp:
        assert res["mismatch"] is not None and "does not match the mesh" in res["mismatch"]
        assert res["bad_mesh"] is not None and "does not divide" in res["bad_mesh"]


@pytest.mark.multiprocess
def test_chain_composes_outputs():
    results = run_world(chain_worker, 4)
    first = results[0]["shards"]
    for res in results[1:]:  # after Full over the world every replica holds the same model
        assert all(torch.equal(a, b) for a, b in zip(first, res["shards"]))
    for res in results:
        for step in res["steps"]:
            for d in step:
                # sign-ed DeMo outputs (-1, 0, 1) of two pairs, averaged by Full: halves.
                # Were the last replicator to win, the step would be the raw mean gradient.
                torch.testing.assert_close(d * 2, (d * 2).round(), atol=1e-4, rtol=0)
                assert d.abs().max() <= 1 + 1e-4
        assert res["bytes"][0] == 3 * all_gather_bytes(res["payload"], 2)
        assert res["bytes"][1] == 3 * all_reduce_bytes(res["numel"] + 8, 4, 4)


@pytest.fixture(scope="module")
def two_ranks():
    return run_world(nonfinite_worker, 2)


@pytest.mark.multiprocess
def test_nonfinite_raises_on_every_replica(two_ranks):
    for res in two_ranks:
        msg, ranks = res["raise"]
        assert ranks == [1] and "non-finite" in msg and "rank(s) [1]" in msg
        assert res["raise_unchanged"]


@pytest.mark.multiprocess
def test_nonfinite_skip_skips_everywhere(two_ranks):
    for res in two_ranks:
        assert res["skip"] is None and res["skip_unchanged"] and res["skip_skipped"] == 1
    a, b = (res["skip_shards"] for res in two_ranks)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.multiprocess
def test_dropin_demo_keeps_replicas_identical(two_ranks):
    a, b = (res["dropin"] for res in two_ranks)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
