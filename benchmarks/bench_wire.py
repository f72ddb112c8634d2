"""Wire-efficiency benchmark on an emulated cluster (network namespaces + shaped links).

Part ``codecs``: bytes per parameter per step and loss after a fixed number of steps for DeMo
codec settings, 2 nodes x 1 rank (2 replicas), the ~10.9M GPT.
Part ``timing``: median step time and replication seconds per step at each bandwidth, 2 nodes
x 2 ranks (FlexDeMo, 2 x 2 mesh), the strategies run in turn for ``--rounds`` rounds: no
replication (the floor), bucketed, per-tensor and delayed (overlapped) DeMo at the default
codec, and the synchronous and delayed ones with the forward transform in bf16. Ratios to the
floor are taken within a round (the machine's slow spells hit neighbours alike).

    python benchmarks/bench_wire.py [--parts codecs,timing] [--steps 150] [--out DIR]

Needs root for shaping (without it, runs unshaped on loopback and says so). Prints tables and
writes ``wire.json`` under ``--out`` (default benchmarks/results).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from flexdemo import check_strategy
from flexdemo.app.args import Parser, int_at_least
from flexdemo.app.tasks import PRESETS
from flexdemo.tools.cluster import EmulatedCluster
from flexdemo.tools.netns import ShapingUnavailableError
from flexdemo.tools.rates import parse_bandwidth

ROOT = Path(__file__).resolve().parent.parent
# DeMo at the library's defaults: a strategy of flexdemo.STRATEGIES (the table
# that examples/train_gpt.py and flexdemo bench share), with codec settings after the name
DEMO = "demo-defaults"
CODECS = [DEMO] + [f"{DEMO}:{s}" for s in (
    "values=bf16", "values=int8", "values=int2", "values=sign", "topk=16", "topk=16:values=int8",
    "topk=16:values=int2", "topk=16:values=sign", "topk=4:values=sign")]
PARTS = ("codecs", "timing")
TIMING = ["floor", "{default}", "{default}:bucket=false", "{default}:overlap=delayed",
          "{default}:transform_dtype=bf16", "{default}:overlap=delayed:transform_dtype=bf16"]


def run_train(cluster_args: dict, strategies: list[str], extra: list[str]) -> list[dict]:
    """Run examples/train_gpt.py on an emulated cluster; returns its results."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        cmd = [sys.executable, str(ROOT / "examples" / "train_gpt.py"),
               "--strategies", ",".join(strategies), "--out", str(out), *extra]
        try:
            cluster = EmulatedCluster(**cluster_args)
        except ShapingUnavailableError as e:
            print(f"note: {e}\nrunning unshaped on loopback instead", flush=True)
            cluster = EmulatedCluster(cluster_args["nodes"], cluster_args["ranks_per_node"],
                                      unshaped=True)
        with cluster:
            result = cluster.run(cmd, cwd=str(ROOT))
        if not result.ok:
            raise SystemExit(f"training failed: {result}")
        return json.loads(out.read_text())["results"]


