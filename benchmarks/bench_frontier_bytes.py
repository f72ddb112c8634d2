"""Bytes per rank, sent and received, of the frontier presets at 2, 4 and 8 replicas.

Each configuration trains the GPT task's model with N replicas simulated in one process
(:class:`flexdemo.SimulatedReplicas`) for one period of H steps (one sync) and reads the bytes
every rank recorded (ring formulas: what a real process group sends). Prints a table and
writes ``frontier_bytes.json``::

    python benchmarks/bench_frontier_bytes.py                  # mini GPT, 2, 4 and 8 replicas
    python benchmarks/bench_frontier_bytes.py --model tiny --replicas 2,4
    python benchmarks/bench_frontier_bytes.py --cases "sparseloco-dct (shared indices)"
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from flexdemo import SimulatedReplicas
from flexdemo.app.tasks import GPT, gpt_config

# name -> (replicator, replicator settings): the papers' presets, our variants (named "muloco"
# and "sparseloco" before issue 57, when RESULTS measured them) and their by-owner variants
# (the sparse mean by reduce-scatter, and over one shared index set)
CASES = {
    "muloco": ("muloco", {}),
    "sparseloco": ("sparseloco", {}),
    "muloco-int4": ("muloco-int4", {}),
    "sparseloco-dct (gather)": ("sparseloco-dct", {}),
    "sparseloco-dct (reduce-scatter)": ("sparseloco-dct",
                                        {"exchange_kwargs": {"reduce": "scatter"}}),
    "sparseloco-dct (shared indices)": ("sparseloco-dct",
                                        {"exchange_kwargs": {"reduce": "shared"}}),
}


def measure(model: str, replicas: int, replicator: str, kwargs: dict) -> dict:
    """One period of a preset on ``replicas`` replicas: bytes per parameter per step."""
    cfg = gpt_config(model)
    torch.manual_seed(0)
    sim = SimulatedReplicas(lambda: GPT(cfg), lambda m, b: m(*b), replicas=replicas,
                            replicator=replicator, optimizer="adamw", lr=1e-3,
                            replicator_kwargs=kwargs or None)
    rep = sim.optimizers[0].replicators[0]
    h = rep.inner_steps
    gen = torch.Generator().manual_seed(0)
    for _ in range(h):
        x = torch.randint(0, 256, (replicas, 2, cfg.seq_len + 1), generator=gen)
        sim.step([(x[r, :, :-1], x[r, :, 1:]) for r in range(replicas)])
    params = sum(p.numel() for p in sim.models[0].parameters())
    sent, received = max(sim.bytes_sent), max(sim.bytes_received)
    return {"replicas": replicas, "params": params, "inner_steps": h,
            "sent_per_param_step": sent / params / h,
            "received_per_param_step": received / params / h}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="mini", help="GPT preset (tiny, mini, small)")
    p.add_argument("--replicas", default="2,4,8", help="comma list of replica counts")
    p.add_argument("--cases", default=",".join(CASES),
                   help=f"comma list of cases to measure, from: {', '.join(CASES)}")
    p.add_argument("--out", default="benchmarks/results/frontier_bytes")
    args = p.parse_args(argv)
    counts = [int(x) for x in args.replicas.split(",")]
    cases = [c.strip() for c in args.cases.split(",")]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        p.error(f"unknown cases {unknown}; choose from: {', '.join(CASES)}")
    rows = []
    t0 = time.perf_counter()
    for name in cases:
        replicator, kwargs = CASES[name]
        for n in counts:
            rows.append({"case": name, **measure(args.model, n, replicator, kwargs)})
    print(f"{'case':<28} {'N':>2} {'sent B/param/step':>18} {'received':>10} {'vs N=2':>7}")
    for r in rows:
        base = next(b for b in rows if b["case"] == r["case"] and b["replicas"] == counts[0])
        print(f"{r['case']:<28} {r['replicas']:>2} {r['sent_per_param_step']:>18.6f} "
              f"{r['received_per_param_step']:>10.6f} "
              f"{r['sent_per_param_step'] / base['sent_per_param_step']:>6.2f}x")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "frontier_bytes.json").write_text(json.dumps(
        {"model": args.model, "rows": rows, "seconds": time.perf_counter() - t0}, indent=1))
    print(f"wrote {out / 'frontier_bytes.json'}")
    return rows


if __name__ == "__main__":
    main()
