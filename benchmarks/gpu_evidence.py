"""One command for a lent GPU: step cost, peak memory and a short quality run, time-boxed.

    PYTHONPATH=src python benchmarks/gpu_evidence.py [--out DIR] [--budget-s 540] [--smoke]
                                                    [--device cuda|cpu]

1. Step cost: the optimizer step (replicator + base optimizer, through ``DeToNATION``) of
   full-sync AdamW and Muon, DeMo at its defaults and delayed, DeMo with Muon's orthogonalised
   step, and the ``muloco`` and ``sparseloco`` presets, in ms and as a share of one
   forward+backward (bf16 autocast on CUDA), on the 124m and 350m GPT shapes of
   ``bench_core.py``, whole and on a 1/8 row shard (sliced, as ``bench_core.py`` does). One
   process is one replica: nothing is sent, the step is the optimizer's own compute.
2. Peak memory of each of those steps (``torch.cuda.max_memory_allocated``) and what the
   optimizer holds after them, in units of P, the fp32 bytes of the parameters of the layout.
3. Quality: a 124M-shaped byte-level GPT on the standard library's sources, 2 replicas in one
   process (``SimulatedReplicas``), about 300 steps each of full-sync AdamW and Muon, MuLoCo and
   the orthogonalised DeMo, at the lrs of the CPU quality benchmark.

Each part has its share of ``--budget-s`` (counted from the start) and stops cleanly when it is
spent, saying how far it got. Writes ``step_cost.md``, ``memory.md``, ``quality.md``,
``evidence.json`` and PNG plots (with matplotlib) to ``--out`` (default
``gpu_evidence/<UTC time>/``, git-ignored) and prints the tables. ``--smoke``: tiny sizes on the
CPU in well under a minute (the test suite runs it). Exit code 1 if a strategy raised.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType

import torch

T0 = time.perf_counter()
HERE = Path(__file__).resolve().parent

from flexdemo import DeToNATION, SimulatedReplicas, make_replicator, parse_strategy  # noqa: E402
from flexdemo.app.schedule import lr_at  # noqa: E402
from flexdemo.app.tasks import GPT, ByteWindows, eval_indices, gpt_config  # noqa: E402


def beside(name: str) -> ModuleType:
    """The script ``name``.py beside this one, loaded from its file (benchmarks/ is not a
    package, and this script edits no ``sys.path``); registered under ``name`` so that its
    dataclasses find it."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None, name
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bench_core, quality = beside("bench_core"), beside("quality")
report = beside("gpu_evidence_report")
plots, quality_table, step_tables = report.plots, report.quality_table, report.step_tables

# row name: a strategy of flexdemo.STRATEGIES (the table `flexdemo bench` reads), with settings
STEP_STRATEGIES = {
    "adamw": "hsdp-adamw",                       # full-sync AdamW
    "muon": "hsdp-muon",                         # full-sync Muon (+ AdamW on the rest)
    "demo": "demo-defaults",                     # DeMo defaults: top-16 of 4096, int2, sign-SGD
    "demo-delayed": "demo-defaults:overlap=delayed",  # the same, exchange behind the next step
    # the same with unbounded groups (one per block shape): the whole-model step took 9.9 ms on
    # an H100 before groups were bounded at 4M coefficients, 21.8 ms after (RESULTS)
    "demo-1group": "demo-defaults:group_numel=1073741824",
    "demo-muon": "flexdemo-muon",                # DeMo replicator, orthogonalised ("muon") step
    "muloco": "muloco-int4",        # the "muloco-int4" preset (named "muloco" when measured)
    "sparseloco": "sparseloco-dct",  # the "sparseloco-dct" preset (named "sparseloco" then)
}
# row name: (strategy, lr, where the lr comes from); each the best of the CPU quality benchmark
# on its largest GPT (benchmarks/archive/results-until-2026-12-07.md, benchmarks/quality.py)
QUALITY = {
    # best of AdamW's grid on the 10.9M GPT at 300 and 1,000 steps ("The 10.9M GPT")
    "adamw": ("hsdp-adamw", 1e-3, "RESULTS: 10.9M GPT, best at 300 and 1,000 steps"),
    # best of {1e-2, 3e-2} on the 10.9M GPT at 300 steps ("The Muon family"); used at 1,000
    "muon": ("hsdp-muon", 1e-2, "RESULTS: Muon family, 10.9M GPT best"),
    # MuLoCo's best on the 10.9M GPT, and the lr of the muloco preset's frontier runs
    "muloco": ("muloco-int4", 1e-2, "RESULTS: MuLoCo 10.9M best; byte frontier lr"),
    # demo-ortho-k64-d0.9 (these settings) on the 10.9M GPT, 1,000 steps: 1e-2 beat 3e-2
    "demo-muon": ("flexdemo-muon", 1e-2, "RESULTS: demo-ortho-k64-d0.9, 10.9M GPT best"),
}
LAYOUTS = {"whole": 1, "1/8 rows": 8}
SHARES = {"step_cost": 0.45, "quality": 0.45}  # of the budget; the rest: start-up, writing


