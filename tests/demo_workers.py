"""Rank workers of tests/test_demo_batched.py (importable by the child processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from dist_util import corrupt_first_values
from torch import nn

from flexdemo import DeMoReplicator, DeToNATION
from flexdemo.replicate import CorruptPayloadError


class Mixed(nn.Module):
    """Padded weights (131 rows, 70 columns), exactly tiling ones, small tensors batched, and
    a layer that gets a gradient only on some steps."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(70, 131)
        self.b = nn.Linear(131, 128)
        self.c = nn.Linear(128, 192)
        self.d = nn.Linear(192, 64)
        self.e = nn.Linear(64, 5)
        self.sometimes = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h))
        h = torch.tanh(self.c(h))
        h = self.e(torch.tanh(self.d(h)))
        return self.sometimes(h) if step % 3 == 1 else h


VARIANTS = {"int2": {}, "fp32": {"values": "fp32", "topk": 32, "sign": False},
            "int8-bf16": {"values": "int8", "transform_dtype": "bf16"},
            "sign-values": {"values": "sign", "topk": 4}}


def _train(rep: DeMoReplicator, rank: int, steps: int = 5, start: int = 0, trained=None):
    if trained is None:
        torch.manual_seed(0)
        model = Mixed()
        fast = [p for n, p in model.named_parameters() if not n.startswith("a.")]
        slow = [p for n, p in model.named_parameters() if n.startswith("a.")]
        opt = DeToNATION([{"params": fast}, {"params": slow, "lr": 3e-3}], rep, lr=1e-2)
    else:
        model, opt = trained
    gen = torch.Generator().manual_seed(100 * start + rank)
    for step in range(start, start + steps):
        x = torch.randn(16, 70, generator=gen)
        model(x, step).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def batched_worker(rank: int, world: int) -> dict:
    """Parameters after a few steps, grouped (one batch per block shape) and per tensor."""
    out = {}
    for name, kw in VARIANTS.items():
        for bucket in (True, False):
            model, _ = _train(DeMoReplicator(bucket=bucket, **kw), rank)
            out[name, bucket] = [p.detach().clone() for p in model.parameters()]
    model, _ = _train(DeMoReplicator(overlap="delayed"), rank)
    out["delayed"] = [p.detach().clone() for p in model.parameters()]
    return out


def corrupt_worker(rank: int, world: int) -> dict:
    """Rank 1 sends a NaN value at step 2: every rank names it, in both overlap modes."""
    out = {}
    for overlap in ("none", "delayed"):
        rep = DeMoReplicator(overlap=overlap)
        trained = _train(rep, rank, steps=2)
        if rank == 1:
            corrupt_first_values(rep, torch.bfloat16, 1)
        try:  # synchronous: raised at step 2; delayed: at step 4, the step after step 2's
            # payloads are applied (bad peers left out on the device, the verdict read late)
            _train(rep, rank, steps=3, start=2, trained=trained)
            out[overlap] = None
        except CorruptPayloadError as e:
            out[overlap] = (str(e), e.global_rank, e.step)
        dist.barrier()
    return out
