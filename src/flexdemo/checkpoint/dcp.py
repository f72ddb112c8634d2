"""The optimizer's state dict in torch's layout, fit for ``torch.distributed.checkpoint``.

``get_state_dict(model, opt)`` / ``set_state_dict(...)`` and ``dcp.save`` / ``dcp.load`` need
an optimizer state dict shaped like torch's: ``{"state": {param: {...}}, "param_groups":
[...]}``. :class:`~flexdemo.optim.DeToNATION` returns one, built here:

* the base optimizer's state (e.g. AdamW's moments) sits under each parameter as usual, so
  DCP stores and reshards it like any optimizer's state;
* state that differs per replica must never share a DCP key: DCP writes one copy of tensors
  it believes replicated (equal keys and offsets) and every rank reads that copy back. So:

  - the replicator chain's state (DeMo's momentum, error feedback, subset buffers, DiLoCo's
    global copy, outer optimizer and syncs in flight), the step counters and, where needed,
    the module buffers live under the first parameter, keys ``flexdemo/chain/rank<global
    rank>``: one opaque object for what varies in structure (syncs in flight, counters), plus
    the large fixed-shape buffers (the entries each replicator names in
    :attr:`~flexdemo.replicate.Replicator.state_tensor_keys`) as DCP tensors
    ``flexdemo/chain/rank<g>/replicators/<i>/.../<name>/<j>``;
  - when the replicators do not keep replicas bitwise identical (DiLoCo's inner steps,
    ``"none"``, schedules that skip steps), the base state and a copy of every parameter's
    local shard are keyed per replica, ``flexdemo/replica<r>/<name>`` (DTensor shards;
    ``flexdemo/rank<g>/<name>`` for unsharded tensors), and loading the optimizer puts each
    replica's own parameters back (``set_state_dict`` loads the model first, then the
    optimizer).

Whether replicas are identical is decided from what the replicators declare and their
schedules (:meth:`DeToNATION.replicas_identical`,
:meth:`~flexdemo.replicate.Replicator.keeps_replicas_identical`), conservatively. A
checkpoint loads into a job with the same world size and mesh; other layouts raise
``ValueError``.

:func:`load` is ``dcp.load`` with flexdemo's checks first (:func:`check_load`): a checkpoint
written on another mesh, for another model, base optimizer or replicators raises
:class:`~flexdemo.checkpoint.CheckpointMismatchError` with the line that
:func:`flexdemo.load_checkpoint` gives, instead of DCP's "Size mismatch" traceback.
"""

from __future__ import annotations

import io
import os
import re
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from ..dtensor import local_tensor
from ..transport import group_rank
from .agree import agree_on
from .mismatch import check_base, check_mesh, check_model, check_replicators

# torch.distributed.checkpoint (and with it DTensor and sympy, about a second of CPU) is
# imported by the functions that read or load a checkpoint, not by ``import flexdemo``
if TYPE_CHECKING:
    from ..buffers import BufferSync
    from ..replicate.base import Replicator


class FlexOptimizer(Protocol):
    """What this module reads and sets of :class:`~flexdemo.optim.DeToNATION` (a protocol:
    the optimizer imports this module)."""

    steps: int
    skipped_steps: int

    @property
    def base(self) -> torch.optim.Optimizer: ...
    @property
    def replicators(self) -> list[Replicator]: ...
    @property
    def param_groups(self) -> list[dict[str, Any]]: ...
    @property
    def params(self) -> list: ...
    @property
    def default_group(self) -> object: ...
    @property
    def buffer_sync(self) -> BufferSync | None: ...
    @property
    def buffer_policy(self) -> str: ...
    def share_state(self) -> None: ...
    def replicas_identical(self) -> bool: ...


PREFIX = "flexdemo/"
FORMAT = 1
MARK = "flexdemo-dcp-tensor:"


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def blob_key() -> str:
    """The key of this rank's replicator-chain state (apart from the per-replica keys)."""
    return f"{PREFIX}chain/rank{_global_rank()}"


