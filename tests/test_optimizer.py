"""Single-process behaviour of replicators and the optimizer (a replication group of one)."""

import copy

import pytest
import torch
from torch import nn

import flexdemo
from flexdemo import (
    DeMo,
    DeMoReplicator,
    DeToNATION,
    FullReplicator,
    NonFiniteGradientError,
    RandomReplicator,
    SlicingReplicator,
    StridingReplicator,
)
from flexdemo.mesh import mesh_shape
from flexdemo.transport import all_gather_bytes, all_reduce_bytes


def setup(rep, shapes):
    rep.setup([torch.Size(s) for s in shapes], torch.device("cpu"), None)
    return rep


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(24, 70), nn.Tanh(), nn.Linear(70, 131), nn.Tanh(),
                         nn.Linear(131, 5))


def loss_of(m, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 24, generator=g)
    return m(x).pow(2).mean()


def train(m, opt, steps, start=0):
    losses = []
    for s in range(start, start + steps):
        loss = loss_of(m, s)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_demo_full_topk_is_sign_sgd():
    """topk = whole block on one replica: the momentum is sent entirely every step, so the
    update is sign-SGD on lr * grad (entries whose gradient is within float round-off of zero
    may take either sign). Blocks here are at most 64x64 (one padded)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(24, 64), nn.Tanh(), nn.Linear(64, 131), nn.Tanh(),
                      nn.Linear(131, 5))
    lr = 0.01
    opt = DeMo(m.parameters(), lr=lr, compression_topk=64 * 64, compression_chunk=64)
    for s in range(3):
        loss_of(m, s).backward()
        before = [p.detach().clone() for p in m.parameters()]
        grads = [p.grad.clone() for p in m.parameters()]
        opt.step()
        opt.zero_grad()
        for p, b, g in zip(m.parameters(), before, grads):
            step = (b - p.detach()) / lr
            significant = g.abs() > 1e-4 * g.abs().max()
            assert significant.float().mean() > 0.9
            assert torch.equal(step[significant].round(), torch.sign(g)[significant])
            assert bool((step.abs().round() <= 1).all())
        for d in opt.replicators[0].delta:  # everything was sent
            assert float(d.abs().max()) < 1e-8


@pytest.mark.parametrize("shape", [(128, 192), (131, 70), (300,), (131,)])
def test_demo_error_feedback_keeps_momentum(shape):
    """What is sent plus what stays in delta equals the decayed momentum (nothing is lost)."""
    torch.manual_seed(0)
    rep = setup(DeMoReplicator(topk=8, chunk=32, decay=0.9, sign=False, small="separate"),
                [shape])
    t, plan = rep.units[0].transform, rep.units[0].plan
    assert len(rep.units) == (2 if shape == (131, 70) else 1)  # rows that tile, and the rest

    def momentum():  # in the parameter's domain, over the tensor's units
        parts = [d.reshape(u.plan.shape) if u.plan.needs_padding
                 else u.transform.decode(d.clone()).reshape(u.plan.shape)
                 for u, d in zip(rep.units, rep.delta)]
        return torch.cat(parts).reshape(shape)

    g1, g2 = torch.randn(shape), torch.randn(shape)
    out1 = rep([g1.clone()], [0.5], 0)[0]
    torch.testing.assert_close(out1 + momentum(), 0.5 * g1, atol=1e-5, rtol=1e-5)
    before = momentum().clone()
    out2 = rep([g2.clone()], [0.5], 1)[0]
    torch.testing.assert_close(out2 + momentum(), 0.9 * before + 0.5 * g2, atol=1e-5, rtol=1e-5)
    if not plan.needs_padding:  # only topk coefficients per block were sent
        rows = out2.reshape(-1, plan.shape2d[1])[: plan.shape2d[0]]
        nonzero = (t.encode(rows).abs() > 1e-6).sum(1)
        assert int(nonzero.max()) <= 8


@pytest.mark.parametrize("cls", [RandomReplicator, StridingReplicator, SlicingReplicator])
def test_subset_error_feedback(cls):
    torch.manual_seed(0)
    rep = setup(cls(rate=0.25, decay=0.9, sign=False), [(20, 10)])
    g = torch.randn(20, 10)
    out = rep([g.clone()], [1.0], 0)[0]
    torch.testing.assert_close(out.reshape(-1) + rep.buffers[0], g.reshape(-1))
    assert int((out != 0).sum()) <= rep.counts[0]


def test_striding_and_slicing_cover_every_entry_once_per_period():
    for cls, period in ((StridingReplicator, 4), (SlicingReplicator, 4)):
        rep = setup(cls(rate=0.25), [(40,), (8, 5)])
        for i, numel in enumerate((40, 40)):
            seen = torch.cat([rep.indices(i, s) for s in range(period)])
            assert sorted(seen.tolist()) == list(range(numel)), cls.__name__


def test_random_indices_shared_seed():
    a = setup(RandomReplicator(rate=0.1, seed=3), [(100,)])
    b = setup(RandomReplicator(rate=0.1, seed=3), [(100,)])
    assert torch.equal(a.indices(0, 5), b.indices(0, 5))
    assert not torch.equal(a.indices(0, 5), a.indices(0, 6))


def test_schedules():
    r = FullReplicator(replicate_every=3)
    assert [s for s in range(10) if r.communicates(s)] == [0, 3, 6, 9]
    r = FullReplicator(skip_every=4)
    assert [s for s in range(10) if not r.communicates(s)] == [3, 7]
    r = FullReplicator(replicate_every=2, skip_every=3)
    assert [s for s in range(12) if r.communicates(s)] == [0, 4, 6, 10]


def test_byte_formulas():
    assert all_reduce_bytes(1000, 4, 1) == 0
    assert all_reduce_bytes(1000, 4, 2) == 4000
    assert all_reduce_bytes(1000, 4, 4) == 2 * 3 * 250 * 4
    assert all_reduce_bytes(1001, 4, 4) == 2 * 3 * 251 * 4
    assert all_gather_bytes(100, 4) == 300
    rep = setup(DeMoReplicator.preset("original"), [(128, 128), (128,)])
    # header 32; the matrix: 4 blocks x 32 indices at 12 bits (192 B) + fp32 values (512 B);
    # the vector, batched as a (2, 64) matrix: one block of 128, 32 indices at 7 bits (28 B,
    # aligned to 32) + values (128 B)
    assert rep.payload_bytes() == 32 + 192 + 512 + 32 + 128
    rep = setup(DeMoReplicator(topk=32, values="int8"), [(128, 128)])
    assert rep.payload_bytes() == 32 + 192 + (4 * 32 + 2 * 4)
    # the default: topk 16, int2 values (2 bits each + two bf16 per block)
    rep = setup(DeMoReplicator(), [(128, 128)])
    assert rep.payload_bytes() == 32 + 96 + (16 + 4 * 4)


def test_state_dict_round_trip_gives_same_next_step():
    for rep in ("demo", "random", "striding", "slicing"):
        m = model()
        opt = DeToNATION(m.parameters(), rep, base="adamw", lr=1e-2, weight_decay=0.1)
        train(m, opt, 3)
        m2 = copy.deepcopy(m)
        opt2 = DeToNATION(m2.parameters(), rep, base="adamw", lr=1e-2, weight_decay=0.1)
        opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
        assert opt2.steps == 3
        a, b = train(m, opt, 2, start=3), train(m2, opt2, 2, start=3)
        assert a == b, rep
        for p, q in zip(m.parameters(), m2.parameters()):
            assert torch.equal(p, q), rep
        # and without the replicator state the trajectory differs (the state matters)
        if rep == "demo":
            m3 = copy.deepcopy(m2)
            opt3 = DeToNATION(m3.parameters(), rep, base="adamw", lr=1e-2, weight_decay=0.1)
            sd = copy.deepcopy(opt2.state_dict())
            opt3.load_state_dict(sd)
            for d in opt3.replicators[0].delta:
                d.zero_()
            train(m2, opt2, 1, start=5)
            train(m3, opt3, 1, start=5)
            assert any(not torch.equal(p, q) for p, q in zip(m2.parameters(), m3.parameters()))


def test_param_groups_stay_shared_after_load():
    m = model()
    opt = DeToNATION(m.parameters(), "demo", base="adamw", lr=1e-2)
    train(m, opt, 1)
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(m, opt, 1, start=1)
    sched.step()
    assert opt.base.param_groups[0]["lr"] == pytest.approx(5e-3)


def test_load_state_dict_rejects_other_model():
    opt = DeToNATION(model().parameters(), "demo")
    other = DeToNATION(nn.Linear(3, 3).parameters(), "demo")
    with pytest.raises(ValueError, match="momentum buffers|another model"):
        opt.load_state_dict(other.state_dict())


def test_load_state_dict_refuses_other_shapes_kinds_and_non_states_before_loading():
    def two(out):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, out))

    def trained(rep, base, out=3):
        m = two(out)
        opt = DeToNATION(m.parameters(), rep, base=base, lr=1e-2)
        loss = m(torch.randn(2, 4)).square().sum()
        loss.backward()
        opt.step()
        return opt.state_dict()

    # same parameter count, other shapes: the small-tensor batch pads both alike, and
    # torch's AdamW would load its moments and fail only at the next step
    cases = [(trained("demo", "adamw"), "demo", "adamw", 5, "parameter 2 has shape"),
             (trained("full", "sgd"), "full", "sgd", 5, "parameter 2 has shape"),
             (trained("demo", "adamw"), "full", "adamw", 3, "replicators"),
             (trained("demo", "adamw"), "diloco", "adamw", 3, "replicators"),
             (trained("demo", "adamw"), "demo", "sgd", 3, "written by AdamW")]
    for sd, rep, base, out, msg in cases:
        opt = DeToNATION(two(out).parameters(), rep, base=base, lr=1e-2)
        with pytest.raises(ValueError, match=msg):
            opt.load_state_dict(sd)
        assert opt.steps == 0 and not any(opt.base.state.values())  # nothing was loaded
    opt = DeToNATION(two(3).parameters(), "demo")
    for junk in ({"foo": 1}, 5, {"state": {}}):
        with pytest.raises(ValueError, match="not an optimizer state of flexdemo"):
            opt.load_state_dict(junk)


def test_bad_settings_name_the_setting_and_the_choices():
    with pytest.raises(ValueError, match=r"replicator 'demo' has no setting 'bogus'.*'topk'"):
        flexdemo.make_replicator("demo", bogus=1)
    with pytest.raises(ValueError, match=r"'demo-warmup' has no setting 'tpk'.*'warmup_topk'"):
        flexdemo.make_replicator("demo-warmup", tpk=1)
    with pytest.raises(ValueError, match=r"'diloco' has no setting 'h'.*'inner_steps'"):
        flexdemo.make_replicator("diloco", h=4)
    with pytest.raises(ValueError, match="warmup_steps must be an integer >= 0"):
        flexdemo.make_replicator("demo-warmup", warmup_steps=-1)
    params = model().parameters()
    with pytest.raises(ValueError, match="learning rate goes in lr="):
        DeToNATION(params, "demo", base="adamw", base_kwargs={"lr": 0.1})
    with pytest.raises(ValueError, match=r"base optimizer 'adamw' \(AdamW\).*'bogus'"):
        DeToNATION(params, "demo", base="adamw", base_kwargs={"bogus": 0.1})
    with pytest.raises(TypeError, match="base_kwargs must be a dict"):
        DeToNATION(params, "demo", base="adamw", base_kwargs=5)


def test_decoupled_weight_decay():
    m = nn.Linear(4, 4)
    before = m.weight.detach().clone()
    opt = DeMo(m.parameters(), lr=0.1, weight_decay=0.5)
    m.weight.grad = torch.zeros_like(m.weight)  # sign(0) = 0: only the decay acts
    opt.step()
    torch.testing.assert_close(m.weight.detach(), before * (1 - 0.1 * 0.5))


def test_parameters_without_gradients_are_skipped():
    m = model()
    opt = DeToNATION(m.parameters(), "demo", lr=1e-2)
    frozen = m[0].weight.detach().clone()
    loss_of(m, 0).backward()
    m[0].weight.grad = None
    opt.step()
    assert torch.equal(m[0].weight, frozen)
    assert not torch.equal(m[2].weight.grad, torch.zeros_like(m[2].weight))


def test_nonfinite_raise_and_skip():
    m = model()
    opt = DeToNATION(m.parameters(), "demo", lr=1e-2)
    loss_of(m, 0).backward()
    m[2].bias.grad[3] = float("nan")
    with pytest.raises(NonFiniteGradientError, match="non-finite"):
        opt.step()
    m = model()
    before = [p.detach().clone() for p in m.parameters()]
    opt = DeToNATION(m.parameters(), "demo", lr=1e-2, nonfinite="skip")
    loss_of(m, 0).backward()
    m[2].weight.grad[0, 0] = float("inf")
    opt.step()
    assert opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    assert all(float(d.abs().sum()) == 0 for d in opt.replicators[0].delta)
    stats = opt.last_step_stats()  # the step is counted, and said to be skipped
    assert (opt.steps, stats["skipped"], stats["skipped_steps"]) == (1, True, 1)
    opt.zero_grad()
    loss_of(m, 0).backward()
    opt.step()
    stats = opt.last_step_stats()
    assert (opt.steps, stats["skipped"], stats["skipped_steps"]) == (2, False, 1)


def test_learns_like_sgd():
    """DeMo on one replica reduces the loss of a small regression task."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    x = torch.randn(256, 8)
    y = x[:, :1] * 2 - x[:, 1:2]
    opt = DeMo(m.parameters(), lr=3e-3, compression_topk=4, compression_chunk=8)
    first = None
    for _ in range(200):
        loss = (m(x) - y).pow(2).mean()
        first = first if first is not None else loss.item()
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.item() < 0.2 * first


