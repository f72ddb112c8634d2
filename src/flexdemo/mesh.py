"""Process groups and the 2-D ("replicate", "shard") device mesh."""

from __future__ import annotations

import atexit
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .join import Joined, agent_store, env_seconds, join, store_host_died

TIMEOUT_ENV = "FLEXDEMO_TIMEOUT"
DEFAULT_TIMEOUT_SECONDS = 300.0
"""How long a collective (or joining the job) waits for a peer before it gives up, unless
``FLEXDEMO_TIMEOUT`` (seconds) or an explicit ``timeout`` says otherwise. The one default of
the library and of ``flexdemo train``."""
DEFAULT_TIMEOUT = None
"""``timeout=DEFAULT_TIMEOUT`` (None) means :func:`timeout_from_env` at the time of the call."""


def timeout_from_env() -> timedelta:
    """``FLEXDEMO_TIMEOUT`` seconds if the variable is set, else
    :data:`DEFAULT_TIMEOUT_SECONDS`; read when called, never at import. Raises ``ValueError``
    naming the variable when it is not a number of seconds > 0."""
    return timedelta(seconds=env_seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_SECONDS))


def _check_timeout(timeout: timedelta | None) -> timedelta:
    if timeout is None:
        return timeout_from_env()
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be a datetime.timedelta > 0, got {timeout!r}")
    return timeout


def backend_for(device: torch.device) -> str:
    """The collective backend that fits ``device``: nccl for CUDA, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed(device: torch.device | str = "cpu",
                     timeout: timedelta | None = DEFAULT_TIMEOUT) -> None:
    """Initialise the default process group if needed.

    Under ``torchrun`` (``WORLD_SIZE`` set) this joins the job; without it, a single-rank
    group is created in-process, so the same code runs on one laptop CPU. Joining and every
    collective give up after ``timeout`` (default: :func:`timeout_from_env`) instead of
    hanging on a dead peer. Every rank first registers in the job's store and waits there for
    the others (:func:`flexdemo.join.join`): a peer that never arrives within
    ``FLEXDEMO_JOIN_TIMEOUT`` (default 30 s), dies while the others wait, or dies before the
    process group's connections are made raises :class:`flexdemo.join.JoinError` (a
    ``TimeoutError``) naming it by rank, the same verdict on every survivor. A gloo group's
    connections are bounded by that window too (the group then waits ``timeout``); when they
    fail with every peer alive, ``TimeoutError`` says so.
    """
    if dist.is_initialized():
        return
    timeout = _check_timeout(timeout)
    device = torch.device(device)
    backend = backend_for(device)
    guard_exit(owned=backend == "gloo")
    if "WORLD_SIZE" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
        return
    missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ValueError(f"WORLD_SIZE is set but {', '.join(missing)} not: launch with torchrun "
                         "(or flexdemo cluster), which sets them all, or unset WORLD_SIZE to "
                         "run in one process")
    if device.type == "cuda":  # an explicit index wins over torchrun's LOCAL_RANK
        torch.cuda.set_device(device if device.index is not None
                              else int(os.environ.get("LOCAL_RANK", "0")))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    joined = join(rank, world, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                  timeout)
    try:
        _make_group(backend, joined, rank, world, timeout)
    finally:
        joined.stop()


def _make_group(backend: str, joined: Joined, rank: int, world: int,
                timeout: timedelta) -> None:
    """The default group over the joined store. Gloo's rendezvous waits for every peer's
    address with no sign of life from it, so it is bounded by the join's window (the
    group's timeout goes back to ``timeout`` once it exists); a peer that died since the
    join is then named by its stopped heartbeat, the same verdict on every survivor."""
    bound = timeout
    if backend == "gloo" and hasattr(dist.distributed_c10d, "_set_pg_timeout"):
        bound = min(timeout, timedelta(seconds=joined.window))
    try:
        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", joined.store),
                                rank=rank, world_size=world, timeout=bound)
    except (RuntimeError, TimeoutError) as e:  # DistError derives from RuntimeError
        if isinstance(e, dist.DistNetworkError) and rank != 0 and not agent_store():
            # the store's connection closed while the group was set up: rank 0 died
            raise store_host_died(rank, os.environ["MASTER_ADDR"],
                                  os.environ["MASTER_PORT"]) from None
        lost = joined.lost_after_failure()
        if lost is not None:
            raise lost from None
        if not is_timeout(e):
            raise
        if bound < timeout:
            raise TimeoutError(
                f"rank {rank}: start-up: every rank joined and still beats, but the process "
                f"group's connections were not made within {joined.note}: a firewall "
                "between the nodes, or the wrong network interface (set GLOO_SOCKET_IFNAME)"
            ) from None
        peer = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise TimeoutError(
            f"rank {rank} could not join the job at {peer} within "
            f"{timeout_note(timeout.total_seconds())}: rank 0 or a peer is "
            "missing or unreachable, or MASTER_ADDR/MASTER_PORT are wrong") from None
    if bound < timeout:
        dist.distributed_c10d._set_pg_timeout(timeout)  # torch has no public setter


_EXIT = {"guarded": False, "owned": False}
_DRAIN_SECONDS = 0.05


def guard_exit(owned: bool = False) -> None:
    """Make the interpreter's exit safe for process groups still alive (idempotent).

    A gloo worker thread frees a finished collective's tensors after ``wait()`` has returned
    to Python, and that needs the GIL. When the script ends right after its last collective,
    the thread can ask for the GIL while the interpreter finalises, which aborts the process
    ("terminate called without an active exception", exit 134) in place of the script's own
    exit code. At exit this tears down the default group when flexdemo created it (``owned``)
    and then yields the GIL for a moment so that those threads finish first."""
    _EXIT["owned"] = _EXIT["owned"] or owned
    if not _EXIT["guarded"]:
        _EXIT["guarded"] = True
        atexit.register(_release_at_exit)


def _release_at_exit() -> None:
    if _EXIT["owned"] and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # leaving anyway
            pass
    time.sleep(_DRAIN_SECONDS)  # the GIL goes to worker threads releasing finished work


def timeout_note(seconds: float) -> str:
    """For error messages: how long was waited and where that came from."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    source = f"{TIMEOUT_ENV}={raw}" if raw else f"the default; set {TIMEOUT_ENV} to change it"
    return f"{seconds:g} s ({source})"


