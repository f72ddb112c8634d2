"""The DeToNATION optimizer: shard-local gradients -> replicators -> any torch optimizer."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import required

from . import memory
from .buffers import BUFFER_POLICIES, BufferSync
from .checkpoint import dcp as _dcp
from .consistency import check_same_settings
from .decay import NoDecay, no_decay_flags
from .dtensor import local_tensor
from .lion import Lion
from .mesh import guard_exit
from .muon import MuonAdamW
from .replicate import DeMoReplicator, NonFiniteGradientError, Replicator, make_replicator
from .replicate.agreement import mark_nonfinite, nonfinite_flag
from .transport import Transport, group_size, transport_for

if TYPE_CHECKING:
    from .ft.config import FaultTolerance

BASE_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "lion": Lion,
    "muon": MuonAdamW,
}
# settings only Muon takes: given to another base optimizer, they are refused by name
MUON_ONLY = ("muon_params", "ns_steps", "adjust_lr_fn", "ns_mode", "ns_batch_numel",
             "ns_dtype")


def _named(params: list) -> bool:
    """Whether ``params`` are ``(name, tensor)`` pairs (``model.named_parameters()``)."""
    return bool(params) and all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)
                                for x in params)


def make_base_optimizer(base, params, lr: float, *, no_decay: NoDecay = None,
                        **kwargs) -> torch.optim.Optimizer:
    """A base optimizer from a name (``"sgd"``, ``"adamw"``, ``"adam"``, ``"lion"``,
    ``"muon"``) or a factory. ``params`` may be ``(name, tensor)`` pairs: ``"muon"`` uses the
    names to keep embeddings and the head on AdamW; the others and factories get the tensors.
    ``no_decay`` (:mod:`flexdemo.decay`): those parameters go in a group of their own with
    ``weight_decay`` 0 (a factory then receives the groups)."""
    params = list(params)
    if isinstance(base, str) and base.lower() == "muon":
        if no_decay is not None and no_decay is not False:
            kwargs["no_decay"] = no_decay  # MuonAdamW splits both of its parts
    elif no_decay is not None and no_decay is not False:
        if any(isinstance(x, dict) for x in params):
            raise ValueError("no_decay splits a flat list of parameters; with parameter "
                             "groups, give each group its own weight_decay instead")
        pairs = params if _named(params) else [(None, p) for p in params]
        off = no_decay_flags(no_decay, pairs)
        groups = ({"params": [p for (_, p), f in zip(pairs, off) if not f]},
                  {"params": [p for (_, p), f in zip(pairs, off) if f], "weight_decay": 0.0})
        params = [g for g in groups if g["params"]]
    elif _named(params):
        params = [p for _, p in params]
    if isinstance(base, str):
        cls = BASE_OPTIMIZERS.get(base.lower())
        if cls is None:
            raise ValueError(f"unknown base optimizer {base!r}; choose one of "
                             f"{sorted(BASE_OPTIMIZERS)} or pass a factory params -> Optimizer")
        stray = [k for k in MUON_ONLY if k in kwargs and cls is not MuonAdamW]
        if stray:
            raise ValueError(f"{', '.join(stray)}: a setting of optimizer 'muon', not of "
                             f"{base!r}; use optimizer='muon' or drop it")
        kwargs.setdefault("weight_decay", 0.0)
        try:
            factory: Callable[..., torch.optim.Optimizer] = cls  # (Optimizer itself takes no lr)
            return factory(params, lr=lr, **kwargs)
        except TypeError as e:
            if "keyword argument" not in str(e):
                raise
            raise ValueError(f"base optimizer {base!r} ({cls.__name__}): {e}; see "
                             f"help({cls.__module__}.{cls.__name__}) for its settings") from None
    if callable(base):
        opt = base(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"the base optimizer factory returned {type(opt).__name__}, "
                            "not a torch.optim.Optimizer")
        return opt
    raise TypeError(f"base optimizer must be a name or a factory, got {type(base).__name__}")


def check_group_on_mesh(rep: Replicator, mesh) -> None:
    """A replicator's group must only join ranks that hold the same shard as this rank."""
    if rep.group is None or not dist.is_initialized() or isinstance(rep.group, Transport):
        return
    coords = {}
    for i, row in enumerate(mesh.mesh.tolist()):
        for j, r in enumerate(row):
            coords[int(r)] = (i, j)
    me = dist.get_rank()
    ranks = dist.get_process_group_ranks(rep.group)
    odd = [r for r in ranks if coords.get(r, (None, None))[1] != coords[me][1]]
    if odd:
        raise ValueError(
            f"{rep.name}: the replication group {ranks} does not match the mesh: ranks {odd} "
            f"hold another shard than rank {me} (shard index {coords[me][1]}). A replication "
            "group must join ranks along the mesh's 'replicate' dimension, e.g. "
            "mesh['replicate'].get_group()")


