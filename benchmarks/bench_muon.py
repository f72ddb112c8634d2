"""What sharded Muon costs: the same FlexDeMo-style run with AdamW and with Muon on a mesh.

Spawns ``--replicate x --shard`` gloo ranks on this machine (CPU, ``--threads`` each), builds
the byte-level GPT of ``examples/train_gpt.py`` with ``flexdemo.prepare()`` (FSDP2 over the
shard dimension) and times ``--steps`` steps of each optimizer under the same replicator,
interleaved round by round so that both see the same machine. Reports per step: the whole
step, the optimizer step, Muon's intra-node exchange (seconds and bytes from
``last_step_stats()``), and Muon's extra work (its optimizer step less AdamW's) as a share of
its whole step. Usage::

    python benchmarks/bench_muon.py                       # mini GPT, 2 x 2 mesh, DeMo
    python benchmarks/bench_muon.py --model small --replicator full --out muon.json

``--ns`` instead times one process's ``MuonAdamW.step()`` on GPT-like matrices (``--ns-model``:
``d768x12`` is 12 layers of d=768, 48 matrices of 4 shapes) with the batched Newton-Schulz,
with torch's per-matrix call and with the batched one in fp32 (``ns_dtype="fp32"``),
interleaved, and counts the aten ops (matmuls apart) of a step::

    python benchmarks/bench_muon.py --ns --ns-model d768x12 --steps 5 --warmup 1 --threads 2
    python benchmarks/bench_muon.py --ns --ns-model d768x12 --device cuda   # + kernel launches

Prints a table and writes JSON (default benchmarks/results/muon.json, muon_ns.json for --ns).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch
import torch.multiprocessing as mp

from flexdemo.tools.ranks import free_port

ROOT = Path(__file__).resolve().parent.parent
OPTIMIZERS = {"adamw": {}, "muon": {}}
# --ns: (width, layers) of GPT-like stacks of hidden matrices (d128x4: the mini GPT's, d64x3:
# the tiny GPT's)
NS_MODELS = {"d768x12": (768, 12), "d256x4": (256, 4), "d128x4": (128, 4), "d64x3": (64, 3)}
MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm"})
# --ns: MuonAdamW's settings per variant (ns_mode, and ns_dtype for the fp32 iterations)
NS_VARIANTS = {"batched": {"ns_mode": "batched", "ns_dtype": "bf16"},
               "per_matrix": {"ns_mode": "per_matrix"},
               "fp32": {"ns_mode": "batched", "ns_dtype": "fp32"}}
NS_MODES = tuple(NS_VARIANTS)


class Parser(argparse.ArgumentParser):
    """Errors are one line (no usage block)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def example_gpt():
    """``examples/train_gpt.py`` as a module: the byte-level GPT (``GPT``, ``PRESETS``), its
    text (``load_corpus``) and batches (``get_batch``), all in public code a user can copy."""
    path = ROOT / "examples" / "train_gpt.py"
    spec = importlib.util.spec_from_file_location("train_gpt", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rank(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(args.replicate * args.shard), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(args.shard))
    torch.set_num_threads(args.threads)
    import torch.distributed as dist

    import flexdemo

    dist.init_process_group("gloo")
    gpt = example_gpt()
    cfg = gpt.PRESETS[args.model]
    runs = {}
    for name in OPTIMIZERS:
        torch.manual_seed(0)
        model, opt = flexdemo.prepare(gpt.GPT(cfg), args.replicator, name, lr=1e-3,
                                      replicate=args.replicate, shard=args.shard)
        runs[name] = (model, opt, {"step": [], "opt": [], "shard_s": [], "shard_b": []})
    gen = torch.Generator().manual_seed(rank)
    for i in range(args.warmup + args.steps):
        for _name, (model, opt, rec) in runs.items():
            x = torch.randint(0, 256, (args.batch, cfg.seq_len), generator=gen)
            dist.barrier()
            t0 = time.perf_counter()
            model(x, x).backward()
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            t2 = time.perf_counter()
            if i >= args.warmup:
                st = opt.last_step_stats()
                rec["step"].append(t2 - t0)
                rec["opt"].append(t2 - t1)
                rec["shard_s"].append(st.get("shard_seconds", 0.0))
                rec["shard_b"].append(st.get("shard_bytes_sent", 0))
    result = {name: {k: statistics.median(v) for k, v in rec.items()}
              for name, (_, _, rec) in runs.items()}
    result["params"] = sum(p.numel() for p in runs["muon"][0].parameters())  # global sizes
    result["muon_matrices"] = len(runs["muon"][1].base.muon_names)
    torch.save(result, os.path.join(out, f"{rank}.pt"))
    dist.destroy_process_group()


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(prog="bench_muon.py", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="mini", choices=("tiny", "mini", "small"))
    p.add_argument("--replicator", default="demo", help="replicator name (demo, full, ...)")
    p.add_argument("--replicate", type=int, default=2)
    p.add_argument("--shard", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--out", default=None,
                   help="JSON file (default benchmarks/results/muon.json, muon_ns.json for --ns)")
    p.add_argument("--ns", action="store_true",
                   help="time MuonAdamW.step() with batched vs per-matrix Newton-Schulz")
    p.add_argument("--ns-model", default="d256x4",
                   help=f"--ns: comma-separated matrix sets from {sorted(NS_MODELS)}")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="--ns: where the matrices live (cuda also counts kernel launches)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not (args.ns and torch.cuda.is_available()):
        p.error("--device cuda needs --ns and a CUDA device (torch.cuda.is_available() is "
                f"{torch.cuda.is_available()}); run without --device cuda")
    if args.out is None:
        args.out = str(ROOT / "benchmarks/results" / ("muon_ns.json" if args.ns else "muon.json"))
    unknown = [m for m in args.ns_model.split(",") if m not in NS_MODELS]
    if unknown:
        p.error(f"--ns-model {','.join(unknown)}: choose from {sorted(NS_MODELS)}")
    if min(args.replicate, args.shard, args.steps, args.batch, args.threads) < 1 or \
            args.warmup < 0:
        p.error("--replicate, --shard, --steps, --batch and --threads must be >= 1, "
                "--warmup >= 0")
    if Path(args.out).is_dir():
        p.error(f"--out {args.out!r} is a directory; give a file name")
    return args


def gpt_matrices(width: int, layers: int) -> list[tuple[int, int]]:
    """The hidden matrices of ``layers`` GPT blocks: qkv, attention out, MLP in and out."""
    return [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)] * layers


