"""torch.distributed.checkpoint's own helpers (get_state_dict / set_state_dict, dcp.save /
dcp.load) round-trip the model and flexdemo's optimizer bitwise, per-replica state included."""

import pytest
import torch
from dist_util import replicas_by_shard, run_world
from libgpu_workers import dcp_worker

KINDS = ("demo", "demo-adamw", "diloco")


@pytest.fixture(scope="module", params=[(2, 2, 1), (4, 2, 2)], ids=["2x1", "2x2"])
def results(request, tmp_path_factory):
    world, replicate, shard = request.param
    root = tmp_path_factory.mktemp(f"dcp{world}")
    return run_world(dcp_worker, world, str(root), replicate, shard)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_is_bitwise(results, kind):
    for res in results:
        r = res[kind]
        assert r["save_kept_params"], "saving must not change the model"
        assert r["differs_before"], "the fresh model must start elsewhere for the test to mean much"
        assert r["params"], f"{kind}: parameters differ after load"
        assert r["state"], f"{kind}: optimizer state differs after load"


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", KINDS)
def test_next_steps_match_an_uninterrupted_run(results, kind):
    for res in results:
        assert res[kind]["next"], kind
        assert res[kind]["steps"] == {"demo": 3, "demo-adamw": 2, "diloco": 3}[kind]


@pytest.mark.multiprocess
def test_per_replica_state_really_differs(results):
    """DeMo's momentum and DiLoCo's inner state differ between replicas: a round trip that
    handed every replica one copy would fail the tests above."""
    for kind in ("demo", "diloco"):
        for members in replicas_by_shard(results, kind).values():
            a, b = members[0]["saved_state"], members[1]["saved_state"]
            assert any(not torch.equal(x, y) for x, y in zip(a, b)), kind


@pytest.mark.multiprocess
def test_fresh_optimizers_load_their_base_state(results):
    """AdamW creates its state on the first step: a fresh optimizer has none, and its state
    dict must still offer DCP the tensors to load into (checked by the bitwise tests)."""
    for res in results:
        assert res["demo-adamw"]["fresh_base_state"] == 0
        assert res["diloco"]["fresh_base_state"] == 0


@pytest.mark.multiprocess
def test_layout_follows_the_replicators(results):
    for res in results:
        assert res["demo"]["identical"] and res["demo-adamw"]["identical"]
        assert not res["diloco"]["identical"]


def test_get_state_dict_does_not_step_the_optimizer():
    """torch's helper runs a zero-lr step() on optimizers whose `state` is empty (SGD without
    momentum always is); ours must not run: it would move DeMo's momentum and its counters."""
    from dist_workers import Tiny, train
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import flexdemo

    model = Tiny()
    opt = flexdemo.DeToNATION(model.parameters(), flexdemo.DeMoReplicator(topk=4, chunk=8))
    train(model, opt, 2, 0)
    delta = [d.clone() for d in opt.replicators[0].delta]
    # no base state, but an (empty) entry per parameter in the shared state
    assert opt.state is opt.base.state and not any(opt.state.values())
    assert len(opt.state) == len(list(model.parameters()))
    _, osd = get_state_dict(model, opt)
    assert opt.steps == 2
    assert all(torch.equal(a, b) for a, b in zip(delta, opt.replicators[0].delta))
    assert set(osd["state"]) == {n for n, _ in model.named_parameters()}


def test_large_replicator_buffers_travel_as_dcp_tensors():
    from dist_workers import Tiny, train

    import flexdemo

    model = Tiny()
    opt = flexdemo.DeToNATION(model.parameters(), flexdemo.DeMoReplicator(topk=4, chunk=8))
    train(model, opt, 2, 0)
    first = opt.state_dict()["state"][0]
    deltas = [v for k, v in sorted(first.items()) if "/replicators/0/delta/" in k]
    assert len(deltas) == len(opt.replicators[0].delta) > 0
    assert all(isinstance(d, torch.Tensor) for d in deltas)
    assert isinstance(first["flexdemo/chain/rank0"], bytes)