@dataclass(frozen=True)
class Sizes:
    """What each part runs: the step-cost models (overrides of ``bench_core``'s example GPT),
    their batch and repetitions; the quality GPT (overrides of the app's ``small``), its batch,
    steps, evaluation and text."""

    step_models: dict = field(default_factory=lambda: {
        "124m": bench_core.PRESETS["124m"], "350m": bench_core.PRESETS["350m"]})
    batch: int = 8
    reps: int = 10
    warmup: int = 3
    quality_model: dict = field(default_factory=lambda: {
        "n_layer": 12, "n_head": 12, "d_model": 768, "seq_len": 512})
    quality_batch: int = 16
    quality_steps: int = 300
    eval_every: int = 50
    eval_batches: int = 4
    corpus_bytes: int = 8_000_000


SMOKE = Sizes(step_models={"tiny": {"n_layer": 2, "n_head": 4, "d_model": 64, "seq_len": 64,
                                    "vocab": 256}},
              batch=2, reps=2, warmup=1,
              quality_model={"n_layer": 2, "n_head": 4, "d_model": 64, "seq_len": 64},
              quality_batch=4, quality_steps=10, eval_every=5, eval_batches=2,
              corpus_bytes=200_000)


def left(deadline: float) -> float:
    """Seconds until ``deadline`` (``time.perf_counter()`` time)."""
    return deadline - time.perf_counter()


