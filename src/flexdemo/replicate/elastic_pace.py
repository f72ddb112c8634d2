"""A DiLoCo pace under fault tolerance: replicas come and go, so no count belongs to a rank,
and each replica's inner steps between two syncs are its own business.

Under :mod:`flexdemo.ft` a pace (``pace="adaptive"``) runs as :class:`ElasticPace`:

* **Quorums at syncs only.** A step that exchanges nothing (an inner step before this
  replica's sync: :meth:`ElasticPace.local_next`) runs outside any quorum: no quorum, no undo
  copy, no commit vote. The session forms a quorum for a step that syncs. So replicas that
  take different numbers of inner steps meet where they exchange, and one that stops in the
  middle of a period is missing from the next sync's quorum: it leaves, the others go on.
* **The first period** is ``H`` inner steps on every replica, timed as the adaptive mode
  times (from the end of its first step).
* **At each sync** every replica of the quorum all-gathers three float64 numbers: its seconds
  per inner step in the period (0: not measured), the inner steps it took in it and its
  tokens (``weights="tokens"``). From the same numbers every rank computes the weights of
  the mean (each replica's steps, or tokens, of the period) and the next counts, and keeps
  its own. With every replica measured the counts are :func:`~.pace.adapted_counts`
  against each replica's steps in the period (a count that needs no rank to name the same
  replica from one quorum to the next), kept unless one is off by more than the tolerance.
* **A joiner** heals into its peers' sync: its first step in the quorum is that sync (it
  contributes one step's progress, weighted by that one step), unmeasured. Its next period
  runs on its own clock (:attr:`ElasticPace.target`): the period's time ``T`` is the longest
  of the measured replicas' new counts times their seconds per step, and after each of its
  steps the joiner makes the next one its last when its time since the sync plus one and a
  half of its median step reaches ``T`` (at least 1 step, at most ``2H``). At the sync after
  that it is measured and counted like the others: its count comes from its own speed.

A replica of several ranks (FSDP inside a node) agrees with itself first: its ranks take the
slowest rank's seconds and the sum of their tokens over the node's default group, and a
joiner's ranks decide the end of a timed period together (one flag all-reduced per step of
that period), so every rank of a replica takes the same steps.

Numbers from peers are bounded: a step count outside ``[0, 2H]`` or a seconds figure that is
not a finite positive number counts as 0 (unmeasured); tokens are weighed as reported.

Costs: ``24 (n - 1)`` bytes sent per replica and sync (in ``bytes_sent``), one host read of
them; a joiner's timed period reads the clock after each step (on CUDA a synchronisation).
``pace="timed"``: every replica's period after the first runs on its own clock, as a
joiner's does, for the fastest measured replica's ``H`` steps.

Not reproducible: it reads a clock, and the quorum changes anyway.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from ..transport import CommStats, all_gather, transport_for
from .pace import Pace, adapted_counts, step_counts, step_factors
from .weights import weight_factors

__all__ = ["ElasticPace", "elastic_counts"]


def elastic_counts(seconds: list[float], steps: list[int], inner_steps: int,
                   tolerance: float) -> tuple[list[int | None], float | None]:
    """The next period of every replica of a quorum from what each measured (``seconds`` per
    step, 0: not measured) and took (``steps``) in the one that ended: each measured
    replica's count (:func:`~.pace.adapted_counts` against ``steps``, kept within the
    tolerance), ``None`` for an unmeasured one, and the period's time ``T`` that an
    unmeasured replica runs for (None when every replica is measured or none is; with none
    measured every count is ``H``). Plain float arithmetic: the same on every rank from the
    same numbers."""
    measured = [i for i, s in enumerate(seconds) if s > 0]
    if not measured:
        return [inner_steps] * len(seconds), None
    secs = [seconds[i] for i in measured]
    current = [max(1, steps[i]) for i in measured]
    new = adapted_counts(current, secs, inner_steps, tolerance)
    mine = current if new is None else new
    counts: list[int | None] = [None] * len(seconds)
    for i, k in zip(measured, mine):
        counts[i] = k
    if len(measured) == len(seconds):
        return counts, None
    target = max(k * s for k, s in zip(step_counts(secs, inner_steps), secs))
    return counts, target


def _in_replica(value: torch.Tensor, op) -> torch.Tensor:
    """``value`` reduced over this replica's own ranks (the default group where a replica
    spans several ranks under fault tolerance); as given with one rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    out = value.clone()
    dist.all_reduce(out, op=op)
    return out


