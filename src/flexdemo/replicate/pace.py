"""Replicas of different speeds in DiLoCo: each replica's own number of inner steps per period,
and a mean of the pseudo-gradients weighted by what each replica trained on.

A synchronous DiLoCo runs every replica at the slowest one's pace: with one of four replicas
three times slower, all four run at a third of their speed. With ``DiLoCoReplicator(H,
pace=Pace(...))`` replica ``i`` syncs after its own ``k_i`` inner steps since its last sync
(``counts``, in group-rank order), so sync ``j`` comes after every replica's ``j``-th period:
the collectives pair up although the replicas' step numbers differ (the exchanges' headers carry
the sync's number, not the step's). ``inner_steps`` stays the nominal ``H``. The replicator
runs its own copy of the pace it is given (``opt.replicators[0].pace``: its counts, and the
steps since the last sync).

**Counts.** ``Pace([30, 30, 30, 10])`` fixes them from the start (a reproducible run).
``Pace()`` (``"fixed"``) measures them early in the first period: every replica runs its
first ``measure`` inner steps (default :data:`MEASURE`) as without a pace, timing each of
steps 2 to ``measure`` (the first, with its warm-up, is not timed; a CUDA device is
synchronised at each reading, in these steps only). After step ``measure`` the median seconds
per step are all-gathered (8 bytes per replica) and every rank computes the same counts from
the same gathered numbers (:func:`step_counts`): a period lasts about ``H`` steps of the
fastest replica, the slowest takes ``k = round(H * s_fastest / s_slowest)`` steps and
replica ``i`` ``max(1, round(k * s_slowest / s_i))``. The rest of the first period is
balanced too (:func:`first_period`): replica ``i`` takes ``measure + max(1, round((H -
measure) * s_fastest / s_i))`` steps in it, the fastest ``H``; from the second period on,
its count. So only the ``measure`` steps before the
decision run at the slowest replica's pace. The first steps of a run are a noisy measure (a
warm-up, peers still starting), so the steps after the decision (which every replica starts
together) are timed too, and at the first sync the counts are measured again from them (a
second all-gather of 8 bytes per replica) and fixed from then on. Both decisions keep the
counts in force (``H`` at first) unless some replica's new count is off by more than the
tolerance (:func:`adapted_counts`, as the adaptive mode decides): with speeds within 10% of
each other the counts stay ``H``, the bits of DiLoCo without a pace. With ``measure >= H`` (or
``H`` at most :data:`MEASURE`) the whole first period is timed instead (from the end of its
first step to the end of its ``H``-th) and the counts are decided at the first sync. A run
resumed in the middle of a timed stretch times the steps after its first one since the
resume; one resumed within the first ``measure`` steps reports none there, and then every
replica times the rest of the period instead (decided at its sync). The counts are part of the state
(``state_dict``): a resumed run does not measure again and continues bitwise as the run that
saved it. The measurement itself reads a clock: to repeat a run bit for bit, give the counts
it measured (``opt.replicators[0].pace.counts``; each decision is in ``pace.changes``).

**Weights.** The mean of the pseudo-gradients is ``sum_i w_i delta_i / sum_i w_i``:
``weights="steps"`` (default) weighs each replica by its count (equal batches: equal tokens
per step); ``weights="tokens"`` by the tokens it reported since the last sync
(:meth:`Pace.count_tokens`, which ``DeToNATION.count_tokens(n)`` reaches), all-gathered at each
sync as one float64 per replica (``8 (n - 1)`` bytes sent, counted in ``bytes_sent``). With
no tokens reported by any replica the counts weigh instead; a replica that reports none while
others do weighs nothing.

Each replica scales its pseudo-gradient by its factor ``c_i = w_i n / W`` (computed in
float64 from the same numbers on every rank, rounded to fp32 once) before the exchange, so an
exchange that averages over all ``n`` replicas (the fp32 all-reduce, a gathered or
reduce-scattered quantised mean, DeMo's mean over the replicas) yields ``sum_i c_i delta_i /
n``: the weighted mean, in fp32 within ``n + 1`` roundings of the plain mean's arithmetic. A
mean over the senders (SparseLoCo's, DeMo's ``mean="senders"``) divides each coordinate by
the sum of its senders' factors instead of their number (:attr:`~.base.Replicator.
peer_scales`): the mean weighted over the senders. Error feedback and outer momentum are as
without a pace; an exchange's error feedback keeps the scaled input, so what a replica has not
sent yet reaches the mean later with the weight of the period it came from. Quantised
exchanges quantise the scaled input (the same bytes).

With equal weights nothing changes: equal counts under ``"steps"`` are known on every rank,
and nothing is scaled or exchanged; under ``"tokens"`` equal reports give factors of exactly
1.0 (a product by 1 keeps the bits). Either way the bits of DiLoCo without a pace.

**Adaptive mode.** ``Pace(adaptive=True)`` (``Pace("adaptive")``, ``pace="adaptive"``)
measures at every sync: each replica times the inner steps of the period that just ended
(from the end of the last sync to the end of its last step, the sync's own wait left out; the
first period, and the first after a resume, from the end of its first step), the seconds per
step are all-gathered at each sync (8 bytes per replica, ``8 (n - 1)`` sent, in
``bytes_sent``), and every rank computes the same new counts from the same gathered numbers
(:func:`step_counts`). **Hysteresis** (:func:`adapted_counts`): the counts change only when
some replica's new count differs from its current one by more than ``tolerance`` times the
new count (default ``tolerance=0.1``: a replica off its share by more than 10% of the
period's time); then every count takes its new value, in force from the next period. The
bound is relative to each replica's own count because a step of a slow replica is a larger
part of the period: one step off a count of 10 makes every replica wait 10% of the period,
one step off 30 only 3%. So noise does not flip the counts at every sync, a replica that
falls behind its share by more than the bound gets a smaller count (and, weighted by steps, a
smaller weight) at the next sync, and one that recovers gets it back. With equal speeds the
counts stay ``H``: the bits of DiLoCo without a pace. Each change is recorded in
``pace.changes`` (the sync's number, counted from 1, and the counts decided there; fixed
mode records its one measurement there too): the record of a run, not a way to replay it
(not built yet: a pace from a recorded schedule of counts). The counts in force, the syncs
and the changes are in the state (a resumed run continues with the counts in force).
Given counts (``Pace([6, 6, 2], adaptive=True)``) are the first period's. A replica that has
nothing to report (a period of one step, timed from the end of its first) makes every rank
keep its counts at that sync. It costs, per sync, the all-gather, one host read of its
result and (on CUDA) two synchronisations of the device.

**Timed mode.** ``Pace("timed")`` (``timed=True``; adaptive too) decides the first period as
the adaptive mode does; from the first sync on a count is only a prediction: the period
lasts a time, the fastest replica's ``H`` steps at the seconds gathered at the last sync,
and after each step a replica syncs when another step, at its own seconds per step as last
gathered, would end more than half a step past that time (or after ``2H`` steps). The
replicas leave a sync together and reach the next one within about half a step of the
slowest, whatever their speeds did within the period. Each sync all-gathers every replica's
seconds per step and steps (two float64 each; a peer's steps bounded to ``[1, 2H]``); the
steps weigh the mean (or the tokens) and ``steps_done`` counts them; ``counts`` holds the
prediction for the next period. It reads the clock after every step (on CUDA a
synchronisation each), needs one rank per replica and is not reproducible; the period's time
and the replica's seconds per step are in the state.

**Fill mode.** ``Pace("fill")`` (``fill=True``; adaptive too) reads no clock at its steps after
the first decision (taken as the timed mode takes it, after :data:`MEASURE_TIMED` steps): once
at each period's start (no device synchronisation: the sync's host read has just waited for the
device), and twice in a period where it reached ``H`` before the slowest arrived. A period ends
when the slowest replica has taken its count (the *binding* replica: the fewest steps in the
period, the lowest rank among equals): each replica launches its *arrival*, a one-number
all-reduce it does not wait for, after its count if it is the binding replica and after its
first step otherwise; the binding replica then waits for the others' arrivals (already there),
and every other replica looks whether the all-reduce has completed after each of its steps
(``is_completed``: no wait, no device synchronisation) and takes another step while it has not,
at most ``H`` (no replica takes more steps in a period than without a pace). So the faster
replicas fill the slowest one's period with as many steps as fit, whatever their speeds or the
slowest one's outer step did, and the slowest waits at most for the step the others are in. At
each sync the steps each took are all-gathered with the steps each would have taken (two
float64 per replica; a peer's steps bounded to ``[1, H]``, the other figure to ``[its steps,
4H]``): the steps weigh the mean (or the tokens do), the others give the next counts
(:func:`fill_counts`). A replica that reached ``H`` and waited for the slowest reports the
steps it would have taken by the arrival at its speed in the period (:func:`capped_steps`: its
``H`` steps' time and its wait, on the clock), the others their steps; the speeds are in
proportion to these figures summed over the last :data:`FILL_WINDOW` periods (the first
period's steps before the decision, taken together, left out), and the slowest's count is the
most whose period ends before the fastest's ``H``-th step (after a period in which a faster
replica reached ``H``, one fewer at most). Bytes: one all-reduce of 4 bytes per period and ``16
(n - 1)`` per sync. It needs one rank per replica (the ranks of a sharded replica would see the
arrival after different steps) and real processes (:class:`~flexdemo.SimulatedReplicas` refuses
it); it is not reproducible (the steps depend on the speeds); a dead peer's arrival never
comes: the all-reduce fails when its connection closes (at the latest at the collective's
timeout), as any lost peer's collective does.

**Overlap.** With ``tau > 0`` (and ``keep_overlap=True``: DiLoCo's setting that keeps the
steps a replica takes while its sync is in flight) each replica launches its sync at the end
of its period and applies it :attr:`Pace.delay` of its own steps later: ``tau`` counts the
fastest replica's steps, and a replica with ``k`` steps in the next period takes ``round(tau
k / H)`` of them (at least 1, at most ``k - 1``), so every replica applies it at about the
same time (an exchange's second round, the int4 reduce-scatter's all-gather, starts there).
Those steps belong to the next period (its count and weight), so every count is at least
``tau + 1`` (a count decided lower is raised to it). A filling pace launches a faster
replica's arrival after the step after its delay instead of its first (after the sync it
applied), so every replica's collectives come in the same order. An adaptive pace leaves
the wait at the apply out of its timing, as it leaves the sync's out at ``tau=0``; a timed
pace cannot overlap.

Not supported with a pace: streaming (``fragments > 1``) and ``keep_unsent`` (its residual
lives in the parameters' units, not the scaled ones). Under
fault tolerance an adaptive pace runs as :class:`~.elastic_pace.ElasticPace` (quorums at syncs
only, counts from each quorum's measurements); given counts, ``"fixed"`` and ``"fill"`` are
refused there.
A peer dropped from a gathered mean (``on_bad_peer="drop"``) leaves the others' factors as
they were, and ``clip="median"`` / ``peer_bound`` judge the scaled parts.
:class:`~flexdemo.SimulatedReplicas` steps each replica up to its sync (a replica whose next
step is its sync waits for the others, then all sync together).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..transport import (
    CommStats,
    Pending,
    ProcessGroupTransport,
    Transport,
    all_gather,
    all_reduce_bytes,
    all_reduce_sum,
    transport_for,
)
from .weights import weight_factors

__all__ = ["FILL_WINDOW", "MEASURE", "MEASURE_TIMED", "MODES", "WEIGHTS", "Pace",
           "adapted_counts", "capped_steps", "check_group", "fill_counts", "first_period",
           "make_pace", "measured_counts", "peer_speeds", "peer_steps", "step_counts",
           "step_factors"]

#: what a replica's pseudo-gradient is weighted by
WEIGHTS = ("steps", "tokens")
#: the measured modes (a string in place of the counts)
MODES = ("fixed", "adaptive", "timed", "fill")
#: a measured pace's default ``measure``: the inner steps after which it decides its counts
MEASURE = 8
#: a timed pace's: its periods end on the clock, so a rougher first measurement will do
MEASURE_TIMED = 4
#: a filling pace's speeds: each replica's steps over its last this many periods
FILL_WINDOW = 4


def step_counts(seconds_per_step: Sequence[float], inner_steps: int) -> list[int]:
    """Each replica's inner steps per period from its seconds per inner step ``s_i``, so that
    every replica's period takes about the same time, about ``inner_steps`` (H) steps of the
    fastest replica: the slowest replica takes ``k = round(H * s_fastest / s_slowest)``
    steps, which sets the period's time ``T = k * s_slowest``, and replica ``i`` takes
    ``max(1, round(T / s_i))`` (nearest, ties to even). Rounding then lands on the replicas
    with the most steps, where one step is the smallest part of the period (one of the
    fastest replica's 30 is 3%, one of a slow replica's 10 would be 10%). Where ``k`` rounds
    to 0 (a replica more than 2H times slower) the slowest takes 1 and the fastest H. Plain
    float arithmetic on the given numbers: every rank that computes it from the same
    gathered numbers gets the same counts."""
    if not isinstance(inner_steps, int) or isinstance(inner_steps, bool) or inner_steps < 1:
        raise ValueError(f"inner_steps must be an integer >= 1, got {inner_steps!r}")
    secs = [float(s) for s in seconds_per_step]
    if not secs or not all(s > 0 and s != float("inf") for s in secs):
        raise ValueError(f"seconds per step must be finite numbers > 0, got {secs}")
    fastest, slowest = min(secs), max(secs)
    k = round(inner_steps * fastest / slowest)
    period = k * slowest if k >= 1 else inner_steps * fastest
    return [max(1, round(period / s)) for s in secs]


def first_period(seconds_per_step: Sequence[float], inner_steps: int, measure: int
                 ) -> list[int]:
    """Each replica's steps in a first period whose counts were decided after ``measure``
    steps on every replica: ``measure + max(1, round((H - measure) * s_fastest / s_i))``, so
    the steps after the decision take the same time everywhere (the fastest replica's ``H -
    measure``) and every replica takes at least one before its sync."""
    secs = [float(s) for s in seconds_per_step]
    fastest = min(secs)
    rest = inner_steps - measure
    return [measure + max(1, round(rest * fastest / s)) for s in secs]


def adapted_counts(current: Sequence[int], seconds_per_step: Sequence[float],
                   inner_steps: int, tolerance: float) -> list[int] | None:
    """The adaptive mode's decision at a sync: the new counts from the seconds per step
    measured (:func:`step_counts`), or None (keep ``current``) unless some replica's new
    count ``k`` differs from its current one by more than ``tolerance * k`` (its share of the
    period's time)."""
    new = step_counts(seconds_per_step, inner_steps)
    if any(abs(a - b) > tolerance * a for a, b in zip(new, current)):
        return new
    return None


def fill_counts(steps: Sequence[float], inner_steps: int, at_most: int | None = None
                ) -> list[int]:
    """A filling pace's next counts from each replica's steps in periods that every replica
    began and ended together (``steps``, summed over the last ones: their speeds are in
    proportion; where a faster replica reached ``H`` and waited, the steps it would have
    taken, :func:`capped_steps`): the slowest (the fewest steps, the lowest rank among
    equals) takes ``k = max(1, floor(H * s_slowest / s_most))``, so its period ends before
    the fastest replica's ``H``-th step; the others the steps that fit in it, at most ``H``
    (the schedule's prediction: they fill the period). ``at_most`` (some faster replica
    reached ``H`` steps, and may have waited for the slowest): ``k`` at most that."""
    h = inner_steps
    slowest = min(range(len(steps)), key=lambda i: (steps[i], i))
    k = max(1, math.floor(h * steps[slowest] / max(steps)))
    if at_most is not None:
        k = max(1, min(k, at_most))
    return [k if i == slowest else min(h, max(1, round(k * s / steps[slowest])))
            for i, s in enumerate(steps)]


def capped_steps(steps: int, before: int, start: float, capped: float, end: float) -> float:
    """A filling pace's replica that reached ``H`` (``steps``) at clock ``capped`` and then
    waited for the slowest until ``end``: the steps it would have taken by ``end`` at its
    speed since ``start`` (where it had taken ``before`` of them), ``before + (steps -
    before) (end - start) / (capped - start)``; ``steps`` where no time is measured."""
    if not capped - start > 0 or not end >= capped:
        return float(steps)
    return before + (steps - before) * (end - start) / (capped - start)


def peer_speeds(reported: Sequence[float], steps: Sequence[int], most: int) -> list[float]:
    """A filling pace's speeds: the steps each replica would have taken in the period as it
    reported them (:func:`capped_steps`), bounded to ``[its steps, most]`` (its steps where
    the figure is not a number): no peer's report moves the counts past that."""
    return [min(max(e, float(k)), float(most)) if e == e else float(k)
            for e, k in zip(reported, steps)]


def peer_steps(reported: Sequence[float], most: int) -> list[int]:
    """Each replica's steps in a period as it reported them (gathered floats), bounded to
    ``[1, most]``: a figure above ``most`` counts as ``most``, one below 1 (or not a number)
    as 1, so that no peer's report outweighs a period's most steps nor stops the sync."""
    return [int(min(max(k, 1.0), most)) if k == k else 1 for k in reported]


def _per_replica(values: torch.Tensor, group, world: int, op, stats: CommStats
                 ) -> torch.Tensor:
    """``values`` gathered over the replicate group (one per replica), made the same on every
    rank of the job where each replica spans several ranks (a sharded replica: each of its
    ranks sits in another replicate group, has timed its own steps and counted its own
    tokens): one all-reduce over the default group, the slowest of a replica's ranks
    (``MAX``) or the sum of their tokens (``SUM``, every count there ``world`` times: the
    weights' ratios are kept). As given where every rank of the job is in ``group``."""
    if (isinstance(group, Transport) and not isinstance(group, ProcessGroupTransport)) or not (
            dist.is_available() and dist.is_initialized()):
        return values
    total = dist.get_world_size()
    if total == world:
        return values
    out = values.clone()
    start = time.perf_counter()
    dist.all_reduce(out, op=op)
    nbytes = all_reduce_bytes(out.numel(), out.element_size(), total)
    stats.record(nbytes, nbytes, time.perf_counter() - start)
    return out


def step_factors(period: Sequence[int], device: torch.device) -> torch.Tensor | None:
    """Each replica's factor ``k_i n / sum_j k_j`` from its steps ``k_i`` in a period (fp32,
    computed in float64 from the same numbers on every rank), or None where every count is
    equal (nothing is scaled)."""
    if len(set(period)) == 1:
        return None
    total = sum(period)
    return torch.tensor([k * len(period) / total for k in period], dtype=torch.float64,
                        device=device).float()


def measured_counts(seconds_per_step: float, inner_steps: int, group=None,
                    device: torch.device | str = "cpu") -> list[int]:
    """All-gather this rank's ``seconds_per_step`` over ``group`` (a process group or
    transport; default: the world) and return every replica's counts (:func:`step_counts`),
    the same on every rank: for a pace measured outside the optimizer, ``Pace(counts)``."""
    tr = transport_for(group)
    mine = torch.tensor([float(seconds_per_step)], dtype=torch.float64, device=device)
    gathered = all_gather(mine, tr, CommStats()).reshape(-1)
    return step_counts(gathered.tolist(), inner_steps)


class Pace:
    """Per-replica inner steps per period and the weights of DiLoCo's mean (see the module).

    Args:
        counts: every replica's inner steps per period, in group-rank order (each an integer
            >= 1); ``None`` or ``"fixed"`` (default): measured in the first period (fixed
            from then on); ``"adaptive"``: ``adaptive=True``; ``"timed"``: ``timed=True``;
            ``"fill"``: ``fill=True``.
        weights: ``"steps"`` (default) or ``"tokens"`` (reported by :meth:`count_tokens`).
        adaptive: measure again at every sync and change the counts past ``tolerance``.
        tolerance: a measured pace's bound (default 0.1): the counts change when some
            replica's new count differs from its current one (H before the first) by more
            than this fraction of the new count.
        measure: a measured pace's inner steps before it decides (default :data:`MEASURE`;
            the first is not timed); at least 2; ``H`` or more: the whole first period.
        timed: after the first period each replica ends its period on its own clock
            (``"timed"``; see the module).
        fill: the slowest replica takes its count and the others take steps until it
            arrives (``"fill"``; see the module).
        clock: seconds as a float, read twice per replica and measured period (default
            ``time.perf_counter``; a test gives its own).
    """

    def __init__(self, counts: Sequence[int] | str | None = None, *, weights: str = "steps",
                 adaptive: bool = False, tolerance: float = 0.1, measure: int | None = None,
                 timed: bool = False, fill: bool = False,
                 clock: Callable[[], float] | None = None) -> None:
        if isinstance(counts, str) and counts in MODES:
            timed, fill = timed or counts == "timed", fill or counts == "fill"
            adaptive, counts = adaptive or counts in ("adaptive", "timed", "fill"), None
        if timed and fill:
            raise ValueError("a pace is timed or fills, not both: give pace='timed' or "
                             "pace='fill'")
        for name, on in (("timed", timed), ("fill", fill)):
            if on and counts is not None:
                raise ValueError(f"a {name} pace measures its periods: give pace='{name}' "
                                 f"without counts, got {counts!r}")
        if counts is not None:
            if isinstance(counts, (str, bytes)) or not all(
                    isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in counts):
                raise ValueError(f"pace counts must be a list of integers >= 1 (inner steps "
                                 f"per period of each replica), got {counts!r}")
            if not counts:
                raise ValueError("pace counts must name one count per replica, got none")
        if weights not in WEIGHTS:
            raise ValueError(f"pace weights must be one of {WEIGHTS}, got {weights!r}")
        if (isinstance(tolerance, bool) or not isinstance(tolerance, (int, float))
                or not 0.0 <= tolerance < 1.0):
            raise ValueError(f"pace tolerance must be a fraction in [0, 1), got "
                             f"{tolerance!r}")
        if measure is None:  # a timed pace corrects its first period on the clock: fewer
            measure = MEASURE_TIMED if timed or fill else MEASURE  # steps at the slowest's
        if isinstance(measure, bool) or not isinstance(measure, int) or measure < 2:
            raise ValueError(f"pace measure must be an integer >= 2 (inner steps timed before "
                             f"the counts are decided, the first untimed), got {measure!r}")
        self.adaptive, self.tolerance = bool(adaptive or timed or fill), float(tolerance)
        #: every period after the first lasts a time, not a count (see the module)
        self.timed = bool(timed)
        #: a period ends when the slowest replica has taken its count (see the module)
        self.fill = bool(fill)
        self.measure = measure
        self.given = None if counts is None else [int(k) for k in counts]
        self.weights = weights
        self.clock = time.perf_counter if clock is None else clock
        #: the counts in effect (None while the first period measures)
        self.counts: list[int] | None = None if self.given is None else list(self.given)
        #: inner steps this replica has taken since its last sync
        self.since = 0
        #: syncs taken (counted at each sync, from 1)
        self.synced = 0
        #: ``(sync, counts)`` each time a measurement set the counts (at that sync, in force
        #: from the next period)
        self.changes: list[tuple[int, list[int]]] = []
        self._bound = False

    def settings(self) -> tuple:
        """What every replica must share (the ranks' settings are compared at set-up)."""
        measured = (("measure", self.measure, "tolerance", self.tolerance)
                    if self.given is None or self.adaptive else ())
        return ("counts", self.given, "weights", self.weights, *measured,
                *(("adaptive",) if self.adaptive else ()), *(("timed",) if self.timed else ()),
                *(("fill",) if self.fill else ()))

    def __repr__(self) -> str:
        mode = "'adaptive'" if self.adaptive and self.given is None else "'fixed'"
        mode = "'timed'" if self.timed else "'fill'" if self.fill else mode
        counts = mode if self.given is None else repr(self.given)
        extra = f", adaptive=True, tolerance={self.tolerance}" if self.adaptive else ""
        extra = f", tolerance={self.tolerance}" if self.given is None else extra
        if self.measure != (MEASURE_TIMED if self.timed or self.fill else MEASURE) and (
                self.given is None):
            extra += f", measure={self.measure}"
        return f"Pace(counts={counts}, weights={self.weights!r}{extra})"

    #: an :class:`~.elastic_pace.ElasticPace` (under fault tolerance)
    elastic = False
    #: DiLoCo's ``tau``: each sync is applied this many steps after its launch (set by
    #: :func:`make_pace`; every count exceeds it)
    overlap = 0

    @property
    def bound(self) -> bool:
        """Whether a replicator has set it up."""
        return self._bound

    def local_next(self) -> bool:
        """Whether the next step may run outside a quorum (only under fault tolerance)."""
        return False

    def joined(self) -> None:
        """Healed into the peers' state (only under fault tolerance)."""

    @property
    def lockstep(self) -> bool:
        """Every replica takes the same steps per period throughout (given equal counts, not
        adaptive)."""
        return self.given is not None and len(set(self.given)) == 1 and not self.adaptive

    # ------------------------------------------------------------------ set-up
    def setup(self, inner_steps: int, world: int, rank: int, device: torch.device) -> None:
        """Bind to DiLoCo's ``inner_steps`` (H) and this rank of a group of ``world``."""
        if self._bound:
            raise ValueError("this Pace is already in use by another replicator; give each "
                             "its own")
        if self.given is not None and len(self.given) != world:
            raise ValueError(f"pace counts name {len(self.given)} replicas, the group has "
                             f"{world}: give one count per replica, in group-rank order")
        self._bound = True
        self.inner_steps, self.world, self.rank = inner_steps, world, rank
        self.device = torch.device(device)
        if self.counts is None and (inner_steps == 1 or world == 1):
            self.counts = [inner_steps] * world  # nothing to measure: one step is the least
        self.since = 0
        #: every replica's steps up to the last sync (the same on every rank)
        self.steps_done = [0] * world
        self._first_period: list[int] | None = None  # the first period's, decided early
        self._refine = False  # fixed mode: the rest of an early-decided period is timed too
        self._tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        self._start: float | None = None  # the clock where the measured steps start
        self._first = 1  # the steps of the period taken before that reading
        self._stop: float | None = None  # and at the end of the period's last step
        self._marks: list[float] = []  # the clock after each step before an early decision
        self._target: float | None = None  # timed: the period's seconds (once measured)
        self._taken = 0  # timed: the steps of the period that just ended
        self._own = 0.0  # timed: this replica's seconds per step, as last gathered
        self._offset = 0.0  # timed: the period's seconds before ``_start``
        self._arrival: Pending | None = None  # fill: this replica's arrival, in flight
        self._filled = False  # fill: the period that just ended was filled (not measured)
        self._lockstep = 0  # fill: its steps before the first decision (taken together)
        self._recent: list[list[float]] = []  # fill: each replica's steps, the last periods
        self._t0: float | None = None  # fill: the clock at the period's start (after the
        # first decision: after its ``_lockstep`` steps)
        self._effective = 0.0  # fill: the steps this replica would have taken (capped_steps)
        #: tau > 0: the steps after its launch at which this replica applies a sync (set at
        #: each sync, :meth:`factors`)
        self.delay = self.overlap

    @property
    def measures(self) -> bool:
        """Whether this period is timed: the first of a measured pace (the rest of it after an
        early decision too), or any adaptive one (over more than one replica, H > 1)."""
        if self.fill and self.counts is not None:  # counted, not timed, once decided
            return False
        return self.counts is None or self._refine or (self.adaptive and self.world > 1
                                                       and self.inner_steps > 1)

    @property
    def period(self) -> list[int]:
        """Every replica's inner steps in the current period (the same on every rank)."""
        if self._first_period is not None:
            return list(self._first_period)
        return [self.inner_steps] * self.world if self.counts is None else list(self.counts)

    @property
    def count(self) -> int:
        """This replica's inner steps in the current period."""
        return self.period[self.rank]

    def period_position(self) -> float:
        """Where this replica's next step stands in its period, in steps of the fastest
        replica (from 0 to H): ``since * H / count``; in a first period decided early, its
        steps up to the decision count one each and the rest ``(H - measure) / (count -
        measure)`` each (a learning-rate schedule that follows the run, not the replica)."""
        if self._first_period is not None and self.since > self.measure:
            m = self.measure
            return m + (self.since - m) * (self.inner_steps - m) / (self.count - m)
        return min(self.since * self.inner_steps / self.count, float(self.inner_steps))

    def _times_each_step(self) -> bool:
        """Whether the step just taken is one of the first ``measure`` of a period of a
        measured pace whose counts are still unknown (each timed; the counts decided after
        the last of them)."""
        return (self.counts is None and self.since <= self.measure < self.inner_steps
                and self.world > 1)

    # ------------------------------------------------------------------ stepping
    def count_tokens(self, n: int | float | torch.Tensor) -> None:
        """Add ``n`` tokens (an int, or a tensor on the replicator's device: no host read) to
        this replica's weight at the next sync; a step's tokens go in before that step's
        ``opt.step()``. Nothing under ``weights="steps"``."""
        if self.weights == "tokens":
            self._tokens.add_(n)

    def after_step(self, group=None, stats: CommStats | None = None) -> bool:
        """After an inner step (skipped ones too): whether this replica syncs now. The step
        after which a measured pace decides (its ``measure``-th) all-gathers the seconds
        over ``group`` (the replicator's transport), every replica at the same step."""
        if self.timed and self._target is not None:
            return self._timed_step()
        if self.fill and self.world > 1 and self.counts is not None:
            return self._fill_step(group, CommStats() if stats is None else stats)
        self.since += 1
        if self._times_each_step():  # the steps before an early decision: each one timed
            self._marks.append(self._read())
            if self.since == self.measure:
                self._decide_early(group, CommStats() if stats is None else stats)
        elif self.measures:  # the end of the period's last step, or of its first
            if self.since == self.count and self._start is not None:
                self._stop = self._read()
            elif self._start is None:  # a period's first step, or the first after a resume
                self._start, self._first = self._read(), self.since
        if self.since < self.count:
            return False
        self.since = 0
        return True

    def _timed_step(self) -> bool:
        """After a step of a timed period: whether it ends the period (this replica syncs
        now): when another step, at this replica's last measured seconds per step, would end
        more than half a step past the period's time, or at ``2H`` steps."""
        assert self._target is not None
        self.since += 1
        now = self._read()
        if self._start is None:  # resumed mid-period: timed from here, the steps before at
            self._start, self._first = now, self.since  # the measured pace
            self._offset = self.since * self._own
        elapsed = now - self._start + self._offset
        if elapsed + 0.5 * self._own < self._target and self.since < 2 * self.inner_steps:
            return False
        self._stop, self._taken, self.since = now, self.since, 0
        return True

    def binding(self) -> int:
        """Fill: the replica whose count ends the period (the fewest steps in the period,
        the lowest rank among equals)."""
        period = self.period
        return min(range(self.world), key=lambda i: (period[i], i))

    def _fill_step(self, group, stats: CommStats) -> bool:
        """After a step of a filling pace: whether it ends the period. This replica's arrival
        (a one-number all-reduce, launched without waiting) goes out after its count if it
        is the binding replica (:meth:`binding`), after its first step otherwise (after
        ``measure`` steps in the first period); the period ends when every replica's has
        arrived: the binding replica waits for it, the others look after each step (no
        wait) and take another while it has not, at most ``H`` steps."""
        self.since += 1
        binding = self.binding()
        first = self.delay + 1  # (after the sync in flight is applied: the same order)
        if self._arrival is None and self.since >= (self.count if binding == self.rank
                                                    else first):
            flag = torch.ones(1, dtype=torch.float32, device=self.device)
            self._arrival = all_reduce_sum(flag, group, stats, async_op=True)
        if self._arrival is None:
            return False
        if not (binding == self.rank or self.since >= self.inner_steps
                or self._arrival.done()):
            return False
        # capped at H before the slowest arrived: the wait is timed (capped_steps)
        t0 = self._t0 if binding != self.rank and not self._arrival.done() else None
        t_cap = 0.0 if t0 is None else self._read()
        self._arrival.wait()  # (done already, or the binding replica's wait for the others)
        self._effective = float(self.since) if t0 is None else capped_steps(
            self.since, self._lockstep, t0, t_cap, self._read())
        self._arrival, self._taken, self.since = None, self.since, 0
        self._filled = True
        return True

    def _fill_factors(self, group, stats: CommStats) -> torch.Tensor | None:
        """At the sync of a filling pace: every replica's steps in the period and the steps
        it would have taken all-gathered (two float64 each, bounded: :func:`peer_steps`,
        :func:`peer_speeds`), the next counts (:func:`fill_counts` of the second over the
        last :data:`FILL_WINDOW` periods; where a faster replica reached ``H``, the slowest's
        count one step fewer at most), and the factors of the steps (or tokens) each
        replica took."""
        self._filled = False
        mine = torch.tensor([float(self._taken), self._effective], dtype=torch.float64,
                            device=self.device)
        host = all_gather(mine, group, stats).reshape(-1, 2).tolist()  # one host read a sync
        h = self.inner_steps
        period = peer_steps([k for k, _ in host], h)
        speed = peer_speeds([e for _, e in host], period, 4 * h)
        binding = self.binding()
        self._ended(period)
        assert self.counts is not None  # (a fill follows the first decision)
        capped = any(k >= h for i, k in enumerate(period) if i != binding)
        own = [max(e - self._lockstep, 1.0) for e in speed]  # (less the steps taken together)
        self._recent, self._lockstep = (self._recent + [own])[-FILL_WINDOW:], 0
        new = fill_counts([sum(p[i] for p in self._recent) for i in range(self.world)], h,
                          self.counts[binding] - 1 if capped else None)
        self._set_counts(new)
        return self._weights(period, group, stats)

    def _decide_early(self, group, stats: CommStats) -> None:
        """The counts from the first ``measure`` steps (the median of steps 2 to ``measure``:
        a warm-up or a hiccup in one of them does not count), and the first period's own
        steps (:func:`first_period`); without a measurement on some replica (timed from its
        first step: not after a resume in between), every replica times the rest of the
        period instead (decided at the sync)."""
        marks, self._marks = self._marks, []
        secs = 0.0
        if len(marks) == self.measure:
            secs = statistics.median(b - a for a, b in zip(marks, marks[1:]))
        changes = len(self.changes)
        gathered = self._measured(group, stats, secs)
        if gathered is not None and len(self.changes) > changes:  # counts set: balance the rest
            first = self._floor(first_period(gathered, self.inner_steps, self.measure))
            self._first_period = None if first == self.counts else first
        self._refine = self.counts is not None and not self.adaptive
        self._lockstep = self.since if self.fill else 0
        if self.fill:  # (its first fill period: from here)
            self._t0 = self.clock()
        if self.measures:
            self._start, self._first = self._read(), self.measure  # the rest is timed
        if self.timed and gathered is not None:  # the rest of the period is timed already:
            self._set_target(gathered)  # every replica leaves the decision together, as
            self._offset = self.measure * min(gathered)  # if after the fastest's steps

    def start_period(self) -> None:
        """After a sync completed (adaptive mode): the next period's steps are timed from
        here; nothing otherwise."""
        if self.adaptive and self.measures:
            self._start, self._first, self._offset = self._read(), 0, 0.0
        elif self.fill:  # (the device was synchronised by the sync's host read)
            self._t0 = self.clock()

    def _read(self) -> float:
        """The clock, a CUDA device synchronised first (only when timing)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.clock()

    @contextmanager
    def left_out(self) -> Iterator[None]:
        """What runs within (a sync applied within the period: its wait) is left out of the
        time measured for this period's steps (nothing is read when none is measured)."""
        t0 = self._read() if self.measures and self._start is not None else None
        yield
        if t0 is not None and self._start is not None:
            self._start += self._read() - t0

    def factors(self, group, stats: CommStats) -> torch.Tensor | None:
        """At a sync, on every rank of ``group``: the factor of each rank's pseudo-gradient
        (fp32, ``(world,)``, on the device, the same on every rank), or None where every
        weight is equal and nothing is scaled. Fixes the counts first when the period just
        ended measured them (the one host read of a pace); then :attr:`delay`."""
        out = self._factors(group, stats)
        if self.overlap:  # tau of the fastest replica's steps, in this replica's own
            k = self.count
            self.delay = min(k - 1, max(1, round(self.overlap * k / self.inner_steps)))
        return out

    def _factors(self, group, stats: CommStats) -> torch.Tensor | None:
        self.synced += 1
        if self.timed and self._target is not None:
            return self._timed_factors(group, stats)
        if self.fill and self._filled:
            return self._fill_factors(group, stats)
        period = self.period
        self._ended(period)
        if self.world <= 1:
            return None
        if self.measures:
            n, secs = period[self.rank] - self._first, 0.0  # 0: none measured
            if self._start is not None and self._stop is not None and n > 0:
                secs = (self._stop - self._start) / n
            gathered = self._measured(group, stats, secs)
            self._refine = False
            if self.timed and gathered is not None:  # timed periods from the next one on
                self._set_target(gathered)
        return self._weights(period, group, stats)

    def _weights(self, period: list[int], group, stats: CommStats) -> torch.Tensor | None:
        """The factors of each replica's steps in ``period`` (None where they are equal), or
        of its tokens (all-gathered; the steps where none reported any)."""
        if self.weights == "steps":
            return step_factors(period, self.device)
        tokens = _per_replica(all_gather(self._tokens.reshape(1), group, stats).reshape(-1),
                              group, self.world, dist.ReduceOp.SUM, stats)
        self._tokens.zero_()
        steps = torch.tensor(period, dtype=torch.float64, device=self.device)
        return weight_factors(tokens, steps)

    def _timed_factors(self, group, stats: CommStats) -> torch.Tensor | None:
        """At the sync of a timed period: every replica's seconds per step and steps in it
        all-gathered (two float64 each; a peer's steps bounded to ``[1, 2H]``:
        :func:`peer_steps`), the next counts (a prediction) and period's time from them, and
        the factors of the steps (or tokens) each replica took."""
        n = self._taken - self._first
        secs = (self._stop - self._start) / n if (
            self._start is not None and self._stop is not None and n > 0) else 0.0
        mine = torch.tensor([secs, float(self._taken)], dtype=torch.float64,
                            device=self.device)
        host = all_gather(mine, group, stats).reshape(-1, 2).tolist()  # one host read a sync
        self._start = self._stop = None
        period = peer_steps([k for _, k in host], 2 * self.inner_steps)
        self._ended(period)
        self._set_target([s for s, _ in host])
        return self._weights(period, group, stats)

    def _set_target(self, gathered: list[float]) -> None:
        """Timed: from every replica's seconds per step, the next period's time (the fastest
        replica's ``H`` steps) and the counts it predicts (:func:`step_counts`); kept as they
        are without a measurement on some replica."""
        if not all(s > 0 and s != float("inf") for s in gathered):
            return
        self._target = self.inner_steps * min(gathered)
        self._own = gathered[self.rank]
        self._set_counts(step_counts(gathered, self.inner_steps))

    def _ended(self, period: list[int]) -> None:
        """At a sync: the period that just ended, with every replica's steps in it, is
        done (counted in :attr:`steps_done`; a first period's own counts are over)."""
        self.steps_done = [a + b for a, b in zip(self.steps_done, period)]
        self._first_period = None

    def _floor(self, counts: list[int]) -> list[int]:
        """``counts`` with each at least ``tau + 1`` (a sync in flight is applied first)."""
        return [max(k, self.overlap + 1) for k in counts]

    def _set_counts(self, new: list[int]) -> None:
        """The counts in force from the next period (at least ``tau + 1`` each), recorded in
        :attr:`changes` when they change."""
        new = self._floor(new)
        if new != self.counts:
            self.counts = new
            self.changes.append((self.synced, list(new)))

    def _measured(self, group, stats: CommStats, secs: float) -> list[float] | None:
        """All-gather this replica's seconds per step (``secs``; 0: none measured) and set
        the counts from them, every rank alike: fixed from the first measurement, or
        (adaptive) changed past the tolerance; the seconds gathered. Without a measurement
        on some rank the counts stay (the first period's: measure again) and the result is
        None."""
        mine = torch.tensor([secs], dtype=torch.float64, device=self.device)
        gathered = _per_replica(all_gather(mine, group, stats).reshape(-1), group, self.world,
                                dist.ReduceOp.MAX, stats).tolist()  # a host read a sync
        self._start = self._stop = None
        if not all(s > 0 and s != float("inf") for s in gathered):
            return None
        current = self.counts or [self.inner_steps] * self.world
        new = adapted_counts(current, gathered, self.inner_steps, self.tolerance)
        self.counts = current  # (within the tolerance: kept)
        if new is not None:
            self._set_counts(new)
        return gathered

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"counts": None if self.counts is None else list(self.counts),
                "first_period": (None if self._first_period is None
                                 else list(self._first_period)),
                "steps_done": list(self.steps_done), "refine": self._refine,
                "since": self.since, "tokens": self._tokens.clone(), "synced": self.synced,
                "target": self._target, "own": self._own, "delay": self.delay,
                "changes": [[j, list(k)] for j, k in self.changes]}

    def load_state_dict(self, state: dict | None) -> None:
        if state is None:
            raise ValueError("the DiLoCo state has no pace (saved without pace=?); build the "
                             "replicator as it was saved")
        counts = state["counts"]
        if counts is not None and len(counts) != self.world:
            raise ValueError(f"the saved pace counts name {len(counts)} replicas, the group "
                             f"has {self.world}")
        if (self.given is not None and counts is not None and list(counts) != self.given
                and not self.adaptive):
            raise ValueError(f"the saved pace counts {list(counts)} differ from the given "
                             f"{self.given}; build the replicator with the saved ones")
        self.counts = None if counts is None else [int(k) for k in counts]
        first = state.get("first_period")
        self._first_period = None if first is None else [int(k) for k in first]
        self.steps_done = [int(k) for k in state.get("steps_done", [0] * self.world)]
        self._refine = bool(state.get("refine", False))
        self.since = int(state["since"])
        self._tokens.copy_(state["tokens"])
        self.synced = int(state.get("synced", 0))
        self.changes = [(int(j), [int(k) for k in c]) for j, c in state.get("changes", [])]
        target = state.get("target")
        self._target = None if target is None else float(target)
        self._own = float(state.get("own", 0.0))
        self.delay = int(state.get("delay", self.overlap))
        self._start = self._stop = None  # a measurement interrupted is taken again
        self._marks = []
        self._arrival, self._filled = None, False  # (fill: launched after the next step)


