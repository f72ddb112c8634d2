"""Per-rank workers of the large-model, DCP, buffer and migration tests (importable by child
processes)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_workers import Tiny, batch, shards, train
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import flexdemo
from flexdemo.dtensor import local_tensor
from flexdemo.transport import all_gather_bytes


def _loss(model, rank, step):
    x, y = batch(rank, step)
    return (model(x) - y).pow(2).mean()


def _equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------- meta init, bf16
class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.scale


def large_model_worker(rank, world):
    """2 x 2 mesh: a meta-device model materialised by prepare(); bf16 mixed precision."""
    out = {}
    torch.manual_seed(rank)  # every rank draws other numbers: the broadcast must align them
    with torch.device("meta"):
        model = Tiny()
    model, opt = flexdemo.prepare(model, "demo", lr=0.01, device="cpu", replicate=2, shard=2,
                                  replicator_kwargs={"topk": 4, "chunk": 8})
    out["device"] = {str(local_tensor(p).device) for p in model.parameters()}
    start = shards(model)
    train(model, opt, 3, rank)
    out["meta"] = {"start": start, "end": shards(model), "coord": opt.mesh.get_coordinate()}

    # a 1 x 4 mesh replicates nothing: every rank warns, naming the fix
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flexdemo.prepare(Tiny(), "demo", replicate=1, shard=4)
    out["warned"] = [str(w.message) for w in caught
                     if issubclass(w.category, flexdemo.NoReplicationWarning)]

    # init_fn instead of reset_parameters, for a module that has none
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(12, 4), NoReset(), nn.Linear(4, 6))
    try:
        flexdemo.prepare(model, "demo", device="cpu", replicate=2, shard=2)
        out["no_reset"] = None
    except ValueError as e:
        out["no_reset"] = str(e)

    def init(m):
        if isinstance(m, NoReset):
            nn.init.constant_(m.scale, 0.5)
        elif isinstance(m, nn.Linear):
            m.reset_parameters()

    model, opt = flexdemo.prepare(model, "demo", lr=0.01, device="cpu", replicate=2, shard=2,
                                  init_fn=init, replicator_kwargs={"topk": 4, "chunk": 8})
    out["init_fn_scale"] = local_tensor(model[1].scale).detach().clone()

    # bf16 compute, fp32 gradients for the replicators and fp32 master weights
    torch.manual_seed(0)
    model, opt = flexdemo.prepare(Tiny(), "demo", lr=0.01, replicate=2, shard=2,
                                  precision="bf16", replicator_kwargs={"topk": 4, "chunk": 8})
    seen = []
    rep = opt.replicators[0]
    call = rep.replicate

    def spy(grads, lrs, step, communicate):
        seen.append({g.dtype for g in grads if g is not None})
        return call(grads, lrs, step, communicate)

    rep.replicate = spy
    logits_dtype = []
    for s in range(3):
        x, y = batch(rank, s)
        pred = model(x)
        logits_dtype.append(pred.dtype)
        (pred.float() - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    out["bf16"] = {"grad_dtypes": seen, "param_dtypes": {p.dtype for p in model.parameters()},
                   "logits": logits_dtype, "shards": shards(model),
                   "coord": opt.mesh.get_coordinate()}
    return out


# ---------------------------------------------------------------------------- DCP
def _make(kind: str, seed: int, replicate: int, shard: int):
    torch.manual_seed(seed + dist.get_rank())  # prepare() copies rank 0's weights
    if kind == "demo":
        return flexdemo.prepare(Tiny(), flexdemo.DeMoReplicator(topk=4, chunk=8), lr=0.01,
                                replicate=replicate, shard=shard)
    if kind == "demo-adamw":
        return flexdemo.prepare(Tiny(), flexdemo.DeMoReplicator(topk=4, chunk=8, sign=False),
                                optimizer="adamw", lr=0.01, replicate=replicate, shard=shard)
    if kind == "diloco":  # inner AdamW differs per replica; a sync is in flight after step 3
        rep = flexdemo.DiLoCoReplicator(inner_steps=4, fragments=2, tau=1)
        return flexdemo.prepare(Tiny(), rep, optimizer="adamw", lr=0.01, replicate=replicate,
                                shard=shard)
    raise ValueError(kind)


def _opt_tensors(opt) -> list[torch.Tensor]:
    """Every tensor of the optimizer's state on this rank: base state and replicators."""
    out = []
    for p in opt._params:
        for _, v in sorted(opt.base.state.get(p, {}).items()):
            if isinstance(v, torch.Tensor):
                out.append(local_tensor(v).detach().clone())
    for r in opt.replicators:
        for name in ("delta", "global_params"):
            out += [t.detach().clone() for t in getattr(r, name, []) if t is not None]
        for p in sorted(getattr(r, "pending", {})):
            out += [t.detach().clone() for t in r._result(p)]
    return out