def finite(v):
    """``v`` with NaN and infinities (a diverged loss) as None: strict JSON."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: finite(x) for k, x in v.items()}
    return [finite(x) for x in v] if isinstance(v, (list, tuple)) else v


def one_line(e: BaseException) -> str:
    """An exception as one short line."""
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


# ---------------------------------------------------------------------- 1, 2: step and memory
def time_step(token: str, names: list[str], ps: list[torch.Tensor], gs: list[torch.Tensor],
              timer: bench_core.Timer, sizes: Sizes, deadline: float) -> dict:
    """One strategy's optimizer step on these tensors: per-step seconds (a DiLoCo strategy for
    at least one sync interval, so the mean includes one sync) and, on CUDA, memory. Named
    tensors: Muon takes the hidden matrices by name, AdamW the embeddings, head and the rest."""
    s = parse_strategy(token)
    cuda = ps[0].device.type == "cuda"
    params = [(n, p.clone().requires_grad_(True)) for n, p in zip(names, ps)]
    grads = [g.clone() for g in gs]
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    opt = DeToNATION(params, make_replicator(s.replicator, **s.replicator_kwargs),
                     base=s.optimizer, lr=s.lr, base_kwargs=dict(s.optimizer_kwargs) or None)
    every = int(getattr(opt.replicators[0], "inner_steps", 1))

    def fresh() -> None:  # the same gradients every step (untimed)
        torch._foreach_copy_(grads, gs)
        for (_, p), g in zip(params, grads):
            p.grad = g

    planned = max(sizes.reps, every)
    times = timer.samples(opt.step, planned, sizes.warmup, setup=fresh, deadline=deadline)
    out = {"ms_median": 1e3 * statistics.median(times), "ms_mean": 1e3 * statistics.fmean(times),
           "steps_timed": len(times), "steps_planned": planned, "sync_every": every,
           "mean_has_sync": every > 1 and len(times) >= every}
    mem = opt.memory_stats()  # exact, per storage, on any device
    out.update(state_bytes=mem["state_bytes"], workspace_bytes=mem["workspace_bytes"])
    if cuda:
        torch.cuda.synchronize()
        out.update(peak_bytes=torch.cuda.max_memory_allocated() - base,
                   held_bytes=torch.cuda.memory_allocated() - base)
    return out  # the optimizer and its tensors go with this frame (gc before the next)


def step_cost(sizes: Sizes, device: torch.device, deadline: float) -> dict:
    """Part 1 and 2 for every model, layout and strategy until ``deadline``; every model gets
    an equal share of what is left when it starts."""
    timer = bench_core.Timer(device, "wall")
    gpt = bench_core.example_gpt()
    cuda = device.type == "cuda"
    models, rows, cells = [], [], 0
    total = len(sizes.step_models) * len(LAYOUTS) * len(STEP_STRATEGIES)
    for i, (mname, overrides) in enumerate(sizes.step_models.items()):
        own = time.perf_counter() + left(deadline) / (len(sizes.step_models) - i)
        if left(own) <= 0:
            continue
        cfg = gpt.PRESETS["small"]._replace(**overrides)
        torch.manual_seed(0)
        with torch.device(device):
            model = gpt.GPT(cfg)
        names = [n for n, _ in model.named_parameters()]
        x, y = bench_core.text_batch(gpt, cfg, sizes.batch, device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        fb, grads = bench_core.forward_backward(model, x, y, timer, sizes.reps, sizes.warmup)
        n_params = sum(p.numel() for p in model.parameters())
        models.append({"model": mname, "params": n_params, "config": cfg._asdict(),
                       "batch": sizes.batch, "seq_len": cfg.seq_len, "fwd_bwd_ms": fb * 1e3,
                       "fwd_bwd_peak_P": (torch.cuda.max_memory_allocated() - before)
                       / (4 * n_params) if cuda else None})
        print(f"[{time.perf_counter() - T0:5.0f}s] {mname}: {n_params / 1e6:.1f}M params, "
              f"forward+backward {fb * 1e3:.1f} ms", flush=True)
        params = [p.detach() for p in model.parameters()]
        for layout, parts in LAYOUTS.items():
            ps, gs = bench_core.layout_copies(params, grads, parts)
            local = sum(p.numel() for p in ps)
            for key, token in STEP_STRATEGIES.items():
                if left(own) <= 0:
                    break
                row = {"model": mname, "layout": layout, "strategy": key, "token": token,
                       "local_params": local}
                try:
                    row.update(time_step(token, names, ps, gs, timer, sizes, own))
                    row["pct_fwd_bwd"] = 100 * row["ms_median"] / (fb * 1e3)
                    row["pct_fwd_bwd_mean"] = 100 * row["ms_mean"] / (fb * 1e3)
                    for k in ("peak", "held", "state", "workspace"):
                        if f"{k}_bytes" in row:
                            row[f"{k}_P"] = row[f"{k}_bytes"] / (4 * local)
                except Exception as e:  # a failed strategy is a row; the others still run
                    traceback.print_exc()
                    row["error"] = one_line(e)
                rows.append(row)
                cells += 1
            del ps, gs
        del model, params, grads, x, y
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return {"strategies": STEP_STRATEGIES, "layouts": list(LAYOUTS), "models": models,
            "models_planned": list(sizes.step_models), "rows": rows,
            "cells_done": cells, "cells_planned": total,
            "complete": cells == total and all(r.get("steps_timed") == r.get("steps_planned")
                                               for r in rows)}


# ---------------------------------------------------------------------- 3: quality
def quality_run(key: str, sizes: Sizes, device: torch.device, data: dict,
                deadline: float) -> dict:
    """One strategy, 2 simulated replicas, until its steps are done or ``deadline``."""
    token, lr, source = QUALITY[key]
    s = parse_strategy(token)
    cuda = device.type == "cuda"
    gcfg = data["cfg"]

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)

    def loss_fn(model, b):
        with autocast():
            return model(b[0].to(device), b[1].to(device))

    sources = quality.batch_sources("random", data["train"], 2, gcfg.seq_len, 0)
    torch.manual_seed(0)
    sim = SimulatedReplicas(lambda: GPT(gcfg), loss_fn, replicas=2, replicator=s.replicator,
                            optimizer=s.optimizer, lr=lr,
                            replicator_kwargs=dict(s.replicator_kwargs) or None, device=device,
                            seed=0, base_kwargs=dict(s.optimizer_kwargs) or None)
    n_params = sum(p.numel() for p in sim.models[0].parameters())
    steps, b = sizes.quality_steps, sizes.quality_batch

    def val() -> float:  # replicas that differ (DiLoCo between syncs) are each evaluated
        with autocast():
            models = sim.models[:1] if sim.identical() else sim.models
            return statistics.fmean(quality.evaluate(m, data["val_x"], data["val_y"], b)
                                    for m in models)

    t0 = time.perf_counter()
    curve = [[0, val()]]
    clock = {"eval": time.perf_counter() - t0, "last": time.perf_counter()}
    step_s: list[float] = []
    stop = {"why": "done"}

    def on_step(done: int, losses) -> bool:
        if cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        step_s.append(now - clock["last"])
        if done % sizes.eval_every == 0 and done < steps:
            curve.append([done, val()])
            clock["eval"] = time.perf_counter() - now
            if not math.isfinite(curve[-1][1]):
                stop["why"] = "diverged"
                return True
        clock["last"] = time.perf_counter()
        if done < steps and left(deadline) < statistics.median(step_s[-10:]) + clock["eval"]:
            stop["why"] = "time box"
            return True
        return False

    done = sim.train(steps, lambda step: [src(b) for src in sources],
                     lambda step: lr_at(step, steps, lr, int(0.05 * steps), "cosine", 0.1),
                     on_step)
    if curve[-1][0] != done:
        curve.append([done, val()])
    out = {"strategy": key, "token": token, "lr": lr, "lr_source": source, "params": n_params,
           "steps_planned": steps, "steps_reached": done, "stopped": stop["why"],
           "final_val": curve[-1][1], "curve": curve, "seconds": time.perf_counter() - t0,
           "ms_per_step": 1e3 * statistics.median(step_s) if step_s else None,
           "bytes_per_param_step": max(sim.bytes_sent) / n_params / max(done, 1)}
    return out


def quality_part(sizes: Sizes, device: torch.device, deadline: float) -> dict:
    """Part 3: every strategy in turn, each with an equal share of the time left."""
    train, val = quality.corpus(sizes.corpus_bytes)
    gcfg = gpt_config("small", **sizes.quality_model)
    vwin = ByteWindows(val, gcfg.seq_len + 1)
    vw = vwin.get(eval_indices(len(vwin), 0, 1, sizes.eval_batches * sizes.quality_batch))
    data = {"cfg": gcfg, "train": train, "val_x": vw[:, :-1].to(device),
            "val_y": vw[:, 1:].to(device)}
    rows = []
    for i, key in enumerate(QUALITY):
        own = time.perf_counter() + left(deadline) / (len(QUALITY) - i)
        if left(own) <= 0:
            rows.append({"strategy": key, "token": QUALITY[key][0], "stopped": "not reached"})
            continue
        try:
            rows.append(quality_run(key, sizes, device, data, own))
        except Exception as e:  # a failed strategy is a row; the others still run
            traceback.print_exc()
            rows.append({"strategy": key, "token": QUALITY[key][0], "error": one_line(e)})
        r = rows[-1]
        print(f"[{time.perf_counter() - T0:5.0f}s] quality {key}: "
              f"{r.get('steps_reached', 0)} steps, val {r.get('final_val', math.nan):.4f}",
              flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"model": asdict(gcfg), "replicas": 2, "batch": sizes.quality_batch,
            "rows": rows, "complete": all(r.get("stopped") == "done" for r in rows)}


def main(argv: list[str] | None = None) -> int:
    """Run the three parts within the budget, write the folder, print the tables."""
    global T0
    if __name__ != "__main__":  # called, not run: the budget counts from here
        T0 = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="output folder (default gpu_evidence/<UTC time>/)")
    p.add_argument("--budget-s", type=float, help="seconds for everything (default 540; "
                   "--smoke 40); each part stops at its share")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU unless --device)")
    p.add_argument("--device", choices=["cuda", "cpu"],
                   help="default: cuda when available (--smoke: cpu)")
    args = p.parse_args(argv)
    budget = args.budget_s if args.budget_s is not None else 40.0 if args.smoke else 540.0
    if not budget > 0:
        p.error(f"--budget-s must be positive, got {budget}")
    dev = args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if dev == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    device = torch.device(dev)
    if dev == "cpu":  # one thread: a shared machine's other jobs disturb it less
        torch.set_num_threads(1)
    sizes = SMOKE if args.smoke else Sizes()
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else HERE.parent / "gpu_evidence" / stamp
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(device) if dev == "cuda" else (platform.processor()
                                                                      or "CPU")
    env = (f"{name}, torch {torch.__version__}, Python {platform.python_version()}"
           f"{', 1 CPU thread' if dev == 'cpu' else ''}{', smoke sizes' if args.smoke else ''}")
    print(f"gpu_evidence: {env}; budget {budget:.0f} s; writing to {out}", flush=True)
    result = {"device": dev, "device_name": name, "torch": torch.__version__,
              "python": platform.python_version(), "smoke": args.smoke, "budget_s": budget,
              "shares": SHARES, "sizes": asdict(sizes)}
    ends = {"step_cost": T0 + SHARES["step_cost"] * budget,
            "quality": T0 + (SHARES["step_cost"] + SHARES["quality"]) * budget}
    for part, fn in (("step_cost", step_cost), ("quality", quality_part)):
        t = time.perf_counter()
        result[part] = fn(sizes, device, ends[part])
        result[part]["seconds"] = time.perf_counter() - t
        result[part]["share_s"] = ends[part] - t
    step_md, mem_md = step_tables(result["step_cost"], env)
    quality_md = quality_table(result["quality"], env)
    sc, q = result["step_cost"], result["quality"]
    how_far = (f"step cost: {sc['cells_done']} of {sc['cells_planned']} cells in "
               f"{sc['seconds']:.0f} s{'' if sc['complete'] else ' (time box: cut short)'}; "
               f"quality: {sum(r.get('steps_reached', 0) for r in q['rows'])} of "
               f"{len(q['rows']) * sizes.quality_steps} steps in {q['seconds']:.0f} s"
               f"{'' if q['complete'] else ' (time box or error: cut short)'}")
    result["how_far"] = how_far
    for fname, text in (("step_cost.md", step_md), ("memory.md", mem_md),
                        ("quality.md", quality_md)):
        (out / fname).write_text(text)
        print("\n" + text, flush=True)
    result["plots"] = plots(out, result)
    result["seconds"] = time.perf_counter() - T0
    (out / "evidence.json").write_text(json.dumps(finite(result), indent=1) + "\n")
    errors = [r for part in ("step_cost", "quality") for r in result[part]["rows"]
              if "error" in r]
    print(f"{how_far}; {len(errors)} error(s); {result['seconds']:.0f} s in all; wrote {out}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