def check_group(pace: Pace, group) -> None:
    """Refuse a timed or filling ``pace`` whose replicas span several ranks of the job
    (``group``, the replicate group, a process group smaller than the job): each rank would
    end the period on its own clock, or see the slowest replica arrive after a different
    step."""
    in_process = isinstance(group, Transport) and not isinstance(group, ProcessGroupTransport)
    sharded = (not in_process and dist.is_available() and dist.is_initialized()
               and dist.get_world_size() != pace.world)
    if pace.timed and not pace.elastic and sharded:
        raise ValueError("pace='timed' ends each replica's period on its own clock, and the "
                         "ranks of a sharded replica would each read their own: use one rank "
                         "per replica (shard=1), or pace='adaptive'")
    if pace.fill and sharded:
        raise ValueError("pace='fill' ends each replica's period when the slowest arrives, "
                         "and the ranks of a sharded replica would each see it after a "
                         "different step: use one rank per replica (shard=1), or "
                         "pace='adaptive'")


def make_pace(spec: Pace | Sequence[int] | str | None, *, fragments: int, tau: int,
              keep_unsent: bool, keep_overlap: bool = False) -> Pace | None:
    """DiLoCo's ``pace=`` setting: a :class:`Pace` (copied: each replicator runs its own),
    ``"fixed"`` (``Pace()``), ``"adaptive"`` (``Pace(adaptive=True)``), a list of counts
    (``Pace(counts)``) or None; refused with the settings it does not support. With ``tau >
    0`` (and ``keep_overlap``) every count is at least ``tau + 1``."""
    if spec is None:
        return None
    if isinstance(spec, str):
        if spec not in MODES:
            raise ValueError(f"pace must be a Pace, a list of counts, 'fixed', 'adaptive', "
                             f"'timed' or 'fill', got {spec!r}")
        pace = Pace(spec)
    elif isinstance(spec, Pace):
        pace = Pace(spec.given, weights=spec.weights, adaptive=spec.adaptive,
                    tolerance=spec.tolerance, measure=spec.measure, timed=spec.timed,
                    fill=spec.fill, clock=spec.clock)
    else:
        pace = Pace(list(spec))
    if fragments != 1 or keep_unsent:
        raise ValueError("pace= (replicas of different speeds) needs fragments=1 and "
                         f"keep_unsent=False, got fragments={fragments}, "
                         f"keep_unsent={keep_unsent}")
    if tau and not keep_overlap:
        raise ValueError(f"pace= with tau={tau} needs keep_overlap=True: the steps a replica "
                         "takes while its sync is in flight count in its next period (its "
                         "weight), so they must stay in its parameters")
    if tau and pace.timed:
        raise ValueError("pace='timed' ends each period on the clock and cannot overlap its "
                         "syncs (tau > 0): use pace='fill' or 'adaptive' with tau, or tau=0")
    if pace.given is not None and tau and min(pace.given) <= tau:
        raise ValueError(f"pace counts must exceed tau={tau} (a replica applies its sync "
                         f"tau steps after launching it, before its next), got {pace.given}")
    pace.overlap = tau
    return pace
