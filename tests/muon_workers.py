"""Per-rank workers of the Muon tests (importable by child processes)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from dist_workers import Tiny, batch, shards
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import flexdemo
from flexdemo import LiveBytes
from flexdemo.checkpoint import load_checkpoint, save_checkpoint
from flexdemo.dtensor import local_tensor
from flexdemo.muon import MuonAdamW

# rows not divisible by 2, a matrix with fewer rows than ranks hold, wide and tall ones, and
# repeated shapes (an owner orthogonalises its matrices of one shape in one batched call)
SHAPES = [(7, 5), (33, 16), (1, 8), (16, 40), (12, 12), (33, 16), (12, 12), (12, 12)]
VECTORS = [(9,)]


def _full(step: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7 + step)
    return [scale * torch.randn(s, generator=g) for s in SHAPES + VECTORS]


def optimizer_worker(rank: int, world: int, replicate: int, shard: int,
                     bound: int | None = None) -> dict:
    """Row-sharded MuonAdamW (batched Newton-Schulz; ``bound``: its ns_batch_numel) against
    the unsharded one calling torch's Newton-Schulz per matrix, on the same full gradients."""
    mesh = init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("replicate", "shard"))
    start = _full(-1)
    names = [f"m{i}" for i in range(len(SHAPES))] + ["bias"]
    sharded = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh["shard"], [Shard(0)]))
               for t in start]
    plain = [torch.nn.Parameter(t.clone()) for t in start]
    kw = {"lr": 0.02, "weight_decay": 0.1}
    opt = MuonAdamW(list(zip(names, sharded)), **kw, ns_batch_numel=bound, ns_dtype="bf16")
    ref = MuonAdamW(list(zip(names, plain)), **kw, ns_mode="per_matrix")  # torch's, per matrix
    sent, workspace = [], 0
    for step in range(3):
        for p, q, g in zip(sharded, plain, _full(step)):
            p.grad = distribute_tensor(g.clone(), mesh["shard"], [Shard(0)])
            q.grad = g.clone()
        with LiveBytes() as mem:  # the step's transient bytes, after the first (the state)
            opt.step()
        if step:
            workspace = max(workspace, mem.peak)
        ref.step()
        sent.append((opt.stats.last_bytes_sent, opt.stats.last_bytes_received,
                     opt.stats.last_collectives))
    me = mesh["shard"].get_local_rank()
    mine = [local_tensor(p).detach().clone() for p in sharded]
    rows = [torch.chunk(p.detach(), shard, dim=0) for p in plain]
    expected = [r[me].clone() if me < len(r) else p.detach()[:0].clone()
                for r, p in zip(rows, plain)]
    return {"mine": mine, "expected": expected, "sent": sent, "shard_rank": me,
            "workspace": workspace}


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed + dist.get_rank())  # prepare() copies rank 0's weights
    return Tiny()


def _train(model, opt, steps: int, start: int, rank: int) -> list[dict]:
    stats = []
    for s in range(start, start + steps):
        x, y = batch(rank, s)
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        stats.append(opt.last_step_stats())
    return stats


def prepare_worker(rank: int, world: int, root: str) -> dict:
    """2 x 2 mesh: full sync against a one-process reference on the union of the batches;
    DeMo with an orthogonalised step; MuLoCo (streaming DiLoCo, Muon inner) save/resume."""
    out: dict = {}
    model, opt = flexdemo.prepare(_model(), "full", "muon", lr=0.01, replicate=2, shard=2)
    stats = _train(model, opt, 4, 0, rank)
    torch.manual_seed(0)
    ref = Tiny()
    ref_opt = MuonAdamW(ref.named_parameters(), lr=0.01)
    for s in range(4):  # each rank's gradient, reduced in the 2 x 2 mesh's order: the shard
        grads = []  # pairs (0, 1), (2, 3) first, then the replicas (halving is exact)
        for r in range(world):
            x, y = batch(r, s)
            (ref(x) - y).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
            ref_opt.zero_grad()
        for i, p in enumerate(ref.parameters()):
            p.grad = ((grads[0][i] + grads[1][i]) / 2 + (grads[2][i] + grads[3][i]) / 2) / 2
        ref_opt.step()
        ref_opt.zero_grad()
    out["full"] = {"mine": [p.full_tensor().detach() for p in model.parameters()],
                   "ref": [p.detach().clone() for p in ref.parameters()], "stats": stats,
                   "muon_names": opt.base.muon_names}

    model, opt = flexdemo.prepare(_model(), "demo", "muon", lr=0.01, replicate=2, shard=2,
                                  replicator_kwargs={"topk": 4, "chunk": 8, "sign": False,
                                                     "scale_by_lr": False},
                                  optimizer_kwargs={"momentum": 0.0})
    _train(model, opt, 4, 0, rank)
    out["demo"] = {"shards": shards(model), "coord": opt.mesh.get_coordinate(),
                   "identical": opt.replicas_identical()}

    def muloco(seed):
        rep = flexdemo.DiLoCoReplicator(inner_steps=4, fragments=2, tau=1)
        return flexdemo.prepare(_model(seed), rep, "muon", lr=0.01, replicate=2, shard=2)

    model, opt = muloco(0)
    _train(model, opt, 3, 0, rank)
    save_checkpoint(Path(root) / "step_000003", model, opt, step=3)
    _train(model, opt, 5, 3, rank)
    expected = shards(model)
    model2, opt2 = muloco(100)
    load_checkpoint(Path(root) / "step_000003", model2, opt2)
    _train(model2, opt2, 5, 3, rank)
    out["muloco"] = {"bitwise": all(torch.equal(a, b) for a, b in zip(expected, shards(model2))),
                     "shards": expected, "coord": opt.mesh.get_coordinate()}
    return out
