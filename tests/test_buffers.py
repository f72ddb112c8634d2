"""Module buffers across replicas: BatchNorm statistics follow the documented policy."""

import pytest
import torch
from dist_util import run_world
from libgpu_workers import buffers_worker


@pytest.fixture(scope="module")
def results():
    return run_world(buffers_worker, 2)


@pytest.mark.multiprocess
def test_mean_policy_averages_floating_buffers_every_exchange(results):
    a, b = (r["mean"] for r in results)
    assert all(torch.equal(x, y) for x, y in zip(a["buffers"], b["buffers"]))
    for res in results:
        for expected, got in res["mean"]["means"]:
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
        # one all-reduce of the 2 x 16 floats per step, num_batches_tracked stays local
        assert res["mean"]["bytes"] == 3 * 2 * 1 * 16 * 4
        assert res["mean"]["tracked"] == 3


@pytest.mark.multiprocess
def test_none_policy_lets_statistics_differ(results):
    a, b = (r["none"] for r in results)
    assert not torch.equal(a["buffers"][0], b["buffers"][0])
    assert a["bytes"] == 0


@pytest.mark.multiprocess
def test_buffers_follow_the_exchange_schedule(results):
    for res in results:  # replicate_every=2: exchanges (and averaging) on steps 0 and 2
        assert res["schedule_same"] == [True, False, True, False]
