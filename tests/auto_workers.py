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
