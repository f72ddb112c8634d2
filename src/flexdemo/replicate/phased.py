"""Two replicators in turn: one for the first steps of a run, another for the rest.

The use it was built for is a denser DeMo at the start (:func:`demo_warmup`): in the quality
benchmark the default DeMo loses most of its distance to AdamW in the first hundred steps,
and a start at topk 64 followed by topk 16 keeps most of what topk 64 throughout gains at
a fraction of its bytes (benchmarks/archive/results-until-2026-12-07.md, "A denser start").

At the first step of the second phase the second replicator takes over the first one's
momentum where both keep it in the same layout (DeMo replicators of one ``chunk`` and
small-tensor setting), and the first one's buffers are freed (with overlapped exchanges, once
it has applied the exchange it launched last). Both phases run on the phased replicator's
group and schedule (``replicate_every``, ``skip_every``); the step a phase starts is the same
on every rank, so replicas stay bitwise identical.
"""

from __future__ import annotations

import torch

from .base import Replicator
from .demo import DeMoReplicator

_SCHEDULE = ("replicate_every", "skip_every")


class PhasedReplicator(Replicator):
    """``first`` for steps ``0 .. steps - 1``, then ``then`` (both unused instances, each
    with the default schedule: the schedule is the phased replicator's). Two DeMo phases may
    both overlap their exchanges (``overlap="delayed"``): the exchange launched at the last
    step of the first phase is applied at the first step of the second."""

    name = "phased"

    def __init__(self, first: Replicator, then: Replicator, steps: int, **schedule) -> None:
        super().__init__(**schedule)
        for which, rep in (("first", first), ("then", then)):
            if not isinstance(rep, Replicator):
                raise TypeError(f"phased: {which} must be a Replicator instance, got "
                                f"{type(rep).__name__}")
            if rep.is_set_up:
                raise ValueError(f"phased: the {which} replicator is already in use; pass a "
                                 "fresh one")
            if rep.replicate_every != 1 or rep.skip_every:
                raise ValueError(f"phased: give the schedule to the phased replicator, not to "
                                 f"its {which} phase (replicate_every=1, skip_every=0 there)")
        overlaps = {getattr(rep, "overlap", "none") for rep in (first, then)}
        self._delayed = overlaps == {"delayed"} and all(
            isinstance(rep, DeMoReplicator) for rep in (first, then))
        if overlaps != {"none"} and not self._delayed:
            raise ValueError("phased: overlap='delayed' needs two DeMo phases that both have "
                             "it (the second takes over the first's exchange in flight); "
                             "give both overlap='delayed' or both overlap='none'")
        if first is then:
            raise ValueError("phased: first and then must be two instances")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            raise ValueError(f"phased: steps must be an integer >= 0, got {steps!r}")
        self.first: Replicator | None = first
        self.then = then
        self.steps = steps
        self.phase = 0 if steps > 0 else 1

    def setup(self, shapes, device, default_group, params=None, nonfinite="raise") -> None:
        super().setup(shapes, device, default_group, params, nonfinite)
        for rep in self.inner_replicators():  # both phases: first is cleared only below
            rep.setup(shapes, device, self.group, params, nonfinite)
            rep.stats = self.stats  # one account of bytes and time for both phases
        self._handoff = self._momentum_pairs()
        if self.phase == 1:
            self.first = None

    def _momentum_pairs(self) -> bool:
        """Whether ``then`` can take over ``first``'s momentum (same buffers, same shapes)."""
        a, b = getattr(self.first, "delta", None), getattr(self.then, "delta", None)
        if a is None or b is None:
            return False
        if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
            raise ValueError("phased: the two phases keep their momentum in other layouts "
                             "(another chunk or small-tensor setting?); give both the same")
        return True

    @property
    def active(self) -> Replicator:
        active = self.then if self.phase else self.first
        assert active is not None  # first is cleared only when the phase turns to 1
        return active

    def _switch(self) -> None:
        if self._handoff and self.first is not None:
            # duck-typed: _handoff holds when both phases have momentum buffers (.delta)
            torch._foreach_copy_(self.then.delta, self.first.delta)  # type: ignore[attr-defined]
        self.first = None  # its buffers are no longer needed
        self.phase = 1

    def replicate(self, grads, lrs, step, communicate):
        if self.phase == 0 and step >= self.steps:
            if self._delayed:
                return self._switch_delayed(grads, lrs, step)
            self._switch()
        return self.active.replicate(grads, lrs, step, communicate)

    def _switch_delayed(self, grads, lrs, step):
        """The switch step with overlapped exchanges: the first phase checks its exchange in
        flight, the second takes over the momentum and launches this step's, and the first
        applies what it checked (as one delayed replicator would)."""
        first, then = self.first, self.then
        assert isinstance(first, DeMoReplicator) and isinstance(then, DeMoReplicator)
        plan = first.plan_step(grads, lrs)
        received = first.inflight.receive()
        first.inflight.hand_verdict_to(then.inflight)  # its verdict, judged next step
        self._switch()
        then.inflight.send(grads, lrs, step, then.plan_step(grads, lrs), then.transport,
                           then.stats, then.rank)
        first.inflight.apply(received, plan, grads)
        return grads

    def after_step(self, step: int) -> None:
        self.active.after_step(step)

    def payload_bytes(self) -> int:
        return self.active.payload_bytes()

    def exchange_bytes(self) -> int:
        return self.active.exchange_bytes()

    @property
    def delta(self) -> list[torch.Tensor]:
        """The active phase's momentum buffers."""
        return self.active.delta  # type: ignore[attr-defined]  # DeMo or phased phases

    def inner_replicators(self) -> tuple[Replicator, ...]:
        return tuple(r for r in (self.first, self.then) if r is not None)

    def state_dict(self) -> dict:
        return self._state(copy=True)

    def live_state(self) -> dict:
        return self._state(copy=False)

    def _state(self, copy: bool) -> dict:
        active = self.active.state_dict() if copy else self.active.live_state()
        return {**super().state_dict(), "phase": self.phase, "active": active}

    def state_tensors(self) -> list[torch.Tensor]:
        return self.active.state_tensors()

    def load_state_dict(self, state: dict) -> None:
        phase = int(state["phase"])
        if phase == 1 and self.phase == 0:
            self._switch()
        elif phase == 0 and self.phase == 1:
            raise ValueError("phased: the state is from the first phase, this replicator has "
                             "left it; load it into a fresh one")
        self.active.load_state_dict(state["active"])
        super().load_state_dict(state)  # the stats, shared with both phases

    def extra_repr(self) -> str:
        first = "done" if self.first is None else repr(self.first)
        return f"first={first}, then={self.then!r}, steps={self.steps}"


def demo_warmup(warmup_topk: int = 64, warmup_steps: int = 60, **kwargs) -> PhasedReplicator:
    """DeMo that sends ``warmup_topk`` coefficients per block for the first ``warmup_steps``
    steps and ``topk`` (default 16) after; the other settings (``kwargs``) go to both phases,
    the schedule to the phased replicator."""
    schedule = {k: kwargs.pop(k) for k in _SCHEDULE if k in kwargs}
    if not isinstance(warmup_topk, int) or isinstance(warmup_topk, bool) or warmup_topk < 1:
        raise ValueError(f"warmup_topk must be an integer >= 1, got {warmup_topk!r}")
    if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
    first = DeMoReplicator(**{**kwargs, "topk": warmup_topk})
    return PhasedReplicator(first, DeMoReplicator(**kwargs), warmup_steps, **schedule)
