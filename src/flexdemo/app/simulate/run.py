"""``flexdemo simulate``: N replicas of the GPT task in one process, exchanging through memory.

Each replica draws its own batches of the standard library's sources (``seed + replica``, as
rank ``r`` would in a multi-process run) and the strategy's replicators exchange through
:class:`flexdemo.simulate.SimulatedReplicas`' in-process transport: the bytes reported are those
each replica would send over the network and the weights those N gloo processes would reach.
All replicas share one device (CPU or one GPU), so a study of many replicas needs no cluster.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...simulate import SimulatedReplicas
from ...strategies import check_strategy
from ..outputs import strict_json
from ..schedule import lr_at
from ..tasks.gpt import (
    GPT,
    MIN_CORPUS_BYTES,
    data_generator,
    get_batch,
    gpt_config,
    load_corpus,
)


@dataclass
class SimulateOptions:
    """What one ``flexdemo simulate`` run trains."""

    strategy: str = "flexdemo"
    replicas: int = 4
    model: str = "tiny"
    steps: int = 300
    batch: int = 8
    lr: float | None = None          # None: the strategy's own learning rate
    warmup: int = 0                  # linear warm-up steps, then cosine decay to 10%
    schedule: str = "cosine"         # or "constant"
    device: str = "cpu"
    seed: int = 0
    corpus_bytes: int = 2_000_000
    eval_batches: int = 8
    log_every: int = 25


@torch.no_grad()
def val_loss(model: torch.nn.Module, val: torch.Tensor, batch: int, seq_len: int,
             device: torch.device, batches: int = 8) -> float:
    """Mean loss of ``model`` over fixed random windows of the validation bytes."""
    gen = torch.Generator().manual_seed(1234)
    model.eval()
    losses = [model(*(t.to(device) for t in get_batch(val, batch, seq_len, gen)))
              for _ in range(batches)]
    model.train()
    return float(torch.stack(losses).mean())


def run_simulation(opts: SimulateOptions, echo=print) -> dict[str, Any]:
    """Train ``opts.replicas`` replicas with ``opts.strategy``; returns the summary. Bad
    strategy settings or too little text raise ``ValueError`` (one line) before any replica
    is built."""
    strategy = check_strategy(opts.strategy)
    if opts.corpus_bytes < MIN_CORPUS_BYTES:
        raise ValueError(f"corpus_bytes must be at least {MIN_CORPUS_BYTES}, got "
                         f"{opts.corpus_bytes}")
    device = torch.device(opts.device)
    base_lr = strategy.lr if opts.lr is None else opts.lr
    train, val = load_corpus(opts.corpus_bytes)
    cfg = gpt_config(opts.model)
    gens = [data_generator(opts.seed, rank=r) for r in range(opts.replicas)]

    def loss_fn(model, batch):
        x, y = batch
        return model(x.to(device), y.to(device))

    torch.manual_seed(opts.seed)  # the initial weights (the replicas then share them)
    sim = SimulatedReplicas(lambda: GPT(cfg), loss_fn, replicas=opts.replicas,
                            replicator=strategy.replicator, optimizer=strategy.optimizer,
                            lr=base_lr, replicator_kwargs=strategy.replicator_kwargs or None,
                            device=device, seed=opts.seed,
                            base_kwargs=strategy.optimizer_kwargs or None)
    nparams = sum(p.numel() for p in sim.models[0].parameters())
    echo(f"{opts.replicas} replicas of a {nparams / 1e6:.2f}M-parameter GPT on {device}; "
         f"{sim.optimizers[0]!r}")
    history: list[dict[str, float]] = []
    t0, start, window = time.perf_counter(), time.perf_counter(), []

    def lr_of(step: int) -> float:
        return lr_at(step, opts.steps, base_lr, opts.warmup, opts.schedule)

    def log(done: int, losses: list[torch.Tensor]) -> None:
        nonlocal t0, window
        window.append(torch.stack(losses).mean())
        if done % opts.log_every == 0 or done == opts.steps:
            sent = sim.last_step_stats()[0]["bytes_sent"]
            loss = float(torch.stack(window).mean())  # one read per log line
            ms = (time.perf_counter() - t0) / len(window) * 1e3
            lr = lr_of(done - 1)
            history.append({"step": done, "train_loss": loss, "lr": lr})
            eta = (time.perf_counter() - start) / done * (opts.steps - done)
            echo(f"step {done:5d}/{opts.steps} ({done / opts.steps:4.0%})  loss {loss:.4f}  "
                 f"lr {lr:.2e}  sent/replica/step {sent:,} B ({sent / nparams:.4f} B/param)  "
                 f"{ms:.1f} ms/step  eta {eta:.0f}s")
            t0, window = time.perf_counter(), []

    sim.train(opts.steps, lambda step: [get_batch(train, opts.batch, cfg.seq_len, g)
                                        for g in gens], lr_of, log)
    seconds = time.perf_counter() - start
    vals = [val_loss(m, val, opts.batch, cfg.seq_len, device, opts.eval_batches)
            for m in sim.models]
    identical = sim.identical()
    echo(f"validation loss per replica: {[round(v, 4) for v in vals]}")
    echo(f"bytes sent per replica: {sim.bytes_sent}; replicas identical: {identical}")
    return {
        "options": vars(opts), "strategy": strategy.settings(), "params": nparams,
        "val_loss": sum(vals) / len(vals), "val_loss_per_replica": vals,
        "bytes_sent_per_replica": list(sim.bytes_sent),
        "bytes_per_param_per_step": sim.bytes_sent[0] / max(opts.steps, 1) / nparams,
        "replicas_identical": identical, "seconds": seconds, "history": history,
    }


def write_summary(summary: dict[str, Any], out: str | Path) -> Path:
    """Write the summary as JSON to ``out`` (folders made as needed; NaN as null)."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(strict_json(summary, indent=2) + "\n")
    return path
