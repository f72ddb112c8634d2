"""Links that change during a bench run: a bandwidth written ``"1gbit>10mbit"`` is a link
shaped to the first rate until rank 0 logs half the run's steps, then to the second (``tc``
changed while the ranks train). The time each run took to reach a target loss is
:mod:`flexdemo.app.bench.report`'s."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ...tools.rates import parse_bandwidth

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
