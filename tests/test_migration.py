"""Coming from DeMo / DeToNATION: the drop-in DeMo's signature and counters, the aliases."""

import pytest
import torch
from dist_util import run_world
from dist_workers import Tiny
from libgpu_workers import migration_worker

import flexdemo
from flexdemo import compat


def test_dropin_demo_takes_the_original_argument_order():
    opt = flexdemo.DeMo(Tiny().parameters(), 0.9, 8, 16, 0.1, None, lr=0.05, momentum=0.5)
    rep = opt.replicators[0]
    assert (rep.decay, rep.topk, rep.chunk) == (0.9, 8, 16)
    g = opt.param_groups[0]
    assert g["lr"] == 0.05 and g["momentum"] == 0.5 and g["flexdemo_weight_decay"] == 0.1
    assert rep.values == "fp32" and rep.sign
    # a lone float is the decay, never the learning rate
    opt = flexdemo.DeMo(Tiny().parameters(), 0.999)
    assert opt.replicators[0].decay == 0.999 and opt.param_groups[0]["lr"] == 1e-3


@pytest.mark.parametrize("decay", [1.0, 1.5, -0.1, True])
def test_dropin_demo_rejects_decay_outside_0_1(decay):
    with pytest.raises(ValueError, match=r"compression_decay must be in \[0, 1\)"):
        flexdemo.DeMo(Tiny().parameters(), decay)


def test_counters_on_one_process_are_zero():
    m = Tiny()
    opt = flexdemo.DeMo(m.parameters(), lr=1e-3)
    m(torch.randn(4, 12)).sum().backward()
    opt.step()
    assert opt.data_transmit == 0 and opt.data_receive == 0


def test_compat_replicators_map_names():
    rep = compat.DeMoReplicator(compression_decay=0.99, compression_topk=8, compression_chunk=32)
    assert (rep.decay, rep.topk, rep.chunk, rep.values) == (0.99, 8, 32, "fp32")
    rep = compat.RandomReplicator(compression_decay=0.9, compression_rate=0.25, seed=3)
    assert (rep.decay, rep.rate, rep.seed) == (0.9, 0.25, 3)
    assert isinstance(compat.NoReplicator(), flexdemo.NoReplication)
    assert compat.Optimizers("adamw") is compat.Optimizers.AdamW


def test_compat_optimizers_take_the_reference_arguments():
    opt = compat.DeToAdamW(Tiny().parameters(), detonation_weight_decay=0.1,
                           detonation_sign=False, replicator=compat.DeMoReplicator(),
                           replicate_every=3, skip_every=4, lr=0.02, betas=(0.8, 0.9))
    rep = opt.replicators[0]
    assert type(opt.base).__name__ == "AdamW" and opt.param_groups[0]["betas"] == (0.8, 0.9)
    assert (rep.replicate_every, rep.skip_every, rep.sign) == (3, 4, False)
    assert opt.param_groups[0]["flexdemo_weight_decay"] == 0.1
    with pytest.raises(TypeError, match="flexdemo Replicator"):
        compat.DeToSGD(Tiny().parameters(), replicator="demo")
    with pytest.raises(ValueError, match="one value per replicator"):
        compat.DeToSGD(Tiny().parameters(), replicate_every=[1, 2])


@pytest.fixture(scope="module")
def two_ranks():
    return run_world(migration_worker, 2)


@pytest.mark.multiprocess
def test_data_transmit_and_receive_count_the_last_step(two_ranks):
    for res in two_ranks:
        r = res["dropin"]
        assert r["counters"] == [(r["expected"], r["expected"])] * 2 and r["expected"] > 0
        assert (r["decay"], r["topk"], r["chunk"], r["lr"]) == (0.99, 4, 8, 1e-3)
    a, b = (res["dropin"]["shards"] for res in two_ranks)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.multiprocess
def test_aliases_train_on_two_ranks(two_ranks):
    for res in two_ranks:
        assert res["prepare_detonation"]["base"] == "AdamW"
        assert res["prepare_detonation"]["mesh"] == (2, 1)
        assert res["detosgd"]["sent"] > 0
    for key in ("detosgd", "prepare_detonation"):
        a, b = (res[key]["shards"] for res in two_ranks)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), key
