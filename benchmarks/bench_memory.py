"""Memory per strategy, counted exactly: persistent state, the step's workspace and the peak
of a training iteration, on a byte-level GPT under ``flexdemo.prepare``.

    python benchmarks/bench_memory.py [--model 85m|small|mini|tiny] [--shards 1,2,4]
        [--replicas 2] [--strategies hsdp-adamw,demo-defaults,...] [--steps 3]
        [--batch 2 --seq 128] [--group-numel N] [--inner-steps H]
        [--out benchmarks/results/memory.json]

Every layout runs ``shard x replicas`` real processes (gloo on CPU): ``--shards 1`` is the
whole model per rank, 2 and 4 are FSDP2 row shards of 1/2 and 1/4. Each rank trains
``--steps`` steps on random bytes under :class:`flexdemo.memory.LiveBytes`, which counts the
bytes of every live tensor storage as operators create and free them (no allocator rounding,
no RSS noise). Per strategy, in bytes and in units of P (the whole model's fp32 parameters):

* ``state``: the optimizer's persistent state (what a checkpoint keeps), per storage;
* ``held``: buffers its replicators keep between steps besides the state;
* ``step ws``: the optimizer step's peak above the bytes live at its start (held buffers are
  live at the start, so this is what the step allocates and frees), after the first step
  (which creates the state and the buffers);
* ``peak``: the most live bytes of a whole iteration (forward, backward, step) on rank 0;
* ``RSS``: the process's peak resident set (the allocator's and Python's overhead included).

DiLoCo's strategies (MuLoCo, SparseLoCo) sync every 30 steps, after the few steps measured:
``--inner-steps 2`` makes them sync at steps 1 and 3 (``--steps 4``), so the syncs' workspace
and the outer optimizer's state (made at the first sync) are counted too.

Strategies are names from ``flexdemo.strategies.STRATEGIES``; their learning rates do not
change memory. The ratios are exact on any machine; only RSS and the seconds vary.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
MODELS = {  # byte-level GPTs (flexdemo.app.tasks.gpt): 85m is GPT-2 small's shape
    "85m": {"n_layer": 12, "n_head": 12, "d_model": 768},
    "small": {"n_layer": 6, "n_head": 6, "d_model": 384},
    "mini": {"n_layer": 4, "n_head": 4, "d_model": 128},
    "tiny": {"n_layer": 3, "n_head": 4, "d_model": 64},
}
DEFAULT_STRATEGIES = ("hsdp-adamw", "hsdp-muon", "demo-defaults", "flexdemo-muon",
                      "muloco-int4-h20", "sparseloco-dct")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, cfg: dict, out: str) -> None:
    """One rank: build, prepare and train under the live-bytes count; rank 0 writes."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    import flexdemo
    from flexdemo import STRATEGIES, LiveBytes
    from flexdemo.app.tasks import GPT, GPTConfig

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        s = STRATEGIES[cfg["strategy"]]
        rkw = dict(s.replicator_kwargs)
        if cfg.get("group_numel") is not None and s.replicator == "demo":
            rkw["group_numel"] = cfg["group_numel"] if cfg["group_numel"] > 0 else None
        if cfg.get("inner_steps") and s.replicator.startswith(("diloco", "muloco",
                                                                 "sparseloco")):
            rkw["inner_steps"] = cfg["inner_steps"]
        with LiveBytes(device="cpu") as mem:
            torch.manual_seed(0)
            model = GPT(GPTConfig(seq_len=cfg["seq"], **MODELS[cfg["model"]]))
            P = 4 * sum(p.numel() for p in model.parameters())
            model, opt = flexdemo.prepare(
                model, s.replicator, s.optimizer, s.lr, shard=cfg["shard"],
                replicate=world // cfg["shard"], replicator_kwargs=rkw,
                optimizer_kwargs=dict(s.optimizer_kwargs))
            gen = torch.Generator().manual_seed(rank)
            peak, step_ws, t0 = 0, 0, time.perf_counter()
            for i in range(cfg["steps"]):
                x = torch.randint(0, 256, (cfg["batch"], cfg["seq"] + 1), generator=gen)
                mem.reset_peak()
                opt.zero_grad()
                model(x[:, :-1], x[:, 1:]).backward()
                passes = mem.peak  # the step starts its own peak (its workspace)
                opt.step()
                if i:  # the first step creates the state and the replicators' buffers
                    peak = max(peak, passes, mem.peak)
                    step_ws = max(step_ws, opt.last_step_stats()["step_workspace_bytes"])
            stats = opt.memory_stats()
            local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                        for p in model.parameters()) * 4
        row = {"strategy": cfg["strategy"], "shard": cfg["shard"], "ranks": world, "P": P,
               "params": local, "state": stats["state_bytes"],
               "held": stats["workspace_bytes"], "step_ws": step_ws, "peak": peak,
               "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "seconds_per_step": (time.perf_counter() - t0) / cfg["steps"]}
        rows = [None] * world
        dist.all_gather_object(rows, row)
        if rank == 0:
            worst = {k: max(r[k] for r in rows) for k in ("state", "held", "step_ws", "peak",
                                                          "rss")}
            Path(out).write_text(json.dumps({**row, "max_over_ranks": worst}))
    finally:
        dist.destroy_process_group()


def measure(cfg: dict) -> dict:
    """One strategy on one layout: ``shard * replicas`` processes; rank 0's row."""
    world = cfg["shard"] * cfg["replicas"]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        mp.start_processes(_worker, args=(world, _free_port(), cfg, out), nprocs=world,
                           start_method="spawn")
        return json.loads(Path(out).read_text())


def table(rows: list[dict]) -> str:
    """Markdown: bytes in MB and in units of P; ``vs AdamW``: the peak against the full-sync
    AdamW row of the same layout."""
    mb = 1e6
    lines = ["| layout | strategy | state | held | step ws | peak | peak vs AdamW | RSS |",
             "|---|---|---|---|---|---|---|---|"]
    base = {r["shard"]: r["peak"] for r in rows if r["strategy"] == "hsdp-adamw"}
    for r in rows:
        def cell(v: int, P: int = r["P"]) -> str:
            return f"{v / mb:,.0f} MB ({v / P:.2f} P)"
        ref = base.get(r["shard"])
        vs = f"{(r['peak'] / ref - 1) * 100:+.0f}%" if ref else "-"
        layout = "whole" if r["shard"] == 1 else f"1/{r['shard']} shards"
        lines.append(f"| {layout}, {r['ranks']} ranks | {r['strategy']} | {cell(r['state'])} | "
                     f"{cell(r['held'])} | {cell(r['step_ws'])} | {cell(r['peak'])} | {vs} | "
                     f"{r['rss'] / mb:,.0f} MB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="85m", choices=sorted(MODELS))
    ap.add_argument("--shards", default="1,2")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--group-numel", type=int, default=None,
                    help="DeMo's group_numel (default: the library's; 0: no bound)")
    ap.add_argument("--inner-steps", type=int, default=None,
                    help="DiLoCo strategies' H (default: theirs; 2 with --steps 4 counts "
                         "two syncs)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/memory.json"))
    a = ap.parse_args(argv)
    from flexdemo import STRATEGIES
    names = [s for s in a.strategies.split(",") if s]
    bad = [s for s in names if s not in STRATEGIES]
    if bad:
        print(f"bench_memory: unknown strategies {bad}; choose from {sorted(STRATEGIES)}")
        return 2
    if a.steps < 2:
        print("bench_memory: --steps must be at least 2 (the first step creates the state)")
        return 2
    rows = []
    for shard in (int(s) for s in a.shards.split(",")):
        replicas = a.replicas if shard == 1 else 1
        for name in names:
            row = measure({"strategy": name, "shard": shard, "replicas": replicas,
                           "model": a.model, "steps": a.steps, "batch": a.batch,
                           "seq": a.seq, "group_numel": a.group_numel,
                           "inner_steps": a.inner_steps})
            rows.append(row)
            print(f"{name:>15} shard {shard}: peak {row['peak'] / row['P']:.2f} P, "
                  f"state {row['state'] / row['P']:.2f} P, held {row['held'] / row['P']:.2f} P, "
                  f"step ws {row['step_ws'] / row['P']:.2f} P "
                  f"({row['seconds_per_step']:.1f} s/step)", flush=True)
    text = table(rows)
    print(f"\n{a.model}: P = {rows[0]['P'] / 1e6:,.0f} MB; batch {a.batch} x {a.seq}; "
          f"shard 1: {a.replicas} replicas, shards > 1: one replica\n")
    print(text)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
