"""Fault tolerance by composition: an :class:`ElasticSession` around a plain optimizer.

The optimizer (:class:`~flexdemo.optim.DeToNATION`) knows nothing of quorums; the wrapper owns
the session and runs every step as::

    zero_grad(): session.begin()         the quorum (a joiner heals before its forward pass)
                                         unless the step is local (a DiLoCo pace's inner
                                         step before this replica's sync: no quorum, no vote)
    step():      session.start_step()    joined; a copy of what the step changes
                 inner.step()            the optimizer's own step, called once
                 session.finish_step()   the commit vote: kept, or the copy put back

as torchft's ``OptimizerWrapper`` does. :func:`flexdemo.prepare` returns it under fault
tolerance; everything else (``param_groups``, ``state``, ``state_dict()``, ``steps``,
``replicators``, ...) is the inner optimizer's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..checkpoint import FlexOptimizer
from ..replicate import make_replicator
from ..transport import PeerLostError
from .session import ElasticSession

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from .config import FaultTolerance

__all__ = ["ElasticOptimizer", "InnerOptimizer"]


class InnerOptimizer(FlexOptimizer, Protocol):
    """What the wrapper uses of its inner optimizer, a :class:`~flexdemo.optim.DeToNATION`
    (a protocol: that module builds the wrapper when given ``fault_tolerance=``)."""

    param_groups: list[dict[str, Any]]
    state: Any

    def step(self, closure: Any = None) -> Any: ...
    def zero_grad(self, set_to_none: bool = True) -> None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state_dict: dict) -> None: ...
    def last_step_stats(self) -> dict: ...
    def add_param_group(self, param_group: dict[str, Any]) -> None: ...
    def register_step_pre_hook(self, hook: Any) -> RemovableHandle: ...
    def register_step_post_hook(self, hook: Any) -> RemovableHandle: ...


class ElasticOptimizer(torch.optim.Optimizer):
    """A :class:`~flexdemo.optim.DeToNATION` (``inner``) stepped under an
    :class:`ElasticSession` (``session``, also named ``fault_tolerance``).

    ``zero_grad()`` starts the step's quorum; ``step()`` joins it, runs ``inner.step()`` once
    and votes: the step is committed or undone bitwise (``last_step_stats()["committed"]``).
    A torch optimizer to LR schedulers; ``param_groups``, ``state``, the state dicts, step
    hooks and every other attribute are the inner optimizer's. Build it with
    :func:`flexdemo.prepare` (``fault_tolerance=``) or :meth:`build`.
    """

    # as torchft's OptimizerWrapper: Optimizer.__init__ is not called, there is no state of
    # its own (param_groups, state and the step hooks are the inner optimizer's)
    def __init__(self, session: ElasticSession, inner: InnerOptimizer) -> None:
        if session.opt is not inner:
            raise ValueError("the session must be attached to the inner optimizer "
                             "(session.attach(inner))")
        self.inner = inner
        self.session = session

    @classmethod
    def build(cls, optimizer_class: Callable[..., InnerOptimizer], params: Any,
              replicators: Any = "demo", *args: Any, fault_tolerance: FaultTolerance,
              **kwargs: Any) -> ElasticOptimizer:
        """``optimizer_class(params, replicators, *args, **kwargs)`` (e.g.
        :class:`~flexdemo.optim.DeToNATION`) over the replica groups of each quorum instead of
        ``group``: the session is started first (its transport is the replicators' group),
        then attached."""
        kwargs.pop("group", None)  # each quorum's replica groups
        reps = [make_replicator(r) for r in (
            replicators if isinstance(replicators, (list, tuple)) else [replicators])]
        session = ElasticSession(fault_tolerance, reps)  # checks them before connecting
        try:
            inner = optimizer_class(params, reps, *args, group=session.transport, **kwargs)
        except BaseException:
            session.shutdown()
            raise
        session.attach(inner)  # (shuts the session down if it refuses)
        return cls(session, inner)

    # ------------------------------------------------------------------ the step
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start this step's quorum (a joiner heals here, before its forward pass), then
        clear the gradients."""
        self.session.begin()
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Quorum, the inner optimizer's step (once), commit vote; returns the closure's loss
        (``None`` when the step was lost with a peer)."""
        if self.session.local_step():  # an inner step before this replica's DiLoCo sync
            self.session.local = True
            return self.inner.step(closure)
        self.session.local = False
        undo = self.session.start_step()
        try:
            loss = self.inner.step(closure)
        except PeerLostError:  # recorded by the Manager: the vote says no, the step is undone
            self.session.finish_step(undo)
            return None
        except BaseException as e:
            self.session.finish_step(undo, error=e)  # reported: every group votes no
            raise
        self.session.finish_step(undo)
        return loss

    # ------------------------------------------------------------------ the inner optimizer's
    @property
    def fault_tolerance(self) -> ElasticSession:
        """The session (as ``opt.fault_tolerance`` was before the composition)."""
        return self.session

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.inner.param_groups = groups

    @property
    def state(self) -> Any:
        return self.inner.state

    @state.setter
    def state(self, state: Any) -> None:
        self.inner.state = state

    @property
    def steps(self) -> int:
        """The inner optimizer's committed steps."""
        return self.inner.steps

    @steps.setter
    def steps(self, n: int) -> None:
        self.inner.steps = n

    @property
    def skipped_steps(self) -> int:
        return self.inner.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, n: int) -> None:
        self.inner.skipped_steps = n

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.inner.add_param_group(param_group)

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """A hook before the inner step: in the step's quorum, after the undo copy."""
        return self.inner.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """A hook after the inner step, before the commit vote."""
        return self.inner.register_step_post_hook(hook)

    def last_step_stats(self) -> dict:
        """The inner optimizer's :meth:`~flexdemo.optim.DeToNATION.last_step_stats` and the
        session's: ``replicas`` (groups in the step), ``committed``, the seconds of the
        quorum, the vote and the undo copy, ``failed_commits``."""
        return {**self.inner.last_step_stats(), **self.session.stats()}

    def __getattr__(self, name: str) -> Any:
        # only for names not found on the wrapper: the inner optimizer's (replicators, base,
        # params, memory_stats, ...)
        if name in ("inner", "session") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"ElasticOptimizer({self.inner!r}, replica_id={self.session.config.replica_id!r})"