def share_nonfinite(grads: list, group, device: torch.device) -> None:
    """Mark every shard of a replica non-finite when one is: one tiny all-reduce over the
    (fast, intra-node) shard group (a process group or its :class:`Transport`), marked in-band
    on the device without a host read, so that each replication group's own agreement then
    reports it on every rank in this step."""
    flag = nonfinite_flag(grads, device).to(torch.float32).reshape(1)
    transport_for(group).all_reduce_sum_(flag)  # > 0 when some shard's flag is set
    for g in grads:
        if g is not None and g.numel():
            part = g.view(-1)[:1] if g.is_contiguous() else g
            part.copy_(torch.where(flag > 0, float("nan"), part))
            return


class DeToNATION(torch.optim.Optimizer):
    """Replicate shard-local gradients with a chain of replicators, then step a base optimizer.

    Args:
        params: parameters (or parameter groups) to optimise; FSDP2 DTensors are fine.
            ``model.named_parameters()`` lets ``base="muon"`` keep embeddings and the head
            on AdamW (:mod:`flexdemo.muon`).
        replicators: one replicator or a list (names or instances). Each one's output feeds
            the next; the last output becomes ``param.grad`` for the base optimizer.
        base: base optimizer name (``"sgd"``, ``"adamw"``, ``"adam"``, ``"lion"``, ``"muon"``:
            Muon on hidden matrices and AdamW on the rest) or a factory
            ``params -> torch.optim.Optimizer``.
        lr: learning rate (shared with the base optimizer's param groups).
        weight_decay: decoupled weight decay, ``p *= 1 - lr * weight_decay`` before the base
            step (give the base optimizer none of its own).
        no_decay: parameters that get no weight decay, neither ``weight_decay`` nor the base
            optimizer's own (:mod:`flexdemo.decay`): ``True`` (norms and biases), a rule
            ``(name, param) -> bool`` or a list of names (both need
            ``model.named_parameters()``). They form base parameter groups of their own.
        group: default process group of replicators that were not given one (the mesh's
            replicate dimension under :func:`flexdemo.prepare`; the world otherwise).
        nonfinite: ``"raise"`` (default) raises :class:`NonFiniteGradientError` on every
            replica when any replica's gradient is NaN/Inf; ``"skip"`` skips the whole step on
            every replica instead and counts it in ``skipped_steps``.
        base_kwargs: extra arguments for a base optimizer given by name.
        mesh: the ("replicate", "shard") mesh, if any: every replicator's group is checked to
            join only ranks holding this rank's shard.
        fault_tolerance: a :class:`flexdemo.FaultTolerance`: what is built is then an
            :class:`~flexdemo.ft.optimizer.ElasticOptimizer` holding this optimizer, which
            replicates over the torchft replica groups of each quorum instead of ``group``
            (:mod:`flexdemo.ft`). The optimizer itself knows nothing of quorums.
    """

    #: ``None``: a plain optimizer steps alone (its :class:`~flexdemo.ft.optimizer.
    #: ElasticOptimizer` wrapper's is its session)
    fault_tolerance: None = None

    def __new__(cls, *args: Any, fault_tolerance: FaultTolerance | None = None,
                **kwargs: Any) -> Any:
        if fault_tolerance is None:
            return super().__new__(cls)
        from .ft.optimizer import ElasticOptimizer  # the composition: session around optimizer

        return ElasticOptimizer.build(cls, *args, fault_tolerance=fault_tolerance, **kwargs)

    def __init__(self, params: Iterable, replicators: Replicator | str | Sequence = "demo",
                 base: str | Callable = "sgd", lr: float = 1e-3, *, weight_decay: float = 0.0,
                 group: dist.ProcessGroup | Transport | None = None, nonfinite: str = "raise",
                 base_kwargs: dict | None = None, mesh=None,
                 fault_tolerance: FaultTolerance | None = None,
                 no_decay: NoDecay = None) -> None:
        if fault_tolerance is not None:  # __new__ builds the ElasticOptimizer from it
            raise TypeError("fault_tolerance= goes to DeToNATION(...) itself, which then "
                            "builds an ElasticOptimizer, not to DeToNATION.__init__")
        if not isinstance(lr, (int, float)) or not lr >= 0.0:
            raise ValueError(f"lr must be a number >= 0, got {lr!r}")
        if not isinstance(weight_decay, (int, float)) or not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be a number >= 0, got {weight_decay!r}")
        if nonfinite not in ("raise", "skip"):
            raise ValueError(f"nonfinite must be 'raise' or 'skip', got {nonfinite!r}")
        params = list(params)
        named = params if _named(params) else None  # model.named_parameters(): for "muon"
        params = [p for _, p in named] if named else params
        if base_kwargs is not None and not isinstance(base_kwargs, dict):
            raise TypeError(f"base_kwargs must be a dict of settings, got "
                            f"{type(base_kwargs).__name__}")
        if base_kwargs and "lr" in base_kwargs:
            raise ValueError("the learning rate goes in lr=..., not in the base optimizer's "
                             "settings (optimizer_kwargs / base_kwargs)")
        if base_kwargs and "no_decay" in base_kwargs:
            raise ValueError("no_decay goes to prepare(..., no_decay=...) or DeToNATION(..., "
                             "no_decay=...), not in optimizer_kwargs / base_kwargs")
        self.base = make_base_optimizer(base, named or params, lr, no_decay=no_decay,
                                        **(base_kwargs or {}))
        # the base's defaults too: LR schedulers look for momentum or betas there (OneCycleLR
        # and CyclicLR cycle them); what they write reaches the base by the shared groups
        defaults = {k: v for k, v in self.base.defaults.items()
                    if v is not required}  # (a default no group may lack: not ours)
        super().__init__(params, {**defaults, "lr": lr, "flexdemo_weight_decay": weight_decay})
        self._sealed = True  # add_param_group refuses from here on
        self.mesh = mesh
        self.buffer_sync: BufferSync | None = None
        self.buffer_policy = "none"
        pairs = named or [(None, p) for p in params if not isinstance(p, dict)]
        exempt = {id(p) for (_, p), off in zip(pairs, no_decay_flags(no_decay, pairs)) if off}
        for g in self.base.param_groups:
            off = [id(p) in exempt for p in g["params"]]
            if any(off) and not all(off):
                raise ValueError("the base optimizer puts parameters with and without weight "
                                 "decay (no_decay) in one group; a factory must keep the "
                                 "groups it receives")
            g.setdefault("flexdemo_weight_decay", 0.0 if any(off) else weight_decay)
            if g["flexdemo_weight_decay"] and g.get("weight_decay", 0.0):
                raise ValueError("weight decay is given twice (to the base optimizer and as "
                                 "decoupled weight_decay); give it to one of them")
        self.param_groups = self.base.param_groups  # shared: LR schedulers reach the base
        self.state = self.base.state
        self.nonfinite = nonfinite
        self.skipped_steps = 0
        self._step_workspace: int | None = None  # measured under flexdemo.LiveBytes
        self._last_skipped = False
        self._memory_counts: tuple | None = None  # (when counted, memory_stats' counts)
        self._memory_epoch = 0  # a load changes it
        self.steps = 0
        if not isinstance(replicators, (list, tuple)):
            replicators = [replicators]
        self.replicators: list[Replicator] = [make_replicator(r) for r in replicators]
        if not self.replicators:
            raise ValueError("at least one replicator is needed (use 'none' for no replication)")
        if len({id(r) for r in self.replicators}) != len(self.replicators):
            raise ValueError("the same replicator instance appears twice in the chain")
        self._params = [p for g in self.param_groups for p in g["params"]]
        if not self._params:
            raise ValueError("the optimizer got no parameters")
        devices = {local_tensor(p).device for p in self._params}
        if len(devices) != 1:
            raise ValueError(f"parameters live on several devices {sorted(map(str, devices))}")
        device = devices.pop()
        if dist.is_initialized():
            guard_exit()
        if group is None and dist.is_initialized():
            group = dist.group.WORLD
        self.default_group = group
        self.share_state()
        locals_ = [local_tensor(p) for p in self._params]
        shapes = [t.shape for t in locals_]
        for r in self.replicators:
            r.setup(shapes, device, group, params=locals_, nonfinite=nonfinite)
            if mesh is not None:
                check_group_on_mesh(r, mesh)
        # the other shards of this replica must learn of a non-finite gradient too
        shard_group = (mesh["shard"].get_group()
                       if mesh is not None and mesh["shard"].size() > 1 else None)
        self._shard_group = None if shard_group is None else transport_for(shard_group)
        check_same_settings(self, device)  # ranks built alike, or one error on every rank

    # ------------------------------------------------------------------ stepping
    @torch.no_grad()
    def step(self, closure=None):
        """One step: the closure (if any), the replicators' exchange, the base step. Under
        fault tolerance the :class:`~flexdemo.ft.optimizer.ElasticOptimizer` calls it once
        per step, inside the quorum and before the commit vote."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        mem = memory.active()  # an exact account of the step's memory, when one is kept
        start = mem.reset_peak() if mem is not None else 0
        grads, lrs = [], []
        for pg in self.param_groups:
            for p in pg["params"]:
                grads.append(None if p.grad is None else local_tensor(p.grad))
                lrs.append(float(pg["lr"]))
        if len(grads) != len(self._params):
            raise RuntimeError("parameters were added after construction; build a new optimizer")
        data = list(grads)
        if self._shard_group is not None:
            share_nonfinite(data, self._shard_group, local_tensor(self._params[0]).device)
        errors = []
        for rep in self.replicators:
            try:
                data = rep(data, lrs, self.steps)
            except NonFiniteGradientError as e:
                # the rest of the chain still runs, its inputs marked non-finite, so that the
                # groups of later replicators learn of it in this step too (no rank waits)
                errors.append(e)
                mark_nonfinite(data)
        agreed = [e for e in errors if not e.local]
        if agreed:  # every rank of the chain's groups knows: nothing is left to report later
            for rep in self.replicators:
                rep.reset_withheld()
            if self.nonfinite == "raise":
                raise agreed[0]
        # e.local alone: only this rank knows (a step without exchange): it skips alone, and
        # under "raise" its next exchange tells every rank (see replicate.base)
        skipped = bool(errors)
        if not skipped:
            for g, out in zip(grads, data):
                if g is not None and out is not g:
                    assert out is not None, "a replicator dropped a gradient"
                    g.copy_(out)
            for group in self.param_groups:
                wd = group.get("flexdemo_weight_decay", 0.0)
                if wd:
                    ps = [local_tensor(p) for p in group["params"] if p.grad is not None]
                    if ps:
                        torch._foreach_mul_(ps, 1.0 - group["lr"] * wd)
            self.base.step()
        try:  # also after a skipped step: syncs (DiLoCo) follow the step count on every rank
            for rep in self.replicators:
                rep.after_step(self.steps)
        except NonFiniteGradientError:
            if self.nonfinite == "raise":  # a step skipped here is counted before the error
                self.skipped_steps += skipped
                self._last_skipped = skipped
                self.steps += 1
                raise
            skipped = True
        self.skipped_steps += skipped
        self._last_skipped = skipped
        # on every rank alike (a skipped step too), so the buffers' collective always pairs up
        if self.buffer_sync is not None and self.buffer_policy == "mean" and (
                self._buffers_every_step
                or any(r.stats.last_collectives for r in self.replicators)):
            self.buffer_sync()
        self.steps += 1
        self._step_workspace = None if mem is None else mem.peak - start
        return loss

    def count_tokens(self, n: int | float | torch.Tensor) -> None:
        """Report the tokens of this step's batch (an int, or a tensor on the parameters'
        device: no host read), before :meth:`step`, to the replicators that weigh by them
        (DiLoCo with ``pace=Pace(weights="tokens")``, :mod:`flexdemo.replicate.pace`;
        ``FullReplicator`` and ``DeMoReplicator`` with ``weights="tokens"``,
        :mod:`flexdemo.replicate.weights`) in the optimizer's own chain; the others ignore
        it."""
        for rep in self.replicators:
            count = getattr(rep, "count_tokens", None)
            if count is not None:
                count(n)

    # ------------------------------------------------------------------ buffers, replicas
    @property
    def params(self) -> list:
        """The parameters, in the order of the state's indices (all groups, flat)."""
        return self._params

    def share_state(self) -> None:
        """Share the base optimizer's ``param_groups`` and ``state`` (torch replaces them on
        load), with an entry (possibly empty) for every parameter. A non-empty ``state`` keeps
        torch's ``get_state_dict`` from running a zero-lr ``step()`` of its own, which would
        drive the replicators (and their collectives) and decay DeMo's momentum."""
        self.param_groups = self.base.param_groups
        self.state = self.base.state
        for p in self._params:
            self.state.setdefault(p, {})

    def sync_buffers(self, module: nn.Module, policy: str = "mean",
                     group: dist.ProcessGroup | None = None) -> None:
        """Apply a buffer policy to ``module``'s buffers (:mod:`flexdemo.buffers`):
        ``"mean"`` averages floating buffers over ``group`` (default: every rank) on each step
        where the replicators exchange, in one collective; ``"none"`` leaves them per rank.
        Either way they are saved per rank where replicas may differ. ``prepare()`` calls it."""
        if policy not in BUFFER_POLICIES:
            raise ValueError(f"buffer policy must be one of {BUFFER_POLICIES}, got {policy!r}")
        if group is None and dist.is_initialized():
            group = dist.group.WORLD
        self.buffer_sync = BufferSync(module.buffers(), group)
        self.buffer_policy = policy
        # with a single replica nothing is exchanged: keep the ranks of that replica together
        self._buffers_every_step = all(r.world <= 1 for r in self.replicators)

    def replicas_identical(self) -> bool:
        """Whether the replicators keep the parameters of all replicas bitwise identical at
        every step (from their kinds and schedules; ``False`` when unsure). Decides whether
        checkpoints store base state and parameters once or per replica."""
        n = group_size(self.default_group)
        if n <= 1:
            return True
        return all(r.keeps_replicas_identical(n) for r in self.replicators)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused once built: the replicators were set up for the parameters given at
        construction (their state, payloads and agreement are laid out for them)."""
        if not getattr(self, "_sealed", False):  # Optimizer.__init__ adds the first groups
            super().add_param_group(param_group)
            return
        raise ValueError("DeToNATION.add_param_group: the replicators are set up for the "
                         "parameters given at construction; build the optimizer with every "
                         "parameter from the start (prepare(model) takes all of the model's; "
                         "frozen ones without gradients are left alone) and change a group's "
                         "settings in opt.param_groups")

    # ------------------------------------------------------------------ accounting
    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent over all steps, all replicators."""
        return sum(r.stats.bytes_sent for r in self.replicators)

    @property
    def bytes_received(self) -> int:
        return sum(r.stats.bytes_received for r in self.replicators)

    @property
    def comm_seconds(self) -> float:
        return sum(r.stats.seconds for r in self.replicators)

    @property
    def data_transmit(self) -> int:
        """Bytes this rank sent in the last step (the original DeMo's counter)."""
        return sum(r.stats.last_bytes_sent for r in self.replicators)

    @property
    def data_receive(self) -> int:
        """Bytes this rank received in the last step (the original DeMo's counter)."""
        return sum(r.stats.last_bytes_received for r in self.replicators)

    def last_step_stats(self) -> dict:
        """Bytes sent/received and communication seconds of the last step, all replicators
        (the replication link); ``clipped_contributions``: the peers' parts over the bound
        on each peer's part that this rank scaled down so far (:mod:`flexdemo.replicate.bound`). A
        base optimizer that talks over the shard group (``"muon"`` on sharded matrices) adds
        its intra-node figures as ``shard_bytes_sent``, ``shard_bytes_received`` and
        ``shard_seconds``. (Under fault tolerance the
        :class:`~flexdemo.ft.optimizer.ElasticOptimizer` adds the session's figures.)"""
        rs = self.replicators
        out: dict = {
            "bytes_sent": sum(r.stats.last_bytes_sent for r in rs),
            "bytes_received": sum(r.stats.last_bytes_received for r in rs),
            "comm_seconds": sum(r.stats.last_seconds for r in rs),
            "collectives": sum(r.stats.last_collectives for r in rs),
            # opt.steps counts every step taken, skipped ones too (schedules and syncs follow it)
            "skipped": self._last_skipped, "skipped_steps": self.skipped_steps,
            # peers' parts over the bound (replicate.bound) scaled down, on this rank, so far
            "clipped_contributions": sum(r.clipped_contributions() for r in rs),
        }
        shard = getattr(self.base, "stats", None)
        if shard is not None:
            out.update(shard_bytes_sent=shard.last_bytes_sent,
                       shard_bytes_received=shard.last_bytes_received,
                       shard_seconds=shard.last_seconds)
        for r in rs:  # "auto": what it runs now (None while it measures) and its decisions
            if hasattr(r, "decision") and hasattr(r, "history"):
                out.update(auto_choice=None if r.decision is None else r.decision.label,
                           auto_history=list(r.history),
                           auto_retune_seconds=list(getattr(r, "retune_seconds", [])))
        out.update(self.memory_stats())
        return out

    def memory_stats(self) -> dict:
        """Bytes this rank holds for the optimizer: ``state_bytes`` (the persistent state:
        the base optimizer's and every replicator's, what a checkpoint keeps),
        ``workspace_bytes`` (buffers the replicators keep between steps besides it) and, for
        a step taken under :class:`flexdemo.memory.LiveBytes`, ``step_workspace_bytes``
        (the step's peak above the bytes live at its start). Exact, counted per storage;
        recounted while the first steps create buffers, after a load and when a replicator's
        group changes, else the count is kept (a walk over every buffer costs milliseconds)."""
        key = (min(self.steps, 3), self._memory_epoch, len(self.base.state),
               tuple(r.world for r in self.replicators))
        if self._memory_counts is None or self._memory_counts[0] != key:
            state = [self.base.state] + [r.state_tensors() for r in self.replicators]
            held = memory.storage_bytes(state)
            known = memory.storage_bytes([state, self._params])  # parameters: not workspace
            both = memory.storage_bytes([state, self._params,
                                         memory.reachable_tensors(self.replicators)])
            self._memory_counts = (key, {"state_bytes": held, "workspace_bytes": both - known})
        out = dict(self._memory_counts[1])
        if self._step_workspace is not None:
            out["step_workspace_bytes"] = self._step_workspace
        return out

    def comm_stats(self) -> list[dict]:
        """Per-replicator running totals (``CommStats`` as dicts), in chain order."""
        return [{"replicator": repr(r), **r.stats.as_dict()} for r in self.replicators]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The state in torch's layout (``state`` per parameter, ``param_groups``), with
        per-replica state keyed per replica, so that ``get_state_dict`` / ``dcp.save`` keep
        every replica's copy (:mod:`flexdemo.checkpoint.dcp`)."""
        return _dcp.state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        self._memory_epoch += 1
        keys = sorted(map(str, state_dict))[:8] if isinstance(state_dict, dict) else None
        if keys is not None and "state" in state_dict and "param_groups" in state_dict:
            _dcp.load_state_dict(self, state_dict)
        else:
            got = keys if keys is not None else type(state_dict).__name__
            raise ValueError("not an optimizer state of flexdemo: expected a dict with the keys "
                             f"'state' and 'param_groups' (what opt.state_dict() returns), got "
                             f"{got}")
        self.share_state()  # torch replaced the base's containers

    def __repr__(self) -> str:
        return (f"DeToNATION(base={type(self.base).__name__}, "
                f"replicators={self.replicators!r}, steps={self.steps})")


