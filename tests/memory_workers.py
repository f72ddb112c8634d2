"""Dense exchanges bucket by bucket on gloo ranks (importable by children): the parameters
after a few steps, the held buffers and step workspace counted by LiveBytes, and the bytes
each step recorded against the replicator's own count."""

from __future__ import annotations

import torch
from torch import nn

from flexdemo import DeToNATION, DiLoCoReplicator, FullReplicator, LiveBytes
from flexdemo.replicate import frontier

BUCKET = 1 << 16  # 65,536 values: about 1/14 of the model below


def model() -> nn.Module:
    torch.manual_seed(0)  # 1.2M parameters; bucket boundaries cut tensors
    return nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 512),
                         nn.Linear(512, 300))


def replicator(case: str, bucket_numel):
    """The replicator of ``case`` with buckets of ``bucket_numel`` values (None: whole)."""
    if case == "fp32":
        return FullReplicator(bucket_numel=bucket_numel), "sgd"
    if case == "int4-feedback":
        return FullReplicator(values="int4", error_feedback=0.9,
                              bucket_numel=bucket_numel), "sgd"
    if case == "int8-scatter":
        return FullReplicator(values="int8", block=64, reduce="scatter",
                              bucket_numel=bucket_numel), "sgd"
    kw: dict = {"inner_steps": 2}
    if case == "muloco-int4":
        kw["exchange_kwargs"] = {"bucket_numel": bucket_numel}
    else:
        kw["exchange_kwargs"] = {"topk": 8, "chunk": 16}
    return frontier.frontier_preset(case, **kw), "sgd"


def train(rank: int, world: int, case: str, bucket_numel, steps: int = 4,
          copy: bool = False) -> dict:
    """``steps`` steps of ``case`` on this rank's own data under LiveBytes; ``copy``: DiLoCo
    with its pseudo-gradients in buffers of their own (the path before they were formed in
    the parameters)."""
    in_place = DiLoCoReplicator._pseudo_in_place
    if copy:
        DiLoCoReplicator._pseudo_in_place = lambda self: False  # type: ignore[method-assign]
    try:
        return _train(rank, case, bucket_numel, steps)
    finally:
        DiLoCoReplicator._pseudo_in_place = in_place  # type: ignore[method-assign]


def compare(rank: int, world: int, case: str) -> dict:
    """``case`` whole and in buckets of :data:`BUCKET` (DiLoCo's: also with its
    pseudo-gradients in buffers of their own, as before)."""
    if case == "sparseloco-dct":  # DeMo's exchange: its own groups (group_numel)
        return {"buckets": train(rank, world, case, None),
                "copy": train(rank, world, case, None, copy=True)}
    out = {"whole": train(rank, world, case, None),
           "buckets": train(rank, world, case, BUCKET)}
    if case == "muloco-int4":
        out["copy"] = train(rank, world, case, BUCKET, copy=True)
    return out


def _train(rank: int, case: str, bucket_numel, steps: int) -> dict:
    with LiveBytes():
        net = model()
        P = 4 * sum(p.numel() for p in net.parameters())
        rep, base = replicator(case, bucket_numel)
        opt = DeToNATION(net.parameters(), [rep], base=base, lr=1e-2)
        gen = torch.Generator().manual_seed(rank)
        step_ws, sent = 0, []
        for s in range(steps):
            x = torch.randn(8, 512, generator=gen)
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
            if s >= 2:  # the first sync (step 1) makes DiLoCo's outer state
                step_ws = max(step_ws, opt.last_step_stats()["step_workspace_bytes"])
            sent.append(rep.stats.last_bytes_sent)
        held = opt.memory_stats()["workspace_bytes"]
    return {"params": [p.detach().clone() for p in net.parameters()], "P": P, "held": held,
            "step_ws": step_ws, "sent": sent, "exchange_bytes": rep.exchange_bytes(),
            "payload_bytes": rep.payload_bytes(),
            "buckets": len(getattr(getattr(rep, "exchanges", [rep])[0], "buckets", None) or ())}
