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
``Pace()`` (``"fixed"``) measures them: the first period runs ``H`` steps on every replica, as
without a pace, each replica timing its own inner steps (seconds from the end of its first step
of the period to the end of its ``H``-th, over ``H - 1`` steps; a CUDA device is synchronised at
those two points only). At the first sync the seconds per step are all-gathered (8 bytes per
replica, once) and every rank computes the same counts from the same gathered numbers
(:func:`step_counts`): the period lasts ``H`` steps of the fastest replica, and replica ``i``
takes ``max(1, round(H * s_fastest / s_i))`` (no replica more than ``H``). A replica whose
measurement is incomplete (a run resumed in the middle of the first period) reports none, and
then every replica keeps ``H`` and measures the next period. The counts are part of the state
(``state_dict``): a resumed run does not measure again and continues bitwise as the run that
saved it. The measurement itself reads a clock: to repeat a run bit for bit, give the counts
it measured (``opt.replicators[0].pace.counts``).

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

Not supported with a pace: streaming (``fragments > 1``), overlap (``tau > 0``),
``keep_unsent`` (its residual lives in the parameters' units, not the scaled ones), fault
tolerance, and :class:`~flexdemo.SimulatedReplicas` with unequal counts (it steps every replica
in lockstep). A peer dropped from a gathered mean (``on_bad_peer="drop"``) leaves the others'
factors as they were, and ``clip="median"`` / ``peer_bound`` judge the scaled parts.
Not built yet: an adaptive mode that re-measures the speeds at later syncs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from ..transport import CommStats, all_gather, transport_for

__all__ = ["WEIGHTS", "Pace", "make_pace", "measured_counts", "step_counts"]

#: what a replica's pseudo-gradient is weighted by
WEIGHTS = ("steps", "tokens")


def step_counts(seconds_per_step: Sequence[float], inner_steps: int) -> list[int]:
    """Each replica's inner steps per period from its seconds per inner step: the period lasts
    ``inner_steps`` (H) steps of the fastest replica, and replica ``i`` takes ``max(1,
    round(H * s_fastest / s_i))`` (nearest, ties to even; never more than H). Plain float
    arithmetic on the given numbers: every rank that computes it from the same gathered
    numbers gets the same counts."""
    if not isinstance(inner_steps, int) or isinstance(inner_steps, bool) or inner_steps < 1:
        raise ValueError(f"inner_steps must be an integer >= 1, got {inner_steps!r}")
    secs = [float(s) for s in seconds_per_step]
    if not secs or not all(s > 0 and s != float("inf") for s in secs):
        raise ValueError(f"seconds per step must be finite numbers > 0, got {secs}")
    fastest = min(secs)
    return [max(1, round(inner_steps * fastest / s)) for s in secs]


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
            >= 1); ``None`` (default): measured in the first period (fixed from then on).
        weights: ``"steps"`` (default) or ``"tokens"`` (reported by :meth:`count_tokens`).
        clock: seconds as a float, read twice per replica to measure (default
            ``time.perf_counter``; a test gives its own).
    """

    def __init__(self, counts: Sequence[int] | None = None, *, weights: str = "steps",
                 clock: Callable[[], float] | None = None) -> None:
        if counts is not None:
            if isinstance(counts, (str, bytes)) or not all(
                    isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in counts):
                raise ValueError(f"pace counts must be a list of integers >= 1 (inner steps "
                                 f"per period of each replica), got {counts!r}")
            if not counts:
                raise ValueError("pace counts must name one count per replica, got none")
        if weights not in WEIGHTS:
            raise ValueError(f"pace weights must be one of {WEIGHTS}, got {weights!r}")
        self.given = None if counts is None else [int(k) for k in counts]
        self.weights = weights
        self.clock = time.perf_counter if clock is None else clock
        #: the counts in effect (None while the first period measures)
        self.counts: list[int] | None = None if self.given is None else list(self.given)
        #: inner steps this replica has taken since its last sync
        self.since = 0
        self._bound = False

    def settings(self) -> tuple:
        """What every replica must share (the ranks' settings are compared at set-up)."""
        return ("counts", self.given, "weights", self.weights)

    def __repr__(self) -> str:
        counts = "'fixed'" if self.given is None else repr(self.given)
        return f"Pace(counts={counts}, weights={self.weights!r})"

    @property
    def lockstep(self) -> bool:
        """Every replica takes the same steps per period from the start (given equal counts)."""
        return self.given is not None and len(set(self.given)) == 1

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
        self._tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        self._start: float | None = None  # the clock at the end of the period's first step
        self._stop: float | None = None  # and at the end of its H-th (measuring)

    @property
    def count(self) -> int:
        """This replica's inner steps in the current period."""
        return self.inner_steps if self.counts is None else self.counts[self.rank]

    # ------------------------------------------------------------------ stepping
    def count_tokens(self, n: int | float | torch.Tensor) -> None:
        """Add ``n`` tokens (an int, or a tensor on the replicator's device: no host read) to
        this replica's weight at the next sync; a step's tokens go in before that step's
        ``opt.step()``. Nothing under ``weights="steps"``."""
        if self.weights == "tokens":
            self._tokens.add_(n)

    def after_step(self) -> bool:
        """After an inner step (skipped ones too): whether this replica syncs now."""
        self.since += 1
        if self.counts is None and self.since in (1, self.inner_steps):  # measuring
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if self.since == 1:
                self._start = self.clock()
            else:
                self._stop = self.clock()
        if self.since < self.count:
            return False
        self.since = 0
        return True

    def factors(self, group, stats: CommStats) -> torch.Tensor | None:
        """At a sync, on every rank of ``group``: the factor of each rank's pseudo-gradient
        (fp32, ``(world,)``, on the device, the same on every rank), or None where every
        weight is equal and nothing is scaled. Fixes the counts first when the period just
        ended measured them (the one host read of a pace)."""
        if self.world <= 1:
            return None
        period = [self.count] * self.world if self.counts is None else list(self.counts)
        if self.counts is None:
            self._fix_counts(group, stats)
        if self.weights == "steps":
            if len(set(period)) == 1:
                return None
            total = sum(period)
            return torch.tensor([k * self.world / total for k in period],
                                dtype=torch.float64, device=self.device).float()
        tokens = all_gather(self._tokens.reshape(1), group, stats).reshape(-1)
        self._tokens.zero_()
        steps = torch.tensor(period, dtype=torch.float64, device=self.device)
        w = torch.where(tokens.sum() > 0, tokens, steps)
        equal = (w == w[0]).all()
        return torch.where(equal, torch.ones_like(w), w * self.world / w.sum()).float()

    def _fix_counts(self, group, stats: CommStats) -> None:
        """All-gather the seconds per step measured in the period that just ended and fix the
        counts from them (every rank alike); without a measurement on some rank, measure
        again."""
        secs = 0.0  # none measured
        if self._start is not None and self._stop is not None and self.inner_steps > 1:
            secs = (self._stop - self._start) / (self.inner_steps - 1)
        mine = torch.tensor([secs], dtype=torch.float64, device=self.device)
        gathered = all_gather(mine, group, stats).reshape(-1).tolist()
        self._start = self._stop = None
        if all(s > 0 and s != float("inf") for s in gathered):
            self.counts = step_counts(gathered, self.inner_steps)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"counts": None if self.counts is None else list(self.counts),
                "since": self.since, "tokens": self._tokens.clone()}

    def load_state_dict(self, state: dict | None) -> None:
        if state is None:
            raise ValueError("the DiLoCo state has no pace (saved without pace=?); build the "
                             "replicator as it was saved")
        counts = state["counts"]
        if counts is not None and len(counts) != self.world:
            raise ValueError(f"the saved pace counts name {len(counts)} replicas, the group "
                             f"has {self.world}")
        if self.given is not None and counts is not None and list(counts) != self.given:
            raise ValueError(f"the saved pace counts {list(counts)} differ from the given "
                             f"{self.given}; build the replicator with the saved ones")
        self.counts = None if counts is None else [int(k) for k in counts]
        self.since = int(state["since"])
        self._tokens.copy_(state["tokens"])
        self._start = self._stop = None  # a measurement interrupted is taken again


def make_pace(spec: Pace | Sequence[int] | str | None, *, fragments: int, tau: int,
              keep_unsent: bool) -> Pace | None:
    """DiLoCo's ``pace=`` setting: a :class:`Pace` (copied: each replicator runs its own),
    ``"fixed"`` (``Pace()``), a list of counts (``Pace(counts)``) or None; refused with the
    settings it does not support."""
    if spec is None:
        return None
    if isinstance(spec, str):
        if spec != "fixed":
            raise ValueError(f"pace must be a Pace, a list of counts or 'fixed', got {spec!r}")
        pace = Pace()
    elif isinstance(spec, Pace):
        pace = Pace(spec.given, weights=spec.weights, clock=spec.clock)
    else:
        pace = Pace(list(spec))
    if fragments != 1 or tau or keep_unsent:
        raise ValueError("pace= (replicas of different speeds) needs fragments=1, tau=0 and "
                         f"keep_unsent=False, got fragments={fragments}, tau={tau}, "
                         f"keep_unsent={keep_unsent}")
    return pace
