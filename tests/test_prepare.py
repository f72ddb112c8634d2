"""prepare() for large models: meta-device init, FSDP2 options, bf16, bad input, warnings."""

import pytest
import torch
from dist_util import replicas_by_shard, run_world
from dist_workers import Tiny
from libgpu_workers import large_model_worker
from torch import nn

import flexdemo
from flexdemo.sharding import broadcast_tensors


@pytest.fixture(scope="module")
def large():
    return run_world(large_model_worker, 4)


@pytest.mark.multiprocess
def test_meta_model_materialises_trains_and_replicas_start_identical(large):
    for res in large:
        assert res["device"] == {"cpu"}
        assert all(torch.isfinite(t).all() for t in res["meta"]["start"])
    groups = replicas_by_shard(large, "meta")
    for members in groups.values():
        a, b = members
        assert all(torch.equal(x, y) for x, y in zip(a["start"], b["start"]))
        assert all(torch.equal(x, y) for x, y in zip(a["end"], b["end"]))
        assert any(not torch.equal(x, y) for x, y in zip(a["start"], a["end"]))


@pytest.mark.multiprocess
def test_one_replica_mesh_warns_on_every_rank(large):
    for res in large:
        assert res["warned"] and "1 x 4" in res["warned"][0] and "replicate=" in res["warned"][0]


@pytest.mark.multiprocess
def test_meta_model_without_reset_parameters_needs_init_fn(large):
    for res in large:
        msg = res["no_reset"]
        assert msg is not None and "'1' (NoReset)" in msg and "init_fn" in msg
        assert torch.equal(res["init_fn_scale"], torch.full_like(res["init_fn_scale"], 0.5))


@pytest.mark.multiprocess
def test_bf16_computes_in_bf16_and_replicators_see_fp32(large):
    for res in large:
        r = res["bf16"]
        assert r["param_dtypes"] == {torch.float32}  # master weights
        assert set(r["logits"]) == {torch.bfloat16}
        assert r["grad_dtypes"] and all(d == {torch.float32} for d in r["grad_dtypes"])
    for members in replicas_by_shard(large, "bf16").values():
        assert all(torch.equal(x, y) for x, y in zip(members[0]["shards"], members[1]["shards"]))


# ---------------------------------------------------------------------------- one process
def test_meta_model_on_one_process_with_fsdp_kwargs():
    with torch.device("meta"):
        model = Tiny()
    with pytest.warns(flexdemo.NoReplicationWarning, match="1 x 1"):
        model, opt = flexdemo.prepare(model, "demo", device="cpu",
                                      fsdp_kwargs={"reshard_after_forward": False})
    assert all(p.device.type == "cpu" for p in model.parameters())
    x = torch.randn(4, 12)
    model(x).pow(2).mean().backward()
    opt.step()


class Parent(nn.Module):
    """Its initialiser overrides its child's, as after eager construction."""

    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(8, 8)
        self.attn = nn.MultiheadAttention(8, 2)  # initialises itself with _reset_parameters
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.child.weight, 0.25)

    def forward(self, x):
        return self.attn(self.child(x), x, x)[0]


def test_meta_init_runs_children_first_and_private_resets():
    with torch.device("meta"):
        model = Parent()
    eager = Parent()
    with pytest.warns(flexdemo.NoReplicationWarning):
        model, _ = flexdemo.prepare(model, "demo", device="cpu")
    assert torch.equal(model.child.weight, eager.child.weight)  # 0.25: the parent won
    w = model.attn.in_proj_weight
    assert torch.isfinite(w).all() and 0 < w.std() < 1 and torch.equal(
        model.attn.in_proj_bias, torch.zeros(24))