def summarize_timing(strategies: list[str], runs: list[dict]) -> list[dict]:
    """Per strategy: the median over rounds of its median step time, its ratio to the floor
    (``strategies[0]``) within each round, and the median of those ratios."""
    n = len(strategies)
    rounds = [runs[i:i + n] for i in range(0, len(runs), n)]
    rows = []
    for j, name in enumerate(strategies):
        steps = [rd[j]["step_seconds_median"] for rd in rounds]
        ratios = [rd[j]["step_seconds_median"] / rd[0]["step_seconds_median"] for rd in rounds]
        comm = [rd[j]["comm_seconds"] / rd[j]["steps"] for rd in rounds]
        rows.append({"strategy": name, "step_seconds": statistics.median(steps),
                     "x_floor": statistics.median(ratios), "ratios": ratios,
                     "comm_seconds_per_step": statistics.median(comm),
                     "bytes_per_param_per_step": rounds[0][j]["bytes_per_param_per_step"]})
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated, of {', '.join(PARTS)} (default %(default)s)")
    p.add_argument("--model", default="small", choices=tuple(PRESETS))
    p.add_argument("--steps", type=int_at_least(1), default=150, help="training steps per codec")
    p.add_argument("--timing-steps", type=int_at_least(1), default=30)
    p.add_argument("--rounds", type=int_at_least(1), default=3,
                   help="timing: passes over the strategies")
    p.add_argument("--bandwidths", default="100mbit,1gbit")
    p.add_argument("--codecs", default=",".join(CODECS))
    p.add_argument("--default", default=f"{DEMO}:topk=16:values=int2",
                   help="the codec used in the timing part")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    parts = {s.strip() for s in args.parts.split(",") if s.strip()}
    unknown = sorted(parts - set(PARTS))
    if unknown or not parts:
        what = f"unknown {', '.join(map(repr, unknown))}" if unknown else "name at least one"
        p.error(f"argument --parts: {what}; choose from {', '.join(PARTS)} (comma-separated)")
    # the rest is checked here too: a bad token would otherwise fail inside the cluster
    tokens = ([("--codecs", t) for t in args.codecs.split(",")] if "codecs" in parts else []) + (
        [("--default", args.default)] if "timing" in parts else [])
    for opt, token in tokens:
        try:
            check_strategy(token)
        except ValueError as e:
            p.error(f"argument {opt}: {' '.join(str(e).split())}")
    for bw in args.bandwidths.split(",") if "timing" in parts else []:
        try:
            parse_bandwidth(bw)
        except ValueError as e:
            p.error(f"argument --bandwidths: {e}")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        p.error(f"argument --out: {args.out!r} is a file; give a directory (wire.json goes "
                "in it)")
    report: dict = {"model": args.model}
    common = ["--model", args.model, "--batch", "4", "--log-every", "50"]
    if "codecs" in parts:
        codecs = args.codecs.split(",")
        res = run_train({"nodes": 2, "ranks_per_node": 1, "bandwidth": "1gbit"}, codecs,
                        common + ["--steps", str(args.steps), "--replicate", "2", "--shard", "1"])
        report["codecs"] = res
        print(f"\ncodecs: {args.model} GPT, 2 replicas, {args.steps} steps, "
              f"batch 4 x {PRESETS[args.model].seq_len}")
        print(f"{'strategy':<34} {'B/param/step':>12} {'val loss':>9} {'train':>8}")
        for r in res:
            print(f"{r['strategy']:<34} {r['bytes_per_param_per_step']:12.5f} "
                  f"{r['val_loss']:9.4f} {r['train_loss']:8.4f}")
    if "timing" in parts:
        report["timing"] = {}
        strategies = [s.format(default=args.default) for s in TIMING]
        for bw in args.bandwidths.split(","):
            # the strategies run in turn, ``--rounds`` times over, in one cluster: a slow spell
            # of the machine hits every strategy alike; each round's figure is the median step
            res = run_train({"nodes": 2, "ranks_per_node": 2, "bandwidth": bw},
                            strategies * args.rounds,
                            common + ["--steps", str(args.timing_steps), "--replicate", "2",
                                      "--shard", "2", "--eval-batches", "1"])
            rows = summarize_timing(strategies, res)
            report["timing"][bw] = {"rows": rows, "runs": res}
            print(f"\ntiming at {bw}: {args.model} GPT, 2 nodes x 2 ranks, "
                  f"{args.rounds} rounds x {args.timing_steps} steps (median step, s)")
            print(f"{'strategy':<52} {'s/step':>7} {'x floor':>8} {'rounds x floor':>18} "
                  f"{'comm s/step':>11} {'B/param':>8}")
            for r in rows:
                spread = ",".join(f"{x:.3f}" for x in r["ratios"])
                print(f"{r['strategy']:<52} {r['step_seconds']:7.3f} {r['x_floor']:8.3f} "
                      f"{spread:>18} {r['comm_seconds_per_step']:11.4f} "
                      f"{r['bytes_per_param_per_step']:8.5f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "wire.json").write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out / 'wire.json'}")
    return report


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
