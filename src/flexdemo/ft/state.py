"""What a fault-tolerant step keeps to undo itself, and what a joiner fetches from a peer.

*Undo.* A step whose commit vote fails is undone exactly: before it, :func:`snapshot` copies
everything the step may change (the rank-local parameters, the base optimizer's state, every
replicator's state, the step counters) and :func:`restore` puts it back bit for bit. DeMo's
error feedback thus gets back what it subtracted, and a DiLoCo sync runs again at the next
quorum. The cost is one copy of that state per step, written into the last undo copy's
tensors (no allocation once the state's shapes are settled). A restored copy lends only its
parameters' tensors: ``load_state_dict`` may keep the others as the live state.

*Healing.* A joiner fetches :func:`heal_state` from a healthy peer (the same rank of another
replica group): parameters, base optimizer state, step counters, and the replicators'
*shared* state (DiLoCo's global copy, outer optimizer and syncs). Per-replica state (the
momentum and error feedback of DeMo and of the Random, Striding and Slicing replicators, also
inside a DiLoCo exchange) starts from zero on the joiner:
it is the part of this replica's own gradients that it has not sent yet, and a copy of a
peer's would send that peer's residual a second time.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from ..dtensor import is_dtensor, local_tensor
from ..replicate import REPLICATORS, Replicator


def _clone(tree):
    """A deep copy with every tensor cloned (detached)."""
    return copy.deepcopy(tree)


_ATOMIC = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
"""Leaf types that :func:`copy.deepcopy` returns as they are: the undo copy keeps them without
going through it (a step's state holds dozens: steps, flags, hyperparameters)."""


def _fits(old: Any, new: torch.Tensor) -> bool:
    """Whether tensor ``old`` can hold a copy of ``new`` (a DTensor: of the same layout)."""
    if (type(old) is not type(new) or old.shape != new.shape or old.dtype != new.dtype
            or old.device != new.device):
        return False
    if is_dtensor(new):  # (so is ``old``, of the same type): its local shard is copied
        return (getattr(old, "placements", None) == getattr(new, "placements", None)
                and getattr(old, "device_mesh", None) == getattr(new, "device_mesh", None)
                and local_tensor(old).shape == local_tensor(new).shape)
    return True


def _copy_tree(tree: Any, spare: Any, dst: list[torch.Tensor], src: list[torch.Tensor]) -> Any:
    """``tree`` (dicts, lists and tuples of tensors and plain values) with every tensor
    copied: into ``spare``'s tensor at the same place where it fits (queued on ``dst`` /
    ``src`` for one batched copy), else cloned; other values deep-copied."""
    kind = type(tree)
    if kind in _ATOMIC:  # as deepcopy gives them back
        return tree
    if kind is torch.Tensor and type(spare) is torch.Tensor:  # the common case: _fits inlined
        if (spare.shape == tree.shape and spare.dtype == tree.dtype
                and spare.device == tree.device):
            dst.append(spare)
            src.append(tree.detach())
            return spare
    if isinstance(tree, torch.Tensor):
        if isinstance(spare, torch.Tensor) and _fits(spare, tree):
            dst.append(local_tensor(spare))
            src.append(local_tensor(tree).detach())
            return spare
        out = tree.detach().clone()
        return out.requires_grad_() if tree.requires_grad else out
    if kind is dict:
        keyed: dict = spare if type(spare) is dict else {}
        return {k: _copy_tree(v, keyed.get(k), dst, src) for k, v in tree.items()}
    if kind is list or kind is tuple:
        olds = spare if type(spare) is kind and len(spare) == len(tree) else (None,) * len(tree)
        return kind([_copy_tree(v, o, dst, src) for v, o in zip(tree, olds)])
    return copy.deepcopy(tree)


def copy_into(tree: Any, spare: Any = None) -> Any:
    """A copy of ``tree`` as :func:`copy.deepcopy` makes it (tensors detached), written into
    the tensors of ``spare`` (an earlier copy of the same structure, no longer needed and
    aliasing no live state) wherever they fit, in one batched copy."""
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    out = _copy_tree(tree, spare, dst, src)
    if dst:
        with torch.no_grad():
            torch._foreach_copy_(dst, src)
    return out


def _supported_names() -> str:
    """The registered replicators that declare themselves fault tolerant."""
    names = []
    for factory in REPLICATORS.values():
        cls = factory if isinstance(factory, type) and issubclass(factory, Replicator) else None
        if cls is not None and cls.fault_tolerant and cls.name not in names:
            names.append(cls.name)
    return ", ".join(names)


def check_supported(rep: Replicator) -> None:
    """Refuse, in one line, replicators not (yet) made fault tolerant
    (:meth:`~flexdemo.replicate.Replicator.fault_tolerance_problem`)."""
    if not rep.fault_tolerant:
        raise ValueError(f"fault tolerance supports the replicators {_supported_names()}; "
                         f"{rep.name!r} is not supported yet")
    problem = rep.fault_tolerance_problem()
    if problem is not None:
        raise ValueError(problem)
    for part in rep.inner_replicators():
        check_supported(part)


def rebind(rep: Replicator) -> None:
    """Re-read the size of ``rep``'s group and its rank (a quorum may change both); buffers
    whose size depends on them are rebuilt, state is kept."""
    rep.rebind()


# ---------------------------------------------------------------------- undo
@dataclass
class Snapshot:
    """The state of one rank before a step (see :func:`snapshot`). ``restored``: put back
    by :func:`restore`, after which only ``params`` are its own (the base optimizer's and the
    replicators' ``load_state_dict`` may have kept the other tensors as live state)."""

    params: list[torch.Tensor]
    base: dict
    replicators: list[dict]
    steps: int
    skipped_steps: int
    restored: bool = False


def snapshot(opt, spare: Snapshot | None = None) -> Snapshot:
    """Copy what ``opt.step()`` may change on this rank. ``spare``: a snapshot no longer
    needed, whose tensors are written over where they still fit (no new allocation): all of
    them, or after a :func:`restore` of it only its parameters' copies."""
    with torch.no_grad():
        params = copy_into([local_tensor(p).detach() for p in opt.params],
                           None if spare is None else spare.params)
    own = spare if spare is not None and not spare.restored else None
    base = copy_into(opt.base.state_dict(), None if own is None else own.base)
    olds = [None] * len(opt.replicators) if own is None else own.replicators
    reps = [copy_into(r.live_state(), old) for r, old in zip(opt.replicators, olds)]
    return Snapshot(params, base, reps, opt.steps, opt.skipped_steps)


def restore(opt, snap: Snapshot) -> None:
    """Put ``snap`` back: the step it was taken before never happened (bitwise). Marks it
    ``restored``: a later :func:`snapshot` reuses only its parameters' copies."""
    snap.restored = True
    with torch.no_grad():
        torch._foreach_copy_([local_tensor(p) for p in opt.params], snap.params)
    opt.base.load_state_dict(snap.base)
    opt.share_state()
    for r, s in zip(opt.replicators, snap.replicators):
        r.load_state_dict(s)
    opt.steps, opt.skipped_steps = snap.steps, snap.skipped_steps


# ---------------------------------------------------------------------- healing
def shared_state(rep: Replicator) -> dict:
    """The part of ``rep``'s state that is equal on every replica (cloned)."""
    return rep.shared_state()


def load_shared_state(rep: Replicator, state: dict) -> None:
    """Load a peer's :func:`shared_state`; per-replica state starts from zero."""
    rep.load_shared_state(state)


def heal_state(opt) -> dict:
    """What a joiner fetches from this rank (cloned: the peer may step on meanwhile)."""
    with torch.no_grad():
        params = [local_tensor(p).detach().clone() for p in opt.params]
    return {"params": params, "base": _clone(opt.base.state_dict()), "steps": opt.steps,
            "skipped_steps": opt.skipped_steps,
            "replicators": [shared_state(r) for r in opt.replicators]}


def load_heal_state(opt, state: dict) -> None:
    """Become the peer whose :func:`heal_state` this is (per-replica state zeroed)."""
    if len(state["params"]) != len(opt.params):
        raise ValueError(f"the peer has {len(state['params'])} parameters, this replica "
                         f"{len(opt.params)}: replica groups must train the same model")
    with torch.no_grad():
        for p, v in zip(opt.params, state["params"]):
            local = local_tensor(p)
            if local.shape != v.shape:
                raise ValueError(f"the peer's parameter shard has shape {tuple(v.shape)}, "
                                 f"this one {tuple(local.shape)}: nodes must have as many "
                                 "ranks and the same model")
            local.copy_(v)
    opt.base.load_state_dict(state["base"])
    opt.share_state()
    opt.steps, opt.skipped_steps = int(state["steps"]), int(state["skipped_steps"])
    for r, s in zip(opt.replicators, state["replicators"]):
        load_shared_state(r, s)