def test_bad_input_gives_one_clear_line():
    cases = [
        (dict(replicator=123), TypeError, "replicator must be a name"),
        (dict(replicator=["demo", 4]), TypeError, "replicator must be a name"),
        (dict(replicator=[]), TypeError, "empty list"),
        (dict(precision="fp16"), ValueError, "precision must be one of"),
        (dict(fsdp_kwargs={"mesh": None}), ValueError, "not fully_shard options"),
        (dict(fsdp_kwargs={"bogus": 1}), ValueError, "not fully_shard options"),
        (dict(precision="bf16", fsdp_kwargs={"mp_policy": None}), ValueError, "not both"),
        (dict(buffers="sum"), ValueError, "buffers must be one of"),
        (dict(device="meta"), ValueError, "cannot train"),
        (dict(device="tpu9"), ValueError, "device must be"),
        (dict(replicator_kwargs=5), TypeError, "replicator_kwargs must be a dict"),
        (dict(optimizer_kwargs=[1]), TypeError, "optimizer_kwargs must be a dict"),
        (dict(replicator_kwargs={"bogus": 1}), ValueError, "'demo' has no setting 'bogus'"),
    ]
    if not torch.cuda.is_available():
        cases.append((dict(device="cuda"), ValueError, "CUDA is not available"))
    for kwargs, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            flexdemo.prepare(Tiny(), **kwargs)


def test_second_prepare_and_complex_parameters_are_rejected():
    model = Tiny()
    with pytest.warns(flexdemo.NoReplicationWarning):
        model, _ = flexdemo.prepare(model, "demo")
    with pytest.raises(ValueError, match="already passed to flexdemo.prepare"):
        flexdemo.prepare(model, "demo")
    net = nn.Linear(3, 3)
    net.weight = nn.Parameter(torch.randn(3, 3, dtype=torch.complex64))
    with pytest.raises(ValueError, match="complex parameters are not supported"):
        flexdemo.prepare(net)


def test_no_warning_when_no_replication_is_asked_for(recwarn):
    flexdemo.prepare(Tiny(), "none")
    assert not [w for w in recwarn if issubclass(w.category, flexdemo.NoReplicationWarning)]


