"""Heartbeats in the rendezvous store, to tell a dead peer from a slow one: a daemon thread
bumps this rank's counter every :data:`BEAT_SECONDS`, and a peer whose counter stopped
moving for :data:`STALE_SECONDS` died. The join (:mod:`flexdemo.join`) and ``flexdemo
train``'s set-up (:mod:`flexdemo.app.train.liveness`) both use them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch.distributed as dist

__all__ = ["BEAT_SECONDS", "STALE_SECONDS", "Beat", "StallWatch"]

BEAT_SECONDS = 1.0
"""How often a rank bumps its heartbeat."""
STALE_SECONDS = 15.0
"""A peer whose heartbeat has not moved for this long has died (while the job assembles:
the join, and ``flexdemo train``'s set-up until its loop starts). A rank busy starting up (a
slow import, a corpus being read on a loaded machine) still beats well within it."""


class Beat:
    """Bumps ``key`` in ``store`` now and every ``interval`` seconds from a daemon thread.
    After each bump it calls ``then`` (if given); the thread ends when ``then`` returns True,
    after :meth:`stop`, or when the store fails (its host is gone: whoever waits on the store
    says so)."""

    def __init__(self, store: dist.Store, key: str, interval: float = BEAT_SECONDS,
                 then: Callable[[], bool] | None = None,
                 name: str = "flexdemo-heartbeat") -> None:
        self.store, self.key, self.interval, self.then = store, key, interval, then
        self.stopped = threading.Event()
        store.add(key, 1)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                self.store.add(self.key, 1)
                if self.then is not None and self.then():
                    return
            except Exception:  # the store is gone; whoever waits on it will say so
                return

    def stop(self, wait: bool = False) -> None:
        """Stop beating; with ``wait``, also wait (briefly) for the thread to end."""
        self.stopped.set()
        if wait and self.thread is not threading.current_thread():
            self.thread.join(timeout=2 * self.interval + 1)


class StallWatch:
    """The peers whose heartbeat counters have not moved for ``limit`` seconds, from one look
    at their counters after another (:meth:`stalled`)."""

    def __init__(self, limit: float = STALE_SECONDS) -> None:
        self.limit = limit
        self._moved: dict[int, tuple[int, float]] = {}  # rank -> (count, when it last moved)

    def stalled(self, counters: dict[int, int], now: float | None = None) -> list[int]:
        """Record ``counters`` (rank -> heartbeat count, read at ``now``) and return the ranks
        among them whose count has not moved for over ``limit`` seconds."""
        now = time.monotonic() if now is None else now
        out = []
        for r, count in counters.items():
            last = self._moved.get(r)
            if last is None or last[0] != count:
                self._moved[r] = (count, now)
            elif now - last[1] > self.limit:
                out.append(r)
        return out
