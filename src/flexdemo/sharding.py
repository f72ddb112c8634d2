"""``prepare()``: hybrid sharding (FSDP2 inside a node) plus a replicating optimizer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from .mesh import DEFAULT_TIMEOUT, build_mesh, check_mesh, init_distributed
from .optim import DeToNATION
from .replicate import Replicator, make_replicator


def default_shard_units(model: nn.Module) -> list[nn.Module]:
    """Modules sharded as their own FSDP unit: the members of every ``nn.ModuleList`` that do
    not sit inside another such member (a block's own list of layers stays in the block)."""
    units = [m for mod in model.modules() if isinstance(mod, nn.ModuleList) for m in mod]
    nested = {id(d) for u in units for d in u.modules() if d is not u}
    return [u for u in units if id(u) not in nested]


def _model_device(model: nn.Module) -> torch.device:
    devices = {p.device for p in model.parameters()}
    if not devices:
        raise ValueError("the model has no parameters")
    if len(devices) > 1:
        raise ValueError(f"the model's parameters live on several devices {devices}; move it "
                         "to one device before prepare()")
    return devices.pop()


@torch.no_grad()
def broadcast_module(model: nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s parameters and buffers to every rank (identical starting points)."""
    if dist.get_world_size() == 1:
        return
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src=src)


def prepare(model: nn.Module, replicator: str | Replicator | Sequence = "demo",
            optimizer: str | Callable = "sgd", lr: float = 1e-3, *,
            mesh: DeviceMesh | None = None, replicate: int | None = None,
            shard: int | None = None, weight_decay: float = 0.0,
            replicator_kwargs: dict | None = None, optimizer_kwargs: dict | None = None,
            shard_units: Callable[[nn.Module], list[nn.Module]] | None = None,
            sync_init: bool = True, nonfinite: str = "raise",
            timeout: timedelta = DEFAULT_TIMEOUT) -> tuple[nn.Module, DeToNATION]:
    """Shard ``model`` with FSDP2 inside each replica and return it with its optimizer.

    The world is arranged as a ``(replicate, shard)`` mesh (default: ``shard`` = ranks per node
    from ``LOCAL_WORLD_SIZE``). Parameters are sharded with ``fully_shard`` over the shard
    dimension (skipped when it has one rank: plain data parallelism), and the returned
    :class:`~flexdemo.optim.DeToNATION` optimizer replicates across the replicate dimension.
    The process group is created if needed (gloo for CPU models, nccl for CUDA), also for a
    single process without torchrun.

    Example: ``model, opt = flexdemo.prepare(model, replicator="demo", lr=1e-3)``.
    """
    if replicator_kwargs and not isinstance(replicator, str):
        raise ValueError("replicator_kwargs go with a replicator given by name")
    device = _model_device(model)
    init_distributed(device, timeout)
    if mesh is None:
        mesh = build_mesh(device.type, replicate, shard)
    else:
        check_mesh(mesh)
        if mesh.size() != dist.get_world_size():
            raise ValueError(f"the mesh spans {mesh.size()} ranks, the world has "
                             f"{dist.get_world_size()}")
        if replicate is not None or shard is not None:
            raise ValueError("give either mesh= or replicate=/shard=, not both")
    if sync_init:
        broadcast_module(model)
    if mesh["shard"].size() > 1:
        units = (shard_units or default_shard_units)(model)
        for unit in units:
            if unit is not model:
                fully_shard(unit, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
    rep = make_replicator(replicator, **(replicator_kwargs or {})) \
        if isinstance(replicator, (str, Replicator)) else list(replicator)
    opt = DeToNATION(model.parameters(), rep, base=optimizer, lr=lr,
                     weight_decay=weight_decay, group=mesh["replicate"].get_group(),
                     nonfinite=nonfinite, base_kwargs=optimizer_kwargs, mesh=mesh)
    opt.mesh = mesh
    return model, opt