def test_broadcast_tensors_single_rank_is_a_no_op():
    t = [torch.randn(3), torch.arange(5)]
    before = [x.clone() for x in t]
    flexdemo.init_distributed()
    broadcast_tensors(t)
    assert all(torch.equal(a, b) for a, b in zip(t, before))


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp1", "inner-ddp"])
def test_data_parallel_wrapped_models_are_refused(wrapper):
    """DDP (or FSDP1) all-reduces every gradient itself: under prepare() the full gradients
    would cross the slow link on top of the replicator's exchange, without a word."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    fresh = not dist.is_initialized()  # earlier tests' prepare() may have made one
    if fresh:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        if wrapper == "ddp":
            model, name = DistributedDataParallel(Tiny()), "DistributedDataParallel"
        elif wrapper == "fsdp1":
            model = FullyShardedDataParallel(Tiny(), device_id=torch.device("cpu"))
            name = "FullyShardedDataParallel"
        else:
            model, name = nn.Sequential(DistributedDataParallel(Tiny())), "DistributedDataParallel"
        with pytest.raises(ValueError) as info:
            flexdemo.prepare(model, "demo")
        msg = str(info.value)
        assert "\n" not in msg and name in msg and "model.module" in msg, msg
    finally:
        if fresh:
            dist.destroy_process_group()


# ---------------------------------------------------------------------------- torch's habits
def test_gradient_accumulation_switch_works_at_shard_1():
    """The recipe of docs/optimizers.md at shard=1, where prepare() returns the model itself:
    set_requires_gradient_sync is there (a no-op) and the gradients just add up."""
    torch.manual_seed(0)
    net = Tiny()
    model, opt = flexdemo.prepare(net, "none", lr=0.01, shard=1)
    assert model is net and type(model) is Tiny  # not wrapped: type checks still hold
    xs = [torch.randn(4, 12) for _ in range(3)]
    expected = [torch.zeros_like(p) for p in model.parameters()]
    for x in xs:
        model.zero_grad()
        model(x).pow(2).mean().backward()
        for e, p in zip(expected, model.parameters()):
            e += p.grad
    model.zero_grad()
    for i, x in enumerate(xs):
        model.set_requires_gradient_sync(i == len(xs) - 1)
        model(x).pow(2).mean().backward()
    for e, p in zip(expected, model.parameters()):
        torch.testing.assert_close(p.grad, e)
    opt.step()
    with pytest.raises(TypeError, match="True or False"):
        model.set_requires_gradient_sync("no")


def _norm_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 4))


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("where", ["prepare", "optimizer_kwargs"])
def test_no_decay_spares_norms_and_biases(optimizer, where):
    """no_decay=True: a LayerNorm's weight and the biases keep their values under weight decay
    (a step on zero gradients moves parameters by the decay alone); the Linear weights decay,
    whether the decay is prepare()'s own or the base optimizer's (AdamW, both parts of Muon)."""
    lr, wd = 0.1, 0.5
    decay = {"weight_decay": wd} if where == "prepare" else {
        "optimizer_kwargs": {"weight_decay": wd}}
    model, opt = flexdemo.prepare(_norm_model(), "none", optimizer, lr=lr, shard=1,
                                  no_decay=True, **decay)
    assert flexdemo.decay.no_decay_names(model) == [
        "0.bias", "1.weight", "1.bias", "2.bias", "3.bias"]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        if n.endswith("bias") or n.startswith("1."):
            assert torch.equal(p, before[n]), n
        else:
            torch.testing.assert_close(p, before[n] * (1 - lr * wd), rtol=0, atol=1e-7)
            assert not torch.equal(p, before[n]), n


def test_no_decay_rules_and_refusals():
    model, opt = flexdemo.prepare(_norm_model(), "none", "adamw", lr=0.1, shard=1,
                                  weight_decay=0.5, no_decay=["2.weight"])
    spared = [g for g in opt.param_groups if g["flexdemo_weight_decay"] == 0.0]
    assert [p for g in spared for p in g["params"]] == [model[2].weight]
    _, opt = flexdemo.prepare(_norm_model(), "none", "adamw", shard=1,
                              optimizer_kwargs={"weight_decay": 0.1},
                              no_decay=lambda name, p: name.startswith("3."))
    assert sorted(len(g["params"]) for g in opt.param_groups if g["weight_decay"] == 0) == [2]
    with pytest.raises(ValueError, match="does not have: \\['nope'\\]"):
        flexdemo.prepare(_norm_model(), "none", shard=1, no_decay=["nope"])
    with pytest.raises(ValueError, match="not in optimizer_kwargs"):
        flexdemo.prepare(_norm_model(), "none", shard=1, optimizer_kwargs={"no_decay": True})
    # without names (plain tensors), True falls back to the dimensions alone
    opt = flexdemo.DeToNATION(_norm_model().parameters(), "none", base="adamw",
                              weight_decay=0.1, no_decay=True)
    assert [len(g["params"]) for g in opt.param_groups] == [3, 5]


def test_data_parallel_wrap_after_prepare_is_refused_at_the_forward():
    """Frameworks (HF Trainer, Accelerate, Lightning) wrap the model they are given in DDP,
    after prepare(): DDP would all-reduce every gradient in full before the optimizer's step.
    A group of one: DDP runs there."""
    from torch.nn.parallel import DistributedDataParallel

    model, _ = flexdemo.prepare(Tiny(), "none", shard=1)
    x = torch.randn(2, 12)
    model(x)  # unwrapped: fine
    for wrapped in (DistributedDataParallel(model),
                    DistributedDataParallel(nn.Sequential(model, nn.Linear(6, 6)))):
        with pytest.raises(RuntimeError) as info:
            wrapped(x)
        msg = str(info.value)
        assert "\n" not in msg and "DistributedDataParallel" in msg and "wrap" in msg, msg
    # DDP told to leave the prepared model's parameters alone syncs nothing of it: allowed
    parent = nn.Sequential(model, nn.Linear(6, 6))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        parent, [f"0.{n}" for n, _ in model.named_parameters()])
    DistributedDataParallel(parent)(x)
