"""Worker functions run on every rank by the distributed tests (importable by child processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from dist_util import corrupt_first_values
from torch import nn

import flexdemo
from flexdemo import DeMoReplicator, FullReplicator, NonFiniteGradientError
from flexdemo.dtensor import local_tensor

REPLICATORS = {
    "demo": {"topk": 4, "chunk": 8},
    "full": {},
    "none": {},
    "random": {"rate": 0.25},
    "striding": {"rate": 0.25},
    "slicing": {"rate": 0.25},
}
STEPS = 6


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 32)
        self.blocks = nn.ModuleList([nn.Linear(32, 32) for _ in range(2)])
        self.out = nn.Linear(32, 6)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.out(x)


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 12, generator=g), torch.randn(8, 6, generator=g)


def train(model, opt, steps, rank, start=0):
    per_step = []
    for s in range(start, start + steps):
        x, y = batch(rank, s)
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        per_step.append(opt.last_step_stats())
    return per_step


def shards(model):
    return [local_tensor(p).detach().clone() for p in model.parameters()]


def fresh_model(seed=0):
    torch.manual_seed(seed + dist.get_rank())  # different on purpose: prepare() syncs rank 0's
    return Tiny()


def replicas_worker(rank, world, replicate, shard):
    out = {}
    for name, kw in REPLICATORS.items():
        model, opt = flexdemo.prepare(fresh_model(), replicator=name, optimizer="sgd", lr=0.01,
                                      replicate=replicate, shard=shard, replicator_kwargs=kw)
        stats = train(model, opt, STEPS, rank)
        rep = opt.replicators[0]
        out[name] = {
            "shards": shards(model),
            "coord": opt.mesh.get_coordinate(),
            "stats": stats,
            "payload": rep.payload_bytes() if hasattr(rep, "payload_bytes") else None,
            "numel": sum(local_tensor(p).numel() for p in model.parameters()),
        }
    # schedules: DeMo every 2nd step, skipping every 3rd step
    model, opt = flexdemo.prepare(
        fresh_model(), DeMoReplicator(topk=4, chunk=8, replicate_every=2, skip_every=3),
        lr=0.01, replicate=replicate, shard=shard)
    out["schedule"] = {"stats": train(model, opt, 8, rank), "shards": shards(model),
                       "coord": opt.mesh.get_coordinate(),
                       "payload": opt.replicators[0].payload_bytes()}
    return out


def hsdp_worker(rank, world):
    """Full replicator + AdamW against FSDP2's own HSDP with AdamW, same data."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    ref = Tiny()
    torch.manual_seed(0)
    mine = Tiny()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for b in ref.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(ref, mesh=mesh)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    mine, opt = flexdemo.prepare(mine, replicator="full", optimizer="adamw", lr=1e-2,
                                 weight_decay=0.1, mesh=mesh)  # an existing mesh
    for s in range(5):
        for m, o in ((ref, ref_opt), (mine, opt)):
            x, y = batch(rank, s)
            (m(x) - y).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    a = [p.full_tensor().detach() for p in ref.parameters()]
    b = [p.full_tensor().detach() for p in mine.parameters()]
    # the replicator's group must lie along the mesh's replicate dimension
    try:
        flexdemo.prepare(fresh_model(), DeMoReplicator(group=dist.group.WORLD), lr=0.01,
                         replicate=2, shard=2)
        mismatch = None
    except ValueError as e:
        mismatch = str(e)
    try:
        flexdemo.prepare(fresh_model(), "demo", replicate=3)
        bad_mesh = None
    except ValueError as e:
        bad_mesh = str(e)
    return {"ref": a, "mine": b, "mismatch": mismatch, "bad_mesh": bad_mesh}


