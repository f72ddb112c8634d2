"""Process groups and the 2-D ("replicate", "shard") device mesh."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DEFAULT_TIMEOUT = timedelta(seconds=float(os.environ.get("FLEXDEMO_TIMEOUT", "300")))


def backend_for(device: torch.device) -> str:
    """The collective backend that fits ``device``: nccl for CUDA, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed(device: torch.device | str = "cpu",
                     timeout: timedelta = DEFAULT_TIMEOUT) -> None:
    """Initialise the default process group if needed.

    Under ``torchrun`` (``WORLD_SIZE`` set) this joins the job; without it, a single-rank
    group is created in-process, so the same code runs on one laptop CPU. Collectives time out
    after ``timeout`` (``FLEXDEMO_TIMEOUT`` seconds, default 300) instead of hanging on a dead
    peer.
    """
    if dist.is_initialized():
        return
    device = torch.device(device)
    backend = backend_for(device)
    if "WORLD_SIZE" in os.environ:
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)


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
    return init_device_mesh(device_type, (r, s), mesh_dim_names=("replicate", "shard"))


def check_mesh(mesh: DeviceMesh) -> None:
    names = mesh.mesh_dim_names
    if mesh.ndim != 2 or names is None or tuple(names) != ("replicate", "shard"):
        raise ValueError(f"the mesh must be 2-D with dimensions ('replicate', 'shard'), got "
                         f"{mesh.ndim}-D {names}; build one with flexdemo.build_mesh")
