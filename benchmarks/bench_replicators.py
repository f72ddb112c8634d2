"""Time one step of the dense and subset replicators (Full, Random, Striding, Slicing, DiLoCo)
on GPT-2-like parameter shapes, with the host synchronisations per step.

One process: the exchange itself is simulated (``--peers 2``: every peer sent this rank's
payload, so all checks pass), which measures the replicator's own work — filling buckets,
encoding, checking and decoding payloads, momentum, selection, error feedback, writing the
gradients — without a network. Usage::

    python benchmarks/bench_replicators.py --device cuda --model 124m [--out FILE]
        [--bucket-numel auto|none|N]

``--bucket-numel`` is the dense replicators' ``bucket_numel`` (Full, DiLoCo's exchange):
values per bucket, ``none`` for the whole model in one.

Prints a table (median and minimum ms per step, host synchronisations per step on CUDA) and
writes the per-case records with the run's settings as JSON to ``--out`` (default
benchmarks/results/replicators.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import warnings
from pathlib import Path

import torch

from flexdemo import REPLICATORS
from flexdemo.app.args import Parser, check_out_file, int_at_least
from flexdemo.transport import Pending, Transport

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"small": (4, 256, 256), "124m": (12, 768, 50257), "350m": (24, 1024, 50257)}
CASES = {
    "full-fp32": ("full", {}),
    "full-bf16": ("full", {"values": "bf16"}),
    "full-int8": ("full", {"values": "int8"}),
    "full-int4": ("full", {"values": "int4"}),
    "random": ("random", {}),
    "striding": ("striding", {}),
    "slicing": ("slicing", {}),
    # plain averaging (the class's default when RESULTS measured these; now "diloco-avg")
    "diloco-sync": ("diloco", {"inner_steps": 1, "outer_lr": 1.0, "outer_momentum": 0.0}),
    "diloco-inner": ("diloco", {"inner_steps": 1000, "outer_lr": 1.0, "outer_momentum": 0.0}),
}


def gpt_shapes(layers: int, d: int, vocab: int) -> list[torch.Size]:
    shapes = [torch.Size([vocab, d]), torch.Size([1024, d])]
    for _ in range(layers):
        shapes += [torch.Size(s) for s in ([d], [d], [3 * d, d], [3 * d], [d, d], [d], [d], [d],
                                           [4 * d, d], [4 * d], [d, 4 * d], [d])]
    return shapes + [torch.Size([d]), torch.Size([d])]


class MirrorTransport(Transport):
    """A group of ``peers`` ranks in which every peer sent this rank's payload (so every
    check passes): this process is rank 0, and nothing crosses a network."""

    def __init__(self, peers: int) -> None:
        self.size, self.rank = peers, 0

    def global_rank(self, r: int) -> int:
        return r

    def all_reduce_sum_(self, buf, async_op=False):
        n = self.size
        trailer = buf[-2 * n:]  # every peer's flag and code, as this rank's
        trailer[1:n].copy_(trailer[0].expand(n - 1))
        trailer[n + 1:].copy_(trailer[n].expand(n - 1))
        buf[: -2 * n].mul_(n)
        return Pending(buf) if async_op else None

    def all_gather_into(self, out, inp, async_op=False):
        out.view(self.size, -1).copy_(inp.reshape(1, -1).expand(self.size, -1))
        return Pending(out) if async_op else None


def bench(name: str, shapes, device, peers: int, steps: int,
          bucket_numel: int | str | None = "auto") -> dict:
    kind, kw = CASES[name]
    if kind == "full":
        kw = {**kw, "bucket_numel": bucket_numel}
    elif kind == "diloco":
        kw = {**kw, "exchange_kwargs": {"bucket_numel": bucket_numel}}
    rep = REPLICATORS[kind](**kw)
    params = [torch.randn(s, device=device) * 0.02 for s in shapes]
    # DiLoCo's exchanges see a group of one
    group = MirrorTransport(peers) if peers > 1 and kind != "diloco" else None
    rep.setup(shapes, device, group, params=params)
    grads = [torch.randn(s, device=device) for s in shapes]
    lrs = [1e-3] * len(shapes)
    times, syncs = [], []
    cuda = device.type == "cuda"
    for s in range(steps + 3):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            rep(grads, lrs, s)
            rep.after_step(s)
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
        if s >= 3:
            times.append(dt * 1e3)
            syncs.append(sum("synchroniz" in str(w.message) for w in caught))
    return {"case": name, "ms_median": round(statistics.median(times), 3),
            "ms_min": round(min(times), 3), "syncs_per_step": max(syncs) if cuda else None,
            "bytes_sent_per_step": rep.stats.bytes_sent // (steps + 3),
            "params": sum(s.numel() for s in shapes), "tensors": len(shapes)}


def _bucket_numel(text: str) -> int | str | None:
    if text in ("auto", "none"):
        return None if text == "none" else text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected auto, none or an integer >= 1, got {text!r}")
    return int(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; bad ones exit with one line and code 2."""
    ap = Parser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", default="small", choices=sorted(MODELS))
    ap.add_argument("--peers", type=int_at_least(1), default=2, help="simulated replicas, >= 1")
    ap.add_argument("--steps", type=int_at_least(1), default=10,
                    help="timed steps per case, >= 1")
    ap.add_argument("--cases", nargs="*", default=sorted(CASES),
                    help=f"of {', '.join(sorted(CASES))} (default: all)")
    ap.add_argument("--bucket-numel", type=_bucket_numel, default="auto",
                    help="dense replicators' values per bucket: auto (default), none (the "
                         "whole model) or an integer >= 1")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "replicators.json"),
                    help="JSON file to write (default benchmarks/results/replicators.json)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available; use --device cpu")
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        ap.error(f"argument --cases: unknown {', '.join(map(repr, unknown))}; "
                 f"choose from {', '.join(sorted(CASES))}")
    if not args.cases:
        ap.error(f"argument --cases: name at least one, from {', '.join(sorted(CASES))}")
    check_out_file(ap, args.out)
    return args


def main(argv: list[str] | None = None) -> dict:
    """Time the cases, print a table, write JSON."""
    args = parse_args(argv)
    device = torch.device(args.device)
    shapes = gpt_shapes(*MODELS[args.model])
    dev_name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()
    print(f"{args.model}: {sum(s.numel() for s in shapes) / 1e6:.1f}M parameters in "
          f"{len(shapes)} tensors; {args.peers} simulated peers, {args.steps} timed steps; "
          f"{device.type} ({dev_name}), torch {torch.__version__}\n")
    head = f"{'case':<13} {'ms median':>10} {'ms min':>9} {'host syncs':>10}"
    print(head + "\n" + "-" * len(head), flush=True)
    rows = []
    for name in args.cases:
        r = bench(name, shapes, device, args.peers, args.steps, args.bucket_numel)
        rows.append(r)
        syncs = "-" if r["syncs_per_step"] is None else r["syncs_per_step"]
        print(f"{r['case']:<13} {r['ms_median']:>10.3f} {r['ms_min']:>9.3f} {syncs:>10}",
              flush=True)
    result = {"model": args.model, "device": device.type, "device_name": dev_name,
              "peers": args.peers, "steps": args.steps, "bucket_numel": args.bucket_numel,
              "torch": torch.__version__,
              "threads": torch.get_num_threads(), "python": platform.python_version(),
              "params": sum(s.numel() for s in shapes), "tensors": len(shapes), "cases": rows}
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
