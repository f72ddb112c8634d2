"""Wire efficiency across real processes: codecs, bucketing, overlap, untrusted payloads."""

import pytest
import torch
from dist_util import run_world
from dist_workers import wire_worker


@pytest.fixture(scope="module")
def results():
    return run_world(wire_worker, 2)


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["values-bf16", "values-int8", "values-int2", "values-sign",
                                  "bucketed", "per-tensor", "delayed", "separate-small",
                                  "transform-bf16", "warmup-delayed"])
def test_replicas_identical(results, name):
    assert _same(results[0][name]["shards"], results[1][name]["shards"])


@pytest.mark.multiprocess
def test_bucketed_and_per_tensor_updates_are_bitwise_identical(results):
    for res in results:
        assert _same(res["bucketed"]["shards"], res["per-tensor"]["shards"])
        one = [s["collectives"] for s in res["bucketed"]["stats"]]
        many = [s["collectives"] for s in res["per-tensor"]["stats"]]
        assert one == [1] * 5 and many == [1 + res["per-tensor"]["units"]] * 5
        assert [s["bytes_sent"] for s in res["bucketed"]["stats"]] == \
            [res["bucketed"]["payload"]] * 5


@pytest.mark.multiprocess
def test_smaller_codecs_send_fewer_bytes(results):
    sizes = [results[0][f"values-{v}"]["payload"] for v in ("bf16", "int8", "int2", "sign")]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]


@pytest.mark.multiprocess
def test_delayed_differs_from_synchronous(results):
    assert not _same(results[0]["delayed"]["shards"], results[0]["bucketed"]["shards"])


@pytest.mark.multiprocess
def test_delayed_warmup_is_not_the_plain_delayed_run(results):
    """The overlapped warm-up (topk 8 for two steps, then 4) trained otherwise than topk 4
    throughout, with the same data; its replicas are identical (above)."""
    assert not _same(results[0]["warmup-delayed"]["shards"], results[0]["delayed"]["shards"])


@pytest.mark.multiprocess
def test_corrupt_payload_named_on_every_rank(results):
    for res in results:
        msg, global_rank = res["raise"]
        assert global_rank == 1 and "corrupt payload from rank 1" in msg
        assert "non-finite value" in msg


@pytest.mark.multiprocess
def test_corrupt_payload_dropped_on_every_rank(results):
    for res in results:
        assert res["drop"] is None and res["drop_dropped"] == 1
    assert _same(results[0]["drop_shards"], results[1]["drop_shards"])


@pytest.mark.multiprocess
def test_corrupt_payload_dropped_a_step_late_in_delayed_mode(results):
    """Left out of the mean on the device when applied (step 3), counted at step 4."""
    for res in results:
        assert res["drop-delayed"]["dropped"] == (0, 1)
    assert _same(results[0]["drop-delayed"]["shards"], results[1]["drop-delayed"]["shards"])
    assert all(torch.isfinite(t).all() for t in results[0]["drop-delayed"]["shards"])
