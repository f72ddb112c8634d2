"""Distributed checkpoints with per-replica state, on torch.distributed.checkpoint (DCP).

A checkpoint holds the model (FSDP2 shards as DTensors, or plain tensors), the base optimizer's
state, every replicator's state (DeMo's ``delta``, subset buffers, DiLoCo's global copy, outer
optimizer and syncs in flight), ``optimizer.steps`` / ``skipped_steps``, the trainer's ``extra``
(per rank: data position, RNG states, ...) and ``step``. Resuming with the same world size and
mesh continues the run bitwise.

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
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from .integrity import (
    DAMAGED,
    DIGEST,
    IO,
    MARKER_FILE,
    CheckpointStatus,
    check_checkpoint,
    describe_os_error,
    record_files,
    storage_cause,
)
from .mismatch import (
    CheckpointMismatchError,
    check_base,
    check_mesh,
    check_model,
    check_replicators,
    setting_differences,  # noqa: F401 - re-exported
)

__all__ = ["FORMAT_VERSION", "CheckpointError", "CheckpointMismatchError", "NotACheckpointError",
           "describe_os_error", "latest_checkpoint", "load_checkpoint", "read_info",
           "save_checkpoint", "verify_checkpoint"]

FORMAT_VERSION = 1
META_FILE = "flexdemo.json"
RANKS_DIR = "ranks"
_SCRATCH = re.compile(r"\.(tmp|old)-\d+$")  # temporary / replaced directories, never loaded


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


# ---------------------------------------------------------------------------- process group
def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class CheckpointError(OSError):
    """Storage failed while saving or loading a checkpoint (a full disk, no permission, a
    missing file, a damaged checkpoint). Raised on every rank with the same one-line message,
    which names the path and the cause; a save that fails leaves the previous checkpoint
    untouched. ``cause`` is one of ``"no space"``, ``"permission"``, ``"missing"``,
    ``"damaged"`` or ``"I/O"``."""

    def __init__(self, message: str, cause: str = IO) -> None:
        super().__init__(message)
        self.cause = cause

    def __reduce__(self):
        return type(self), (str(self), self.cause)


def _storage_cause(e: BaseException) -> BaseException | None:
    """The storage error behind ``e``: an OSError itself, or the first one DCP collected."""
    if isinstance(e, OSError):
        return e
    if isinstance(e, CheckpointException):
        for _rank, (exc, _trace) in sorted(e.failures.items()):
            return exc
    return None


def _classify(error: BaseException) -> tuple[str, str] | None:
    """``(cause, text)`` of a storage error, or None for other errors."""
    if isinstance(error, CheckpointError):
        return error.cause, str(error)
    storage = _storage_cause(error)
    if isinstance(storage, OSError):
        return storage_cause(storage)
    return None


def _agree(error: BaseException | None, action: str, payload: Any = None) -> list:
    """Collective: every rank learns whether any rank failed, and gets every rank's payload.

    Raises on every rank if one failed, so no rank goes on into a collective that the others
    never join. A storage error (OSError, :class:`CheckpointError`) becomes the same
    :class:`CheckpointError` on every rank (the lowest failing rank's); otherwise the failing
    rank re-raises its own exception. Also serves as a barrier.
    """
    rank, world = _rank_world()
    storage = _classify(error) if error is not None else None
    if storage is not None and not isinstance(error, CheckpointError):
        storage = (storage[0], f"{action}: {storage[1]}")
    if world == 1:
        if storage is not None:
            raise CheckpointError(storage[1], storage[0]) from None
        if error is not None:
            raise error
        return [payload]
    note = None if error is None else ("error", f"{type(error).__name__}: {error}")
    if storage is not None:
        note = ("storage", storage)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (note, payload))
    failed = {r: n for r, (n, _) in enumerate(gathered) if n is not None}
    if failed:
        on_disk = {r: n[1] for r, n in failed.items() if n[0] == "storage"}
        if on_disk:
            first = min(on_disk)
            cause, text = on_disk[first]
            where = f" (rank {first})" if world > 1 else ""
            raise CheckpointError(f"{text}{where}", cause) from None
        if error is not None:
            raise error
        first = min(failed)
        text = failed[first][1]
        cls = ValueError if text.startswith("ValueError") else RuntimeError
        raise cls(f"{action} failed on rank(s) {sorted(failed)}; rank {first}: {text}")
    return [p for _, p in gathered]


def _dcp_call(fn, state: dict, action: str, directory: Path, **kwargs) -> None:
    """Run ``dcp.save`` / ``dcp.load`` (without a process group in a lone process). DCP's
    ``CheckpointException`` derives from ``BaseException`` and holds every rank's traceback;
    it becomes one :class:`CheckpointError` naming the cause (a full disk that torch's writer
    reports as a RuntimeError is told apart by a probe write into ``directory``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            fn(state, no_dist=not (dist.is_available() and dist.is_initialized()), **kwargs)
        except CheckpointException as e:
            cause = _storage_cause(e)
            kind, text = storage_cause(cause, directory if fn is dcp.save else None)
            if kind == DAMAGED:  # e.g. EOFError or an unpickling error from a cut file
                what = text.rstrip(": ")
                text = f"its data files (*.distcp) are truncated or corrupt ({what[:200]})"
            raise CheckpointError(f"{action}: {text}", kind) from None


# ---------------------------------------------------------------------------- layout
def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local part of a DTensor (sharing storage), or ``t`` itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _optimizer_parts(optimizer) -> tuple[torch.optim.Optimizer, list]:
    """The base torch optimizer and the replicator chain (none for a plain torch optimizer)."""
    base = getattr(optimizer, "base", optimizer)
    if not isinstance(base, torch.optim.Optimizer):
        raise TypeError(f"expected a flexdemo.DeToNATION or torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    return base, list(getattr(optimizer, "replicators", []))


def _mesh_shape(model: nn.Module, optimizer) -> tuple[int, int]:
    """``(replicate, shard)``: the optimizer's mesh, else the parameters' shard mesh, else DP."""
    rank, world = _rank_world()
    mesh = getattr(optimizer, "mesh", None)
    if mesh is not None:
        if mesh.get_coordinate() is None:
            raise ValueError(f"rank {rank} is not part of the optimizer's mesh")
        r, s = (int(n) for n in mesh.mesh.shape)
        return r, s
    for p in model.parameters():
        if isinstance(p, DTensor):  # sharded without prepare(): the parameters' mesh is a shard
            size = p.device_mesh.size()
            return world // size, size
    return world, 1


def _fingerprints(tensors: dict[str, torch.Tensor]) -> dict[tuple, str]:
    """Digest of this rank's tensors per chunk identity (the mesh coordinate along sharded
    dimensions; ``()`` for plain tensors). DCP keeps one copy of chunks with equal identity, so
    a shared layout is exact only if every rank with the same identity has the same digest."""
    hashes: dict[tuple, Any] = {}
    for key in sorted(tensors):
        t = tensors[key]
        ident: tuple = ()
        if isinstance(t, DTensor):
            coord = t.device_mesh.get_coordinate() or ()
            ident = tuple(c for c, pl in zip(coord, t.placements) if pl.is_shard())
        loc = _local(t).detach()
        h = hashes.setdefault(ident, hashlib.blake2b(digest_size=16))
        h.update(f"{key}|{loc.dtype}|{tuple(loc.shape)}|".encode())
        if loc.numel():
            h.update(loc.contiguous().reshape(-1).view(torch.uint8).cpu().numpy())
    return {ident: h.hexdigest() for ident, h in hashes.items()}


def _replicas_identical(prints: list[dict[tuple, str]]) -> bool:
    seen: dict[tuple, str] = {}
    for rank_prints in prints:
        for ident, digest in rank_prints.items():
            if seen.setdefault(ident, digest) != digest:
                return False
    return True


# ---------------------------------------------------------------------------- state trees
def _split(obj: Any, prefix: str, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """Replace every tensor in nested dicts/lists/tuples by a :class:`_Ref` (key ``prefix<i>``)
    and collect the tensors in ``tensors``."""
    if isinstance(obj, DTensor):
        raise ValueError(f"{where} holds a DTensor; per-rank state must hold plain tensors "
                         "(pass t.to_local() or t.full_tensor())")
    if isinstance(obj, torch.Tensor):
        key = f"{prefix}{len(tensors)}"
        tensors[key] = obj.detach()
        return _Ref(key, tuple(obj.shape), obj.dtype, str(obj.device))
    if isinstance(obj, dict):
        out = obj.copy()
        for k, v in obj.items():
            out[k] = _split(v, prefix, tensors, f"{where}[{k!r}]")
        return out
    if isinstance(obj, (list, tuple)):
        items = [_split(v, prefix, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _join(obj: Any, loaded: dict[str, torch.Tensor]) -> Any:
    """The inverse of :func:`_split`: put the loaded tensors back in place of the references."""
    if isinstance(obj, _Ref):
        return loaded[obj.key]
    if isinstance(obj, dict):
        out = obj.copy()
        for k, v in obj.items():
            out[k] = _join(v, loaded)
        return out
    if isinstance(obj, (list, tuple)):
        items = [_join(v, loaded) for v in obj]
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _refs(obj: Any):
    """Every :class:`_Ref` in a nested structure."""
    if isinstance(obj, _Ref):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _refs(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _refs(v)


def _to_device(t: torch.Tensor, device: str) -> torch.Tensor:
    """Move a loaded tensor back to the device it was saved from, where that device exists."""
    dev = torch.device(device)
    if dev.type == "cpu" or (dev.type == "cuda" and not torch.cuda.is_available()):
        return t
    try:
        return t.to(dev)
    except (RuntimeError, AssertionError):
        return t


def _param_names(model: nn.Module, base: torch.optim.Optimizer) -> list[str]:
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


def _split_optimizer(model: nn.Module, base: torch.optim.Optimizer, rank: int,
                     own: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """The base optimizer's state keyed by parameter name.

    Returns the structure (tensors as references) and the model-scoped tensors
    ``optim/<fqn>/<name>``; tensors nested deeper go to the rank's own keys ``own``.
    """
    names = _param_names(model, base)
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
                if isinstance(v, DTensor):
                    p = params[fqn]
                    if not (isinstance(p, DTensor) and v.shape == p.shape
                            and v.device_mesh == p.device_mesh and v.placements == p.placements):
                        raise ValueError(f"optimizer state {fqn}/{k} is a DTensor sharded unlike "
                                         "its parameter; this is not supported")
                    like = fqn
                tensors[key] = v.detach()
                out[k] = _Ref(key, tuple(v.shape), v.dtype, str(_local(v).device), "model", like)
            else:
                out[k] = _split(v, f"rank{rank}/state/", own, f"optimizer state {fqn}/{k}")
        state[fqn] = out
    groups = []
    for g in sd["param_groups"]:
        g = {k: v for k, v in g.items() if k != "params"} | {
            "params": [names[i] for i in g["params"]]}
        groups.append(_split(g, f"rank{rank}/state/", own, "optimizer param_groups"))
    return {"state": state, "param_groups": groups}, tensors


# ---------------------------------------------------------------------------- files
def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_scratch(root: Path) -> None:
    """Remove temporary and replaced checkpoint directories left by an interrupted save."""
    if not root.is_dir():
        return
    for d in root.iterdir():
        if _SCRATCH.search(d.name) and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)


def _commit(tmp: Path, final: Path) -> None:
    """Move the finished temporary directory into place (rank 0 only; the atomic step)."""
    old = None
    if final.exists():
        old = final.with_name(f"{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _rank_file(path: Path, rank: int) -> Path:
    return path / RANKS_DIR / f"rank{rank:05d}.pkl"


def _read_meta(path: Path) -> dict | None:
    """The metadata of a complete checkpoint at ``path``, or None."""
    try:
        if not (path / MARKER_FILE).is_file() or not (path / ".metadata").is_file():
            return None
        meta = json.loads((path / META_FILE).read_text())
        return meta if isinstance(meta, dict) else None
    except (OSError, ValueError):
        return None


class NotACheckpointError(ValueError):
    """``path`` holds no complete checkpoint; ``reason`` says why and ``hint`` what to do
    in the library's words (callers with other words, such as the command line, use
    ``reason`` with their own advice)."""

    def __init__(self, reason: str, hint: str) -> None:
        super().__init__(f"{reason}; {hint}")
        self.reason, self.hint = reason, hint

    def __reduce__(self):
        return type(self), (self.reason, self.hint)


def _require_complete(path: Path) -> dict:
    hint = "use flexdemo.checkpoint.latest_checkpoint(root) to find the newest complete one"
    if not path.is_dir():
        raise NotACheckpointError(f"no checkpoint at {path}: the directory does not exist",
                                  hint)
    if _SCRATCH.search(path.name):
        raise NotACheckpointError(f"{path} is not a complete flexdemo checkpoint but the "
                                  "temporary directory of an interrupted save", hint)
    meta = _read_meta(path)
    if meta is None:
        if latest_checkpoint(path) is not None:
            raise NotACheckpointError(f"{path} is a directory of checkpoints, not a checkpoint",
                                      f"pass latest_checkpoint({str(path)!r}) or one of its "
                                      "step directories")
        raise NotACheckpointError(f"{path} is not a complete flexdemo checkpoint (no "
                                  f"{MARKER_FILE} marker, or unreadable {META_FILE}): its save "
                                  "was interrupted or it was written by something else", hint)
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {path} has format {meta.get('format')!r}, this flexdemo "
                         f"reads format {FORMAT_VERSION}; load it with the flexdemo version that "
                         f"wrote it ({meta.get('flexdemo_version')})")
    return meta


def _flexdemo_version() -> str:
    import flexdemo

    return str(getattr(flexdemo, "__version__", "unknown"))


def _tensor_table(msd: dict) -> dict[str, dict]:
    return {k: {"shape": list(v.shape), "dtype": str(v.dtype)}
            for k, v in msd.items() if isinstance(v, torch.Tensor)}


def _check_compatible(path: Path, meta: dict, world: int, mesh_shape: tuple[int, int],
                      msd: dict, base: torch.optim.Optimizer, reps: list) -> None:
    """Raise :class:`CheckpointMismatchError` if the checkpoint at ``path`` cannot be resumed
    by this job."""
    check_mesh(path, meta["world_size"], meta["mesh_shape"], world, mesh_shape)
    check_model(path, {k: v["shape"] for k, v in meta["tensors"].items()},
                {k: v["shape"] for k, v in _tensor_table(msd).items()})
    check_base(path, meta["base_optimizer"], type(base).__name__)
    check_replicators(path, meta["replicators"], [repr(r) for r in reps])
    if meta.get("flexdemo_version") != _flexdemo_version():
        warnings.warn(f"checkpoint {path} was written by flexdemo "
                      f"{meta.get('flexdemo_version')}, this is {_flexdemo_version()}",
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
    records the SHA-256 of every file (:mod:`flexdemo.integrity`). Returns ``path``.
    """
    final = Path(path)
    rank, world = _rank_world()
    base, reps = _optimizer_parts(optimizer)
    error, facts = None, None
    try:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        if not final.name or _SCRATCH.search(final.name):
            raise ValueError(f"invalid checkpoint directory name {final.name!r}")
        if extra is not None and not isinstance(extra, dict):
            raise ValueError(f"extra must be a dict or None, got {type(extra).__name__}")
        try:
            info_json = json.loads(json.dumps(info or {}))
        except (TypeError, ValueError) as e:
            raise ValueError(f"info must hold JSON values: {e}") from None
        mesh_shape = _mesh_shape(model, optimizer)
        msd = get_model_state_dict(model)
        own: dict[str, torch.Tensor] = {}
        optim_tree, optim_tensors = _split_optimizer(model, base, rank, own)
        state = {
            "replicators": [r.state_dict() for r in reps],
            "steps": getattr(optimizer, "steps", None),
            "skipped_steps": getattr(optimizer, "skipped_steps", None),
            "extra": {} if extra is None else extra,
        }
        state_tree = _split(state, f"rank{rank}/state/", own, "the rank's state")
        try:
            blob = pickle.dumps({"rank": rank, "state": state_tree, "optim": optim_tree},
                                protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise ValueError(f"the checkpoint state (extra or optimizer state) cannot be "
                             f"pickled: {e}; keep extra to tensors, numbers, strings and "
                             "lists/tuples/dicts of them") from e
        shared = {f"model/{k}": v for k, v in msd.items() if isinstance(v, torch.Tensor)}
        shared.update(optim_tensors)
        facts = {"prints": _fingerprints(shared), "step": step, "pid": os.getpid()}
    except Exception as e:
        error = e
    infos = _agree(error, f"saving checkpoint {final}", facts)
    if len({i["step"] for i in infos}) != 1:
        raise ValueError(f"ranks passed different steps to save_checkpoint: "
                         f"{[i['step'] for i in infos]}")
    identical = _replicas_identical([i["prints"] for i in infos])
    if identical:
        flat = dict(shared)
    else:  # replicas differ: every rank keeps its own local tensors
        flat = {f"rank{rank}/{k}": _local(v) for k, v in shared.items()}
    flat.update(own)
    tmp = final.parent / f"{final.name}.tmp-{infos[0]['pid']}"
    error = None
    if rank == 0:
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            _remove_scratch(final.parent)
            (tmp / RANKS_DIR).mkdir(parents=True)
        except Exception as e:
            error = e
    _agree(error, f"saving checkpoint {final}: creating {tmp}")
    try:
        error = None
        try:
            _dcp_call(dcp.save, flat, f"saving checkpoint {final}", tmp,
                      storage_writer=FileSystemWriter(tmp))
        except CheckpointError as e:
            error = e
        _agree(error, f"saving checkpoint {final}")  # the same cause on every rank
        error, written = None, None
        try:
            _fsync_write(_rank_file(tmp, rank), blob)
            names = [f.name for f in tmp.glob(f"__{rank}_*.distcp")]
            names.append(f"{RANKS_DIR}/{_rank_file(tmp, rank).name}")
            if rank == 0:
                meta = {
                    "format": FORMAT_VERSION,
                    "flexdemo_version": _flexdemo_version(),
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
                _fsync_write(tmp / META_FILE, json.dumps(meta, indent=1).encode())
                names += [".metadata", META_FILE]
            written = record_files(tmp, names)  # what this rank saved, read back once
        except Exception as e:
            error = e
        tables = _agree(error, f"saving checkpoint {final}", written)
        error = None
        if rank == 0:
            try:
                _fsync_dir(tmp / RANKS_DIR)
                files = {name: d for table in tables for name, d in table.items()}
                marker = {"step": step, "time": time.time(), "digest": DIGEST, "files": files,
                          "ranks": {str(r): sorted(t) for r, t in enumerate(tables)}}
                _fsync_write(tmp / MARKER_FILE, json.dumps(marker, indent=1).encode())
                _fsync_dir(tmp)
                _commit(tmp, final)
            except Exception as e:
                error = e
        _agree(error, f"saving checkpoint {final}: committing it")
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def verify_checkpoint(path: str | os.PathLike) -> CheckpointStatus:
    """Check the checkpoint at ``path`` against the digests its marker records (collective
    when a process group is up: each rank reads its share of the files once). Returns the
    same :class:`~flexdemo.integrity.CheckpointStatus` on every rank."""
    rank, world = _rank_world()
    status = check_checkpoint(path, rank, world)
    if world == 1:
        return status
    gathered: list = [None] * world
    dist.all_gather_object(gathered, status)
    problems = [p for st in gathered for p in st.problems]
    merged = gathered[0]
    if any(st.state == "damaged" for st in gathered):
        merged.state = "damaged"
    merged.problems = problems
    return merged


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer, *,
                    verify: bool = True) -> dict:
    """Restore a checkpoint written by :func:`save_checkpoint` into ``model`` and ``optimizer``.

    Collective. With ``verify`` (the default) every file is first checked against its
    recorded digest; a damaged checkpoint raises :class:`CheckpointError` (cause
    ``"damaged"``) naming what is wrong. The job must have the world size and mesh that
    wrote it, and the same model, base optimizer and replicators; otherwise
    :class:`CheckpointMismatchError` (a ``ValueError``) says what differs. Each rank gets its
    own replicator state and ``extra`` back. Returns ``{"step": int, "extra": dict}``.
    """
    path = Path(path)
    rank, world = _rank_world()
    base, reps = _optimizer_parts(optimizer)
    error = None
    flat: dict[str, torch.Tensor] = {}
    if verify and path.is_dir() and (path / MARKER_FILE).exists():
        status = verify_checkpoint(path)
        if status.state == "damaged":
            raise CheckpointError(f"loading checkpoint {path}: it is damaged: "
                                  f"{status.describe().split(': ', 1)[1]}", DAMAGED)
    try:
        meta = _require_complete(path)
        mesh_shape = _mesh_shape(model, optimizer)
        msd = get_model_state_dict(model)
        _check_compatible(path, meta, world, mesh_shape, msd, base, reps)
        rank_file = _rank_file(path, rank)
        if not rank_file.is_file():
            raise ValueError(f"checkpoint {path} lacks {rank_file.name} (rank {rank}'s state); "
                             "the directory is incomplete")
        saved = pickle.loads(rank_file.read_bytes())
        per_rank = meta["layout"] == "per_rank"
        prefix = f"rank{rank}/" if per_rank else ""
        for k, v in msd.items():
            if isinstance(v, torch.Tensor):
                flat[f"{prefix}model/{k}"] = _local(v) if per_rank else v
        names = _param_names(model, base)
        it = iter(names)
        current = [[next(it) for _ in g["params"]] for g in base.param_groups]
        if [g["params"] for g in saved["optim"]["param_groups"]] != current:
            raise ValueError(f"checkpoint {path}: the optimizer's parameter groups differ from "
                             "the saved ones; build the optimizer with the same groups")
        params = dict(model.named_parameters())
        loaded: dict[str, torch.Tensor] = {}
        for ref in _refs(saved):
            if ref.like is not None:
                value = torch.empty_like(params[ref.like], dtype=ref.dtype)
                target = _local(value) if per_rank else value
            else:
                value = target = torch.empty(ref.shape, dtype=ref.dtype)
            flat[prefix + ref.key if ref.scope == "model" else ref.key] = target
            loaded[ref.key] = value
    except Exception as e:
        error = e
    _agree(error, f"loading checkpoint {path}")
    _dcp_call(dcp.load, flat, f"loading checkpoint {path}", path,
              storage_reader=FileSystemReader(path))
    error, result = None, None
    try:
        for ref in _refs(saved):
            if ref.like is None:
                loaded[ref.key] = _to_device(loaded[ref.key], ref.device)
        set_model_state_dict(model, msd)
        _load_base(base, names, _join(saved["optim"], loaded))
        if optimizer is not base:  # Optimizer.load_state_dict replaced the shared containers
            optimizer.param_groups = base.param_groups
            optimizer.state = base.state
        state = _join(saved["state"], loaded)
        for r, s in zip(reps, state["replicators"]):
            r.load_state_dict(s)
        if state["steps"] is not None and hasattr(optimizer, "steps"):
            optimizer.steps = int(state["steps"])
        if state["skipped_steps"] is not None and hasattr(optimizer, "skipped_steps"):
            optimizer.skipped_steps = int(state["skipped_steps"])
        result = {"step": int(meta["step"]), "extra": state["extra"]}
    except Exception as e:
        error = e
    _agree(error, f"restoring checkpoint {path}")
    return result


def _load_base(base: torch.optim.Optimizer, names: list[str], saved: dict) -> None:
    index = {n: i for i, n in enumerate(names)}
    state = {index[fqn]: entry for fqn, entry in saved["state"].items()}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in saved["param_groups"]]
    base.load_state_dict({"state": state, "param_groups": groups})


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint under ``root`` with the highest step (newest on ties), or None.

    Directories without the completion marker (interrupted saves) and temporary directories
    are ignored.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    best, best_key = None, None
    for d in root.iterdir():
        if _SCRATCH.search(d.name) or not d.is_dir():
            continue
        meta = _read_meta(d)
        if meta is None or not isinstance(meta.get("step"), int):
            continue
        try:
            stamp = json.loads((d / MARKER_FILE).read_text()).get("time", 0.0)
        except (OSError, ValueError, AttributeError):
            stamp = 0.0
        key = (meta["step"], float(stamp), d.name)
        if best_key is None or key > best_key:
            best, best_key = d, key
    return best
