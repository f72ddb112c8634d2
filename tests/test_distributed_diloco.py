"""DiLoCo across real processes (gloo on CPU)."""

import pytest
import torch
from dist_util import replicas_by_shard, run_world
from dist_workers import DILOCO_EXCHANGES, diloco_averaging_worker, diloco_replicas_worker

from flexdemo.transport import all_gather_bytes, all_reduce_bytes


@pytest.mark.multiprocess
def test_h1_outer_sgd_lr1_is_parameter_averaging():
    for res in run_world(diloco_averaging_worker, 2):
        for a, b in zip(res["ref"], res["mine"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module", params=[(2, 2), (4, 1)], ids=["hybrid2x2", "dp1x4"])
def diloco_results(request):
    replicate, shard = request.param
    return replicate, shard, run_world(diloco_replicas_worker, 4, replicate, shard)


def _identical(members, step, params=None):
    first = members[0]["snaps"][step]
    idx = range(len(first)) if params is None else params
    return all(torch.equal(first[i], m["snaps"][step][i]) for m in members[1:] for i in idx)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(DILOCO_EXCHANGES))
def test_replicas_identical_after_every_outer_step(diloco_results, name):
    replicate, shard, results = diloco_results
    for members in replicas_by_shard(results, name).values():
        for step in (2, 5):  # H=3: outer steps after steps 2 and 5
            assert _identical(members, step), f"{name}: replicas differ after step {step}"
        for step in (3, 4, 6):  # inner steps on different data: replicas drift
            assert not _identical(members, step)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(DILOCO_EXCHANGES))
def test_bytes_only_on_sync_steps(diloco_results, name):
    replicate, shard, results = diloco_results
    for res in results:
        r = res[name]
        if name == "full-fp32":
            per_sync = all_reduce_bytes(r["payload"] // 4, 4, replicate)
        else:
            per_sync = all_gather_bytes(r["payload"], replicate)
        assert r["sent"] == [0, 0, per_sync, 0, 0, per_sync, 0]


@pytest.mark.multiprocess
def test_streaming_fragments_sync_in_turn(diloco_results):
    replicate, shard, results = diloco_results
    for members in replicas_by_shard(results, "streaming").values():
        parts = members[0]["parts"]
        # fragment 0 applied after steps 2 and 6, fragment 1 after step 4 (tau = 1); each
        # is launched (and its bytes sent) one step earlier
        for step, frag in ((2, 0), (4, 1), (6, 0)):
            assert _identical(members, step, parts[frag])
            assert not _identical(members, step, parts[1 - frag])
    for res in results:
        r = res["streaming"]
        b = [all_reduce_bytes(p // 4, 4, replicate) for p in r["payloads"]]
        assert r["sent"] == [0, b[0], 0, b[1], 0, b[0], 0, b[1]]
