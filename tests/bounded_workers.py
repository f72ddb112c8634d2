"""The worker of tests/test_bounded.py's real gloo run (importable by child processes)."""

from __future__ import annotations

import contextlib
import io

import torch
import torch.distributed as dist
from test_bounded import STEPS_GLOO, batch, codecs, eval_loss_of, hostile, tiny_model

import flexdemo


def hostile_muloco_worker(rank: int, world: int, bad: int) -> dict:
    """MuLoCo's preset (int4 by reduce-scatter, H=5, AdamW inner steps) over gloo, replica
    ``bad`` hostile: this rank's eval loss, clip count, stderr and parameters."""
    model = tiny_model()
    opt = flexdemo.DeToNATION(list(model.named_parameters()),
                              flexdemo.make_replicator("muloco-int4", inner_steps=5), base="adamw",
                              lr=1e-2, group=dist.group.WORLD)
    if rank == bad:
        for codec in codecs(opt):
            hostile(codec)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        for step in range(STEPS_GLOO):
            loss = torch.nn.functional.mse_loss(model(batch(rank, step)[0]), batch(rank, step)[1])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {"eval": eval_loss_of(model), "clipped": opt.last_step_stats()["clipped_contributions"],
            "err": err.getvalue(), "params": [p.detach().clone() for p in model.parameters()]}
