"""Links that change during a bench run, and the time each run took to reach a target loss.

A bandwidth written ``"1gbit>10mbit"`` is a link shaped to the first rate until rank 0 logs
half the run's steps, then to the second (``tc`` changed while the ranks train). The time to
a target validation loss is read off each run's evaluations (linear between two of them).
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ..tools.rates import parse_bandwidth

CHANGE = ">"
_STEP_LINE = re.compile(r"^\[rank 0\] step\s+(\d+)/")


@dataclass(frozen=True)
class LinkPlan:
    """The rate a run starts with and, for a changing link, the rate after the change."""

    first: str
    then: str | None = None

    @property
    def changes(self) -> bool:
        return self.then is not None


def parse_link(text: str) -> LinkPlan:
    """``"100mbit"`` or ``"1gbit>10mbit"``; raises ``ValueError`` with a one-line message."""
    parts = text.split(CHANGE)
    if len(parts) > 2 or not all(parts):
        raise ValueError(f"bandwidth {text!r}: write one rate ('100mbit') or a rate that "
                         f"changes halfway through each run ('1gbit{CHANGE}10mbit')")
    for part in parts:
        parse_bandwidth(part)
    return LinkPlan(parts[0], parts[1] if len(parts) == 2 else None)


def dir_label(bandwidth: str) -> str:
    """The bandwidth as a folder name (``1gbit>10mbit`` -> ``1gbit-to-10mbit``)."""
    return bandwidth.replace(CHANGE, "-to-")


class StepWatch:
    """Calls ``action(step)`` once, when rank 0 first logs a step at or after ``at``; feed it
    the run's output (:meth:`feed`, from any thread)."""

    def __init__(self, at: int, action: Callable[[int], None]) -> None:
        self.at, self.action = at, action
        self.fired_at: int | None = None
        self._lock = threading.Lock()

    def feed(self, text: str) -> None:
        for line in text.splitlines():
            m = _STEP_LINE.match(line)
            if m is None or int(m.group(1)) < self.at:
                continue
            with self._lock:
                if self.fired_at is not None:
                    return
                self.fired_at = int(m.group(1))
            self.action(self.fired_at)
            return


def time_to_target(curve: dict, target: float) -> float | None:
    """Training seconds at which the validation loss first reached ``target`` (linear between
    the evaluation before and the one that reached it), or None when none did."""
    seconds, losses = curve.get("val_seconds", []), curve.get("val_loss", [])
    prev: tuple[float, float] | None = None
    for t, v in zip(seconds, losses):
        if not math.isfinite(v):
            prev = None
            continue
        if v <= target:
            if prev is None or prev[1] == v:
                return float(t)
            t0, v0 = prev
            return float(t0 + (t - t0) * (v0 - target) / (v0 - v))
        prev = (t, v)
    return None


def _best(r: dict) -> float:
    vals = [v for v in r.get("curve", {}).get("val_loss", []) if math.isfinite(v)]
    return min(vals) if vals else math.inf


def default_target(runs: list[dict], within: float = 0.05) -> float | None:
    """The loosest loss every competitive run reached: the highest of the lowest validation
    losses of the runs whose lowest is within ``within`` (5%) of the best run's (a run far
    behind would make the target one that every run reaches in its first steps). None
    without a finished run with an evaluation."""
    best = [_best(r) for r in runs if r.get("status") == "ok"]
    best = [b for b in best if math.isfinite(b)]
    if not best:
        return None
    return max(b for b in best if b <= min(best) * (1 + within))


def time_to_target_lines(results: list[dict], reference: str = "auto",
                         target: float | None = None) -> list[str]:
    """Per bandwidth: the target (``target``, else :func:`default_target`), every finished
    run's time to reach it, and ``reference`` against the fastest other run."""
    lines: list[str] = []
    for bw in dict.fromkeys(r["bandwidth"] for r in results):
        runs = [r for r in results if r["bandwidth"] == bw and r.get("status") == "ok"]
        goal = target if target is not None else default_target(runs)
        if goal is None:
            continue
        times = {r["strategy"]: time_to_target(r["curve"], goal) for r in runs}
        cells = ", ".join(f"{name} {'never' if t is None else f'{t:.1f} s'}"
                          for name, t in times.items())
        lines.append(f"time to val loss {goal:.4f} @ {bw}: {cells}")
        mine = times.get(reference)
        others = {n: t for n, t in times.items() if n != reference and t is not None}
        if reference in times and others:
            name, best = min(others.items(), key=lambda kv: kv[1])
            if mine is None:
                lines.append(f"  {reference}: did not reach it; {name} did in {best:.1f} s")
            else:
                lines.append(f"  {reference} {mine:.1f} s vs the fastest fixed strategy ({name}) "
                             f"{best:.1f} s: {100 * (mine - best) / best:+.1f}% time")
    return lines