def dcp_worker(rank, world, root, replicate, shard):
    """Train k steps, save with DCP's own helpers, train on; a fresh (other) model and
    optimizer load and must hold the same tensors and take the same next steps."""
    out = {}
    for kind, k, m in (("demo", 3, 2), ("demo-adamw", 2, 2), ("diloco", 3, 3)):
        model, opt = _make(kind, 0, replicate, shard)
        train(model, opt, k, rank)
        saved_params, saved_state = shards(model), _opt_tensors(opt)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/{kind}")
        after_save = shards(model)
        train(model, opt, m, rank, start=k)
        expected = shards(model)

        model2, opt2 = _make(kind, 100, replicate, shard)  # other weights
        if kind == "demo":  # other state too; the other kinds load into fresh optimizers
            train(model2, opt2, 1, rank, start=50)
        fresh_state = sum(bool(v) for v in opt2.base.state.values())
        differs = not _equal(shards(model2), saved_params)
        msd2, osd2 = get_state_dict(model2, opt2)
        dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=f"{root}/{kind}")
        set_state_dict(model2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
        loaded_params, loaded_state = shards(model2), _opt_tensors(opt2)
        steps = opt2.steps
        train(model2, opt2, m, rank, start=k)
        out[kind] = {
            "save_kept_params": _equal(after_save, saved_params),
            "differs_before": differs,
            "params": _equal(loaded_params, saved_params),
            "state": _equal(loaded_state, saved_state) and len(saved_state) > 0,
            "steps": steps,
            "fresh_base_state": fresh_state,
            "next": _equal(shards(model2), expected),
            "identical": opt.replicas_identical(),
            "coord": opt.mesh.get_coordinate(),
            "saved_state": saved_state,
        }
    return out


# ---------------------------------------------------------------------------- buffers
class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.bn = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 6)

    def forward(self, x):
        return self.out(torch.tanh(self.bn(self.inp(x))))


def buffers_worker(rank, world):
    """BatchNorm statistics under the "mean" policy, "none", and a local schedule."""
    out = {}
    for policy in ("mean", "none"):
        torch.manual_seed(0)
        model, opt = flexdemo.prepare(BNNet(), "demo", lr=0.01, replicate=world, shard=1,
                                      buffers=policy, replicator_kwargs={"topk": 4, "chunk": 8})
        means = []
        for s in range(3):
            _loss(model, rank, s).backward()
            local = model.bn.running_mean.clone()  # this rank's own statistics
            gathered = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(gathered, local)
            opt.step()
            opt.zero_grad()
            means.append((torch.stack(gathered).mean(0), model.bn.running_mean.clone()))
        out[policy] = {"buffers": [b.clone() for b in model.buffers()], "means": means,
                       "tracked": int(model.bn.num_batches_tracked),
                       "bytes": opt.buffer_sync.stats.bytes_sent}
    # a schedule that exchanges every 2nd step: buffers are averaged on those steps only
    torch.manual_seed(0)
    rep = flexdemo.DeMoReplicator(topk=4, chunk=8, replicate_every=2)
    model, opt = flexdemo.prepare(BNNet(), rep, lr=0.01, replicate=world, shard=1)
    same = []
    for s in range(4):
        _loss(model, rank, s).backward()
        opt.step()
        opt.zero_grad()
        gathered = [torch.empty_like(model.bn.running_var) for _ in range(world)]
        dist.all_gather(gathered, model.bn.running_var)
        same.append(all(torch.equal(gathered[0], g) for g in gathered))
    out["schedule_same"] = same
    return out


