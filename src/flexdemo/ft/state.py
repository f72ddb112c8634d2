"""What a fault-tolerant step keeps to undo itself, and what a joiner fetches from a peer.

*Undo.* A step whose commit vote fails is undone exactly: before it, :func:`snapshot` copies
everything the step may change (the rank-local parameters, the base optimizer's state, every
replicator's state, the step counters) and :func:`restore` puts it back bit for bit. DeMo's
error feedback thus gets back what it subtracted, and a DiLoCo sync runs again at the next
quorum. The cost is one copy of that state per step.

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

import torch

from ..dtensor import local_tensor
from ..replicate import REPLICATORS, Replicator


def _clone(tree):
    """A deep copy with every tensor cloned (detached)."""
    return copy.deepcopy(tree)


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
    """The state of one rank before a step (see :func:`snapshot`)."""

    params: list[torch.Tensor]
    base: dict
    replicators: list[dict]
    steps: int
    skipped_steps: int


def _replicator_copy(rep: Replicator) -> dict:
    """``rep``'s state, copied once: a ``state_dict()`` that clones its tensors already
    (:attr:`~flexdemo.replicate.Replicator.state_dict_copies`) is kept; the others' may hold
    references (DiLoCo's outer optimizer)."""
    if rep.state_dict_copies:
        return rep.state_dict()
    return _clone(rep.state_dict())


def snapshot(opt, spare: list[torch.Tensor] | None = None) -> Snapshot:
    """Copy what ``opt.step()`` may change on this rank. ``spare``: the parameters' copies of
    a snapshot no longer needed, written over when they still fit (no new allocation)."""
    with torch.no_grad():
        live = [local_tensor(p).detach() for p in opt.params]
        if spare is not None and len(spare) == len(live) and all(
                s.shape == t.shape and s.dtype == t.dtype and s.device == t.device
                for s, t in zip(spare, live)):
            torch._foreach_copy_(spare, live)
            params = spare
        else:
            params = [t.clone() for t in live]
    return Snapshot(params, _clone(opt.base.state_dict()),
                    [_replicator_copy(r) for r in opt.replicators], opt.steps,
                    opt.skipped_steps)


def restore(opt, snap: Snapshot) -> None:
    """Put ``snap`` back: the step it was taken before never happened (bitwise)."""
    with torch.no_grad():
        for p, v in zip(opt.params, snap.params):
            local_tensor(p).copy_(v)
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
