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

from ..replicate import (
    DeMoReplicator,
    DiLoCoReplicator,
    FullReplicator,
    RandomReplicator,
    Replicator,
    SlicingReplicator,
    StridingReplicator,
)
from ..replicate.base import Agreement
from ..transport import group_rank, group_size

SUBSET = (RandomReplicator, StridingReplicator, SlicingReplicator)
SUPPORTED = (FullReplicator, DeMoReplicator, DiLoCoReplicator, *SUBSET)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _clone(tree):
    """A deep copy with every tensor cloned (detached)."""
    return copy.deepcopy(tree)


def check_supported(rep: Replicator) -> None:
    """Refuse, in one line, replicators not (yet) made fault tolerant."""
    if not isinstance(rep, SUPPORTED):
        names = ", ".join(c.name for c in SUPPORTED)
        raise ValueError(f"fault tolerance supports the replicators {names}; {rep.name!r} is "
                         "not supported yet")
    if isinstance(rep, DeMoReplicator) and rep.overlap == "delayed":
        raise ValueError("fault tolerance does not support DeMo's delayed mode "
                         "(overlap='delayed') yet; use the synchronous mode")
    if isinstance(rep, DiLoCoReplicator) and rep.tau:
        raise ValueError("fault tolerance does not support DiLoCo syncs that overlap later "
                         f"steps (tau={rep.tau}) yet: a quorum change would meet a sync in "
                         "flight; use tau=0")
    for ex in getattr(rep, "exchanges", ()):
        check_supported(ex)


def rebind(rep: Replicator) -> None:
    """Re-read the size of ``rep``'s group and its rank (a quorum may change both); buffers
    whose size depends on them are rebuilt, state is kept."""
    world, rank = group_size(rep.group), group_rank(rep.group)
    if (world, rank) != (rep.world, rep.rank):
        rep.world, rep.rank = world, rank
        rep.agreement = Agreement(rep.name, rank, world, rep.device)
        if isinstance(rep, FullReplicator):
            rep._setup_state()  # the fp32 bucket's trailer holds 2 values per replica
        elif isinstance(rep, SUBSET):  # the same trailer; the momenta stay
            rep._bucket = torch.zeros(rep._total + Agreement.trailer_size(world),
                                      dtype=torch.float32, device=rep.device)
    for ex in getattr(rep, "exchanges", ()):
        rebind(ex)


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
    """``rep``'s state, copied once: DeMo's and the subset replicators' ``state_dict()``
    clones its tensors already; the others' may hold references (DiLoCo's outer optimizer)."""
    if isinstance(rep, (DeMoReplicator, *SUBSET)):
        return rep.state_dict()
    return _clone(rep.state_dict())


def snapshot(opt) -> Snapshot:
    """Copy what ``opt.step()`` may change on this rank."""
    with torch.no_grad():
        params = [_local(p).detach().clone() for p in opt._params]
    return Snapshot(params, _clone(opt.base.state_dict()),
                    [_replicator_copy(r) for r in opt.replicators], opt.steps,
                    opt.skipped_steps)


def restore(opt, snap: Snapshot) -> None:
    """Put ``snap`` back: the step it was taken before never happened (bitwise)."""
    with torch.no_grad():
        for p, v in zip(opt._params, snap.params):
            _local(p).copy_(v)
    opt.base.load_state_dict(snap.base)
    opt._share_state()
    for r, s in zip(opt.replicators, snap.replicators):
        r.load_state_dict(s)
    opt.steps, opt.skipped_steps = snap.steps, snap.skipped_steps


# ---------------------------------------------------------------------- healing
def shared_state(rep: Replicator) -> dict:
    """The part of ``rep``'s state that is equal on every replica (cloned)."""
    if isinstance(rep, DiLoCoReplicator):
        sd = rep.state_dict()
        sd.pop("stats", None)
        sd["exchanges"] = [shared_state(ex) for ex in rep.exchanges]
        return _clone(sd)
    return {}  # Full: none; DeMo, Random, Striding, Slicing: their momenta are per replica


def load_shared_state(rep: Replicator, state: dict) -> None:
    """Load a peer's :func:`shared_state`; per-replica state starts from zero."""
    if isinstance(rep, DiLoCoReplicator):
        own = rep.state_dict()
        own.update({k: v for k, v in state.items() if k != "exchanges"})
        rep.load_state_dict(own)
        for ex, s in zip(rep.exchanges, state["exchanges"]):
            load_shared_state(ex, s)
    elif isinstance(rep, DeMoReplicator):
        with torch.no_grad():
            for d in rep.delta:
                d.zero_()
        rep._inflight = rep._pending = None
    elif isinstance(rep, SUBSET):  # their momenta (error feedback) are per replica too
        with torch.no_grad():
            torch._foreach_zero_(rep.buffers)
    rep._withheld = None


def heal_state(opt) -> dict:
    """What a joiner fetches from this rank (cloned: the peer may step on meanwhile)."""
    with torch.no_grad():
        params = [_local(p).detach().clone() for p in opt._params]
    return {"params": params, "base": _clone(opt.base.state_dict()), "steps": opt.steps,
            "skipped_steps": opt.skipped_steps,
            "replicators": [shared_state(r) for r in opt.replicators]}


def load_heal_state(opt, state: dict) -> None:
    """Become the peer whose :func:`heal_state` this is (per-replica state zeroed)."""
    if len(state["params"]) != len(opt._params):
        raise ValueError(f"the peer has {len(state['params'])} parameters, this replica "
                         f"{len(opt._params)}: replica groups must train the same model")
    with torch.no_grad():
        for p, v in zip(opt._params, state["params"]):
            local = _local(p)
            if local.shape != v.shape:
                raise ValueError(f"the peer's parameter shard has shape {tuple(v.shape)}, "
                                 f"this one {tuple(local.shape)}: nodes must have as many "
                                 "ranks and the same model")
            local.copy_(v)
    opt.base.load_state_dict(state["base"])
    opt._share_state()
    opt.steps, opt.skipped_steps = int(state["steps"]), int(state["skipped_steps"])
    for r, s in zip(opt.replicators, state["replicators"]):
        load_shared_state(r, s)
