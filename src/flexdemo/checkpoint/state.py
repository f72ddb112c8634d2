"""How a rank's model and optimizer state splits into DCP tensors (shared where every
replica holds the same values, per rank otherwise) and a per-rank structure that refers to
them (:class:`_Ref`), and back."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..dtensor import is_dtensor, local_tensor
from .agree import rank_world


@dataclass(frozen=True)
class _Ref:
    """Where a tensor of a rank's state went: its DCP key, global shape, dtype and device.

    ``scope`` is ``"rank"`` for keys that belong to this rank alone, ``"model"`` for base
    optimizer state that follows the model's layout (shared or per rank). ``like`` names the
    parameter whose sharding a DTensor shares.
    """

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    scope: str = "rank"
    like: str | None = None


# ---------------------------------------------------------------------------- layout
def optimizer_parts(optimizer) -> tuple[torch.optim.Optimizer, list]:
    """The base torch optimizer and the replicator chain (none for a plain torch optimizer)."""
    base = getattr(optimizer, "base", optimizer)
    if not isinstance(base, torch.optim.Optimizer):
        raise TypeError(f"expected a flexdemo.DeToNATION or torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    return base, list(getattr(optimizer, "replicators", []))


def mesh_shape_of(model: nn.Module, optimizer) -> tuple[int, int]:
    """``(replicate, shard)``: the optimizer's mesh, else the parameters' shard mesh, else DP."""
    rank, world = rank_world()
    mesh = getattr(optimizer, "mesh", None)
    if mesh is not None:
        if mesh.get_coordinate() is None:
            raise ValueError(f"rank {rank} is not part of the optimizer's mesh")
        r, s = (int(n) for n in mesh.mesh.shape)
        return r, s
    for p in model.parameters():
        if is_dtensor(p):  # sharded without prepare(): the parameters' mesh is a shard
            size = p.device_mesh.size()
            return world // size, size
    return world, 1


def fingerprints(tensors: dict[str, torch.Tensor]) -> dict[tuple, str]:
    """Digest of this rank's tensors per chunk identity (the mesh coordinate along sharded
    dimensions; ``()`` for plain tensors). DCP keeps one copy of chunks with equal identity, so
    a shared layout is exact only if every rank with the same identity has the same digest."""
    hashes: dict[tuple, Any] = {}
    for key in sorted(tensors):
        t = tensors[key]
        ident: tuple = ()
        if is_dtensor(t):
            coord = t.device_mesh.get_coordinate() or ()
            ident = tuple(c for c, pl in zip(coord, t.placements) if pl.is_shard())
        loc = local_tensor(t).detach()
        h = hashes.setdefault(ident, hashlib.blake2b(digest_size=16))
        h.update(f"{key}|{loc.dtype}|{tuple(loc.shape)}|".encode())
        if loc.numel():
            h.update(loc.contiguous().reshape(-1).view(torch.uint8).cpu().numpy())
    return {ident: h.hexdigest() for ident, h in hashes.items()}


def replicas_identical(prints: list[dict[tuple, str]]) -> bool:
    seen: dict[tuple, str] = {}
    for rank_prints in prints:
        for ident, digest in rank_prints.items():
            if seen.setdefault(ident, digest) != digest:
                return False
    return True


# ---------------------------------------------------------------------------- state trees
def split_state(obj: Any, prefix: str, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """Replace every tensor in nested dicts/lists/tuples by a :class:`_Ref` (key ``prefix<i>``)
    and collect the tensors in ``tensors``."""
    if is_dtensor(obj):
        raise ValueError(f"{where} holds a DTensor; per-rank state must hold plain tensors "
                         "(pass t.to_local() or t.full_tensor())")
    if isinstance(obj, torch.Tensor):
        key = f"{prefix}{len(tensors)}"
        tensors[key] = obj.detach()
        return _Ref(key, tuple(obj.shape), obj.dtype, str(obj.device))
    if isinstance(obj, dict):
        out = obj.copy()
        for k, v in obj.items():
            out[k] = split_state(v, prefix, tensors, f"{where}[{k!r}]")
        return out
    if isinstance(obj, (list, tuple)):
        items = [split_state(v, prefix, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def join_state(obj: Any, loaded: dict[str, torch.Tensor]) -> Any:
    """The inverse of :func:`split_state`: the loaded tensors back in place of the
    references."""
    if isinstance(obj, _Ref):
        return loaded[obj.key]
    if isinstance(obj, dict):
        out = obj.copy()
        for k, v in obj.items():
            out[k] = join_state(v, loaded)
        return out
    if isinstance(obj, (list, tuple)):
        items = [join_state(v, loaded) for v in obj]
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def refs(obj: Any):
    """Every :class:`_Ref` in a nested structure."""
    if isinstance(obj, _Ref):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from refs(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from refs(v)


def to_device(t: torch.Tensor, device: str) -> torch.Tensor:
    """Move a loaded tensor back to the device it was saved from, where that device exists."""
    dev = torch.device(device)
    if dev.type == "cpu" or (dev.type == "cuda" and not torch.cuda.is_available()):
        return t
    try:
        return t.to(dev)
    except (RuntimeError, AssertionError):
        return t


def param_names(model: nn.Module, base: torch.optim.Optimizer) -> list[str]:
    """Names of the base optimizer's parameters, in its (state dict index) order."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for g in base.param_groups:
        for p in g["params"]:
            if id(p) not in names:
                raise ValueError("the optimizer holds a parameter that is not in the model; "
                                 "checkpoint the model the optimizer was built for")
            out.append(names[id(p)])
    return out


def split_optimizer(model: nn.Module, base: torch.optim.Optimizer, rank: int,
                     own: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """The base optimizer's state keyed by parameter name.

    Returns the structure (tensors as references) and the model-scoped tensors
    ``optim/<fqn>/<name>``; tensors nested deeper go to the rank's own keys ``own``.
    """
    names = param_names(model, base)
    params = {n: p for n, p in model.named_parameters()}
    sd = base.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    state: dict[str, dict] = {}
    for idx, entry in sd["state"].items():
        fqn = names[idx]
        out = {}
        for k, v in entry.items():
            if isinstance(v, torch.Tensor):
                key = f"optim/{fqn}/{k}"
                like = None
                if is_dtensor(v):
                    p = params[fqn]
                    if not (is_dtensor(p) and v.shape == p.shape
                            and v.device_mesh == p.device_mesh and v.placements == p.placements):
                        raise ValueError(f"optimizer state {fqn}/{k} is a DTensor sharded unlike "
                                         "its parameter; this is not supported")
                    like = fqn
                tensors[key] = v.detach()
                out[k] = _Ref(key, tuple(v.shape), v.dtype, str(local_tensor(v).device),
                              "model", like)
            else:
                out[k] = split_state(v, f"rank{rank}/state/", own, f"optimizer state {fqn}/{k}")
        state[fqn] = out
    groups = []
    for g in sd["param_groups"]:
        g = {k: v for k, v in g.items() if k != "params"} | {
            "params": [names[i] for i in g["params"]]}
        groups.append(split_state(g, f"rank{rank}/state/", own, "optimizer param_groups"))
    return {"state": state, "param_groups": groups}, tensors
