"""Train N replicas of a small byte-level GPT in one process, exchanging through memory.

    python examples/simulate.py --replicas 4 --steps 300                 # DeMo, CPU
    python examples/simulate.py --replicas 8 --device cuda --model small
    python examples/simulate.py --replicator full --optimizer adamw --lr 1e-3

Every replica draws its own batches of the Python standard library's sources (seed + replica
index, as rank r would in a multi-process run); the replicators exchange through
:class:`flexdemo.simulate.SimulatedReplicas`' in-process transport, so the bytes printed are
those each replica would send over the network, and the weights are those N gloo processes
would reach, bit for bit. Prints the mean training loss, the bytes per replica per step, and
at the end the validation loss and whether the replicas are still identical.
"""

from __future__ import annotations

import argparse
import time

import torch

from flexdemo.app.tasks.gpt import GPT, data_generator, get_batch, gpt_config, load_corpus
from flexdemo.simulate import SimulatedReplicas


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=4, help="number of simulated replicas")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--model", default="tiny", help="GPT preset: tiny, mini, small")
    p.add_argument("--batch", type=int, default=8, help="sequences per replica per step")
    p.add_argument("--replicator", default="demo",
                   help="demo, full, none, random, striding, slicing, diloco")
    p.add_argument("--optimizer", default="sgd", help="base optimizer: sgd, adamw, adam")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", default="cpu", help="cpu or cuda (all replicas on one device)")
    p.add_argument("--corpus-bytes", type=int, default=2_000_000)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


@torch.no_grad()
def val_loss(model, val, batch: int, seq_len: int, device, batches: int = 8) -> float:
    """Mean loss of ``model`` over fixed random batches of the validation bytes."""
    gen = torch.Generator().manual_seed(1234)
    model.eval()
    losses = [model(*(t.to(device) for t in get_batch(val, batch, seq_len, gen)))
              for _ in range(batches)]
    model.train()
    return float(torch.stack(losses).mean())


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    train, val = load_corpus(args.corpus_bytes)
    cfg = gpt_config(args.model)
    torch.manual_seed(args.seed)
    gens = [data_generator(args.seed, rank=r) for r in range(args.replicas)]

    def loss_fn(model, batch):
        x, y = batch
        return model(x.to(device), y.to(device))

    sim = SimulatedReplicas(lambda: GPT(cfg), loss_fn, replicas=args.replicas,
                            replicator=args.replicator, optimizer=args.optimizer, lr=args.lr,
                            device=device, seed=args.seed)
    nparams = sum(p.numel() for p in sim.models[0].parameters())
    print(f"{args.replicas} replicas of a {nparams / 1e6:.2f}M-parameter GPT on {device}; "
          f"{sim.optimizers[0]!r}")
    t0, window = time.perf_counter(), []
    for step in range(args.steps):
        batches = [get_batch(train, args.batch, cfg.seq_len, g) for g in gens]
        window.append(torch.stack(sim.step(batches)).mean())
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            sent = sim.last_step_stats()[0]["bytes_sent"]
            loss = float(torch.stack(window).mean())
            ms = (time.perf_counter() - t0) / len(window) * 1e3
            print(f"step {step + 1:5d}  loss {loss:.4f}  sent/replica/step {sent:,} B "
                  f"({sent / nparams:.4f} B/param)  {ms:.1f} ms/step")
            t0, window = time.perf_counter(), []
    vals = [val_loss(m, val, args.batch, cfg.seq_len, device) for m in sim.models]
    print(f"validation loss per replica: {[round(v, 4) for v in vals]}")
    print(f"bytes sent per replica: {sim.bytes_sent}; replicas identical: {sim.identical()}")


if __name__ == "__main__":
    main()
