"""What fault tolerance costs per step: the same training, 2 replicas, with and without torchft.

Without: one gloo world of 2 processes (``prepare(...)``, replicate=2). With: 2 torchft replica
groups of one process each on a lighthouse started here (``fault_tolerance=``). Both train the
same MLP on loopback and report the median step (zero_grad, forward, backward, step) and, with
fault tolerance, the median quorum, commit vote and undo copy. CPU, one thread per process.

    python benchmarks/elastic_overhead.py --width 1024 --steps 40 --replicator demo

Beside the wall-clock step it reports each step's CPU time (the process's, all its threads:
the work, which other jobs on a shared machine do not inflate as they do the wall-clock
time), and that CPU time by thread (``threads_ms``: the main thread, gloo's, torchft's; Linux).
``--profile DIR`` runs every rank's loop under cProfile, timed by the main thread's CPU time
(so other jobs on the machine and the waits in collectives do not count), writes
``DIR/{plain,elastic}-{rank}.pstats``, then prints the functions whose own CPU time per step
grew most with fault tolerance (rank 0).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import multiprocessing as mp
import os
import pstats
import statistics
import time

import torch
from torch import nn

from flexdemo.app.bench.elastic import thread_cpu
from flexdemo.tools.ranks import free_port


def _model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, 16))


def _train(opt, net, args, rank: int, name: str) -> dict:
    prof = cProfile.Profile(time.thread_time) if args.profile else None
    if prof is not None:
        prof.enable()
    try:
        return _loop(opt, net, args, rank)
    finally:
        if prof is not None:
            prof.disable()
            prof.dump_stats(os.path.join(args.profile, f"{name}-{rank}.pstats"))


def _loop(opt, net, args, rank: int) -> dict:
    times, cpu = [], []
    threads0: dict[str, float] = {}
    extra = {"quorum_seconds": [], "commit_seconds": [], "snapshot_seconds": []}
    g = torch.Generator().manual_seed(rank)
    while opt.steps < args.steps:
        if len(times) == min(5, args.steps // 4):  # after the warm-up
            threads0 = thread_cpu(os.getpid())
        x, y = torch.randn(32, args.width, generator=g), torch.randn(32, 16, generator=g)
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        s = opt.last_step_stats()
        for k in extra:
            if k in s:
                extra[k].append(s[k])
    threads1 = thread_cpu(os.getpid())
    skip = min(5, len(times) // 4)  # warm-up
    out = {"rank": rank, "step_ms": 1e3 * statistics.median(times[skip:]),
           "cpu_ms": 1e3 * statistics.median(cpu[skip:])}
    out.update({k.replace("seconds", "ms"): 1e3 * statistics.median(v[skip:])
                for k, v in extra.items() if v})
    n = max(1, len(times) - skip)  # steps since threads0 (clock ticks: 10 ms, summed)
    out["threads_ms"] = {k: round(1e3 * (v - threads0.get(k, 0.0)) / n, 2)
                         for k, v in sorted(threads1.items(), key=lambda kv: -kv[1])
                         if v - threads0.get(k, 0.0) > 0}
    return out


def _kwargs(args) -> dict:
    return {"demo": {"topk": 32, "chunk": 64}, "full": {}}[args.replicator]


def _plain(rank: int, port: int, args, q) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import flexdemo

    net, opt = flexdemo.prepare(_model(args.width), replicator=args.replicator,
                                replicator_kwargs=_kwargs(args), lr=1e-3, device="cpu")
    q.put(_train(opt, net, args, rank, "plain"))


def _elastic(rank: int, url: str, args, q) -> None:
    torch.set_num_threads(1)
    import flexdemo

    ft = flexdemo.FaultTolerance(lighthouse=url, replica_id=f"g{rank}", min_replicas=2,
                                 hostname="127.0.0.1")
    net, opt = flexdemo.prepare(_model(args.width), replicator=args.replicator,
                                replicator_kwargs=_kwargs(args), lr=1e-3, device="cpu",
                                fault_tolerance=ft)
    q.put(_train(opt, net, args, rank, "elastic"))
    opt.fault_tolerance.shutdown()


def _run(target, extra, args) -> list[dict]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=target, args=(r, extra, args, q)) for r in range(2)]
    for p in ps:
        p.start()
    results = [q.get(timeout=args.timeout) for _ in ps]
    for p in ps:
        p.join(timeout=args.timeout)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--replicator", default="demo", choices=("demo", "full"))
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run at most")
    ap.add_argument("--profile", metavar="DIR", help="cProfile every rank's loop into DIR")
    args = ap.parse_args()
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    from torchft.coordination import LighthouseServer

    plain = _run(_plain, free_port(), args)
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=2000)
    try:
        url = f"http://127.0.0.1:{lh.address().rsplit(':', 1)[1]}"  # it names the host
        elastic = _run(_elastic, url, args)
    finally:
        lh.shutdown()
    params = sum(p.numel() for p in _model(args.width).parameters())
    worst = lambda rs, k: max(r[k] for r in rs)  # noqa: E731 - the slower replica
    row = {"replicator": args.replicator, "params": params, "steps": args.steps,
           "plain_step_ms": worst(plain, "step_ms"), "ft_step_ms": worst(elastic, "step_ms"),
           "plain_cpu_ms": worst(plain, "cpu_ms"), "ft_cpu_ms": worst(elastic, "cpu_ms"),
           **{k: worst(elastic, k) for k in ("quorum_ms", "commit_ms", "snapshot_ms")}}
    row["overhead"] = row["ft_step_ms"] / row["plain_step_ms"] - 1
    row["cpu_overhead"] = row["ft_cpu_ms"] / row["plain_cpu_ms"] - 1
    rank0 = lambda rs: next(r for r in rs if r["rank"] == 0)  # noqa: E731
    row["plain_threads_ms"] = rank0(plain).get("threads_ms")
    row["ft_threads_ms"] = rank0(elastic).get("threads_ms")
    print(json.dumps(row))
    if args.profile:
        _grown(args.profile, args.steps)


def _grown(folder: str, steps: int, top: int = 15) -> None:
    """The functions whose own time per step grew most from the plain to the elastic run."""
    own = {}
    for name in ("plain", "elastic"):
        st = pstats.Stats(os.path.join(folder, f"{name}-0.pstats"))
        own[name] = {f"{k[0].rsplit('/', 2)[-1]}:{k[1]}({k[2]})": v[2]
                     for k, v in st.stats.items()}  # type: ignore[attr-defined]
    diff = {k: own["elastic"].get(k, 0.0) - own["plain"].get(k, 0.0)
            for k in set(own["plain"]) | set(own["elastic"])}
    print(f"own CPU time per step, rank 0's main thread (ms): elastic - plain, top {top}")
    for k, d in sorted(diff.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {1e3 * d / steps:+8.2f}  {k}")


if __name__ == "__main__":
    main()