def count_ops(fn: Callable[[], object]) -> dict[str, int]:
    """Aten ops that ``fn()`` runs, by name (what would be kernel launches on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: dict[str, int] = {}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            ops[name] = ops.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return ops


def count_kernels(fn: Callable[[], object]) -> int:
    """CUDA kernels (memsets and copies included) that ``fn()`` launches, by torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def ns_bench(args: argparse.Namespace) -> dict:
    """``MuonAdamW.step()`` per ``ns_mode`` on each ``--ns-model``: median seconds, ops."""
    from flexdemo import MuonAdamW

    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    out = {}
    for model in args.ns_model.split(","):
        shapes = gpt_matrices(*NS_MODELS[model])
        gen = torch.Generator().manual_seed(0)
        start = [torch.randn(s, generator=gen).to(dev) for s in shapes]
        grads = [torch.randn(s, generator=gen).to(dev) for s in shapes]
        params = {m: [torch.nn.Parameter(t.clone()) for t in start] for m in NS_MODES}
        opts = {m: MuonAdamW(params[m], lr=1e-3, **NS_VARIANTS[m]) for m in NS_MODES}
        times: dict[str, list[float]] = {m: [] for m in NS_MODES}
        for i in range(args.warmup + args.steps):
            for m in NS_MODES:  # interleaved: both see the same machine
                for p, g in zip(params[m], grads):
                    p.grad = g
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                opts[m].step()
                if cuda:
                    torch.cuda.synchronize()
                if i >= args.warmup:
                    times[m].append(time.perf_counter() - t0)
        ops = {m: count_ops(opts[m].step) for m in NS_MODES}
        kernels = {m: count_kernels(opts[m].step) if cuda else None for m in NS_MODES}
        out[model] = {"matrices": len(shapes), "shapes": len(set(shapes)),
                      "params": sum(a * b for a, b in shapes),
                      "bitwise": all(torch.equal(a, b) for a, b in
                                     zip(params["batched"], params["per_matrix"])),
                      # how far the fp32 iterations' parameters are from torch's, relative
                      # to how far torch's moved from the start
                      "fp32_rel_diff": _rel_diff(params["fp32"], params["per_matrix"], start),
                      **{m: {"step_s": statistics.median(times[m]),
                             "matmuls": sum(n for k, n in ops[m].items() if k in MATMULS),
                             "ops": sum(ops[m].values()), "kernels": kernels[m]}
                         for m in NS_MODES}}
    where = (f"{torch.cuda.get_device_name(dev)}" if cuda else "CPU") + \
        f", {args.threads} thread(s)"
    print(f"MuonAdamW.step() on {where}, median of {args.steps} steps")
    print(f"{'matrices':<22} {'mode':<11} {'step ms':>9} {'matmuls':>8} {'aten ops':>9} "
          + (f"{'kernels':>8} " if cuda else "") + f"{'speed-up':>9} {'vs torch':>12}")
    for model, r in out.items():
        label = f"{model} ({r['matrices']}, {r['shapes']} shapes)"
        for m in NS_MODES:
            up = r["per_matrix"]["step_s"] / r[m]["step_s"]
            same = ("torch's" if m == "per_matrix" else
                    f"{r['fp32_rel_diff']:.2%} off" if m == "fp32" else
                    "bitwise" if r["bitwise"] else "NOT bitwise")
            launches = f"{r[m]['kernels']:>8} " if cuda else ""
            print(f"{label:<22} {m:<11} {1e3 * r[m]['step_s']:>9.1f} {r[m]['matmuls']:>8} "
                  f"{r[m]['ops']:>9} {launches}{up:>8.2f}x {same:>12}")
    print("fp32: ns_dtype='fp32', the iterations in fp32 (bf16 in and out); 'off': the "
          "distance of its parameters from torch's, relative to torch's whole move")
    return out


