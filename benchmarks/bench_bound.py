"""What the bound on each peer's part costs a step (``peer_bound``, docs/replicators.md).

Two simulations of the same run, one with the default bound (8) and one without, step
alternately in blocks of 5 on the same batches (so the machine's drift falls on both): the
GPT task's model, N replicas in one process (:class:`flexdemo.SimulatedReplicas`), batch 8 of
each replica, one torch thread. For each exchange it prints the mean and median step time of
each, their ratio, whether the two runs ended on the same bits (honest peers never reach the
bound) and the clipped parts counted; writes ``bound.json``::

    python benchmarks/bench_bound.py                          # small GPT, 40 steps, 2 replicas
    python benchmarks/bench_bound.py --model tiny --steps 10 --cases demo,int4
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from flexdemo import SimulatedReplicas
from flexdemo.app.args import Parser, int_at_least
from flexdemo.app.tasks import GPT, gpt_config

OUTER = {"outer_lr": 1.0, "outer_momentum": 0.0}
CASES = {  # name: (replicator, settings, base optimizer); the bound goes where it applies
    "int4": ("full", {"values": "int4"}, "adamw"),
    "int4-scatter": ("full", {"values": "int4", "reduce": "scatter"}, "adamw"),
    "demo": ("demo", {}, "sgd"),
    "diloco-int4": ("diloco", {"inner_steps": 10, **OUTER, "exchange": "full",
                               "exchange_kwargs": {"values": "int4", "reduce": "scatter"}},
                    "adamw"),
    "diloco-sparse": ("diloco", {"inner_steps": 10, **OUTER, "exchange": "demo",
                                 "exchange_kwargs": {"topk": 64, "chunk": 64,
                                                     "values": "stat2", "decay": 0.95}},
                      "adamw"),
}


def _with_bound(settings: dict, bound: float | None) -> dict:
    out = {**settings}
    if "exchange_kwargs" in out:
        out["exchange_kwargs"] = {**out["exchange_kwargs"], "peer_bound": bound}
    else:
        out["peer_bound"] = bound
    return out


def run_case(name: str, model: str, steps: int, replicas: int) -> dict:
    rep, settings, opt = CASES[name]
    cfg = gpt_config(model)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (steps * replicas, 8, cfg.seq_len + 1), generator=g)
    sims = {}
    for bound in (8.0, None):
        torch.manual_seed(0)
        sims[bound] = SimulatedReplicas(
            lambda: GPT(cfg), lambda m, b: m(b[:, :-1], b[:, 1:]), replicas=replicas,
            replicator=rep, optimizer=opt, lr=1e-3, seed=0,
            replicator_kwargs=_with_bound(settings, bound))
    times: dict = {8.0: [], None: []}
    block = 5
    for s0 in range(0, steps, block):
        order = (8.0, None) if (s0 // block) % 2 == 0 else (None, 8.0)
        for bound in order:
            for s in range(s0, min(s0 + block, steps)):
                t0 = time.perf_counter()
                sims[bound].step([data[s * replicas + r] for r in range(replicas)])
                times[bound].append(time.perf_counter() - t0)
    same = all(torch.equal(p, q) for a, b in zip(sims[8.0].models, sims[None].models)
               for p, q in zip(a.parameters(), b.parameters()))
    on, off = (times[b][1:] or times[b] for b in (8.0, None))  # the first step sets up
    return {"case": name, "mean_on_ms": statistics.fmean(on) * 1e3,
            "mean_off_ms": statistics.fmean(off) * 1e3,
            "median_on_ms": statistics.median(on) * 1e3,
            "median_off_ms": statistics.median(off) * 1e3,
            "ratio": statistics.fmean(on) / statistics.fmean(off), "same_bits": same,
            "clipped": sum(s["clipped_contributions"] for s in sims[8.0].last_step_stats())}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", help="the GPT task's preset (default small)")
    ap.add_argument("--steps", type=int_at_least(2), default=40)
    ap.add_argument("--replicas", type=int_at_least(2), default=2)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    ap.add_argument("--out", default="runs/bench_bound")
    a = ap.parse_args(argv)
    names = [c for c in a.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown or not names:
        ap.error(f"--cases: unknown {unknown[0]!r}; choose from {', '.join(CASES)}" if unknown
                 else "--cases: name at least one")
    torch.set_num_threads(1)
    rows = [run_case(c, a.model, a.steps, a.replicas) for c in names]
    print(f"{'exchange':<14} {'mean on (ms)':>12} {'mean off (ms)':>13} {'on / off':>9} "
          f"{'median on':>10} {'median off':>10} {'same bits':>9} {'clipped':>7}")
    for r in rows:
        print(f"{r['case']:<14} {r['mean_on_ms']:>12.1f} {r['mean_off_ms']:>13.1f} "
              f"{r['ratio']:>9.3f} {r['median_on_ms']:>10.1f} {r['median_off_ms']:>10.1f} "
              f"{str(r['same_bits']):>9} {r['clipped']:>7}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bound.json").write_text(json.dumps({"model": a.model, "steps": a.steps,
                                                "replicas": a.replicas, "rows": rows,
                                                "torch": torch.__version__}, indent=2))
    print(f"wrote {out / 'bound.json'}")
    return rows


if __name__ == "__main__":
    main()