def is_timeout(e: BaseException) -> bool:
    """Whether a c10d/gloo error is a timeout (rather than a lost connection)."""
    text = str(e).lower()
    return isinstance(e, TimeoutError) or "timed out" in text or "timeout" in text


def mesh_shape(world: int, replicate: int | None = None, shard: int | None = None
               ) -> tuple[int, int]:
    """Resolve ``(replicate, shard)`` for ``world`` ranks.

    The shard size defaults to the ranks per node (``LOCAL_WORLD_SIZE``, set by torchrun),
    or to ``world / replicate`` when only ``replicate`` is given.
    """
    for name, v in (("replicate", replicate), ("shard", shard)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if shard is None and replicate is None:
        shard = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if world % shard:
            raise ValueError(f"LOCAL_WORLD_SIZE={shard} does not divide the world size {world}; "
                             "pass replicate= and shard= explicitly")
    if shard is None:
        assert replicate is not None  # both None was handled above
        if world % replicate:
            raise ValueError(f"replicate={replicate} does not divide the world size {world}")
        shard = world // replicate
    if replicate is None:
        if world % shard:
            raise ValueError(f"shard={shard} does not divide the world size {world}")
        replicate = world // shard
    if replicate * shard != world:
        raise ValueError(f"mesh replicate={replicate} x shard={shard} = {replicate * shard} "
                         f"ranks, but the world has {world}; choose sizes whose product is "
                         f"{world}")
    return replicate, shard


def build_mesh(device_type: str = "cpu", replicate: int | None = None,
               shard: int | None = None) -> DeviceMesh:
    """The 2-D mesh ``("replicate", "shard")``; ranks of one shard group are consecutive."""
    world = dist.get_world_size()
    r, s = mesh_shape(world, replicate, shard)
    guard_exit()
    return init_device_mesh(device_type, (r, s), mesh_dim_names=("replicate", "shard"))


def check_mesh(mesh: DeviceMesh) -> None:
    names = mesh.mesh_dim_names
    if mesh.ndim != 2 or names is None or tuple(names) != ("replicate", "shard"):
        raise ValueError(f"the mesh must be 2-D with dimensions ('replicate', 'shard'), got "
                         f"{mesh.ndim}-D {names}; build one with flexdemo.build_mesh")
