"""Helpers and per-rank workers of the checkpoint tests (importable by child processes)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from dist_workers import Tiny, batch, shards

import flexdemo
from flexdemo.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint


def run_steps(model, opt, steps: int, start: int, rank: int = 0) -> None:
    """Train ``steps`` steps on the deterministic batches ``start, start + 1, ...``."""
    for s in range(start, start + steps):
        x, y = batch(rank, s)
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def make_replicator(kind: str):
    if kind == "demo":
        return flexdemo.DeMoReplicator(topk=4, chunk=8)
    if kind == "diloco":  # a fragment's sync is in flight after steps 1 and 3 (applied at 2, 4)
        return flexdemo.DiLoCoReplicator(inner_steps=4, fragments=2, tau=1)
    raise ValueError(kind)


def make_single(kind: str, seed: int, width: int = 32):
    """A one-process model and DeToNATION optimizer (no process group needed)."""
    torch.manual_seed(seed)
    model = Tiny()
    if width != 32:
        model.out = torch.nn.Linear(32, width)
    rep = (flexdemo.DeMoReplicator(overlap="delayed") if kind == "demo-delayed"
           else make_replicator(kind))
    opt = flexdemo.DeToNATION(model.parameters(), rep, base="adamw", lr=0.01)
    return model, opt


def extra_for(rank: int) -> dict:
    """What a trainer would pass: RNG states (as uint8 tensors), a data position, and so on."""
    gen = torch.Generator().manual_seed(1234 + rank)
    rng = gen.get_state()  # as torch.get_rng_state() would give, but the same on every call
    torch.randn(3, generator=gen)
    return {"rank": rank, "data_pos": 100 + rank, "rng": rng, "gen": gen.get_state(),
            "note": ("tuple", [1, 2.5, None])}


def _prepare(kind: str, seed: int, replicate: int = 2, shard: int = 2):
    torch.manual_seed(seed + torch.distributed.get_rank())  # prepare() copies rank 0's weights
    return flexdemo.prepare(Tiny(), make_replicator(kind), optimizer="adamw", lr=0.01,
                            replicate=replicate, shard=shard)


def _delta(opt) -> list[torch.Tensor]:
    return [d.clone() for d in opt.replicators[0].delta if d is not None]


def resume_worker(rank: int, world: int, root: str) -> dict:
    """2 x 2 mesh: train, save, train on; a fresh model+optimizer loads and trains the same."""
    out: dict = {}
    for kind, k, m in (("demo", 3, 3), ("diloco", 4, 4)):
        model, opt = _prepare(kind, 0)
        run_steps(model, opt, k, 0, rank)
        if kind == "diloco":
            out["diloco_in_flight"] = bool(opt.replicators[0].pending)
        path = save_checkpoint(Path(root) / kind / f"step_{k:06d}", model, opt, step=k,
                               extra=extra_for(rank))
        saved_delta = _delta(opt) if kind == "demo" else None
        run_steps(model, opt, m, k, rank)
        expected = shards(model)

        model2, opt2 = _prepare(kind, 100)  # other initial weights
        differs_before = any(not torch.equal(a, b) for a, b in zip(shards(model2), expected))
        found = latest_checkpoint(Path(root) / kind)
        res = load_checkpoint(found, model2, opt2)
        loaded_delta = _delta(opt2) if kind == "demo" else None
        steps_after_load = opt2.steps
        run_steps(model2, opt2, m, k, rank)
        got = shards(model2)
        out[kind] = {
            "found": str(found) == str(path),
            "differs_before": differs_before,
            "bitwise": all(torch.equal(a, b) for a, b in zip(expected, got)),
            "step": res["step"],
            "extra_ok": _same(res["extra"], extra_for(rank)),
            "steps": steps_after_load,
            "layout": json.loads((path / "flexdemo.json").read_text())["layout"],
            "coord": list(opt.mesh.get_coordinate()),
            "saved_delta": saved_delta,
            "loaded_delta": loaded_delta,
        }
    # same world size, another mesh: every rank raises the same ValueError
    model3, opt3 = _prepare("demo", 0, replicate=4, shard=1)
    try:
        load_checkpoint(Path(root) / "demo" / "step_000003", model3, opt3)
        out["mesh_error"] = None
    except ValueError as e:
        out["mesh_error"] = str(e)
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b)))
    return a == b


def fewer_replicas_worker(rank: int, world: int, root: str) -> dict:
    """1 x 2 mesh: load the 2 x 2 checkpoints (only replica 0 goes on), then save them."""
    out: dict = {}
    for kind, k in (("demo", 3), ("diloco", 4)):
        model, opt = _prepare(kind, 100, replicate=1, shard=2)
        res = load_checkpoint(Path(root) / kind / f"step_{k:06d}", model, opt)
        out[kind] = {"delta": _delta(opt) if kind == "demo" else None, "steps": opt.steps,
                     "extra_ok": _same(res["extra"], extra_for(rank)), "shards": shards(model)}
        save_checkpoint(Path(root) / f"{kind}-1x2" / f"step_{k:06d}", model, opt, step=k,
                        extra=extra_for(rank))
    return out


def more_replicas_worker(rank: int, world: int, root: str) -> dict:
    """2 x 2 mesh: load the 1 x 2 checkpoints; replica 1 is new. Then two more steps."""
    out: dict = {}
    for kind, k in (("demo", 3), ("diloco", 4)):
        model, opt = _prepare(kind, 100)
        res = load_checkpoint(Path(root) / f"{kind}-1x2" / f"step_{k:06d}", model, opt)
        out[kind] = {"delta": _delta(opt) if kind == "demo" else None, "steps": opt.steps,
                     "extra": res["extra"], "shards": shards(model)}
        run_steps(model, opt, 2, k, rank)
        out[kind]["after"] = shards(model)
    return out


def rank0_only_worker(rank: int, world: int, root: str) -> dict:
    """2 replicas of one rank each: rank 0 alone saves opt.state_dict() with torch.save, every rank
    loads that file; then a collective shows that both ranks are still in step (no reset)."""
    model, opt = _prepare("demo", 0, replicate=2, shard=1)
    run_steps(model, opt, 2, 0, rank)
    path = Path(root) / "rank0_only.pt"
    if rank == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    torch.distributed.barrier()
    saved = torch.load(path, weights_only=False)
    model.load_state_dict(saved["model"])
    error = None
    try:
        opt.load_state_dict(saved["opt"])
    except ValueError as e:
        error = str(e)
    total = torch.ones(1)
    torch.distributed.all_reduce(total)
    return {"error": error, "total": float(total), "steps": opt.steps}
