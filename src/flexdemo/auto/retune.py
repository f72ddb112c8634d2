"""Retuning during a run: the exchanges' own times show when the link changes.

Every step adds to a window what this rank measured in-band: its wall time (from the start of
one optimizer step to the next), the communication seconds the replicator recorded (what the
step waited for: the exposed part) and the bytes it sent. At a **check**, every ``max(period,
every)`` steps and at a step where no exchange is in flight (a safe boundary: DiLoCo's syncs
applied, any step for full sync), the window gives this rank's estimate of the link: the
bandwidth at which the chosen strategy's syncs would take the time they took (for syncs that
overlap ``tau`` steps, only when some of them was exposed: a hidden sync says only that the
link is fast enough; a window whose bytes take under 5 ms on the wire says nothing either).
One all-gather makes the ranks agree: the largest bandwidth and the smallest exposed share
(the rank that waited least arrived last, so its wait is the link's and not a slower peer's),
the largest compute. A link more than ``factor`` (2) times faster than the one the decision
assumed, or slower with an exposed share over the budget, at ``checks`` (2) checks in a row,
takes a new decision at that check, on every rank at the same step. A link that
**collapses** (more than ``COLLAPSE_RATIO`` (10) times slower, with over ``COLLAPSE_SHARE``
(half) of the steps exposed) takes it at the first check: a second check would cost another
window of steps at that price (full sync on a link that fell from 1 Gbit/s to 10 Mbit/s: 10
steps at three times their time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .choose import Sizing
from .link import Link

__all__ = ["COLLAPSE_RATIO", "COLLAPSE_SHARE", "MIN_WIRE_SECONDS", "Retuner", "Window"]

#: a window whose bytes take less than this on the wire (measured or assumed) tells the
#: latency, not the bandwidth: it does not count
MIN_WIRE_SECONDS = 0.005
#: a link this many times slower than assumed, with this share of the steps exposed, has
#: collapsed: one check decides (a loaded machine's noise measured at most 6.6x and 12%)
COLLAPSE_RATIO = 10.0
COLLAPSE_SHARE = 0.5


@dataclass
class Window:
    """The steps since the last check: ``[seconds, exposed, bytes, collectives]`` each (the
    last step's seconds are known at the next step's start: 0 until then)."""

    steps: list[list[float]] = field(default_factory=list)

    def step_done(self, exposed: float, nbytes: int, collectives: int) -> None:
        self.steps.append([0.0, float(exposed), float(nbytes), float(collectives)])

    def step_time(self, seconds: float) -> None:
        if self.steps and self.steps[-1][0] == 0.0:
            self.steps[-1][0] = seconds

    def estimate(self, link: Link, sizing: Sizing) -> tuple[float, float, float]:
        """This rank's ``(bandwidth, compute, share)``: the bandwidth that explains the
        window's syncs (``inf`` when they tell nothing: none sent, or all hidden behind
        compute), the compute seconds per step and the exposed share of the steps; over the
        steps whose time is known."""
        done = [s for s in self.steps if s[0] > 0]
        if not done:
            return math.inf, 0.0, 0.0
        seconds, exposed, nbytes, colls = (sum(col) for col in zip(*done))
        compute = max(seconds - exposed, 0.0) / len(done)
        share = exposed / seconds
        syncs = sum(1 for s in done if s[2] > 0)
        if not syncs or (sizing.overlap and exposed <= 1e-3 * seconds):
            return math.inf, compute, share
        wire = exposed + syncs * sizing.overlap * compute - colls * link.latency
        if max(wire, nbytes / link.bandwidth) < MIN_WIRE_SECONDS:  # latency, not bytes
            return math.inf, compute, share
        return nbytes / max(wire, 1e-9), compute, share


class Retuner:
    """When to check, and the verdict of the agreed checks (see the module)."""

    def __init__(self, factor: float = 2.0, checks: int = 2, every: int = 10) -> None:
        self.factor, self.checks, self.every = factor, checks, every
        self.window = Window()
        self.strikes = 0  # checks in a row that saw the same change
        self.direction = 0  # +1: slower, -1: faster
        self.due = False

    def after_step(self, step: int, period: int) -> None:
        if (step + 1) % max(period, self.every) == 0:
            self.due = True

    def verdict(self, assumed: Link, bandwidth: float, share: float, budget: float) -> bool:
        """Count an agreed check that measured ``bandwidth`` and an exposed ``share`` of the
        steps; whether to retune now. A slower link counts only when it costs: its exposed
        share is over the ``budget`` (a few ms of noise in a window are not a link)."""
        self.window = Window()
        self.due = False
        if not math.isfinite(bandwidth):
            self.strikes, self.direction = 0, 0
            return False
        ratio = assumed.bandwidth / bandwidth
        slower = ratio > self.factor and share > budget
        direction = 1 if slower else -1 if ratio < 1 / self.factor else 0
        if direction == 0:
            self.strikes, self.direction = 0, 0
            return False
        self.strikes = self.strikes + 1 if direction == self.direction else 1
        self.direction = direction
        collapsed = slower and ratio > COLLAPSE_RATIO and share > COLLAPSE_SHARE
        if self.strikes >= self.checks or collapsed:
            self.strikes, self.direction = 0, 0
            return True
        return False

    def state_dict(self) -> dict:
        return {"steps": [list(s) for s in self.window.steps], "strikes": self.strikes,
                "direction": self.direction, "due": self.due}

    def load_state_dict(self, state: dict) -> None:
        self.window = Window([list(map(float, s)) for s in state.get("steps", [])])
        self.strikes = int(state.get("strikes", 0))
        self.direction = int(state.get("direction", 0))
        self.due = bool(state.get("due", False))