@pytest.mark.parametrize("kwargs,match", [
    ({"topk": 0}, "topk"), ({"topk": 2.5}, "topk"), ({"chunk": 1}, "chunk"),
    ({"topk": 65, "chunk": 8}, "exceeds"), ({"decay": 1.5}, "decay"), ({"decay": -0.1}, "decay"),
    ({"replicate_every": 0}, "replicate_every"), ({"skip_every": 1}, "skip_every"),
    ({"skip_every": -2}, "skip_every"), ({"values": "int3"}, "values"),
    ({"overlap": "early"}, "overlap"), ({"overlap": "delayed", "bucket": False}, "delayed"),
    ({"overlap": "delayed", "replicate_every": 2}, "delayed"),
    ({"on_bad_peer": "ignore"}, "on_bad_peer"), ({"small": "dense"}, "small"),
])
def test_bad_demo_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DeMoReplicator(**kwargs)


@pytest.mark.parametrize("cls", [RandomReplicator, StridingReplicator, SlicingReplicator])
def test_bad_rates(cls):
    for rate in (0, -0.5, 1.5):
        with pytest.raises(ValueError, match="rate"):
            cls(rate=rate)


def test_bad_optimizer_arguments():
    ps = list(model().parameters())
    with pytest.raises(ValueError, match="unknown replicator"):
        DeToNATION(ps, "dilo")
    with pytest.raises(ValueError, match="unknown base optimizer"):
        DeToNATION(ps, "demo", base="lamb")
    with pytest.raises(ValueError, match="lr"):
        DeToNATION(ps, "demo", lr=-1)
    with pytest.raises(ValueError, match="nonfinite"):
        DeToNATION(ps, "demo", nonfinite="ignore")
    with pytest.raises(ValueError, match="twice"):
        DeToNATION(ps, "demo", base="adamw", weight_decay=0.1,
                   base_kwargs={"weight_decay": 0.1})
    with pytest.raises(ValueError, match="empty parameter list"):
        DeToNATION([], "demo")
    with pytest.raises(TypeError, match="name or a Replicator"):
        DeToNATION(ps, 3)


