"""The start-up probe of ``"auto"`` (:func:`flexdemo.auto.probe_link`): its wall time and what
it measures, on real gloo ranks. Rank 0 prints one row per probe and the median::

    torchrun --nproc-per-node 2 benchmarks/bench_auto_probe.py            # loopback
    flexdemo cluster --nodes 2 --bandwidth 100mbit -- \\
        .venv/bin/python benchmarks/bench_auto_probe.py                    # a shaped link (root)

``--repeats N`` probes (default 5), ``--seconds S`` the bound (default 2.0). A barrier after
each probe lets what a bounded probe left in flight finish before the next one starts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

import torch.distributed as dist

from flexdemo.auto import probe_link
from flexdemo.transport import ProcessGroupTransport


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seconds", type=float, default=2.0)
    args = p.parse_args(argv)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = ProcessGroupTransport(None)
    rows = []
    for _ in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        link, inflight = probe_link(group, args.seconds)
        wall = time.perf_counter() - t0
        dist.barrier()  # what was left in flight is done
        drained = time.perf_counter() - t0
        rows.append((wall, drained, link))
        if rank == 0:
            state = "timed out" if link.timed_out else f"{len(inflight)} left in flight"
            print(f"probe {wall:.3f} s (all done {drained:.3f} s): {link.describe()} "
                  f"between {world} ranks; {state}", flush=True)
    if rank == 0:
        med = statistics.median
        print(f"median of {len(rows)}: probe {med(r[0] for r in rows):.3f} s, "
              f"{med(r[2].mbit for r in rows):.0f} Mbit/s, "
              f"{med(r[2].latency for r in rows) * 1e3:.2f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