class DeMo(DeToNATION):
    """Drop-in DeMo optimizer with the original's constructor: sign-SGD on the decoded mean of
    the replicas' top-k DCT momentum components, over ``process_group`` (default: world).

    ``DeMo(params, compression_decay=0.999, compression_topk=32, compression_chunk=64,
    weight_decay=0.0, process_group=None, **sgd_kwargs)``: arguments in the original's order,
    ``lr`` (default 1e-3) and other SGD settings (``momentum``, ``nesterov``, ...) as keywords
    for the SGD step that follows, as in the original. ``compression_chunk`` is the block edge
    (2-D weights: ``chunk x chunk`` blocks). Values travel as fp32, as in the original (with
    compact packed indices). :attr:`data_transmit` / :attr:`data_receive` give the bytes this
    rank sent and received in the last step. ``nonfinite`` is flexdemo's policy for NaN/Inf
    gradients (see :class:`DeToNATION`).
    """

    def __init__(self, params: Iterable, compression_decay: float = 0.999,
                 compression_topk: int = 32, compression_chunk: int = 64,
                 weight_decay: float = 0.0, process_group: dist.ProcessGroup | None = None,
                 *, nonfinite: str = "raise", **sgd_kwargs) -> None:
        if isinstance(compression_decay, bool) or not isinstance(
                compression_decay, (int, float)) or not 0.0 <= compression_decay < 1.0:
            raise ValueError(f"compression_decay must be in [0, 1), got {compression_decay!r} "
                             "(DeMo(params, compression_decay, compression_topk, ...): give lr "
                             "as a keyword, DeMo(params, lr=...))")
        lr = sgd_kwargs.pop("lr", 1e-3)
        rep = DeMoReplicator(topk=compression_topk, chunk=compression_chunk,
                             decay=compression_decay, sign=True, scale_by_lr=True,
                             values="fp32")
        super().__init__(params, [rep], base="sgd", lr=lr, weight_decay=weight_decay,
                         group=process_group, nonfinite=nonfinite, base_kwargs=sgd_kwargs)
