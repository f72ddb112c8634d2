"""Cases run both by N gloo processes and by N simulated replicas (importable by children)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from dist_workers import Tiny, batch

from flexdemo import (
    DeMoReplicator,
    DeToNATION,
    DiLoCoReplicator,
    FullReplicator,
    StridingReplicator,
)

# name -> (replicators factory, base optimizer, lr)
CASES = {
    "demo": (lambda: [DeMoReplicator(topk=4, chunk=8)], "sgd", 0.01),
    "demo-delayed": (lambda: [DeMoReplicator(topk=4, chunk=8, overlap="delayed")], "sgd", 0.01),
    "diloco-demo": (lambda: [DiLoCoReplicator(inner_steps=2, exchange="demo",
                                              exchange_kwargs={"topk": 4, "chunk": 8})],
                    "adamw", 0.01),
    "full": (lambda: [FullReplicator()], "sgd", 0.05),
    "full-int8": (lambda: [FullReplicator(values="int8", block=32)], "sgd", 0.05),
    "striding": (lambda: [StridingReplicator(rate=0.25)], "sgd", 0.01),
    "diloco-full": (lambda: [DiLoCoReplicator(inner_steps=2)], "adamw", 0.01),
    "diloco-int4-scatter": (lambda: [DiLoCoReplicator(
        inner_steps=2, exchange_kwargs={"values": "int4", "block": 16, "reduce": "scatter"})],
        "adamw", 0.01),
    "full-int8-scatter": (lambda: [FullReplicator(values="int8", block=8, reduce="scatter")],
                          "sgd", 0.05),
    # the owner's coding of the mean fed back (owner_error_feedback), with and without the
    # replicas' own error feedback
    "full-int2-scatter-oef": (lambda: [FullReplicator(
        values="int2", block=8, reduce="scatter", error_feedback=0.9, owner_error_feedback=True)],
        "sgd", 0.05),
    "diloco-stat1-scatter-oef": (lambda: [DiLoCoReplicator(
        inner_steps=2, exchange_kwargs={"values": "stat1", "block": 16, "reduce": "scatter",
                                        "owner_error_feedback": 0.8})], "adamw", 0.01),
}
STEPS = 5


def model() -> Tiny:
    torch.manual_seed(0)  # the same weights on every rank and replica
    return Tiny()


def loss_fn(m, b) -> torch.Tensor:
    x, y = b
    return (m(x) - y).pow(2).mean()


def optimizer(case: str, params, group=None) -> DeToNATION:
    reps, base, lr = CASES[case]
    return DeToNATION(params, reps(), base=base, lr=lr, group=group)


def snapshot(m, opt) -> dict:
    return {"params": [p.detach().clone() for p in m.parameters()],
            "sent": opt.last_step_stats()["bytes_sent"], "received": opt.bytes_received}


def gloo_worker(rank: int, world: int, cases: list[str]) -> dict:
    """Every case trained for STEPS steps on this rank; a snapshot after each step."""
    out = {}
    for case in cases:
        m = model()
        opt = optimizer(case, m.parameters())
        trace = []
        for s in range(STEPS):
            loss_fn(m, batch(rank, s)).backward()
            opt.step()
            opt.zero_grad()
            trace.append(snapshot(m, opt))
        out[case] = trace
    assert dist.get_world_size() == world
    return out
