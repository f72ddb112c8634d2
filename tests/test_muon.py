"""optimizer="muon": the parameter split, torch.optim.Muon's bits, sharding, MuLoCo, errors."""

from __future__ import annotations

import copy

import pytest
import torch
from dist_util import run_world
from muon_workers import SHAPES, optimizer_worker, prepare_worker

import flexdemo
from flexdemo.app.tasks.gpt import GPT, gpt_config
from flexdemo.muon import MuonAdamW, chunk_rows, hidden_matrix_names, owners
from flexdemo.optim import make_base_optimizer


def _gpt():
    torch.manual_seed(0)
    return GPT(gpt_config("tiny"))


def test_split_keeps_embeddings_head_norms_and_biases_on_adamw():
    model = _gpt()
    opt = MuonAdamW(model.named_parameters(), lr=1e-3)
    muon = set(opt.muon_names)
    assert muon == set(hidden_matrix_names(model))
    for name, p in model.named_parameters():
        hidden = p.ndim == 2 and name.startswith("blocks.")
        assert (name in muon) == hidden, name
    # an embedding named like a hidden layer is still found by its module type
    m = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4))
    assert hidden_matrix_names(m) == ["1.weight"]
    # the rule can be overridden: by names or by a predicate
    names = ["blocks.0.attn.qkv.weight"]
    assert MuonAdamW(model.named_parameters(), muon_params=names).muon_names == names
    every = MuonAdamW(model.named_parameters(), muon_params=lambda n, p: p.ndim == 2)
    assert "head.weight" in every.muon_names and "tok.weight" in every.muon_names


def test_lr_and_weight_decay_reach_both_parts():
    model = _gpt()
    opt = flexdemo.DeToNATION(list(model.named_parameters()), "none", base="muon", lr=0.01,
                              base_kwargs={"weight_decay": 0.1, "momentum": 0.9})
    kinds = {g["use_muon"]: g for g in opt.param_groups}
    assert set(kinds) == {True, False}
    assert kinds[True]["weight_decay"] == kinds[False]["weight_decay"] == 0.1
    assert kinds[True]["momentum"] == 0.9
    for g in opt.param_groups:  # what an lr schedule does
        g["lr"] = 0.5
    assert [g["lr"] for g in opt.base._adamw.param_groups] == [0.5]
    # lr 0 and weight decay: parameters are unchanged by both parts
    for g in opt.param_groups:
        g["lr"] = 0.0
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randint(0, 256, (2, 64)), torch.randint(0, 256, (2, 64))).backward()
    opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    for g in opt.param_groups:  # a step with lr: both parts move
        g["lr"] = 0.01
    opt.step()
    moved = {n: not torch.equal(a, p) for (n, p), a in zip(model.named_parameters(), before)}
    assert moved["blocks.0.attn.qkv.weight"] and moved["tok.weight"] and moved["ln_f.bias"]


