"""Workers of tests/test_auto.py: ``prepare(model, "auto")`` on real gloo ranks."""

from __future__ import annotations

import time

import torch
from torch import nn

import flexdemo


def tiny_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def train(model, opt, steps: int, rank: int) -> None:
    g = torch.Generator().manual_seed(100 + rank)  # every rank its own data
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def result(model, auto) -> dict:
    return {"decision": auto.decision.as_dict(), "probe": auto.probed.as_dict(),
            "lines": list(auto.lines), "identical": auto.keeps_replicas_identical(2),
            "history": list(auto.history),
            "params": [getattr(p, "_local_tensor", p).detach().clone()
                       for p in model.parameters()]}


def prepare_worker(rank: int, world: int, candidates: list[str], steps: int,
                   shard: int = 1) -> dict:
    """Each rank starts from other weights (prepare broadcasts rank 0's); the probe at set-up,
    the warm-up, the decision, then the steps. With ``shard`` > 1 every shard's replicate
    group probes its own link, and all ranks agree."""
    model, opt = flexdemo.prepare(tiny_model(rank), "auto", optimizer="adamw", lr=1e-2,
                                  replicate=world // shard, shard=shard,
                                  replicator_kwargs={"candidates": candidates,
                                                     "verbose": False})
    train(model, opt, steps, rank)
    return result(model, opt.replicators[0])


def timeout_worker(rank: int, world: int, sleep: float) -> dict:
    """Rank 1 reaches the probe ``sleep`` seconds late (a real process that sleeps): rank 0's
    probe times out within its bound; both ranks agree on the fallback and train on."""
    import flexdemo.auto.replicator as auto_mod

    probe = auto_mod.probe_link
    took: list[float] = []

    def late_probe(*args, **kwargs):
        if rank == 1:
            time.sleep(sleep)
        t0 = time.perf_counter()
        out = probe(*args, **kwargs)
        took.append(time.perf_counter() - t0)
        return out

    auto_mod.probe_link = late_probe
    try:
        model, opt = flexdemo.prepare(tiny_model(rank), "auto", optimizer="adamw", lr=1e-2,
                                      replicate=world, shard=1,
                                      replicator_kwargs={"probe_seconds": 1.0,
                                                         "compute_seconds": 0.05,
                                                         "verbose": False})
    finally:
        auto_mod.probe_link = probe
    train(model, opt, 3, rank)
    return {**result(model, opt.replicators[0]), "probe_wall": took[0]}


def resume_worker(rank: int, world: int, folder: str, save_ats: list[int], steps: int) -> dict:
    """flexdemo's checkpoints across the decision: ``steps`` straight, against ``save_at``
    steps, a checkpoint, a fresh ``prepare()`` that loads it, and the rest (for each of
    ``save_ats``)."""
    kw = {"candidates": ["diloco-h20-int4"], "link": "10mbit,5ms", "verbose": False}

    def build():
        return flexdemo.prepare(tiny_model(0), "auto", optimizer="adamw", lr=1e-2,
                                replicate=world, shard=1, replicator_kwargs=kw)

    def run(model, opt, start, stop):
        for s in range(start, stop):
            g = torch.Generator().manual_seed(1000 * rank + s)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    model, opt = build()
    run(model, opt, 0, steps)
    straight = [p.detach().clone() for p in model.parameters()]
    out = {}
    for save_at in save_ats:
        model, opt = build()
        run(model, opt, 0, save_at)
        path = f"{folder}/step_{save_at:06d}"
        flexdemo.save_checkpoint(path, model, opt, step=save_at)
        model, opt = build()
        flexdemo.load_checkpoint(path, model, opt)
        run(model, opt, save_at, steps)
        out[save_at] = {"same": all(torch.equal(a, b)
                                    for a, b in zip(straight, model.parameters())),
                        "lines": list(opt.replicators[0].lines)}
    return out