def chain_worker(rank, world):
    """DeMo within pairs {0,1}, {2,3}, then Full across all four: outputs compose."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    chain = [DeMoReplicator(topk=4, chunk=8, group=pair), FullReplicator(group=dist.group.WORLD)]
    model, opt = flexdemo.prepare(fresh_model(), chain, lr=0.5, replicate=4, shard=1)
    steps = []
    for s in range(3):
        before = shards(model)
        train(model, opt, 1, rank, start=s)
        steps.append([(b - a) / 0.5 for a, b in zip(shards(model), before)])
    return {"steps": steps, "shards": shards(model),
            "bytes": [r.stats.bytes_sent for r in opt.replicators],
            "payload": opt.replicators[0].payload_bytes(),
            "numel": sum(p.numel() for p in model.parameters())}


def nonfinite_worker(rank, world):
    res = {}
    for policy in ("raise", "skip"):
        model, opt = flexdemo.prepare(fresh_model(), "demo", lr=0.01, replicate=2, shard=1,
                                      nonfinite=policy, replicator_kwargs={"topk": 4, "chunk": 8})
        train(model, opt, 2, rank)
        before = shards(model)
        x, y = batch(rank, 9)
        (model(x) - y).pow(2).mean().backward()
        if rank == 1:
            model.out.weight.grad[0, 0] = float("nan")
        try:
            opt.step()
            res[policy] = None
        except NonFiniteGradientError as e:
            res[policy] = (str(e), e.ranks)
        opt.zero_grad()
        res[policy + "_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, shards(model)))
        train(model, opt, 2, rank, start=10)  # training goes on after a skipped step
        res[policy + "_shards"] = shards(model)
        res[policy + "_skipped"] = opt.skipped_steps
    # the drop-in DeMo on plain data parallelism (no prepare, no FSDP)
    torch.manual_seed(0)
    model = Tiny()
    opt = flexdemo.DeMo(model.parameters(), lr=1e-3, compression_topk=4, compression_chunk=8)
    train(model, opt, 4, rank)
    res["dropin"] = shards(model)
    return res


def diloco_averaging_worker(rank, world):
    """H=1, outer SGD lr 1, no momentum, against averaging the parameters after every step."""
    from flexdemo import DiLoCoReplicator

    torch.manual_seed(0)
    ref = Tiny()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    model, opt = flexdemo.prepare(
        fresh_model(), DiLoCoReplicator(inner_steps=1, outer_lr=1.0, outer_momentum=0.0),
        optimizer="sgd", lr=0.05, replicate=world, shard=1)
    with torch.no_grad():  # same start as the prepared model (rank 0's)
        for p, q in zip(ref.parameters(), model.parameters()):
            p.copy_(q)
    for s in range(4):
        for m, o in ((ref, ref_opt), (model, opt)):
            x, y = batch(rank, s)
            (m(x) - y).pow(2).mean().backward()
            o.step()
            o.zero_grad()
        with torch.no_grad():
            for p in ref.parameters():
                dist.all_reduce(p)
                p.div_(world)
    return {"ref": shards(ref), "mine": shards(model)}


DILOCO_EXCHANGES = {
    "full-fp32": ("full", {}),
    "full-int4": ("full", {"values": "int4", "block": 32}),
    "demo": ("demo", {"topk": 4, "chunk": 8}),
}


def _step_trace(model, opt, steps, rank):
    """Train ``steps`` single steps; the local shards and the bytes sent after each."""
    snaps, sent = [], []
    for s in range(steps):
        train(model, opt, 1, rank, start=s)
        snaps.append(shards(model))
        sent.append(opt.last_step_stats()["bytes_sent"])
    return snaps, sent


def diloco_replicas_worker(rank, world, replicate, shard):
    from flexdemo import DiLoCoReplicator

    out = {}
    for name, (exchange, kw) in DILOCO_EXCHANGES.items():
        rep = DiLoCoReplicator(inner_steps=3, exchange=exchange, exchange_kwargs=kw)
        model, opt = flexdemo.prepare(fresh_model(), rep, optimizer="adamw", lr=0.01,
                                      replicate=replicate, shard=shard)
        snaps, sent = _step_trace(model, opt, 7, rank)
        payload = sum(ex.payload_bytes() for ex in rep.exchanges)
        out[name] = {"snaps": snaps, "sent": sent, "payload": payload,
                     "coord": opt.mesh.get_coordinate(),
                     "numel": sum(local_tensor(p).numel() for p in model.parameters())}
    # streaming: 2 fragments, H=4, tau=1: fragment 0 launched after steps 1, 5; applied 2, 6
    rep = DiLoCoReplicator(inner_steps=4, fragments=2, tau=1)
    model, opt = flexdemo.prepare(fresh_model(), rep, optimizer="adamw", lr=0.01,
                                  replicate=replicate, shard=shard)
    snaps, sent = _step_trace(model, opt, 8, rank)
    out["streaming"] = {"snaps": snaps, "sent": sent, "parts": rep.parts,
                        "payloads": [ex.payload_bytes() for ex in rep.exchanges],
                        "coord": opt.mesh.get_coordinate()}
    return out


def wire_worker(rank, world):
    """Codecs, bucketing, delayed overlap and corrupt payloads on real process groups."""
    from flexdemo.replicate import CorruptPayloadError, demo_warmup

    out = {}
    variants = {f"values-{v}": {"values": v} for v in ("bf16", "int8", "int2", "sign")}
    variants.update({"bucketed": {}, "per-tensor": {"bucket": False},
                     "delayed": {"overlap": "delayed"}, "separate-small": {"small": "separate"},
                     "transform-bf16": {"transform_dtype": "bf16"}})
    for name, kw in variants.items():
        rep = DeMoReplicator(topk=4, chunk=8, **kw)
        model, opt = flexdemo.prepare(fresh_model(), rep, lr=0.01, replicate=world, shard=1)
        stats = train(model, opt, 5, rank)
        out[name] = {"shards": shards(model), "stats": stats, "payload": rep.payload_bytes(),
                     "units": len(rep.units)}
    # overlapped exchanges through a phase switch (topk 8 for steps 0-1, then 4)
    rep = demo_warmup(warmup_topk=8, warmup_steps=2, topk=4, chunk=8, overlap="delayed")
    model, opt = flexdemo.prepare(fresh_model(), rep, lr=0.01, replicate=world, shard=1)
    train(model, opt, 5, rank)
    out["warmup-delayed"] = {"shards": shards(model)}
    # a corrupt payload from rank 1 (NaN value): every rank names it, or drops it
    for policy in ("raise", "drop"):
        rep = DeMoReplicator(topk=4, chunk=8, on_bad_peer=policy)
        model, opt = flexdemo.prepare(fresh_model(), rep, lr=0.01, replicate=world, shard=1)
        train(model, opt, 2, rank)
        if rank == 1:
            corrupt_first_values(rep, torch.float32, 1)
        try:
            train(model, opt, 1, rank, start=2)
            out[policy] = None
        except CorruptPayloadError as e:
            out[policy] = (str(e), e.global_rank)
        out[policy + "_dropped"] = rep.dropped_payloads
        out[policy + "_shards"] = shards(model)
    # the same in delayed mode: rank 1's payloads from step 2 on are left out on the device
    # from step 3 on; the first verdict is read, counted and warned of at step 4
    rep = DeMoReplicator(topk=4, chunk=8, on_bad_peer="drop", overlap="delayed")
    model, opt = flexdemo.prepare(fresh_model(), rep, lr=0.01, replicate=world, shard=1)
    train(model, opt, 2, rank)
    if rank == 1:
        corrupt_first_values(rep, torch.float32, 1)
    train(model, opt, 2, rank, start=2)
    dropped = rep.dropped_payloads
    train(model, opt, 1, rank, start=4)
    out["drop-delayed"] = {"dropped": (dropped, rep.dropped_payloads), "shards": shards(model)}
    return out



SETTINGS_CASES = {  # name: the optimizer arguments of a rank (rank 1 differs, but in "same")
    "same": lambda r: {"replicators": "demo"},
    "topk": lambda r: {"replicators": DeMoReplicator(topk=4 * (1 + r), chunk=8)},
    "seed": lambda r: {"replicators": flexdemo.RandomReplicator(seed=r)},
    "kinds": lambda r: {"replicators": ["demo", "full"][r]},
    "nonfinite": lambda r: {"nonfinite": ["raise", "skip"][r]},
    "base": lambda r: {"base": ["sgd", "adamw"][r]},
    "diloco": lambda r: {"replicators": flexdemo.DiLoCoReplicator(inner_steps=2 + r)},
}


def settings_worker(rank, world):
    """Per case, every rank builds an optimizer with the case's arguments: the error each
    rank raises, or ``"ok"`` after a step."""
    out = {}
    for name, kwargs in SETTINGS_CASES.items():
        model = fresh_model()
        try:
            opt = flexdemo.DeToNATION(model.parameters(), lr=0.01, **kwargs(rank))
        except ValueError as e:
            out[name] = str(e)
            continue
        train(model, opt, 1, rank)
        out[name] = "ok"
    return out
