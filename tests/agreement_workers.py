"""Workers for the agreement tests: non-finite inputs and corrupt payloads on 2 real ranks."""

from __future__ import annotations

import torch
from dist_workers import batch, fresh_model, shards

import flexdemo
from flexdemo import NonFiniteGradientError
from flexdemo.replicate.agreement import CorruptPayloadError

# name -> (replicator, settings, step whose gradient is NaN on rank 1, steps run)
NONFINITE_CASES = {
    "demo": ("demo", {"topk": 4, "chunk": 8}, 3, 6),
    "full": ("full", {}, 3, 6),
    "full-int8": ("full", {"values": "int8", "block": 32}, 3, 6),
    "full-every2": ("full", {"replicate_every": 2}, 3, 6),  # step 3 exchanges nothing
    "demo-every2": ("demo", {"topk": 4, "chunk": 8, "replicate_every": 2}, 3, 6),
    # step 3's payloads are applied at step 4 (the update zeroed on the device), and the
    # verdict, read a step later, raises at step 5
    "demo-delayed": ("demo", {"topk": 4, "chunk": 8, "overlap": "delayed"}, 3, 7),
    "random": ("random", {"rate": 0.25}, 3, 6),
    "striding": ("striding", {"rate": 0.25}, 3, 6),
    "slicing": ("slicing", {"rate": 0.25}, 3, 6),
    "diloco-full": ("diloco", {"inner_steps": 3}, 3, 9),  # syncs after steps 2, 5, 8
    "diloco-demo": ("diloco", {"inner_steps": 3, "exchange": "demo",
                               "exchange_kwargs": {"topk": 4, "chunk": 8}}, 3, 9),
    # H=4, two fragments, tau=1: fragment 1 launched after step 3, applied after step 4;
    # fragment 0 applied after steps 2 and 6 (the last step run)
    "diloco-stream": ("diloco", {"inner_steps": 4, "fragments": 2, "tau": 1}, 3, 7),
    "none": ("none", {}, 3, 6),
}


def _run(name: str, policy: str, rank: int, poison_param: bool = False) -> dict:
    kind, kw, bad_step, steps = NONFINITE_CASES[name]
    model, opt = flexdemo.prepare(fresh_model(), kind, optimizer="sgd", lr=0.05, replicate=2,
                                  shard=1, nonfinite=policy, replicator_kwargs=kw)
    raised = []
    for s in range(steps):
        x, y = batch(rank, s)
        (model(x) - y).pow(2).mean().backward()
        if rank == 1 and s == bad_step:
            if poison_param:  # a parameter (not a gradient) goes bad: DiLoCo finds it at sync
                with torch.no_grad():
                    model.out.weight[0, 0] = float("inf")
            else:
                model.out.weight.grad[0, 0] = float("nan")
        try:
            opt.step()
        except NonFiniteGradientError as e:
            raised.append((s, e.ranks, str(e)))
        opt.zero_grad()
    synced = getattr(opt.replicators[0], "parts", [None])[0]  # DiLoCo: the last synced part
    return {"raised": raised, "skipped": opt.skipped_steps, "shards": shards(model),
            "synced": synced,
            "finite": all(bool(torch.isfinite(t).all()) for t in shards(model))}


def nonfinite_worker(rank: int, world: int) -> dict:
    out = {}
    for name in NONFINITE_CASES:
        for policy in ("raise", "skip"):
            out[name, policy] = _run(name, policy, rank)
    for policy in ("raise", "skip"):
        out["diloco-param", policy] = _run("diloco-full", policy, rank, poison_param=True)
    return out


def corrupt_worker(rank: int, world: int) -> dict:
    """Quantised Full payloads: a NaN scale from rank 1, an fp16 overflow on rank 1."""
    out = {}
    for policy in ("raise", "drop"):
        for case in ("int8-nan-scale", "fp16-overflow"):
            values = "int8" if case.startswith("int8") else "fp16"
            rep = flexdemo.FullReplicator(values=values, block=32, on_bad_peer=policy)
            model, opt = flexdemo.prepare(fresh_model(), rep, lr=0.01, replicate=2, shard=1)
            caught = None
            for s in range(3):
                x, y = batch(rank, s)
                (model(x) - y).pow(2).mean().backward()
                if rank == 1 and s == 1:
                    if case == "fp16-overflow":
                        model.out.weight.grad[0, 0] = 1e6  # finite, beyond fp16's range
                    else:
                        encode = rep.codec.encode

                        def corrupt(x, buf, encode=encode):
                            encode(x, buf)
                            buf[:4].view(torch.float32).fill_(float("nan"))  # first scale

                        rep.codec.encode = corrupt
                try:
                    opt.step()
                except CorruptPayloadError as e:
                    caught = (s, e.global_rank, str(e))
                if rank == 1 and case != "fp16-overflow":
                    rep.codec.encode = type(rep.codec).encode.__get__(rep.codec)
                opt.zero_grad()
            out[case, policy] = {"caught": caught, "dropped": rep.dropped_payloads,
                                 "shards": shards(model),
                                 "finite": all(bool(torch.isfinite(t).all())
                                               for t in shards(model))}
    return out