def _rel_diff(a: list[torch.Tensor], b: list[torch.Tensor], start: list[torch.Tensor]) -> float:
    num = sum(float((x.detach() - y.detach()).square().sum()) for x, y in zip(a, b))
    den = sum(float((y.detach() - s).square().sum()) for y, s in zip(b, start))
    return (num / den) ** 0.5 if den else 0.0


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.ns:
        result = {"command": " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
                  "settings": vars(args), "machine": platform.platform(),
                  "cpus": os.cpu_count(), "torch": torch.__version__, "ns": ns_bench(args)}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
        return result
    world = args.replicate * args.shard
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(args, free_port(), tmp), nprocs=world)
        ranks = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(world)]
    # the slowest rank sets the pace of a synchronous step
    agg = {name: {k: max(r[name][k] for r in ranks) for k in ranks[0][name]}
           for name in OPTIMIZERS}
    adamw, muon = agg["adamw"], agg["muon"]
    # what Muon adds: its optimizer step against AdamW's (forward and backward are the same
    # work in both, and only add noise to a difference of whole steps)
    extra = muon["opt"] - adamw["opt"]
    summary = {"extra_seconds": extra, "extra_share_of_step": extra / muon["step"],
               "exchange_share_of_step": muon["shard_s"] / muon["step"],
               "shard_bytes_per_step": muon["shard_b"],
               "shard_bytes_per_param": muon["shard_b"] / ranks[0]["params"]}
    print(f"{args.model} GPT ({ranks[0]['params']:,} parameters, "
          f"{ranks[0]['muon_matrices']} Muon matrices), mesh {args.replicate} x {args.shard}, "
          f"replicator {args.replicator}, {args.threads} thread(s) per rank, median of "
          f"{args.steps} steps, slowest rank")
    print(f"{'optimizer':<10} {'step ms':>9} {'opt.step ms':>12} {'shard ms':>9} "
          f"{'shard KB sent':>14}")
    for name, r in agg.items():
        print(f"{name:<10} {1e3 * r['step']:>9.1f} {1e3 * r['opt']:>12.1f} "
              f"{1e3 * r['shard_s']:>9.1f} {r['shard_b'] / 1e3:>14.1f}")
    print(f"Muon's extra work: {1e3 * extra:.1f} ms = {summary['extra_share_of_step']:.1%} of "
          f"its step (exchange {summary['exchange_share_of_step']:.1%}); intra-node "
          f"{muon['shard_b'] / 1e3:.1f} KB sent per rank per step")
    result = {"command": " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
              "settings": vars(args), "machine": platform.platform(),
              "cpus": os.cpu_count(), "per_optimizer": agg, "ranks": ranks, **summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