class ElasticPace(Pace):
    """A pace under fault tolerance (see the module): built from an adaptive :class:`Pace`
    by DiLoCo when a session takes it (:meth:`from_pace`)."""

    elastic = True

    @classmethod
    def from_pace(cls, pace: Pace) -> ElasticPace:
        return cls(None, weights=pace.weights, adaptive=True, tolerance=pace.tolerance,
                   measure=pace.measure, timed=pace.timed, clock=pace.clock)

    def __repr__(self) -> str:
        timed = ", timed=True" if self.timed else ""
        return f"ElasticPace(weights={self.weights!r}, tolerance={self.tolerance}{timed})"

    def setup(self, inner_steps: int, world: int, rank: int, device: torch.device) -> None:
        super().setup(inner_steps, world, rank, device)
        self.counts = None  # no count names a rank
        #: this replica's inner steps in the current period (None: it runs until ``target``)
        self.own: int | None = inner_steps
        #: a timed period's seconds (a joiner's first whole period), else None
        self.target: float | None = None
        self._taken = 0  # the steps of the period that just ended
        self._skip = 0  # steps of this period that a healed replica's peer took
        self._timed = 0

    # ------------------------------------------------------------------ what others read
    @property
    def period(self) -> list[int]:
        """This replica's steps in the current period (its peers' are not known here)."""
        return [self.count]

    @property
    def count(self) -> int:
        """This replica's inner steps in the current period (a timed one: the steps so far
        and one more, until it decides)."""
        return self.since + 1 if self.own is None else self.own

    @property
    def measures(self) -> bool:
        return self.inner_steps > 1

    def period_position(self) -> float:
        return self.since * self.inner_steps / self.count

    def local_next(self) -> bool:
        """Whether this replica's next step is an inner step before its sync (run outside a
        quorum)."""
        return self.own is None or self.since + 1 < self.own

    def joined(self) -> None:
        """Healed from a peer (its pace state loaded): this replica stands where the peer
        stands in its period (at a sync, or in the first period of a run whose first quorum
        healed it), and weighs only the steps it takes itself; a period ending at its first
        step is not measured."""
        if self.own is None:
            self.own = self.since + 1
        self.target, self._skip = None, self.since
        self._start = self._stop = None
        self._marks, self._timed = [], 0
        self._tokens.zero_()

    # ------------------------------------------------------------------ stepping
    def after_step(self, group=None, stats: CommStats | None = None) -> bool:
        """After an inner step: whether it was this replica's sync. The period is timed from
        the end of its first step (after a sync: from the sync's end) to the end of the step
        before its sync: the sync's own step waits for the quorum and is left out."""
        self.since += 1
        now = None
        if self.own is None:  # a timed period: this replica decides its count on its clock
            if self._start is not None:
                now = self._read()
                self._marks.append(now)
                self._decide_timed()
        if self.own is not None and self.since >= self.own:  # its sync
            self._taken, self.since, self._skip = self.since - self._skip, 0, 0
            return True
        if self._start is None:  # a period's first step (the run's, or after a heal)
            self._start, self._first = self._read(), self.since
        elif self.own is not None and self.since == self.own - 1:  # the quorum is next
            self._stop = self._read() if now is None else now
            self._timed = self.since - self._first
        return False

    def _decide_timed(self) -> None:
        """After a step of a timed period: the next step is the last when the time since the
        period began plus 1.5 median steps reaches :attr:`target` (or the period has 2H)."""
        assert self.target is not None and self._start is not None
        marks = [self._start, *self._marks]
        step = statistics.median(b - a for a, b in zip(marks, marks[1:]))
        last = (marks[-1] - self._start + 1.5 * step >= self.target
                or self.since + 1 >= 2 * self.inner_steps)
        flag = torch.tensor([1.0 if last else 0.0], dtype=torch.float64)
        if float(_in_replica(flag, dist.ReduceOp.MAX)[0]) > 0:  # every rank of the replica
            self.own = self.since + 1

    def start_period(self) -> None:
        """After a sync: the next period is timed from here."""
        self._start, self._first, self._stop = self._read(), 0, None
        self._marks, self._timed = [], 0

    def factors(self, group, stats: CommStats) -> torch.Tensor | None:
        """At a sync: the all-gather of the three numbers, the next period (:attr:`own` or
        :attr:`target`) and the factors of the weighted mean (None where the weights are
        equal)."""
        self.synced += 1
        taken, timed = self._taken, self._timed
        secs = 0.0
        if self._start is not None and self._stop is not None and timed > 0:
            secs = (self._stop - self._start) / timed
        self._timed = 0
        secs = float(_in_replica(torch.tensor([secs], dtype=torch.float64),
                                 dist.ReduceOp.MAX)[0])
        tokens = _in_replica(self._tokens.reshape(1).clone(), dist.ReduceOp.SUM)
        self._tokens.zero_()
        mine = torch.cat([torch.tensor([secs, float(taken)], dtype=torch.float64,
                                       device=self.device), tokens.to(self.device)])
        tr = transport_for(group)
        rows = all_gather(mine, tr, stats).reshape(-1, 3)
        rank = tr.rank
        host = rows[:, :2].tolist()  # the one host read of a sync
        H = self.inner_steps
        seconds = [s if s == s and 0 < s < float("inf") else 0.0 for s, _ in host]
        steps = [int(k) if k == k and 0 <= k <= 2 * H else 0 for _, k in host]
        self._start = self._stop = None
        counts, target = elastic_counts(seconds, steps, H, self.tolerance)
        self.own, self.target = counts[rank], target if counts[rank] is None else None
        if self.own is None and self.target is None:
            self.own = H
        measured = [s for s in seconds if s > 0]
        if self.timed and measured:  # every replica's period on its own clock
            self.own, self.target = None, H * min(measured)
        self.changes.append((self.synced, [k if k is not None else 0 for k in counts]))
        if len(self.changes) > 64:
            del self.changes[:-64]
        if len(rows) <= 1:
            return None
        if self.weights == "steps":
            return step_factors(steps, self.device)
        w_steps = torch.tensor(steps, dtype=torch.float64, device=self.device)
        return weight_factors(rows[:, 2].clamp_min(0.0), w_steps)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd.update({"own": self.own, "target": self.target, "taken": self._taken,
                   "skip": self._skip})
        return sd

    def load_state_dict(self, state: dict | None) -> None:
        if state is None:
            raise ValueError("the DiLoCo state has no pace (saved without pace=?); build the "
                             "replicator as it was saved")
        self.since = int(state["since"])
        self._tokens.copy_(state["tokens"])
        self.synced = int(state.get("synced", 0))
        self.changes = [(int(j), [int(k) for k in c]) for j, c in state.get("changes", [])]
        own = state.get("own", self.inner_steps)
        self.own = None if own is None else int(own)
        target = state.get("target")
        self.target = None if target is None else float(target)
        if self.own is None and self.target is None:
            self.own = self.inner_steps
        self._taken = int(state.get("taken", 0))
        self._skip = int(state.get("skip", 0))
        self._start = self._stop = None  # a measurement interrupted is taken again
        self._marks, self._timed = [], 0
