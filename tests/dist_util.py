"""Run a function on N real processes joined by a gloo process group on CPU."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import traceback
from datetime import timedelta

import torch

from flexdemo.tools.ranks import free_port

_CTX = mp.get_context("forkserver")
# what every rank imports, imported once in the fork server: a rank then starts without the
# second or two of CPU that torch.distributed.tensor (with sympy), FSDP and flexdemo cost it
# (tests/test_agreement.py: 107 s -> 44 s on the 2-core machine under load); torch._dynamo
# too, which every torch optimizer imports when it is built (add_param_group is wrapped in
# torch._disable_dynamo): 0.7 s of CPU in each rank that steps an optimizer; and DCP, which
# flexdemo imports only to save or load
_CTX.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.fsdp",
                             "torch.distributed.tensor", "torch._dynamo",
                             "torch.distributed.checkpoint", "flexdemo"])


def spawn_ranks(world: int, args: list[str], timeout: float = 30,
                ranks: list[int] | None = None, port: int | None = None,
                env: dict | None = None) -> list[subprocess.Popen]:
    """``world`` bare processes of ``python -m flexdemo ARGS`` with torchrun's variables, one
    rank per launcher (``LOCAL_WORLD_SIZE=1``), collectives timing out after ``timeout`` s;
    stdout and stderr together in each one's ``stdout`` pipe. ``ranks``: start only these
    (a job whose other ranks never arrive); ``env``: more variables."""
    port = port or free_port()
    procs = []
    for rank in range(world) if ranks is None else ranks:
        env_r = dict(os.environ, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world),
                     LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                     OMP_NUM_THREADS="1", FLEXDEMO_TIMEOUT=str(timeout))
        env_r.update(env or {})
        procs.append(subprocess.Popen([sys.executable, "-m", "flexdemo", *args], env=env_r,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return procs


def reap(procs: list[subprocess.Popen]) -> None:
    """Kill and wait for every process of ``procs`` still running (a test's clean-up)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.communicate()


def _entry(fn, rank, world, port, outdir, args, env):
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(outdir, f"{rank}.pt"))
    except BaseException:
        with open(os.path.join(outdir, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn, world: int, *args, timeout: float = 240, env: dict | None = None) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return their results by rank.

    Raises ``AssertionError`` with the workers' tracebacks if any of them failed or hung.
    """
    with tempfile.TemporaryDirectory() as outdir:
        port = free_port()
        procs = [_CTX.Process(target=_entry, args=(fn, r, world, port, outdir, args, env or {}))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = []
        for r in range(world):
            path = os.path.join(outdir, f"{r}.err")
            if os.path.exists(path):
                errors.append(f"--- rank {r} ---\n" + open(path).read())
        if hung or errors:
            raise AssertionError(f"hung ranks: {hung}\n" + "\n".join(errors))
        return [torch.load(os.path.join(outdir, f"{r}.pt"), weights_only=False)
                for r in range(world)]


def replicas_by_shard(results: list, name: str) -> dict:
    """The per-rank results of entry ``name`` grouped by shard coordinate: each group holds
    the replicas of one shard (results carry the rank's mesh ``coord``)."""
    groups: dict = {}
    for res in results:
        groups.setdefault(res[name]["coord"][1], []).append(res[name])
    return groups


def corrupt_first_values(rep, dtype: torch.dtype, count: int) -> None:
    """Make DeMo replicator ``rep`` send NaN as the first ``count`` values (of ``dtype``) of its
    first group from now on: a corrupt peer."""
    fill = rep.encode_payload

    def corrupt(grads, lrs, step, buf):
        res = fill(grads, lrs, step, buf)
        g = rep.groups[0]
        buf[g.val_off: g.val_off + count * dtype.itemsize].view(dtype).fill_(float("nan"))
        return res

    rep.encode_payload = corrupt
