"""``flexdemo bench``: sweep strategies x bandwidths (:func:`flexdemo.app.bench.run.run_bench`)."""

from __future__ import annotations

import argparse
import sys

from ...strategies import STRATEGIES
from ..args import positive_float, positive_int, seconds_arg
from ..config.schema import ConfigError
from .run import (
    DEFAULT_BANDWIDTHS,
    DEFAULT_STRATEGIES,
    PRESETS,
    BenchError,
    bench_options,
    run_bench,
)

BENCH_DESCRIPTION = """\
Sweep strategies x bandwidths on an emulated cluster (flexdemo cluster): for every pair, run
`flexdemo train` on --nodes x --ranks-per-node ranks whose nodes are joined by links of that
rate, then write results.json, results.csv and plots (loss vs wall-clock time, loss vs bytes
sent, step time split into compute and communication) to --out and print a table.

Shaping needs root and iproute2; without them (or with --unshaped) the ranks run on loopback
with no bandwidth limit, and the bench says so.
"""


def add_bench_parser(sub) -> None:
    width = max(map(len, STRATEGIES)) + 1
    strategies = "\n".join(f"  {name:<{width}} {spec.about}" for name, spec in STRATEGIES.items())
    presets = "\n".join(f"  {name:<12} {spec['about']}" for name, spec in PRESETS.items())
    b = sub.add_parser(
        "bench", help="sweep strategies x bandwidths on an emulated cluster; table + plots",
        description=BENCH_DESCRIPTION,
        epilog=f"strategies:\n{strategies}\n\npresets:\n{presets}\n\nexamples:\n"
               "  flexdemo bench --preset main\n"
               "  flexdemo bench --preset elastic --kill-at 30 --restart-at 50\n"
               "  flexdemo bench --preset auto\n"
               "  flexdemo bench --preset stragglers --slow-factor 2 --slow-node 0\n"
               "  flexdemo bench --strategies auto,muloco-int4-h20 --bandwidths '1gbit>10mbit'\n"
               "  flexdemo bench --strategies flexdemo,hsdp-adamw --bandwidths 10mbit,1gbit "
               "--steps 100\n"
               "  flexdemo bench --unshaped --steps 20 task.model=tiny\n",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides for every run, e.g. task.model=tiny")
    b.add_argument("--preset", choices=sorted(PRESETS),
                   help="a ready-made sweep (its settings apply first; other options refine)")
    b.add_argument("--strategies", metavar="LIST",
                   help=f"comma-separated (default {','.join(DEFAULT_STRATEGIES)})")
    b.add_argument("--bandwidths", metavar="LIST",
                   help=f"comma-separated rates (default {','.join(DEFAULT_BANDWIDTHS)}); "
                        "'1gbit>10mbit': a link that changes halfway through each run")
    b.add_argument("--nodes", type=positive_int, metavar="N", help="emulated nodes (default 2)")
    b.add_argument("--ranks-per-node", type=positive_int, metavar="M",
                   help="ranks per node (default 2)")
    b.add_argument("--steps", type=positive_int, metavar="N",
                   help="training steps per run (default: a train.steps=N override, else "
                        "train.steps of --config, else the preset's, else 100; an override "
                        "that differs from --steps is an error)")
    b.add_argument("--config", metavar="FILE",
                   help="base training config for every run (default: the GPT task)")
    b.add_argument("--out", metavar="DIR", help="output folder (default runs/bench)")
    b.add_argument("--unshaped", action="store_true",
                   help="no shaping, no root needed: all ranks on loopback")
    b.add_argument("--timeout", type=seconds_arg, metavar="S",
                   help="stop a run that takes longer than S seconds")
    b.add_argument("--device", choices=("auto", "cpu", "cuda"),
                   help="where every rank trains (default: train.device of --config, else "
                        "auto: CUDA when this machine has a GPU per rank, else CPU)")
    b.add_argument("--kill-at", type=positive_int, metavar="K",
                   help="elastic preset: kill the last node when node 0 reaches step K "
                        "(default: the preset's 40, at most a third of the steps)")
    b.add_argument("--restart-at", type=positive_int, metavar="M",
                   help="elastic preset: start the killed node again at node 0's step M "
                        "(default 70, at most 7/12 of the steps)")
    b.add_argument("--repeat", type=positive_int, metavar="N",
                   help="elastic preset: run the plain and the elastic run N times, "
                        "alternately, and report each pair's overhead with the median and the "
                        "range (default 1)")
    b.add_argument("--target", type=positive_float, metavar="LOSS",
                   help="report every run's time to this validation loss (default with "
                        "the auto preset: the loosest loss every run within 5 percent of the "
                        "best reached)")
    b.add_argument("--slow-factor", type=float, metavar="F",
                   help="make each step of one node last F times its compute (train.slowdown: "
                        "an emulated slower GPU, >= 1; default 1, the stragglers preset 3)")
    b.add_argument("--slow-node", type=int, metavar="N",
                   help="the node --slow-factor slows, from 0 (default: the last)")
    b.add_argument("-q", "--quiet", action="store_true",
                   help="do not echo the ranks' progress (it still goes to each run's log.txt)")
    b.set_defaults(func=_cmd_bench, subparser=b)


def _cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        options = bench_options(
            preset=args.preset, strategies=args.strategies, bandwidths=args.bandwidths,
            nodes=args.nodes, ranks_per_node=args.ranks_per_node, steps=args.steps,
            config=args.config, out=args.out, unshaped=args.unshaped,
            overrides=args.overrides, timeout=args.timeout, quiet=args.quiet,
            device=args.device, kill_at=args.kill_at, restart_at=args.restart_at,
            repeat=args.repeat, target=args.target, slow_factor=args.slow_factor,
            slow_node=args.slow_node)
    except (BenchError, ConfigError) as e:
        print(f"flexdemo bench: error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        results = run_bench(options)
    except BenchError as e:
        print(f"flexdemo bench: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("flexdemo bench: interrupted; runs stopped", file=sys.stderr, flush=True)
        return 130
    return 0 if all(r["status"] == "ok" for r in results) else 1
