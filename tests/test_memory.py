"""Memory accounting (flexdemo.memory) and DeMo's bounded workspace (group_numel)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flexdemo import DeToNATION, LiveBytes
from flexdemo.memory import state_bytes, storage_bytes
from flexdemo.replicate import DeMoReplicator


def test_live_bytes_counts_storages_as_they_live():
    with LiveBytes() as mem:
        a = torch.zeros(1000)
        assert mem.current == 4000
        v = a.view(10, 100)[2:]  # a view: the same storage
        assert mem.current == 4000
        b = a + 1
        assert mem.current == 8000
        del b
        assert (mem.current, mem.peak) == (4000, 8000)
        assert mem.reset_peak() == 4000 and mem.peak == 4000
        made_before = torch.ones(10, dtype=torch.float64)
    mem.track([made_before, v])  # counted once per storage
    assert mem.current == 4080


def test_storage_bytes_counts_each_storage_once():
    a = torch.zeros(256)
    assert storage_bytes({"x": [a, a[:10], a.view(16, 16)], "y": (torch.zeros(3),)}) == 1036


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 512 rows tile into 64 x 64 blocks; 300 rows need padding (split at 256)
    return nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 512),
                         nn.Linear(512, 300))


def _train(group_numel, steps=2, **kw):
    with LiveBytes() as mem:
        model = _model()
        opt = DeToNATION(model.parameters(), [DeMoReplicator(group_numel=group_numel, **kw)],
                         base="sgd", lr=1e-2)
        x = torch.randn(8, 512, generator=torch.Generator().manual_seed(1))
        for _ in range(steps):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    return model, opt, mem


def test_demo_workspace_is_bounded_by_group_numel():
    """Held buffers: a few buffers of one group (the staged rows, the transform's products,
    the selection's and the decode's scratch), whatever the model's size; the step's transient
    peak: within two groups. Without the bound every buffer is model-sized (so the bound bites
    on this model)."""
    n = 1 << 15  # coefficients per group: 8 blocks of 64 x 64
    model, opt, _ = _train(n)
    P = 4 * sum(p.numel() for p in model.parameters())
    stats = opt.memory_stats()
    assert stats["state_bytes"] == state_bytes(opt) >= P  # the momentum (padded rows round up)
    assert stats["workspace_bytes"] <= 5 * (4 * n) < 0.2 * P
    assert stats["step_workspace_bytes"] <= 2 * (4 * n)
    _, free, _ = _train(None)
    assert free.memory_stats()["workspace_bytes"] > 3 * P


@pytest.mark.parametrize("kw", [{}, {"transform": "none", "sign": False, "values": "stat2"}])
def test_bounded_groups_give_the_same_bits_and_load_each_others_state(kw):
    """Splitting tensors to fit group_numel changes no bits of the step or the momentum, and
    a state saved with one bound loads under another (or none)."""
    a, oa = _train_mixed(group_numel=None, **kw)
    b, ob = _train_mixed(group_numel=1 << 12, **kw)  # one 64 x 64 block per group
    assert len(ob.replicators[0].groups) > len(oa.replicators[0].groups)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)

    def momentum(o):
        return torch.cat([d.reshape(-1) for d in o.replicators[0].delta])
    assert torch.equal(momentum(oa), momentum(ob))
    _, oc = _train_mixed(group_numel=1 << 13, **kw)
    oc.load_state_dict(ob.state_dict())
    assert torch.equal(momentum(oc), momentum(oa))
    oa.load_state_dict(oc.state_dict())
    assert torch.equal(momentum(oa), momentum(ob))


@pytest.mark.parametrize("rep, base", [("full", "adamw"), ("diloco", "adamw"),
                                       ("demo", "muon")])
def test_state_bytes_match_what_a_checkpoint_keeps(rep, base):
    model = _model()
    params = model.named_parameters() if base == "muon" else model.parameters()
    opt = DeToNATION(params, rep, base=base, lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 512)).square().mean().backward()
        opt.step()
    stats = opt.last_step_stats()
    assert stats["state_bytes"] == state_bytes(opt) > 0
    assert "step_workspace_bytes" not in stats  # measured only under LiveBytes


def test_group_numel_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="group_numel must be an integer >= 1"):
        DeMoReplicator(group_numel=0)


def _train_mixed(nan: bool = False, **kw):
    torch.manual_seed(0)  # rows that tile, rows that need padding, small tensors
    model = nn.Sequential(nn.Linear(150, 260), nn.ReLU(), nn.Linear(260, 128),
                          nn.Linear(128, 100))
    opt = DeToNATION(model.parameters(), [DeMoReplicator(**kw)], base="sgd", lr=1e-2,
                     nonfinite="skip")
    x = torch.randn(32, 150, generator=torch.Generator().manual_seed(1))
    for s in range(4):
        opt.zero_grad()
        model(x).square().mean().backward()
        if nan and s == 2:
            model[0].weight.grad[3, 5] = float("nan")
        opt.step()
    return model, opt


@pytest.mark.parametrize("kw, nan", [({}, True), ({"overlap": "delayed"}, True),
                                     ({"group_numel": 1 << 13, "transform_dtype": "bf16",
                                       "values": "fp32"}, False)])
def test_offloaded_momentum_gives_the_same_bits(kw, nan):
    """offload=True brings each group's momentum from host memory for its encode and sends
    it back: the same parameters and momentum as keeping it on the device, a skipped
    non-finite step included; the states load into each other."""
    a, oa = _train_mixed(nan, **kw)
    b, ob = _train_mixed(nan, offload=True, **kw)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    for d, e in zip(oa.replicators[0].delta, ob.replicators[0].delta):
        assert torch.equal(d, e)
    _, oc = _train_mixed(offload=True, **kw)
    oc.load_state_dict(oa.state_dict())
    oa.load_state_dict(ob.state_dict())
    for d, e in zip(oa.replicators[0].delta, oc.replicators[0].delta):
        assert torch.equal(d, e)


def test_offload_refuses_cuda_graphs():
    with pytest.raises(ValueError, match="offload=True and graphs=True do not combine"):
        DeMoReplicator(offload=True, graphs=True)


def test_diloco_builds_its_pseudo_gradients_in_the_exchange_buffer():
    """A dense exchange's flat buffer holds DiLoCo's pseudo-gradients: its held buffers are
    that one copy of the parameters (and the payload), not two."""
    with LiveBytes():
        model = _model()
        P = 4 * sum(p.numel() for p in model.parameters())
        opt = DeToNATION(model.parameters(), "diloco", base="adamw", lr=1e-3)
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(4, 512)).square().mean().backward()
            opt.step()
    rep = opt.replicators[0]
    flat = rep.exchanges[0].layout.flat
    assert all(p.untyped_storage()._cdata == flat.untyped_storage()._cdata for p in rep.pseudo)
    assert P <= opt.memory_stats()["workspace_bytes"] < 1.2 * P