def test_unsharded_is_bitwise_torch_muon_plus_adamw():
    model = _gpt()
    ref = copy.deepcopy(model)
    opt = MuonAdamW(model.named_parameters(), lr=1e-2, weight_decay=0.1, momentum=0.9,
                    ns_dtype="bf16")  # torch's precision (the default on CPU is fp32)
    muon = set(opt.muon_names)
    ref_muon = torch.optim.Muon([p for n, p in ref.named_parameters() if n in muon], lr=1e-2,
                                weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw")
    ref_adam = torch.optim.AdamW([p for n, p in ref.named_parameters() if n not in muon],
                                 lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x, y = torch.randint(0, 256, (4, 64), generator=g), torch.randint(0, 256, (4, 64),
                                                                         generator=g)
        for m in (model, ref):
            m(x, y).backward()
        for o in (opt, ref_muon, ref_adam):
            o.step()
            o.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


def test_state_dict_round_trip_resumes_bitwise():
    model = _gpt()
    opt = MuonAdamW(model.named_parameters(), lr=1e-2)
    x = torch.randint(0, 256, (2, 64))

    def step(m, o):
        m(x, x).backward()
        o.step()
        o.zero_grad()

    step(model, opt)
    twin = copy.deepcopy(model)
    twin_opt = MuonAdamW(twin.named_parameters(), lr=1e-2)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for _ in range(2):
        step(model, opt)
        step(twin, twin_opt)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_owners_spread_the_matrices_and_rows_follow_torch_chunk():
    shapes = [torch.Size(s) for s in [(64, 64)] * 4 + [(8, 8)] * 2]
    own = owners(shapes, 2)
    assert sorted(own[:4]) == [0, 0, 1, 1]
    for rows, parts in ((7, 2), (33, 4), (1, 2), (10, 4)):
        assert chunk_rows(rows, parts) == [len(c) for c in torch.arange(rows).chunk(parts)] + \
            [0] * (parts - len(torch.arange(rows).chunk(parts)))


def test_bad_muon_settings_are_one_line(monkeypatch):
    p = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="a setting of optimizer 'muon', not of 'adamw'"):
        make_base_optimizer("adamw", [p], 1e-3, ns_steps=3)
    with pytest.raises(ValueError, match="names parameters the model does not have"):
        MuonAdamW([("w", p)], muon_params=["v"])
    with pytest.raises(ValueError, match="2-D parameters only"):
        MuonAdamW([("b", torch.nn.Parameter(torch.zeros(3)))], muon_params=["b"])
    with pytest.raises(ValueError, match="momentum must be in"):
        MuonAdamW([p], momentum=1.5)
    monkeypatch.delattr(torch.optim, "Muon")  # a torch older than 2.9
    with pytest.raises(ValueError, match=r"needs torch >= 2\.9 .*this is torch"):
        make_base_optimizer("muon", [p], 1e-3)


def test_muloco_in_simulated_replicas_resumes_bitwise():
    def loss_fn(model, b):
        return model(*b)

    def sim():
        return flexdemo.SimulatedReplicas(_gpt, loss_fn, replicas=2, replicator="diloco",
                                          optimizer="muon", lr=1e-2, seed=0,
                                          replicator_kwargs={"inner_steps": 3})

    gens = [torch.Generator().manual_seed(r) for r in range(2)]
    data = [[(torch.randint(0, 256, (2, 64), generator=g),) * 2 for g in gens]
            for _ in range(8)]
    a = sim()
    for b in data[:4]:
        a.step(b)
    saved = copy.deepcopy(a.state_dict())
    for b in data[4:]:
        a.step(b)
    c = sim()
    c.load_state_dict(saved)
    for b in data[4:]:
        c.step(b)
    assert type(a.optimizers[0].base).__name__ == "MuonAdamW"
    for ma, mc in zip(a.models, c.models):
        assert all(torch.equal(x, y) for x, y in zip(ma.parameters(), mc.parameters()))


@pytest.mark.multiprocess
@pytest.mark.parametrize("replicate,shard", [(1, 2), (2, 2)], ids=["1x2", "2x2"])
def test_sharded_is_bitwise_the_unsharded_optimizer(replicate, shard):
    results = run_world(optimizer_worker, replicate * shard, replicate, shard)
    for res in results:
        for i, (a, b) in enumerate(zip(res["mine"], res["expected"])):
            assert torch.equal(a, b), f"shard rank {res['shard_rank']}: parameter {i} differs"
    # every matrix crossed once each way: bf16 rows that the owner does not hold itself
    own = owners([torch.Size(s) for s in SHAPES], shard)
    away = sum(r * s[1] for i, s in enumerate(SHAPES)
               for o, r in enumerate(chunk_rows(s[0], shard)) if o != own[i])
    group = results[:shard]
    for step in range(3):
        assert sum(r["sent"][step][0] for r in group) == 2 * 2 * away
        assert sum(r["sent"][step][1] for r in group) == 2 * 2 * away
        assert all(r["sent"][step][2] == 2 for r in group)


@pytest.mark.multiprocess
def test_sharded_in_bounded_chunks_is_bitwise_the_unsharded_optimizer():
    """ns_batch_numel cuts the sharded matrices into chunks (one exchange there and back
    each, owners balanced per chunk, applied before the next): the same bits as the
    unsharded optimizer, in a few bf16 copies of a chunk."""
    results = run_world(optimizer_worker, 2, 1, 2, 150)
    for res in results:
        for i, (a, b) in enumerate(zip(res["mine"], res["expected"])):
            assert torch.equal(a, b), f"shard rank {res['shard_rank']}: parameter {i} differs"
    assert all(r["sent"][step][2] > 2 for r in results for step in range(3))
    # the step's transient bytes, counted exactly: at most 4 bf16 copies of a chunk (a rank's
    # send and receive buffers, or the owner's stack, spare and products); the chunk is the
    # bound on each of 2 ranks, or a larger matrix alone (33 x 16). Before the buffers were
    # written in bf16 and dropped as they were spent, rank 0 peaked at 9,944 bytes
    chunk = max(2 * 150, *(r * c for r, c in SHAPES))
    assert all(0 < r["workspace"] <= 2 * 4 * chunk for r in results)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return run_world(prepare_worker, 4, str(tmp_path_factory.mktemp("muon")))


@pytest.mark.multiprocess
def test_prepare_full_sync_matches_one_process_reference(prepared):
    for res in prepared:
        full = res["full"]
        assert "head.weight" not in full["muon_names"] and "inp.weight" in full["muon_names"]
        # the reference reduces each rank's gradient in the mesh's order, so the sums are
        # the same floating-point sums: bitwise (it summed the concatenated batches before,
        # and Newton-Schulz amplified that rounding past a fixed tolerance on AMX hosts)
        for a, b in zip(full["mine"], full["ref"]):
            assert torch.equal(a, b), (a - b).abs().max()
        assert all(s["shard_bytes_sent"] > 0 and s["shard_seconds"] >= 0 for s in full["stats"])


@pytest.mark.multiprocess
def test_prepare_demo_orthogonalised_keeps_replicas_identical(prepared):
    by_shard: dict = {}
    for res in prepared:
        by_shard.setdefault(res["demo"]["coord"][1], []).append(res["demo"]["shards"])
        assert res["demo"]["identical"]
    for first, second in by_shard.values():
        assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.multiprocess
def test_prepare_muloco_resumes_bitwise_on_every_rank(prepared):
    assert all(res["muloco"]["bitwise"] for res in prepared)
    # inner Muon steps differ per replica until a sync: replicas of a shard are not identical
    by_shard: dict = {}
    for res in prepared:
        by_shard.setdefault(res["muloco"]["coord"][1], []).append(res["muloco"]["shards"])
    assert any(not all(torch.equal(a, b) for a, b in zip(*pair)) for pair in by_shard.values())


def test_momentum_schedulers_cycle_muons_momentum():
    """OneCycleLR with its defaults: ``defaults`` shows Muon's momentum, which it cycles in
    the Muon groups (AdamW's betas keep their values)."""
    model = _gpt()
    opt = flexdemo.DeToNATION(list(model.named_parameters()), "none", base="muon", lr=0.01,
                              no_decay=True, base_kwargs={"weight_decay": 0.1})
    assert opt.defaults["momentum"] == opt.base.defaults["momentum"] == 0.95
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=4)
    x = torch.randint(0, 256, (2, 16))
    seen = []
    for _ in range(3):
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        seen.append([g["momentum"] for g in opt.base.param_groups if g["use_muon"]])
    assert len({m[0] for m in seen}) == 3 and all(len(set(m)) == 1 for m in seen)
    assert {g["betas"] for g in opt.base._adamw.param_groups} == {(0.9, 0.999)}
    assert [g["weight_decay"] for g in opt.base.param_groups] == [0.1, 0.1, 0.0]