@pytest.mark.parametrize("world,rep,shard,match", [
    (4, 3, None, "does not divide"), (4, None, 3, "does not divide"),
    (4, 2, 3, "ranks, but the world has 4"), (4, 0, None, "positive integer"),
])
def test_bad_mesh_shapes(world, rep, shard, match):
    with pytest.raises(ValueError, match=match):
        mesh_shape(world, rep, shard)


def test_mesh_shape_defaults(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert mesh_shape(8) == (4, 2)
    assert mesh_shape(8, replicate=8) == (8, 1)
    assert mesh_shape(8, shard=8) == (1, 8)


def test_prepare_single_process_runs():
    m, opt = flexdemo.prepare(model(), replicator="demo", lr=1e-3)
    losses = train(m, opt, 3)
    assert all(x == x for x in losses) and opt.steps == 3
    assert opt.mesh.shape == (1, 1)


def test_demo_presets():
    from flexdemo.replicate import make_replicator

    agg = make_replicator("demo-aggressive")
    assert (agg.topk, agg.values) == (4, "sign")
    orig = make_replicator("demo-original", chunk=32)
    assert (orig.topk, orig.values, orig.chunk) == (32, "fp32", 32)
    assert (DeMoReplicator().topk, DeMoReplicator().values) == (16, "int2")
    with pytest.raises(ValueError, match="unknown DeMo preset"):
        DeMoReplicator.preset("fastest")


def test_default_shard_units_take_outermost_blocks():
    """Blocks in a ModuleList that hold their own ModuleList of layers (T5-like) are sharded
    as whole blocks: FSDP2 cannot shard a layer inside an already sharded block."""
    from flexdemo.sharding import default_shard_units

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.ModuleList([Block(), Block()])
            self.decoder = nn.ModuleList([Block()])
            self.heads = nn.ModuleList([nn.Linear(4, 2)])

    net = Net()
    units = default_shard_units(net)
    assert [id(u) for u in units] == [id(m) for m in (*net.encoder, *net.decoder, *net.heads)]


# ---------------------------------------------------------------------------- torch's habits
SCHEDULERS = {
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=8),
    "CyclicLR": lambda o: torch.optim.lr_scheduler.CyclicLR(o, base_lr=0.001, max_lr=0.05,
                                                          step_size_up=3),
}


