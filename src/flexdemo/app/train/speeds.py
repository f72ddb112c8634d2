"""``flexdemo train`` with replicas of different speeds (issue 55): a pace, balanced batches,
and the benchmark's emulated slower rank.

**A run with a pace.** With ``strategy.replicator_kwargs.pace`` (``"fixed"``, ``"adaptive"``
or a list of counts) on a DiLoCo-family replicator, each replica syncs after its own number
of inner steps (:mod:`flexdemo.replicate.pace`), so the ranks take different numbers of steps
and the run is measured in syncs (:class:`PacedRun`): it lasts ``ceil(train.steps / H)``
syncs (a period is ``H`` steps of the fastest replica, so the fastest runs ``train.steps``
steps rounded up to a whole period) and every rank stops at the same sync, which every rank
counts alike. With ``train.pace_budget = "tokens"`` the run lasts instead until the replicas
together have taken ``train.steps`` x replicas steps (at equal batches: the tokens of a
synchronous run of ``train.steps``), at the first sync at or past it; its number of syncs is
known once the counts are (:attr:`PacedRun.total`, estimated from ``train.steps`` before),
and its learning rate follows the tokens: the schedule of the synchronous run at the same
tokens (:meth:`PacedRun.position`), which the adaptive mode's changes of counts do not move.
``train.stop_at`` stops at the first sync at or after it. After sync ``j`` the
run stands at step ``j H`` (the checkpoint's name ``step_NNNNNN``, the progress line); the
loop's collectives (evaluation, checkpoints, the agreement on a signal) happen at syncs only,
where the replicas are identical: an evaluation or a checkpoint at the first sync at or after
each multiple of ``train.eval_every`` / ``train.checkpoint_every``, and at the last sync.

**The learning rate follows the run's progress**, not a rank's own count: step ``s`` (from 0)
of period ``j`` of a replica that takes ``k`` steps per period is step ``j H + s H / k`` of
the schedule, which spans ``syncs x H`` steps; so at each sync every replica is at the same
rate, the slower ones in larger strides (in a first period whose counts were decided after
its first few steps, those steps count one each: :meth:`PacedRun.position`).

**Balanced batches** (``train.batches = "balanced"``, :class:`BatchBalance`): for exchanges at
every step (full sync, DeMo) weighted by tokens (``replicator_kwargs.weights = "tokens"``).
Every rank trains at ``train.batch`` for :data:`BALANCE_STEPS` steps after its first, timing
its compute per sample; then the seconds per sample are summed over ranks (each rank its own
slot), a replica's taken as its slowest rank's, and every rank computes the same sizes
(:func:`flexdemo.balanced_batches`): ``train.batch x replicas`` samples per step shared in
proportion to the replicas' speeds (at least 1 each), every rank of a replica at its
replica's size, from then on. A size larger than a rank's share of the data stops every rank
with one line. The size is in each rank's checkpoint (a resume keeps it).

**Slowdown** (``train.slowdown``, for benchmarks): the ranks of ``train.slow_ranks`` (all,
when empty) make each step last ``slowdown`` times its measured compute time (the step's
time minus its communication) by sleeping the difference, the forward and backward passes'
share before ``opt.step()`` and the optimizer step's after it, an emulated slower
GPU: the simplest honest emulation (the step's work is unchanged; only its length). The
sleep counts as the step's compute time in the metrics. On CUDA the device is synchronised
first, so the compute measured is the GPU's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from ...balance import balanced_batches
from ..errors import TrainingError
from ..tasks import ShardSampler
from .checkpointer import sum_over_ranks

__all__ = ["BALANCE_STEPS", "BatchBalance", "PacedRun", "Slowdown", "crossed",
           "paced_replicator", "schedule_step"]

BALANCE_STEPS = 5
"""Balanced batches: the steps (after a run's first) each rank times at ``train.batch``."""


def paced_replicator(opt: Any) -> Any | None:
    """The replicator of ``opt`` that runs with a pace (DiLoCo's ``pace=``), or None."""
    return next((r for r in getattr(opt, "replicators", ())
                 if getattr(r, "pace", None) is not None), None)


def schedule_step(syncs: int, since: int, count: int, inner_steps: int) -> float:
    """The schedule's step (from 0) of a replica's next step: ``syncs`` periods done,
    ``since`` steps taken of its current period of ``count`` steps, a period being
    ``inner_steps`` (H) steps of the run: ``syncs H + since H / count``."""
    return syncs * inner_steps + since * inner_steps / count


def crossed(every: int, before: int, now: int) -> bool:
    """Whether the run passed a multiple of ``every`` going from step ``before`` to ``now``
    (``every`` 0: never)."""
    return bool(every) and now // every > before // every


@dataclass
class PacedRun:
    """A run with a pace, in syncs (see the module): the replicator ``rep`` with the pace,
    its ``inner_steps`` (H), the syncs a run by ``train.steps`` lasts (``planned``), the sync
    ``train.stop_at`` stops at (``stop``, None: none) and, for ``train.pace_budget =
    "tokens"``, the replicas' steps the run lasts (``budget``: ``train.steps`` x replicas)."""

    rep: Any
    inner_steps: int
    planned: int
    stop: int | None = None
    budget: int | None = None

    @classmethod
    def of(cls, opt: Any, steps: int, stop_at: int = 0, budget: str = "steps"
           ) -> PacedRun | None:
        """The paced run of ``opt`` for ``train.steps``, ``train.stop_at`` and
        ``train.pace_budget``, or None without a pace."""
        rep = paced_replicator(opt)
        if rep is None:
            return None
        h = int(rep.inner_steps)
        return cls(rep, h, math.ceil(steps / h), math.ceil(stop_at / h) if stop_at else None,
                   steps * int(rep.pace.world) if budget == "tokens" else None)

    @property
    def syncs(self) -> int:
        """Syncs launched (the same on every rank between syncs)."""
        return int(self.rep.syncs[0])

    @property
    def applied(self) -> int:
        """Syncs applied: :attr:`syncs`, less the one in flight (DiLoCo's ``tau > 0``: each
        replica applies it ``tau`` of its own steps after the launch, every rank at the same
        place among its collectives). The run's marks (evaluations, checkpoints, a stop)
        come where a sync is applied."""
        return self.syncs - len(self.rep.pending)

    def settle(self) -> None:
        """After a step: the run's last sync, once launched, is applied at once (the run ends
        on the synced model, not ``tau`` steps later). A stop before it (``train.stop_at``)
        comes where its sync is applied, as the whole run applies it: a resume continues
        bit for bit."""
        if self.rep.pending and self.syncs >= self.total:
            self.rep.settle()

    @property
    def total(self) -> int:
        """The syncs the run lasts. By tokens: the syncs done, and those whose periods (at
        the counts known now) bring the replicas' steps to the budget: it changes only when
        the counts do (the first period's decision, the adaptive mode's changes), the same
        on every rank."""
        if self.budget is None:
            return self.planned
        pace = self.rep.pace
        done = sum(pace.steps_done)
        if done >= self.budget:
            return self.syncs
        per = sum(pace.counts) if pace.counts is not None else self.inner_steps * pace.world
        left = self.budget - done - sum(pace.period)
        return self.syncs + 1 + max(0, math.ceil(left / per))

    @property
    def last(self) -> int:
        """The sync this process runs to: ``train.stop_at``'s, or the run's last."""
        total = self.total
        return total if self.stop is None else min(self.stop, total)

    @property
    def span(self) -> int:
        """The schedule's length in steps: ``total x H``; by tokens, ``train.steps`` (the
        synchronous run's)."""
        if self.budget is not None:
            return self.budget // int(self.rep.pace.world)
        return self.total * self.inner_steps

    @property
    def done(self) -> bool:
        return self.applied >= self.last

    @property
    def at(self) -> int:
        """The run's step at the last sync applied: ``applied x H``."""
        return self.applied * self.inner_steps

    def position(self) -> float:
        """The schedule's step (from 0) of this replica's next step: :func:`schedule_step`,
        where a first period decided after a few steps runs those at one each
        (:meth:`flexdemo.replicate.pace.Pace.period_position`). By tokens: the replicas'
        steps so far over the replicas (the synchronous run's step at the same tokens), at
        the last sync and then this replica's share of its period's: a schedule that the
        counts' changes do not move."""
        pace = self.rep.pace
        if self.budget is None:
            return self.syncs * self.inner_steps + pace.period_position()
        share = pace.period_position() / self.inner_steps
        return (sum(pace.steps_done) + share * sum(pace.period)) / int(pace.world)

    def counts(self) -> list[int] | None:
        """Every replica's inner steps per period (None while the first period measures)."""
        counts = self.rep.pace.counts
        return None if counts is None else list(counts)

    def note(self, steps: int) -> str:
        """The line that says how long the run is."""
        pace = self.rep.pace
        if self.budget is not None:
            return (f"pace {pace!r}: syncs of H={self.inner_steps} until the replicas have "
                    f"taken {self.budget} steps together (train.pace_budget='tokens': the "
                    f"data of {steps} synchronous steps), each replica its own steps per "
                    "period, the run measured in syncs")
        rounded = "" if steps % self.inner_steps == 0 else (
            f" (train.steps={steps} rounded up to a whole period: a run ends at a sync)")
        return (f"pace {pace!r}: {self.total} syncs of H={self.inner_steps}, the fastest "
                f"replica runs {self.span} steps{rounded}; each replica its own steps per "
                "period, the run measured in syncs")


class Slowdown:
    """``train.slowdown`` on this rank (see the module): :meth:`before_step` sleeps
    ``(factor - 1)`` times the forward and backward passes' time, :meth:`after_step` as much
    of the optimizer step's compute (its communication left out): each part of the step
    lasts ``factor`` times as long where it runs, as on a slower device, so a sync's
    exchange meets the slow rank after its slow backward pass, not before."""

    def __init__(self, factor: float, device: torch.device) -> None:
        self.factor, self.device = float(factor), device

    @classmethod
    def for_rank(cls, factor: float, ranks: list[int], rank: int,
                 device: torch.device) -> Slowdown | None:
        """The slowdown of ``rank`` (None: not slowed, or a factor of 1)."""
        if factor == 1.0 or (ranks and rank not in ranks):
            return None
        return cls(factor, device)

    def before_step(self, t0: float) -> float:
        """Before ``opt.step()``: sleep ``(factor - 1) x`` the time since ``t0`` (the step's
        start: its batch, forward and backward passes); returns the seconds slept."""
        return self.after_step(t0, 0.0)

    def after_step(self, t0: float, comm: float) -> float:
        """Sleep ``(factor - 1) x`` the compute time since ``t0`` (``time.perf_counter()``)
        of which ``comm`` seconds were communication; returns the seconds slept."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        compute = max(time.perf_counter() - t0 - comm, 0.0)
        extra = (self.factor - 1.0) * compute
        if extra > 0:
            time.sleep(extra)
        return extra


class BatchBalance:
    """``train.batches = "balanced"`` on one rank (see the module): :meth:`observe` after each
    step, the same steps on every rank; at the last step measured it decides every
    replica's size (a collective) and :attr:`batch` becomes this rank's."""

    def __init__(self, batch: int, rank: int, world: int, shard: int, start: int,
                 items: int, saved: int = 0) -> None:
        self.base, self.rank, self.world, self.shard, self.items = batch, rank, world, shard, items
        #: this rank's batch size (``train.batch`` until decided; a resumed run's saved one)
        self.batch = saved or batch
        self.decided = bool(saved)
        self.sizes: list[int] | None = None  # every replica's, once decided in this run
        self.first, self.last = start + 2, start + 1 + BALANCE_STEPS
        self.seconds = 0.0
        self.samples = 0

    def observe(self, step: int, compute_seconds: float, device: torch.device) -> bool:
        """After step ``step`` (its compute seconds, at :attr:`batch`): whether the sizes
        were decided now (collective at the last step measured, on every rank)."""
        if self.decided or step < self.first:
            return False
        self.seconds += compute_seconds
        self.samples += self.batch
        if step < self.last:
            return False
        n = 2  # each rank's slot: its replica and its seconds per sample
        mine = [0.0] * (n * self.world)
        mine[self.rank * n:(self.rank + 1) * n] = [self.rank // self.shard,
                                                   self.seconds / max(self.samples, 1)]
        got = sum_over_ranks(mine, device)
        replicas = self.world // self.shard
        secs = [0.0] * replicas
        for replica, s in zip(got[0::n], got[1::n]):  # a replica as fast as its slowest rank
            secs[int(replica)] = max(secs[int(replica)], s)
        secs = [s if s > 0 else min((x for x in secs if x > 0), default=1.0) for s in secs]
        self.sizes = balanced_batches(secs, self.base * replicas)
        share = ShardSampler.smallest_share(self.items, self.world)
        if max(self.sizes) > share:
            raise TrainingError(
                f"train.batches='balanced': the sizes {self.sizes} (train.batch={self.base} x "
                f"{replicas} replicas, by speed) need {max(self.sizes)} items of a rank's "
                f"share of the training data, which holds {share}; lower train.batch or use "
                "more data")
        self.batch = self.sizes[self.rank // self.shard]
        self.decided = True
        return True