def diloco_checkpoint_worker(rank: int, world: int) -> dict:
    """A sync that will fail is in flight when the state is saved (tau=1): a resumed twin
    fails it at the same step as the original."""
    kw = {"inner_steps": 4, "fragments": 2, "tau": 1}
    out = {}
    for who in ("original", "resumed"):
        model, opt = flexdemo.prepare(fresh_model(), "diloco", optimizer="sgd", lr=0.05,
                                      replicate=2, shard=1, replicator_kwargs=kw)
        raised = []
        for s in range(6):
            x, y = batch(rank, s)
            (model(x) - y).pow(2).mean().backward()
            if rank == 1 and s == 3:  # fragment 1 is launched after step 3, applied after 4
                model.out.weight.grad[0, 0] = float("nan")
            try:
                opt.step()
            except NonFiniteGradientError as e:
                raised.append((s, e.ranks))
            opt.zero_grad()
            if s == 3 and who == "resumed":  # save with the failing sync in flight, resume
                state = opt.state_dict()
                twin, opt = flexdemo.prepare(fresh_model(), "diloco", optimizer="sgd",
                                             lr=0.05, replicate=2, shard=1,
                                             replicator_kwargs=kw)
                twin.load_state_dict(model.state_dict())
                opt.load_state_dict(state)
                model = twin
        out[who] = {"raised": raised, "shards": shards(model)}
    return out


def chain_worker(rank: int, world: int) -> dict:
    """DeMo within pairs {0,1}, {2,3}, then Full across all four; a NaN on rank 1 must reach
    ranks 2 and 3 in the same step (through Full's exchange)."""
    import torch.distributed as dist

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out = {}
    for policy in ("raise", "skip"):
        chain = [flexdemo.DeMoReplicator(topk=4, chunk=8, group=pairs[rank // 2]),
                 flexdemo.FullReplicator(group=dist.group.WORLD)]
        model, opt = flexdemo.prepare(fresh_model(), chain, lr=0.05, replicate=4, shard=1,
                                      nonfinite=policy)
        raised = []
        for s in range(4):
            x, y = batch(rank, s)
            (model(x) - y).pow(2).mean().backward()
            if rank == 1 and s == 2:
                model.out.weight.grad[0, 0] = float("nan")
            try:
                opt.step()
            except NonFiniteGradientError:
                raised.append(s)
            opt.zero_grad()
        out[policy] = {"raised": raised, "skipped": opt.skipped_steps, "shards": shards(model)}
    return out


def sharded_worker(rank: int, world: int) -> dict:
    """2 replicas x 2 FSDP shards: a NaN in rank 1's shard must reach ranks 0 and 2 too."""
    out = {}
    for name, kw in (("demo", {"topk": 4, "chunk": 8}), ("full", {}),
                     ("diloco", {"inner_steps": 3})):
        for policy in ("raise", "skip"):
            model, opt = flexdemo.prepare(fresh_model(), name, optimizer="sgd", lr=0.05,
                                          replicate=2, shard=2, nonfinite=policy,
                                          replicator_kwargs=kw)
            raised = []
            for s in range(6):
                x, y = batch(rank // 2, s)  # the two shards of a replica see the same data
                (model(x) - y).pow(2).mean().backward()
                if rank == 1 and s == 3:
                    grad = opt.param_groups[0]["params"][-1].grad
                    grad._local_tensor.view(-1)[0] = float("nan")
                try:
                    opt.step()
                except NonFiniteGradientError:
                    raised.append(s)
                opt.zero_grad()
            out[name, policy] = {"raised": raised, "skipped": opt.skipped_steps,
                                 "shards": shards(model), "coord": opt.mesh.get_coordinate()}
    return out


def global_rank_worker(rank: int, world: int) -> dict:
    """2 replicas x 2 shards, DeMo: a NaN in global rank 3's gradient at step 1."""
    model, opt = flexdemo.prepare(fresh_model(), "demo", optimizer="sgd", lr=0.05, replicate=2,
                                  shard=2, replicator_kwargs={"topk": 4, "chunk": 8})
    for s in range(2):
        x, y = batch(rank // 2, s)
        (model(x) - y).pow(2).mean().backward()
        if rank == 3 and s == 1:
            opt.param_groups[0]["params"][-1].grad._local_tensor.view(-1)[0] = float("nan")
        try:
            opt.step()
        except NonFiniteGradientError as e:
            return {"ranks": e.ranks, "message": str(e), "coord": opt.mesh.get_coordinate()}
        opt.zero_grad()
    return {"ranks": None}