@pytest.mark.parametrize("sched", sorted(SCHEDULERS))
@pytest.mark.parametrize("base,kwargs", [("adamw", {}), ("sgd", {"momentum": 0.9})])
def test_schedulers_that_cycle_momentum_work_with_their_defaults(sched, base, kwargs):
    """OneCycleLR and CyclicLR look for momentum or betas in ``defaults`` and cycle them: what
    they write reaches the base optimizer, so with "none" the run is torch's own, bitwise."""
    m, ref = model(), model()
    opt = DeToNATION(m.parameters(), "none", base=base, lr=0.01, base_kwargs=kwargs)
    torch_opt = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[base](
        ref.parameters(), lr=0.01, weight_decay=0.0, **kwargs)
    key = "betas" if base == "adamw" else "momentum"
    assert opt.defaults[key] == torch_opt.defaults[key]
    s, s_ref = SCHEDULERS[sched](opt), SCHEDULERS[sched](torch_opt)
    seen = set()
    for step in range(6):
        for mod, o, sc in ((m, opt, s), (ref, torch_opt, s_ref)):
            loss_of(mod, step).backward()
            o.step()
            o.zero_grad()
            sc.step()
        group = opt.base.param_groups[0]
        seen.add(group["betas"][0] if base == "adamw" else group["momentum"])
        assert opt.param_groups[0] is group
    assert len(seen) > 2  # the momentum (beta1) was cycled in the base optimizer
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_add_param_group_is_refused_at_the_call():
    opt = DeToNATION(model().parameters(), "demo", base="adamw")
    with pytest.raises(ValueError, match=r"add_param_group.*build the optimizer with every "
                                         r"parameter") as info:
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    assert "\n" not in str(info.value)
    assert len(opt.param_groups) == 1
    train(model(), DeToNATION(model().parameters(), "demo"), 1)  # construction still works


def test_frozen_parameters_join_the_exchange_once_unfrozen():
    """What add_param_group is used for: build with every parameter, frozen ones included."""
    m = model()
    m[0].weight.requires_grad_(False)
    opt = DeToNATION(m.parameters(), "demo", base="adamw", lr=1e-2)
    before = m[0].weight.detach().clone()
    train(m, opt, 2)
    assert torch.equal(m[0].weight, before)
    m[0].weight.requires_grad_(True)
    train(m, opt, 2, start=2)
    assert not torch.equal(m[0].weight, before)
