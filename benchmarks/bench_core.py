"""Core costs of DeMo replication on the "small" (~10.9M parameter) byte-level GPT.

    python benchmarks/bench_core.py [--out benchmarks/results/core.json]

a. Bytes a rank sends per step over the replicate dimension: DeMo (all-gather of its payload
   to the ``n - 1`` peers) against an fp32 ring all-reduce (``2 (n-1)/n * 4`` bytes per
   element), for ``n`` = 2 and 4 replicas, for the whole model (data-parallel layout) and for
   the half-row shards a rank holds in the FlexDeMo 2x2 layout (FSDP2 over 2 ranks cuts every
   parameter, vectors too, into ``shape[0] // 2`` rows).
b. Single-thread compute: forward+backward at batch 4 x 128 tokens against one DeMo replicator
   step (transform, top-k, error feedback, decode, sign; no communication in a group of one)
   plus the sign-SGD update, and against a ``torch.optim.AdamW`` step, for both layouts.
   Medians over ``--reps`` repetitions after warm-up.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from flexdemo import DeMoReplicator
from flexdemo.app.tasks import GPT, data_generator, get_batch, gpt_config, load_corpus
from flexdemo.comm import all_gather_bytes, all_reduce_bytes


def half_rows(shape: torch.Size, parts: int = 2) -> torch.Size:
    """The local shape of one FSDP shard when dim 0 is split ``parts`` ways (even split)."""
    return torch.Size((shape[0] // parts, *shape[1:]))


def median_seconds(fn: Callable[[], None], reps: int, warmup: int,
                   setup: Callable[[], None] | None = None) -> float:
    """Median wall time of ``fn`` over ``reps`` runs after ``warmup`` runs (``setup`` untimed)."""
    times = []
    for i in range(warmup + reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
    return statistics.median(times)


def traffic(shapes: list[torch.Size], replicas: int, topk: int, chunk: int,
            values: str = "fp32") -> dict:
    """Bytes per rank per step of DeMo vs. an fp32 ring all-reduce for local ``shapes``."""
    rep = DeMoReplicator(topk=topk, chunk=chunk, values=values)
    rep.setup(shapes, torch.device("cpu"), None)
    numel = sum(s.numel() for s in shapes)
    demo = all_gather_bytes(rep.payload_bytes(), replicas)
    dense = sum(all_reduce_bytes(s.numel(), 4, replicas) for s in shapes)
    dense_bucket = all_reduce_bytes(numel, 4, replicas)
    return {
        "replicas": replicas, "local_params": numel, "payload_bytes": rep.payload_bytes(),
        "demo_bytes": demo, "allreduce_bytes": dense_bucket,
        "allreduce_bytes_per_tensor": dense,
        "demo_bytes_per_param": demo / numel, "allreduce_bytes_per_param": dense_bucket / numel,
        "ratio": dense_bucket / demo,
    }


def time_optimizers(params: list[torch.Tensor], grads: list[torch.Tensor], reps: int,
                    warmup: int, lr: float, topk: int, chunk: int, values: str = "fp32",
                    transform_dtype: str = "fp32") -> dict:
    """Median seconds of a DeMo step + sign-SGD update and of an AdamW step on ``params``."""
    rep = DeMoReplicator(topk=topk, chunk=chunk, values=values, transform_dtype=transform_dtype)
    rep.setup([p.shape for p in params], torch.device("cpu"), None)
    work = [torch.empty_like(g) for g in grads]
    lrs = [lr] * len(params)
    step = [0]

    def fresh() -> None:
        torch._foreach_copy_(work, grads)

    @torch.no_grad()
    def demo_step() -> None:
        out = rep(work, lrs, step[0])
        torch._foreach_add_(params, out, alpha=-lr)
        step[0] += 1

    demo = median_seconds(demo_step, reps, warmup, setup=fresh)
    replicate_only = median_seconds(lambda: rep(work, lrs, 0), reps, warmup, setup=fresh)

    adam_params = [p.detach().clone().requires_grad_(True) for p in params]
    for p, g in zip(adam_params, grads):
        p.grad = g.clone()
    adam = torch.optim.AdamW(adam_params, lr=lr)
    adamw = median_seconds(adam.step, reps, warmup)
    return {"demo_step_s": demo, "demo_replicator_s": replicate_only, "adamw_step_s": adamw}


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print the tables, write JSON."""
    p = argparse.ArgumentParser(description="DeMo bytes and compute on the small GPT")
    p.add_argument("--model", default="small")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--topk", type=int, default=32)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--values", default="fp32", help="value format (fp32, int8, int2, sign, ...)")
    p.add_argument("--transform-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="precision of the forward DCT's products")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/core.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    cfg = gpt_config(args.model)
    model = GPT(cfg)
    params = [q for q in model.parameters()]
    n_params = sum(q.numel() for q in params)
    layouts = {
        "full": [q.shape for q in params],
        "half-rows": [half_rows(q.shape) for q in params],
    }

    # a. traffic -----------------------------------------------------------------------
    bytes_rows = []
    for layout, shapes in layouts.items():
        for n in (2, 4):
            bytes_rows.append({"layout": layout, **traffic(shapes, n, args.topk, args.chunk,
                                                               args.values)})

    # b. compute -----------------------------------------------------------------------
    train, _ = load_corpus(1_000_000, val_bytes=1)
    gen = data_generator(0, 0)
    x, y = get_batch(train, args.batch, cfg.seq_len, gen)

    def fwd_bwd() -> None:
        model.zero_grad(set_to_none=True)
        model(x, y).backward()

    fb = median_seconds(fwd_bwd, args.reps, args.warmup)
    fwd_bwd()
    grads = [q.grad.detach().clone() for q in params]
    compute = {"forward_backward_s": fb, "batch": args.batch, "seq_len": cfg.seq_len,
               "layouts": []}
    for layout in layouts:
        if layout == "full":
            ps = [q.detach().clone() for q in params]
            gs = grads
        else:
            ps = [q.detach()[: q.shape[0] // 2].clone() for q in params]
            gs = [g[: g.shape[0] // 2].clone() for g in grads]
        t = time_optimizers(ps, gs, args.reps, args.warmup, args.lr, args.topk, args.chunk,
                            args.values, args.transform_dtype)
        compute["layouts"].append({
            "layout": layout, "local_params": sum(q.numel() for q in ps), **t,
            "demo_pct_of_fwd_bwd": 100 * t["demo_step_s"] / fb,
            "adamw_pct_of_fwd_bwd": 100 * t["adamw_step_s"] / fb,
        })

    # report ---------------------------------------------------------------------------
    print(f"model {args.model}: {n_params / 1e6:.2f}M parameters, DeMo topk={args.topk} "
          f"chunk={args.chunk} values={args.values} transform {args.transform_dtype}, "
          f"torch {torch.__version__}, "
          f"{args.threads} thread(s)\n")
    head = (f"{'layout':<10} {'n':>2} {'local params':>12} {'DeMo B/step':>12} "
            f"{'fp32 AR B/step':>15} {'DeMo B/param':>13} {'AR B/param':>11} {'ratio':>7}")
    print(head + "\n" + "-" * len(head))
    for r in bytes_rows:
        print(f"{r['layout']:<10} {r['replicas']:>2} {r['local_params']:>12,} "
              f"{r['demo_bytes']:>12,} {r['allreduce_bytes']:>15,} "
              f"{r['demo_bytes_per_param']:>13.4f} {r['allreduce_bytes_per_param']:>11.3f} "
              f"{r['ratio']:>6.1f}x")
    print(f"\nforward+backward (batch {args.batch} x {cfg.seq_len}): {fb * 1e3:.1f} ms "
          f"(median of {args.reps})")
    head = (f"{'layout':<10} {'local params':>12} {'DeMo+signSGD ms':>16} {'% of f+b':>9} "
            f"{'(replicator ms)':>16} {'AdamW ms':>9} {'% of f+b':>9}")
    print(head + "\n" + "-" * len(head))
    for r in compute["layouts"]:
        print(f"{r['layout']:<10} {r['local_params']:>12,} {r['demo_step_s'] * 1e3:>16.1f} "
              f"{r['demo_pct_of_fwd_bwd']:>8.1f}% {r['demo_replicator_s'] * 1e3:>16.1f} "
              f"{r['adamw_step_s'] * 1e3:>9.1f} {r['adamw_pct_of_fwd_bwd']:>8.1f}%")

    result = {
        "model": args.model, "params": n_params, "topk": args.topk, "chunk": args.chunk,
        "values": args.values, "transform_dtype": args.transform_dtype,
        "torch": torch.__version__, "threads": args.threads, "python": platform.python_version(),
        "machine": platform.machine(), "reps": args.reps, "bytes": bytes_rows,
        "compute": compute,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