# ---------------------------------------------------------------------------- migration
def migration_worker(rank, world):
    """The drop-in DeMo's counters and the detonation aliases on two real ranks."""
    from flexdemo.compat import DeToSGD, prepare_detonation

    out = {}
    torch.manual_seed(0)
    model = Tiny()
    opt = flexdemo.DeMo(model.parameters(), 0.99, 4, 8, lr=1e-3)
    counters = []
    for s in range(2):
        _loss(model, rank, s).backward()
        opt.step()
        opt.zero_grad()
        counters.append((opt.data_transmit, opt.data_receive))
    rep = opt.replicators[0]
    out["dropin"] = {"counters": counters, "expected": all_gather_bytes(rep.payload_bytes(), 2),
                     "decay": rep.decay, "topk": rep.topk, "chunk": rep.chunk,
                     "lr": opt.param_groups[0]["lr"], "shards": shards(model)}
    torch.manual_seed(0)
    model = Tiny()
    opt = DeToSGD(model.parameters(), lr=1e-3, momentum=0.9)
    train(model, opt, 3, rank)
    out["detosgd"] = {"shards": shards(model), "sent": opt.data_transmit}
    torch.manual_seed(rank)
    model, opt = prepare_detonation(Tiny(), "adamw", replication_group_size=2, lr=1e-3)
    train(model, opt, 2, rank)
    out["prepare_detonation"] = {"shards": shards(model), "base": type(opt.base).__name__,
                                 "mesh": tuple(opt.mesh.mesh.shape)}
    return out


# ---------------------------------------------------------------------------- DCP mismatches
class Wider(nn.Module):
    """Tiny's parameter names with another hidden width: another model."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.out = nn.Linear(16, 6)

    def forward(self, x):
        return self.out(self.inp(x))


def dcp_mismatch_worker(rank, world, root):
    """Save a 2 x 1 DeMo job both ways (DCP helpers, flexdemo.save_checkpoint); load each
    into another mesh, replicator setting and model: flexdemo.checkpoint.dcp.load must refuse
    with the line load_checkpoint gives (its path swapped), and before DCP reads anything."""
    def make(model, replicate, shard, topk=4):
        torch.manual_seed(0)
        return flexdemo.prepare(model, flexdemo.DeMoReplicator(topk=topk, chunk=8), lr=0.01,
                                replicate=replicate, shard=shard)

    model, opt = make(Tiny(), 2, 1)
    train(model, opt, 2, rank)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/dcp")
    flexdemo.save_checkpoint(f"{root}/native", model, opt, step=2)
    out = {}
    for case, (m, r, s, topk) in {"mesh": (Tiny(), 1, 2, 4), "replicator": (Tiny(), 2, 1, 8),
                                  "model": (Wider(), 2, 1, 4)}.items():
        model2, opt2 = make(m, r, s, topk)
        before = shards(model2)
        lines = {}
        try:
            flexdemo.load_checkpoint(f"{root}/native", model2, opt2)
        except flexdemo.checkpoint.CheckpointMismatchError as e:
            lines["native"] = str(e).replace(f"{root}/native", "PATH")
        msd2, osd2 = get_state_dict(model2, opt2)
        try:
            from flexdemo.checkpoint import dcp as fdcp

            fdcp.load({"model": msd2, "optim": osd2}, checkpoint_id=f"{root}/dcp")
        except Exception as e:  # the test names the type it wants
            lines["dcp"] = str(e).replace(f"{root}/dcp", "PATH")
            lines["dcp_type"] = type(e).__name__
        lines["untouched"] = _equal(shards(model2), before)
        out[case] = lines
    return out
