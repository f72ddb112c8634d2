"""Distributed checkpoints with per-replica state, on torch.distributed.checkpoint (DCP).

A checkpoint holds the model (FSDP2 shards as DTensors, or plain tensors), the base optimizer's
state, every replicator's state (DeMo's ``delta``, subset buffers, DiLoCo's global copy, outer
optimizer and syncs in flight), ``optimizer.steps`` / ``skipped_steps``, the trainer's ``extra``
(per rank: data position, RNG states, ...) and ``step``. Resuming with the same world size and
mesh continues the run bitwise; another number of replicas with the same shard size regroups
them (:func:`load_checkpoint`).

Directory layout of one checkpoint (e.g. ``runs/x/checkpoints/step_000100/``)::

    .metadata, __<rank>_0.distcp   DCP: every tensor of every rank
    flexdemo.json                  who wrote it: world size, mesh, tensors, optimizer, version
    ranks/rank00000.pkl, ...       per rank: the structure of its state, tensors by DCP key
    COMPLETE                       written last; a directory without it is not a checkpoint

DCP keys: ``model/<fqn>`` and ``optim/<fqn>/<name>`` (base optimizer state) when every replica
holds the same values (DCP then writes one copy); otherwise (DiLoCo inner steps, ``"none"``,
schedules that skip, buffers that differ per rank) each rank writes its own local tensors under
``rank<r>/model/...`` and ``rank<r>/optim/...``. State that is always per rank (replicators,
``extra``) lives under ``rank<r>/state/<i>``: DCP keeps one copy of equal keys, so state that
differs per replica must never share a key.

Saving is atomic: all ranks write into a sibling ``<name>.tmp-<pid>``; when every rank is done,
rank 0 writes ``COMPLETE`` and renames the directory into place. A crash leaves the previous
checkpoint as the newest complete one; stale temporary directories are removed by the next save.
Collectives run on the default process group and time out with its timeout.

This module saves, verifies and loads; the other modules of :mod:`flexdemo.checkpoint` are its
parts: ``files`` (the files on disk), ``state`` (state split into DCP tensors and back),
``agree`` (one outcome on every rank, storage errors by cause), ``integrity`` (digests) and
``mismatch`` (what differs from the job that loads it).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..dtensor import local_tensor
from ..version import __version__
from .agree import CheckpointError, agree_on, dcp_call, rank_world
from .files import (
    FORMAT_VERSION,
    META_FILE,
    RANKS_DIR,
    fsync_dir,
    fsync_write,
    rank_file_path,
    remove_scratch,
    require_complete,
)
from .integrity import (
    DAMAGED,
    DIGEST,
    MARKER_FILE,
    PERMISSION,
    SCRATCH,
    UNREADABLE,
    CheckpointStatus,
    check_checkpoint,
    record_files,
)
from .mismatch import check_base, check_mesh, check_model, check_replicators
from .state import (
    fingerprints,
    join_state,
    mesh_shape_of,
    optimizer_parts,
    param_names,
    refs,
    replicas_identical,
    split_optimizer,
    split_state,
    to_device,
)

__all__ = ["load_checkpoint", "read_info", "save_checkpoint", "source_rank", "verify_checkpoint"]


def _commit(tmp: Path, final: Path) -> None:
    """Move the finished temporary directory into place (rank 0 only; the atomic step)."""
    old = None
    if final.exists():
        old = final.with_name(f"{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _tensor_table(msd: dict) -> dict[str, dict]:
    return {k: {"shape": list(v.shape), "dtype": str(v.dtype)}
            for k, v in msd.items() if isinstance(v, torch.Tensor)}


def _check_compatible(path: Path, meta: dict, world: int, mesh_shape: tuple[int, int],
                      msd: dict, base: torch.optim.Optimizer, reps: list) -> None:
    """Raise :class:`CheckpointMismatchError` if the checkpoint at ``path`` cannot be resumed
    by this job."""
    check_mesh(path, meta["world_size"], meta["mesh_shape"], world, mesh_shape,
               replicas_may_change=True)
    check_model(path, {k: v["shape"] for k, v in meta["tensors"].items()},
                {k: v["shape"] for k, v in _tensor_table(msd).items()})
    check_base(path, meta["base_optimizer"], type(base).__name__)
    check_replicators(path, meta["replicators"], [repr(r) for r in reps])
    if meta.get("flexdemo_version") != __version__:
        warnings.warn(f"checkpoint {path} was written by flexdemo "
                      f"{meta.get('flexdemo_version')}, this is {__version__}",
                      stacklevel=3)


def read_info(path: str | os.PathLike) -> dict | None:
    """The ``info`` that :func:`save_checkpoint` recorded for the checkpoint at ``path`` (and
    its world size, mesh, base optimizer and replicators under ``"checkpoint"``), or None if
    its ``flexdemo.json`` cannot be read. Reads no tensors."""
    try:
        meta = json.loads((Path(path) / META_FILE).read_text())
        info = dict(meta.get("info") or {})
        info["checkpoint"] = {k: meta[k] for k in ("world_size", "mesh_shape", "base_optimizer",
                                                   "replicators", "step")}
        return info
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


# ---------------------------------------------------------------------------- public API
def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer, *, step: int,
                    extra: dict | None = None, info: dict | None = None) -> Path:
    """Save model, optimizer (base state, replicators, step counters), ``step`` and ``extra``.

    Collective: every rank calls it with the same ``path`` and ``step``; ``extra`` may differ
    per rank (tensors in it, e.g. RNG states, are stored per rank). ``info`` (rank 0's, JSON
    values) is recorded in ``flexdemo.json``, readable before loading (:func:`read_info`).
    ``path`` is the checkpoint directory, e.g. ``runs/x/checkpoints/step_000100``; it is
    written atomically and replaces an existing checkpoint of the same name; its marker
    records the SHA-256 of every file (:mod:`flexdemo.checkpoint.integrity`). Returns ``path``.
    """
    # DCP (with DTensor and sympy) loads on first use, not with ``import flexdemo``
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    final = Path(path)
    rank, world = rank_world()
    base, reps = optimizer_parts(optimizer)
    error, facts = None, None
    try:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        if not final.name or SCRATCH.search(final.name):
            raise ValueError(f"invalid checkpoint directory name {final.name!r}")
        if extra is not None and not isinstance(extra, dict):
            raise ValueError(f"extra must be a dict or None, got {type(extra).__name__}")
        try:
            info_json = json.loads(json.dumps(info or {}))
        except (TypeError, ValueError) as e:
            raise ValueError(f"info must hold JSON values: {e}") from None
        mesh_shape = mesh_shape_of(model, optimizer)
        msd = get_model_state_dict(model)
        own: dict[str, torch.Tensor] = {}
        optim_tree, optim_tensors = split_optimizer(model, base, rank, own)
        state = {
            "replicators": [r.state_dict() for r in reps],
            "steps": getattr(optimizer, "steps", None),
            "skipped_steps": getattr(optimizer, "skipped_steps", None),
            "extra": {} if extra is None else extra,
        }
        state_tree = split_state(state, f"rank{rank}/state/", own, "the rank's state")
        try:
            blob = pickle.dumps({"rank": rank, "state": state_tree, "optim": optim_tree},
                                protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise ValueError(f"the checkpoint state (extra or optimizer state) cannot be "
                             f"pickled: {e}; keep extra to tensors, numbers, strings and "
                             "lists/tuples/dicts of them") from e
        shared = {f"model/{k}": v for k, v in msd.items() if isinstance(v, torch.Tensor)}
        shared.update(optim_tensors)
        facts = {"prints": fingerprints(shared), "step": step, "pid": os.getpid()}
    except Exception as e:
        error = e
    infos = agree_on(error, f"saving checkpoint {final}", facts)
    if len({i["step"] for i in infos}) != 1:
        raise ValueError(f"ranks passed different steps to save_checkpoint: "
                         f"{[i['step'] for i in infos]}")
    identical = replicas_identical([i["prints"] for i in infos])
    if identical:
        flat = dict(shared)
    else:  # replicas differ: every rank keeps its own local tensors
        flat = {f"rank{rank}/{k}": local_tensor(v) for k, v in shared.items()}
    flat.update(own)
    tmp = final.parent / f"{final.name}.tmp-{infos[0]['pid']}"
    error = None
    if rank == 0:
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            remove_scratch(final.parent)
            (tmp / RANKS_DIR).mkdir(parents=True)
        except Exception as e:
            error = e
    agree_on(error, f"saving checkpoint {final}: creating {tmp}")
    try:
        error = None
        try:
            dcp_call(dcp.save, flat, f"saving checkpoint {final}", tmp,
                      storage_writer=FileSystemWriter(tmp))
        except CheckpointError as e:
            error = e
        agree_on(error, f"saving checkpoint {final}")  # the same cause on every rank
        error, written = None, None
        try:
            fsync_write(rank_file_path(tmp, rank), blob)
            names = [f.name for f in tmp.glob(f"__{rank}_*.distcp")]
            names.append(f"{RANKS_DIR}/{rank_file_path(tmp, rank).name}")
            if rank == 0:
                meta = {
                    "format": FORMAT_VERSION,
                    "flexdemo_version": __version__,
                    "torch_version": torch.__version__,
                    "step": step,
                    "world_size": world,
                    "mesh_shape": list(mesh_shape),
                    "layout": "shared" if identical else "per_rank",
                    "tensors": _tensor_table(msd),
                    "base_optimizer": type(base).__name__,
                    "replicators": [repr(r) for r in reps],
                    "info": info_json,
                    "time": time.time(),
                }
                fsync_write(tmp / META_FILE, json.dumps(meta, indent=1).encode())
                names += [".metadata", META_FILE]
            written = record_files(tmp, names)  # what this rank saved, read back once
        except Exception as e:
            error = e
        tables = agree_on(error, f"saving checkpoint {final}", written)
        error = None
        if rank == 0:
            try:
                fsync_dir(tmp / RANKS_DIR)
                files = {name: d for table in tables for name, d in table.items()}
                marker = {"step": step, "time": time.time(), "digest": DIGEST, "files": files,
                          "ranks": {str(r): sorted(t) for r, t in enumerate(tables)}}
                fsync_write(tmp / MARKER_FILE, json.dumps(marker, indent=1).encode())
                fsync_dir(tmp)
                _commit(tmp, final)
            except Exception as e:
                error = e
        agree_on(error, f"saving checkpoint {final}: committing it")
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def verify_checkpoint(path: str | os.PathLike) -> CheckpointStatus:
    """Check the checkpoint at ``path`` against the digests its marker records (collective
    when a process group is up: each rank reads its share of the files once). Returns the
    same :class:`~flexdemo.checkpoint.CheckpointStatus` on every rank."""
    rank, world = rank_world()
    status = check_checkpoint(path, rank, world)
    if world == 1:
        return status
    gathered: list = [None] * world
    dist.all_gather_object(gathered, status)
    return _merge_statuses(gathered)


def _merge_statuses(statuses: list[CheckpointStatus]) -> CheckpointStatus:
    """One status from every rank's: unreadable (permission) before damaged before the rest,
    each problem named once (every rank reads the marker, so each finds a bad one)."""
    merged = statuses[0]
    for state in (UNREADABLE, "damaged"):
        if any(st.state == state for st in statuses):
            merged.state = state
            merged.problems = list(dict.fromkeys(
                p for st in statuses if st.state == state for p in st.problems))
            return merged
    merged.problems = list(dict.fromkeys(p for st in statuses for p in st.problems))
    return merged


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer, *,
                    verify: bool = True) -> dict:
    """Restore a checkpoint written by :func:`save_checkpoint` into ``model`` and ``optimizer``.

    Collective. With ``verify`` (the default) every file is first checked against its
    recorded digest; a damaged checkpoint raises :class:`CheckpointError` (cause
    ``"damaged"``) naming what is wrong. The job must have the shard size that wrote it
    (the number of replicas may differ), and the same model, base optimizer and replicators;
    otherwise :class:`CheckpointMismatchError` (a ``ValueError``) says what differs. Each
    rank gets its own replicator state and ``extra`` back. On more replicas than were saved,
    a new replica loads replica 0's state of its shard (parameters, base optimizer state,
    counters, ``extra``) and the replicators' shared state, and its per-replica state (DeMo's
    momentum, error feedback) starts from zero, as when a replica joins an elastic run; on
    fewer, the replicas beyond the new count are dropped. Returns ``{"step": int, "extra":
    dict}``.
    """
    path = Path(path)
    rank, world = rank_world()
    base, reps = optimizer_parts(optimizer)
    error = None
    flat: dict[str, torch.Tensor] = {}
    if verify and path.is_dir() and (path / MARKER_FILE).exists():
        status = verify_checkpoint(path)
        if status.state == UNREADABLE:
            raise CheckpointError(f"loading checkpoint {path}: {status.reason}", PERMISSION)
        if status.state == "damaged":
            raise CheckpointError(f"loading checkpoint {path}: it is damaged: "
                                  f"{status.reason}", DAMAGED)
    # DCP loads here, past the checks of the files (a refused checkpoint never needs it)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    try:
        meta = require_complete(path)
        mesh_shape = mesh_shape_of(model, optimizer)
        msd = get_model_state_dict(model)
        _check_compatible(path, meta, world, mesh_shape, msd, base, reps)
        source = source_rank(rank, meta["world_size"], meta["mesh_shape"])
        rank_file = rank_file_path(path, source)
        if not rank_file.is_file():
            raise ValueError(f"checkpoint {path} lacks {rank_file.name} (rank {source}'s "
                             "state); the directory is incomplete")
        saved = pickle.loads(rank_file.read_bytes())
        per_rank = meta["layout"] == "per_rank"
        prefix = f"rank{source}/" if per_rank else ""
        for k, v in msd.items():
            if isinstance(v, torch.Tensor):
                flat[f"{prefix}model/{k}"] = local_tensor(v) if per_rank else v
        names = param_names(model, base)
        it = iter(names)
        current = [[next(it) for _ in g["params"]] for g in base.param_groups]
        if [g["params"] for g in saved["optim"]["param_groups"]] != current:
            raise ValueError(f"checkpoint {path}: the optimizer's parameter groups differ from "
                             "the saved ones; build the optimizer with the same groups")
        params = dict(model.named_parameters())
        loaded: dict[str, torch.Tensor] = {}
        for ref in refs(saved):
            if ref.like is not None:
                value = torch.empty_like(params[ref.like], dtype=ref.dtype)
                target = local_tensor(value) if per_rank else value
            else:
                value = target = torch.empty(ref.shape, dtype=ref.dtype)
            flat[prefix + ref.key if ref.scope == "model" else ref.key] = target
            loaded[ref.key] = value
    except Exception as e:
        error = e
    agree_on(error, f"loading checkpoint {path}")
    dcp_call(dcp.load, flat, f"loading checkpoint {path}", path,
              storage_reader=FileSystemReader(path))
    error, result = None, None
    try:
        for ref in refs(saved):
            if ref.like is None:
                loaded[ref.key] = to_device(loaded[ref.key], ref.device)
        set_model_state_dict(model, msd)
        _load_base(base, names, join_state(saved["optim"], loaded))
        if optimizer is not base:  # Optimizer.load_state_dict replaced the shared containers
            optimizer.param_groups = base.param_groups
            optimizer.state = base.state
        state = join_state(saved["state"], loaded)
        for r, s in zip(reps, state["replicators"]):
            r.load_state_dict(s)
        if source != rank:  # a new replica: its peer's shared state, its own from zero
            for r in reps:
                r.load_shared_state(r.shared_state())
        if state["steps"] is not None and hasattr(optimizer, "steps"):
            optimizer.steps = int(state["steps"])
        if state["skipped_steps"] is not None and hasattr(optimizer, "skipped_steps"):
            optimizer.skipped_steps = int(state["skipped_steps"])
        result = {"step": int(meta["step"]), "extra": state["extra"]}
    except Exception as e:
        error = e
    agree_on(error, f"restoring checkpoint {path}")
    assert result is not None  # agree_on raised otherwise
    return result


def source_rank(rank: int, saved_world: int, saved_mesh: Sequence[int]) -> int:
    """The rank whose saved state rank ``rank`` loads: its own where it was in the saved job;
    on more replicas than were saved, a new rank loads replica 0's rank of its shard (global
    ranks run replica-major: ``rank = replica * shard + shard index``)."""
    return rank if rank < saved_world else rank % int(saved_mesh[1])


def _load_base(base: torch.optim.Optimizer, names: list[str], saved: dict) -> None:
    index = {n: i for i, n in enumerate(names)}
    state = {index[fqn]: entry for fqn, entry in saved["state"].items()}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in saved["param_groups"]]
    base.load_state_dict({"state": state, "param_groups": groups})


