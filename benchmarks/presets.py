"""What should I run at my bandwidth? Every named replicator, with Muon and with tuned AdamW
inner steps, each at its best lr strictly inside its grid, on one harness.

The harness: the tiny GPT (0.19M parameters) on 8 simulated replicas
(:class:`flexdemo.SimulatedReplicas`, bitwise what 8 gloo processes reach), 900 steps of 9 x 64
bytes per replica: 22 tokens per parameter, the field's horizon, in about two minutes a run
on one core. 900 steps is a multiple of every preset's sync interval (20, 30, 100), so the
final model of every row is a synchronised one. Each row is ``"<replicator>/<optimizer>"``:
``prepare(model, replicator, optimizer)`` with the library's defaults, AdamW tuned as the
field tunes it (betas 0.9 / 0.95, weight decay 0.1). The search, per row:

1. three lrs a factor 2 apart around a first guess, 2 seeds each;
2. while the best lr (lowest mean final validation loss) is at an edge of the row's grid, the
   next lr beyond that edge (at most ``--extend`` times);
3. where a gap that the table reports (against full sync with the same inner optimizer,
   against the best full sync, against no sync) is under one point, a third seed at the best
   lr and its neighbours.

Usage::

    python benchmarks/presets.py --cost                 # the grid and its cost, runs nothing
    python benchmarks/presets.py --workers 2 --threads 1   # ~1.5-2 h on 2 cores
    python benchmarks/presets.py --rows full/muon,muloco/muon --workers 2

Every finished run is saved to ``--out``/``quality.json`` as it arrives (the format of
``quality.py``, so ``quality.py --merge-only --merge`` reads it), and a second call with the
same ``--out`` runs only what is missing. Writes ``presets.md`` (the tables, with the date
and the command), ``quality.csv``, ``quality.png`` and ``frontier.png`` there.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import os
import sys
from pathlib import Path


def _load_quality():
    import importlib.util
    if "quality" in sys.modules:
        return sys.modules["quality"]
    spec = importlib.util.spec_from_file_location(
        "quality", Path(__file__).resolve().parent / "quality.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["quality"] = module
    spec.loader.exec_module(module)
    return module


quality = _load_quality()

#: the harness every row runs on (quality.py's options)
HARNESS = ["--quick", "--replicas", "8", "--steps", "900", "--batch", "9", "--eval-every",
           "100", "--ns-dtype", "fp32"]
#: every row, with the centre of its first grid (from the one-seed 8-replica look of
#: 2026-12-07, benchmarks/archive/)
ROWS: dict[str, float] = {
    "full/muon": 0.02, "none/muon": 0.01, "diloco/muon": 0.01, "diloco-avg/muon": 0.01,
    "muloco/muon": 0.01, "muloco-int4/muon": 0.01, "sparseloco/muon": 0.005,
    "sparseloco-dct/muon": 0.02,
    "full/adamw": 0.004, "none/adamw": 0.004, "diloco/adamw": 0.004,
    "diloco-avg/adamw": 0.004, "muloco/adamw": 0.004, "muloco-int4/adamw": 0.004,
    "sparseloco/adamw": 0.002, "sparseloco-dct/adamw": 0.004,
}
#: rows run only when named (--rows): DeMo at the library defaults, sign-SGD (a step-by-step
#: exchange of 8 replicas: the costliest row here)
OPTIONAL: dict[str, float] = {"demo/sgd": 0.003, "muloco-int4-h150/muon": 0.01}
GUESS = {**ROWS, **OPTIONAL}
FACTOR = 2.0
SEEDS = 2
CLOSE = 0.01  # a gap under one point: a third seed
#: seconds one run took on the 2-core Intel host (AVX-512), one thread, for --cost
SECONDS_PER_RUN = 115.0


def parse_args(argv=None) -> argparse.Namespace:
    p = quality.Parser(prog="presets.py", description=__doc__.split("\n")[0])
    p.add_argument("--rows", default=",".join(ROWS),
                   help=f"comma list from: {', '.join(GUESS)} (default: all but "
                        f"{', '.join(OPTIONAL)})")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--extend", type=int, default=2,
                   help="at most this many lrs added beyond an edge of a row's grid")
    p.add_argument("--cost", action="store_true", help="print the grid and its cost only")
    p.add_argument("--out", default="benchmarks/results/presets")
    args = p.parse_args(argv)
    args.rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in args.rows if r not in GUESS]
    if unknown or not args.rows:
        p.error(f"unknown row {unknown}; choose from {', '.join(GUESS)}")
    if args.workers < 1 or args.threads < 1 or args.extend < 0:
        p.error("--workers and --threads must be >= 1, --extend >= 0")
    return args


def _lr(x: float) -> float:
    return float(f"{x:.2g}")


def first_grid(row: str) -> list[float]:
    c = GUESS[row]
    return [_lr(c / FACTOR), _lr(c), _lr(c * FACTOR)]


def wanted(runs: list[dict], rows: list[str], extend: int) -> list[tuple[str, float, int]]:
    """The (row, lr, seed) still to run, given the runs so far: the first grids, then one
    step beyond an edge holding the best lr, then a third seed where a gap is close."""
    have = {(r["strategy"], r["lr"], r["seed"]) for r in runs}
    need = [(row, lr, s) for row in rows for lr in first_grid(row) for s in range(SEEDS)
            if (row, lr, s) not in have]
    if need:
        return need
    summary = quality.summarize(runs)
    for row in rows:
        mine = sorted((r for r in summary if r["strategy"] == row), key=lambda r: r["lr"])
        lrs = [r["lr"] for r in mine]
        best = next(r for r in mine if r["best_lr"])
        added = len(lrs) - len(first_grid(row))
        if best["lr_at_grid_edge"] and added < extend:
            lr = _lr(best["lr"] / FACTOR) if best["lr"] == lrs[0] else _lr(best["lr"] * FACTOR)
            need += [(row, lr, s) for s in range(SEEDS) if (row, lr, s) not in have]
            continue
        gaps = [best.get("vs_same"), best.get("vs_best_full"),
                _vs(summary, best, "none/" + row.split("/")[1])]
        if any(g is not None and g != 1.0 and abs(g - 1.0) < CLOSE for g in gaps):
            i = lrs.index(best["lr"])
            for lr in lrs[max(0, i - 1):i + 2]:
                need += [(row, lr, s) for s in range(SEEDS + 1) if (row, lr, s) not in have]
    return need


def configs(need: list[tuple[str, float, int]], threads: int) -> list[dict]:
    out = []
    for row, lr, seed in need:
        a = quality.parse_args(HARNESS + ["--strategies", row, "--lrs", repr(lr), "--seeds", "1",
                                          "--first-seed", str(seed), "--threads", str(threads)])
        out += quality.configurations(a)
    return out


def prepare_call(row: str) -> str:
    """The ``prepare(...)`` call a row runs (its replicator's own settings, if any)."""
    s = quality.SETTINGS[row]
    kw = ", ".join(f'"{k}": {v!r}' for k, v in s.replicator_kwargs.items())
    extra = f", replicator_kwargs={{{kw}}}" if kw else ""
    okw = dict(s.optimizer_kwargs)
    if "weight_decay" in okw:
        extra += f", weight_decay={okw.pop('weight_decay')!r}"
    base = ", ".join(f'"{k}": {v!r}' for k, v in okw.pop("base_kwargs", {}).items())
    extra += f", optimizer_kwargs={{{base}}}" if base else ""
    assert not okw, okw  # every setting of the row is in its call
    return f'prepare(model, "{s.replicator}", "{s.optimizer}"{extra})'


def markdown(rows: list[dict], command: str, when: str) -> str:
    """The tables: one per inner optimizer, each row at its best lr."""
    best = [r for r in rows if r["best_lr"]]
    lines = [f"{when}, `{command}`: the tiny GPT, 8 replicas, 900 steps of 9 x 64 bytes "
             f"each ({best[0]['tokens_per_param']:.1f} tokens per parameter), cosine lr; every "
             "row at its best lr (mean final validation loss over the seeds); a `!` marks a "
             "best lr at the edge of its grid.", ""]
    for inner in ("muon", "adamw", "sgd"):
        mine = sorted((r for r in best if r["strategy"].endswith("/" + inner)),
                      key=lambda r: r["val_mean"])
        if not mine:
            continue
        lines += ["| row | `prepare(...)` | best lr | seeds | val loss | vs full sync, same "
                  "inner | vs best full sync | vs no sync | B/param/step |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in mine:
            edge = " !" if r["lr_at_grid_edge"] else ""
            lines.append(
                f"| `{r['strategy']}` | `{prepare_call(r['strategy'])}` | {r['lr']:g}{edge} | "
                f"{r['seeds']} | {r['val_mean']:.4f} ± {r['val_std']:.4f} | "
                f"{_pct(r.get('vs_same'))} | {_pct(r.get('vs_best_full'))} | "
                f"{_pct(_vs(rows, r, 'none/' + inner))} | {r['bytes_per_param_step']:.4g} |")
        lines.append("")
    return "\n".join(lines)


def _vs(rows: list[dict], r: dict, ref: str) -> float | None:
    b = next((x for x in rows if x["strategy"] == ref and x["best_lr"]), None)
    return r["val_mean"] / b["val_mean"] if b else None


def _pct(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{(x - 1) * 100:+.1f}%"


def main(argv=None) -> None:
    args = parse_args(argv)
    command = " ".join(["python benchmarks/presets.py"]
                       + (argv if argv is not None else sys.argv[1:]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "quality.json"
    runs = quality.load_runs([str(path)])[0][1] if path.exists() else []
    qargs = quality.parse_args(HARNESS + ["--strategies", ",".join(args.rows), "--seeds",
                                          str(SEEDS), "--threads", str(args.threads),
                                          "--workers", str(args.workers), "--out", str(out)])
    quality.check_same([(str(path), runs)], {k: getattr(qargs, k) for k in (*quality.SAME,
                                                                          *quality.DEFAULTED)})
    if args.cost:
        need = wanted(runs, args.rows, args.extend)
        hours = len(need) * SECONDS_PER_RUN / args.workers / 3600
        print(f"{len(need)} runs in the first round ({SECONDS_PER_RUN:.0f} s a run on one core, "
              f"{args.workers} worker(s)): about {hours:.1f} h; edges and close gaps add "
              f"about {2 * len(args.rows) * SECONDS_PER_RUN / args.workers / 3600:.1f} h at most "
              "per extension round")
        for row in args.rows:
            print(f"  {row:<22} lrs {first_grid(row)} x {SEEDS} seeds")
        return
    while need := wanted(runs, args.rows, args.extend):
        print(f"{len(need)} runs: {', '.join(sorted({n[0] for n in need}))}", flush=True)
        quality.run_all(configs(need, args.threads), args.workers,
                        say=lambda s: print(s, flush=True), into=runs,
                        saved=lambda rs: quality.write_json(out, qargs, command, rs))
    rows = [r for r in quality.summarize(runs) if r["strategy"] in args.rows]
    curves = quality.best_curves(runs, rows)
    quality.write_json(out, qargs, command, runs, rows, curves)
    with open(out / "quality.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    best_lrs = {(r["replicas"], r["strategy"]): r["lr"] for r in rows if r["best_lr"]}
    title = "tiny GPT, 8 replicas, 900 steps, batch 9/replica: every preset at its best lr"
    quality.plot(curves, best_lrs, out / "quality.png", title)
    quality.frontier_plot(rows, out / "frontier.png", title)
    when = datetime.date.today().isoformat()
    text = markdown(rows, command, when)
    (out / "presets.md").write_text(text)
    print(quality.table(rows))
    print(text)
    print(f"wrote {out}/quality.json, presets.md, quality.csv, quality.png, frontier.png "
          f"({os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