def replica_tag(opt: FlexOptimizer, t: torch.Tensor) -> str:
    """The per-replica key part for ``t``: ``replica<r>`` for DTensor shards (the chunk's
    offsets tell shards apart), ``rank<g>`` for whole tensors."""
    if hasattr(t, "_local_tensor"):
        mesh = getattr(opt, "mesh", None)
        r = mesh.get_coordinate()[0] if mesh is not None else group_rank(opt.default_group)
        return f"replica{r}"
    return f"rank{_global_rank()}"


def _mesh_shape(opt: FlexOptimizer) -> tuple[int, ...] | None:
    mesh = getattr(opt, "mesh", None)
    return None if mesh is None else tuple(int(n) for n in mesh.mesh.shape)


def tensor_keys(opt: FlexOptimizer) -> set[str]:
    """The replicator state entries that are lists of fixed-shape tensors (DeMo's momentum,
    the subset replicators' buffers, DiLoCo's global copy, as each replicator declares): they
    travel as DCP tensors (keyed per rank), everything else (syncs in flight, counters) inside
    the per-rank object."""
    return set().union(*(r.tensor_state_keys() for r in opt.replicators))


def _extract(tree, path: str, out: dict[str, torch.Tensor], keys: set[str]) -> None:
    """Move the tensors of the lists under ``keys`` in ``tree`` (nested dicts/lists) into
    ``out``, leaving a marker with their key."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            if k in keys and isinstance(v, list):
                for j, t in enumerate(v):
                    if isinstance(t, torch.Tensor):
                        key = f"{path}/{k}/{j}"
                        out[key] = t
                        v[j] = MARK + key
            else:
                _extract(v, f"{path}/{k}", out, keys)
    elif isinstance(tree, list):
        for j, v in enumerate(tree):
            _extract(v, f"{path}/{j}", out, keys)


def _restore(tree, tensors: dict[str, torch.Tensor]):
    """The inverse of :func:`_extract`."""
    if isinstance(tree, str) and tree.startswith(MARK):
        key = tree[len(MARK):]
        if key not in tensors:
            raise ValueError(f"the optimizer state lacks {key!r}; it was written for other "
                             "replicators or settings")
        return tensors[key]
    if isinstance(tree, dict):
        return {k: _restore(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_restore(v, tensors) for v in tree]
    return tree


def _pack(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes | bytearray):
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


@torch.no_grad()
def _init_base_state(opt: FlexOptimizer) -> bool:
    """Create the base optimizer's state by a zero-lr step on zero gradients if it has none
    (what torch's ``get_state_dict`` does for its own optimizers), so that a fresh optimizer's
    state dict has tensors for DCP to load into. Returns whether state was created. Parameters
    are bitwise unchanged; existing gradients are kept."""
    base, params = opt.base, opt.params
    if any(base.state.get(p) for p in params):  # entries may be empty dicts
        return False
    grads = [p.grad for p in params]
    lrs = [g["lr"] for g in base.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in base.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        base.step()
    finally:
        for g, lr in zip(base.param_groups, lrs):
            g["lr"] = lr
        for p, gr in zip(params, grads):
            p.grad = gr
    return any(base.state.get(p) for p in params)


def state_dict(opt: FlexOptimizer) -> dict:
    """``opt``'s state in torch's layout (see the module docstring)."""
    created = _init_base_state(opt)
    sd = opt.base.state_dict()
    if created:  # keep the optimizer as fresh as it was; the dict holds the tensors
        opt.base.state.clear()
        opt.share_state()
    identical = opt.replicas_identical()
    state: dict = {}
    for i, p in enumerate(opt.params):
        entry = dict(sd["state"].get(i, {}))
        if not identical:
            tag = f"{PREFIX}{replica_tag(opt, p)}/"
            entry = {tag + k: v for k, v in entry.items()}
            entry[tag + "param"] = p.detach().clone()
        state[i] = entry
    keep_buffers = opt.buffer_sync is not None and (not identical or opt.buffer_policy == "none")
    reps = [r.state_dict() for r in opt.replicators]
    fixed: dict[str, torch.Tensor] = {}
    _extract(reps, f"{blob_key()}/replicators", fixed, tensor_keys(opt))
    blob = {
        "format": FORMAT,
        "rank": _global_rank(),
        "mesh": _mesh_shape(opt),
        "identical": identical,
        "base_state_created": created,
        "replicators": reps,
        "steps": opt.steps,
        "skipped_steps": opt.skipped_steps,
        "params": [list(local_tensor(p).shape) for p in opt.params],
        "kinds": _kinds(opt),
        "reprs": [repr(r) for r in opt.replicators],
        "buffers": [b.detach().clone() for b in opt.buffer_sync.all_buffers]
        if keep_buffers and opt.buffer_sync is not None else None,
    }
    state[0][blob_key()] = _pack(blob)
    state[0].update(fixed)
    return {"state": state, "param_groups": sd["param_groups"]}


@torch.no_grad()
def load_state_dict(opt: FlexOptimizer, sd: dict) -> None:
    """Restore a state dict made by :func:`state_dict` (int or parameter-name keys).

    Collective when a process group of several ranks is up: every rank loads its own state
    (as DCP's ``set_state_dict`` does), and a state that one rank refuses (a rank-0-only save
    loaded everywhere, another model) is refused on every rank with that rank's line, before
    anything is loaded, so that no rank goes on into a step that the others never join."""
    error, checked = None, None
    try:
        checked = _check_state(opt, sd)
    except Exception as e:
        error = e
    agree_on(error, "loading the optimizer state")
    assert checked is not None  # agree_on raised otherwise
    groups, blob, base_state, copies, reps = checked
    for r, s in zip(opt.replicators, reps):
        r.load_state_dict(s)
    opt.base.load_state_dict({"state": base_state, "param_groups": groups})
    if blob["base_state_created"]:  # the saving optimizer had no base state yet
        opt.base.state.clear()
    opt.share_state()
    for p, c in zip(opt.params, copies):
        if c is not None:
            _copy_local(p, c)
    if blob["buffers"] is not None and opt.buffer_sync is not None:
        for b, v in zip(opt.buffer_sync.all_buffers, blob["buffers"]):
            b.copy_(v)
    opt.steps = int(blob["steps"])
    opt.skipped_steps = int(blob["skipped_steps"])


def _check_state(opt: FlexOptimizer, sd: dict) -> tuple:
    """This rank's parts of ``sd``, checked against ``opt`` without changing anything:
    ``(param_groups, chain blob, base state, parameter copies, replicator states)``."""
    groups = sd["param_groups"]
    saved_ids = [i for g in groups for i in g["params"]]
    if len(groups) != len(opt.param_groups) or len(saved_ids) != len(opt.params):
        raise ValueError(f"the optimizer state is for another model: it holds {len(saved_ids)} "
                         f"parameters in {len(groups)} group(s), this optimizer "
                         f"{len(opt.params)} in {len(opt.param_groups)}")
    mine = blob_key()
    blob, base_state, copies, fixed = None, {}, [], {}
    for sid, p in zip(saved_ids, opt.params):
        tag = f"{PREFIX}{replica_tag(opt, p)}/"
        entry, param_copy = {}, None
        for k, v in sd["state"].get(sid, {}).items():
            if k == mine:
                blob = v
            elif k.startswith(mine + "/"):
                fixed[k] = v
            elif k.startswith(tag):
                name = k[len(tag):]
                if name == "param":
                    param_copy = v
                else:
                    entry[name] = v
            elif not k.startswith(PREFIX):
                entry[k] = v
        if entry:
            base_state[sid] = entry
        copies.append(param_copy)
    if blob is None:
        others = sorted({int(m.group(1)) for entry in sd["state"].values()
                         for k in entry if (m := _CHAIN.match(str(k)))})
        if others:
            raise ValueError(
                f"the optimizer state holds the state of rank(s) {others}, not of this rank "
                f"({_global_rank()}): it was saved on rank(s) {others} only (e.g. torch.save "
                "of opt.state_dict() on rank 0) or by a job of another size, but each rank's "
                "state is its own (DeMo's momentum, error feedback). Save it on every rank: "
                "flexdemo.save_checkpoint(path, model, opt, step=...) or "
                "torch.distributed.checkpoint (dcp.save of get_state_dict(model, opt)), "
                "called on every rank")
        raise ValueError(f"the optimizer state has no {mine!r} entry (this rank's replicator "
                         "state): it was not written by flexdemo's optimizer")
    blob = _unpack(blob) if isinstance(blob, (bytes, bytearray)) else blob
    if blob.get("format") != FORMAT:
        raise ValueError(f"optimizer state format {blob.get('format')!r}, this flexdemo reads "
                         f"{FORMAT}")
    if blob["mesh"] != _mesh_shape(opt):
        raise ValueError(f"the optimizer state was written on a replicate x shard mesh "
                         f"{blob['mesh']}, this optimizer runs on {_mesh_shape(opt)}; per-replica "
                         "state cannot be redistributed: resume with the same world size and "
                         "mesh")
    _check_same_job(opt, blob)
    reps = _restore(blob["replicators"], fixed)
    if len(reps) != len(opt.replicators):
        raise ValueError(f"state has {len(reps)} replicators, this optimizer "
                         f"{len(opt.replicators)}")
    if blob["buffers"] is not None and opt.buffer_sync is not None:
        bufs = opt.buffer_sync.all_buffers
        if len(bufs) != len(blob["buffers"]):
            raise ValueError(f"the optimizer state holds {len(blob['buffers'])} module "
                             f"buffers, this model {len(bufs)}")
    return groups, blob, base_state, copies, reps


def _kinds(opt: FlexOptimizer) -> dict:
    """The classes of the base optimizer and of the replicators, by name."""
    return {"base": type(opt.base).__name__,
            "replicators": [type(r).__name__ for r in opt.replicators]}


def _check_same_job(opt: FlexOptimizer, blob: dict) -> None:
    """Refuse a state written for other parameter shapes, another base optimizer or other
    replicators before anything is loaded (torch's optimizers load such state silently and
    fail, or compute nonsense, at a later step). States written before these were recorded
    are not checked."""
    saved = blob.get("params")
    if saved is not None:
        for i, (shape, p) in enumerate(zip(saved, opt.params)):
            here = tuple(local_tensor(p).shape)
            if tuple(shape) != here:
                raise ValueError(f"the optimizer state is for another model: parameter {i} "
                                 f"has shape {tuple(shape)} there, {here} here; load it into "
                                 "the model it was saved with")
    kinds = blob.get("kinds")
    if kinds is not None and kinds != _kinds(opt):
        mine = _kinds(opt)
        raise ValueError(f"the optimizer state was written by {kinds['base']} with replicators "
                         f"{kinds['replicators']}, this optimizer is {mine['base']} with "
                         f"{mine['replicators']}; build the optimizer as it was saved (or load "
                         "only the model's weights to start a new optimizer)")


def _copy_local(p: torch.Tensor, v: torch.Tensor) -> None:
    local_tensor(p).copy_(local_tensor(v))


# ---------------------------------------------------------------------- checks before dcp.load
_BLOB = re.compile(r"^(.*)" + re.escape(PREFIX) + r"chain/rank(\d+)$")
_CHAIN = re.compile(r"^" + re.escape(PREFIX) + r"chain/rank(\d+)$")  # a rank's own entry


def check_load(state_dict: dict, checkpoint_id: str | os.PathLike) -> None:
    """Compare the DCP checkpoint ``checkpoint_id`` with the job about to load it into
    ``state_dict`` (what ``get_state_dict`` returned, under any top-level keys): the world
    size and mesh, the model's tensors (names and global shapes), the base optimizer and the
    replicators. Raises :class:`~flexdemo.checkpoint.CheckpointMismatchError` with the same line
    as :func:`flexdemo.load_checkpoint`; does nothing for state dicts without flexdemo's
    optimizer. Reads only the checkpoint's metadata and one small entry; not collective."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    flat, _ = flatten_state_dict(state_dict)
    mine = [(k, m) for k in flat if (m := _BLOB.match(k))]
    if not mine:
        return
    key, match = mine[0]
    head = match.group(1)  # e.g. "optim.state.inp.weight."
    top = head.split(".", 1)[0] + "."
    meta = FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    saved_ranks = sorted(int(m.group(2)) for k in meta
                         if (m := _BLOB.match(k)) and k.startswith(top))
    if not saved_ranks:
        return  # not written by flexdemo's optimizer: load_state_dict says so
    saved_key = key if key in meta else next(k for k in meta if _BLOB.match(k)
                                             and k.startswith(top))
    blob = _read_entry(checkpoint_id, saved_key)
    now = _unpack(flat[key]) if isinstance(flat[key], (bytes, bytearray)) else flat[key]
    world = dist.get_world_size() if dist.is_initialized() else 1
    if blob.get("mesh") is not None and now.get("mesh") is not None:
        check_mesh(checkpoint_id, len(saved_ranks), blob["mesh"], world, now["mesh"])
    saved_model = {k: tuple(md.size) for k, md in meta.items()
                   if isinstance(md, TensorStorageMetadata) and not k.startswith(top)}
    now_model = {k: tuple(v.shape) for k, v in flat.items()
                 if isinstance(v, torch.Tensor) and not k.startswith(top)}
    models = {k.split(".", 1)[0] for k in saved_model} | {k.split(".", 1)[0] for k in now_model}
    strip = (lambda k: k.split(".", 1)[1]) if len(models) == 1 else (lambda k: k)
    check_model(checkpoint_id, {strip(k): v for k, v in saved_model.items()},
                {strip(k): v for k, v in now_model.items()})
    saved_kinds, now_kinds = blob.get("kinds"), now.get("kinds")
    if saved_kinds and now_kinds:
        check_base(checkpoint_id, saved_kinds["base"], now_kinds["base"])
    if blob.get("reprs") is not None and now.get("reprs") is not None:
        check_replicators(checkpoint_id, blob["reprs"], now["reprs"])
    elif saved_kinds and now_kinds:
        check_replicators(checkpoint_id, saved_kinds["replicators"], now_kinds["replicators"])


def _read_entry(checkpoint_id: str | os.PathLike, key: str) -> dict:
    """One rank's replicator-chain entry of a DCP checkpoint, read by this rank alone."""
    import torch.distributed.checkpoint as dcp

    one: dict = {key: b""}
    dcp.load(one, checkpoint_id=checkpoint_id, no_dist=True)
    value = one[key]
    return _unpack(value) if isinstance(value, (bytes, bytearray)) else value


def load(state_dict: dict, *, checkpoint_id: str | os.PathLike, **kwargs) -> None:
    """``torch.distributed.checkpoint.load`` after :func:`check_load`: a checkpoint this job
    cannot resume raises :class:`~flexdemo.checkpoint.CheckpointMismatchError` (one line, old
    value against new) before DCP reads anything. Collective, like ``dcp.load``."""
    import torch.distributed.checkpoint as dcp

    check_load(state_dict, checkpoint_id)
    dcp.load(state_dict, checkpoint_id=checkpoint_id, **kwargs)
