"""``flexdemo simulate``: N replicas of the GPT task in one process
(:func:`flexdemo.app.simulate.run.run_simulation`)."""

from __future__ import annotations

import argparse
import sys

import torch

from ...strategies import check_strategy
from ..args import positive_int
from ..tasks.gpt import MIN_CORPUS_BYTES
from .run import SimulateOptions, run_simulation, write_summary


def add_simulate_parser(sub) -> None:
    d = SimulateOptions()
    s = sub.add_parser(
        "simulate", help="train N replicas of the GPT task in one process (CPU or one GPU)",
        description="Train N replicas of the byte-level GPT in one process: each replica its "
                    "own data, the strategy's replicators exchanging through memory with the "
                    "same codecs and byte counts as over a network (bitwise the weights N gloo "
                    "processes reach).",
        epilog="examples:\n  flexdemo simulate --replicas 4 --steps 300\n"
               "  flexdemo simulate --strategy hsdp-adamw --replicas 8 --model small "
               "--device cuda\n  flexdemo simulate --strategy flexdemo:topk=16:values=int2 "
               "--lr 3e-3",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--strategy", default=d.strategy, metavar="NAME",
                   help=f"a named strategy, optionally with settings (default {d.strategy}; "
                        f"see flexdemo bench --help)")
    s.add_argument("--replicas", type=positive_int, default=d.replicas, metavar="N",
                   help=f"replicas trained side by side (default {d.replicas})")
    s.add_argument("--model", default=d.model, choices=("tiny", "mini", "small"),
                   help=f"GPT preset (default {d.model})")
    s.add_argument("--steps", type=positive_int, default=d.steps, metavar="N",
                   help=f"training steps (default {d.steps})")
    s.add_argument("--batch", type=positive_int, default=d.batch, metavar="B",
                   help=f"sequences per replica per step (default {d.batch})")
    s.add_argument("--lr", type=float, metavar="LR", help="default: the strategy's")
    s.add_argument("--warmup", type=int, default=d.warmup, metavar="N",
                   help=f"linear warm-up steps (default {d.warmup})")
    s.add_argument("--schedule", default=d.schedule, choices=("cosine", "constant"),
                   help=f"lr schedule after the warm-up (default {d.schedule})")
    s.add_argument("--device", default=d.device, choices=("cpu", "cuda"),
                   help=f"every replica on this one device (default {d.device})")
    s.add_argument("--seed", type=int, default=d.seed,
                   help=f"initial weights and data order (default {d.seed})")
    s.add_argument("--corpus-bytes", type=positive_int, default=d.corpus_bytes, metavar="N",
                   help=f"bytes of standard-library sources to read (default "
                        f"{d.corpus_bytes:,})")
    s.add_argument("--log-every", type=positive_int, default=d.log_every, metavar="N",
                   help=f"print progress every N steps (default {d.log_every})")
    s.add_argument("--out", metavar="FILE", help="write the summary as JSON")
    s.set_defaults(func=_cmd_simulate, subparser=s)


def _simulate_error(text: str) -> int:
    print(f"flexdemo simulate: error: {text}", file=sys.stderr, flush=True)
    return 2


def _cmd_simulate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:  # the replicator is built once here, so that no replica raises a traceback later
        check_strategy(args.strategy)
    except ValueError as e:
        return _simulate_error(str(e))
    if args.device == "cuda" and not torch.cuda.is_available():
        return _simulate_error("--device cuda: no CUDA device here; use --device cpu")
    if args.lr is not None and not args.lr > 0:
        return _simulate_error(f"--lr must be > 0, got {args.lr}")
    if not 0 <= args.warmup < args.steps:
        return _simulate_error(f"--warmup must be in 0..{args.steps - 1} (fewer than --steps), "
                               f"got {args.warmup}")
    if args.corpus_bytes < MIN_CORPUS_BYTES:
        return _simulate_error(f"--corpus-bytes must be at least {MIN_CORPUS_BYTES} (the "
                               f"training and validation text), got {args.corpus_bytes}")
    opts = SimulateOptions(strategy=args.strategy, replicas=args.replicas, model=args.model,
                           steps=args.steps, batch=args.batch, lr=args.lr, warmup=args.warmup,
                           schedule=args.schedule, device=args.device, seed=args.seed,
                           corpus_bytes=args.corpus_bytes, log_every=args.log_every)
    summary = run_simulation(opts)
    if args.out:
        print(f"wrote {write_summary(summary, args.out)}")
    return 0
