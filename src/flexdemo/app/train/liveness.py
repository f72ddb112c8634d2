"""Which rank was lost: heartbeats in the rendezvous store and one verdict for all survivors,
and short one-line forms of c10d/gloo errors."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from ...heartbeat import BEAT_SECONDS, Beat, StallWatch
from ...secret import RunSecret, resolve_secret
from ...transport import PeerLostError

__all__ = ["COMM_ERRORS", "GLOO_MESSAGES", "Heartbeat", "is_comm_error", "short_error"]

VERDICT_PURPOSE = "liveness-verdict"
"""What a liveness verdict's MAC is for (:meth:`flexdemo.secret.RunSecret.sign`)."""


class Heartbeat:
    """Liveness through the rendezvous store, so that after a failed collective every survivor
    names the same lost ranks.

    Each rank bumps ``hb/<rank>`` every ``interval`` seconds. A rank that sees a collective
    fail marks ``noticed/<rank>`` (it is alive, whatever its heartbeat does next), and the
    first one to finish a diagnosis (heartbeats that stopped, ranks that did not notice)
    publishes it as the ``verdict``; later ones take it. A rank still blocked in a collective
    learns the verdict from its heartbeat thread (``on_verdict``); with ``stale`` set (the
    trainer: :data:`~flexdemo.heartbeat.STALE_SECONDS`), the thread also names a peer whose
    heartbeat stopped for that long, until ``watching`` is cleared (start-up, where no
    collective fails for it). The store's host (rank 0) waits for the survivors to take the
    verdict before it exits, since its exit takes the store down.

    With a run secret (``secret``, default ``$FLEXDEMO_SECRET``) the keys live below a level
    named by the secret and the verdict is signed: a verdict someone else wrote is ignored,
    said once, and never stops the run.
    """

    PREFIX = "flexdemo/liveness/"

    def __init__(self, rank: int, world: int, interval: float = BEAT_SECONDS,
                 on_verdict: Callable[[list[int]], None] | None = None,
                 store: dist.Store | None = None, stale: float | None = None,
                 secret: RunSecret | None = None) -> None:
        self.rank, self.world, self.interval = rank, world, interval
        self.secret = secret if secret is not None else resolve_secret()
        self.prefix = self.PREFIX if self.secret is None else self.secret.scope(self.PREFIX)
        self._warned = False
        self.on_verdict = on_verdict
        self.store = store
        self.stale = stale
        self.watching = threading.Event()  # see _watch; cleared when training starts
        if stale is not None and on_verdict is not None:
            self.watching.set()
        self._stalls = StallWatch(stale if stale is not None else float("inf"))
        self._waited = 0  # beats since a verdict appeared (see _after_beat)
        if store is None and world > 1:
            try:
                self.store = dist.distributed_c10d._get_default_store()
            except Exception:  # no store: no diagnosis, training still runs
                self.store = None
        self.noticed = threading.Event()
        self._beat = (None if self.store is None else
                      Beat(self.store, self._key("hb", rank), interval, self._after_beat))

    def _key(self, what: str, rank: int | None = None) -> str:
        return f"{self.prefix}{what}" + ("" if rank is None else f"/{rank}")

    def _publish(self, lost: list[int]) -> None:
        """Publish ``lost`` as the verdict unless one is there (signed with a secret)."""
        text = json.dumps(lost)
        if self.secret is not None:
            text = self.secret.sign(VERDICT_PURPOSE, f"{self._key('verdict')}\n{text}")
        self._store.compare_set(self._key("verdict"), "", text)

    def _read_verdict(self) -> list[int] | None:
        """The published verdict; None (said once) for one not signed with the secret."""
        text = self._store.get(self._key("verdict")).decode()
        if self.secret is not None:
            key, _, text = (self.secret.open(VERDICT_PURPOSE, text) or "").partition("\n")
            if key != self._key("verdict"):
                if not self._warned:
                    self._warned = True
                    print("flexdemo: ignored a liveness verdict in the job's store that is not "
                          "signed with the run secret; someone else can write to this job's "
                          "store (docs/security.md)", file=sys.stderr, flush=True)
                return None
        return json.loads(text)

    @property
    def _store(self) -> dist.Store:
        """The store, for the heartbeat thread and the diagnosis (they run only with one)."""
        assert self.store is not None
        return self.store

    def _after_beat(self) -> bool:
        """The heartbeat thread, after each beat: watch for stalled peers (start-up) and hand
        a verdict published by others to ``on_verdict``. Returns whether the thread is done
        (a failing store ends it too: lost_ranks() will say so)."""
        if self.on_verdict is None or self.noticed.is_set():
            return False
        if self.watching.is_set() and self._watch():
            return True
        if self._store.check([self._key("verdict")]):
            self._waited += 1  # give the main thread two beats to notice on its own
            if self._waited > 2 and not self.noticed.is_set():
                lost = self._read_verdict()
                if lost is None:  # not ours: training goes on
                    return False
                self.noticed.set()
                self._store.set(self._key("taken", self.rank), "1")
                self.on_verdict(lost)
                return True
        return False

    def _watch(self) -> bool:
        """While watching (start-up, when no collective may fail for a dead peer, e.g. ranks
        waiting for it in a group's creation): a peer whose heartbeat has not moved for
        ``stale`` seconds died; publish that verdict (or take an earlier one) and hand it to
        ``on_verdict``. Returns whether it did."""
        on_verdict = self.on_verdict
        assert self.stale is not None and on_verdict is not None  # watching needs both
        stalled = self._stalls.stalled({r: count for r, count in enumerate(self._counters())
                                        if r != self.rank})
        if not stalled or not self.watching.is_set():
            return False
        self.noticed.set()
        self._store.set(self._key("noticed", self.rank), "1")
        self._publish(stalled)
        on_verdict(self._take_verdict(stalled))
        return True

    def stop(self) -> None:
        """Stop beating (before the process group goes away)."""
        if self._beat is not None:
            self._beat.stop(wait=True)

    def _counters(self) -> list[int]:
        return [self._store.add(self._key("hb", r), 0) for r in range(self.world)]

    def _noticed(self) -> set[int]:
        return {r for r in range(self.world) if self._store.check([self._key("noticed", r)])}

    def _take_verdict(self, mine: list[int]) -> list[int]:
        """The published verdict (``mine`` where the one there is not signed), marked taken."""
        lost = self._read_verdict()
        self._store.set(self._key("taken", self.rank), "1")
        return mine if lost is None else lost

    def lost_ranks(self) -> tuple[list[int], str]:
        """``(ranks that died or stopped responding, a note)``; the same list on every
        survivor. Takes about three heartbeat intervals, or no time if a peer already
        published the verdict."""
        self.noticed.set()
        if self.store is None:
            return [], "no rendezvous store to ask"
        try:
            self.store.set(self._key("noticed", self.rank), "1")
            published = (self._read_verdict() if self.store.check([self._key("verdict")])
                         else None)
            if published is None:
                before = self._counters()
                time.sleep(3 * self.interval)
                after = self._counters()
                alive = self._noticed()
                mine = [r for r in range(self.world) if r != self.rank and r not in alive
                        and after[r] == before[r]]
                self._publish(mine)  # the first diagnosis wins; later ones take it
                lost = self._take_verdict(mine)
            else:
                self.store.set(self._key("taken", self.rank), "1")
                lost = published
        except Exception:  # the store's host (rank 0) is unreachable
            if self.rank == 0:
                return [], "the rendezvous store is unreachable"
            return [0], "the rendezvous store on MASTER_ADDR is unreachable"
        return lost, ""

    def wait_for_survivors(self, lost: list[int], limit: float = 15.0) -> bool:
        """On the store's host (rank 0): wait until every survivor took the verdict (or
        ``limit`` seconds), so that leaving does not take the store from under them. Returns
        whether they all did (True on other ranks, which need not wait)."""
        if self.store is None or self.rank != 0:
            return True
        deadline = time.monotonic() + limit
        others = [r for r in range(self.world) if r != self.rank and r not in lost]
        while True:
            try:
                if all(self.store.check([self._key("taken", r)]) for r in others):
                    return True
            except Exception:  # the store is gone: nothing left to wait for
                return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)


# What torch raises, by type, when a collective or the store loses a peer: c10d's DistError
# (DistBackendError: NCCL and other backends; DistNetworkError, DistStoreError: the store),
# the OS's ConnectionError and TimeoutError, and our own PeerLostError (the fault-tolerant
# group's transport; torchft has no error types of its own: it raises TimeoutError and plain
# RuntimeErrors).
COMM_ERRORS: tuple[type[BaseException], ...] = (
    dist.DistError, ConnectionError, TimeoutError, PeerLostError)

# gloo raises a plain RuntimeError when a peer dies or does not answer (torch 2.13), e.g.
#   "[.../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [ip]:port"
#   "[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation"
#   "Application timeout caused pair closure"
# so only a plain RuntimeError is read, for gloo's name (its source location) or these words.
GLOO_MESSAGES = ("gloo", "connection closed by peer", "connection reset by peer",
                 "timed out waiting", "application timeout caused pair closure")


def is_comm_error(e: BaseException) -> bool:
    """Whether ``e`` tells that a collective (or the rendezvous store) lost a peer: one of
    :data:`COMM_ERRORS`, or gloo's plain ``RuntimeError`` (:data:`GLOO_MESSAGES`)."""
    if isinstance(e, COMM_ERRORS):
        return True
    text = str(e).lower()
    return type(e) is RuntimeError and any(s in text for s in GLOO_MESSAGES)


def short_error(e: BaseException) -> str:
    """The first useful part of a c10d/gloo error, on one line."""
    text = re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", " ".join(str(e).split()))
    text = text.split(" Exception raised from ")[0].split(" This is typically")[0]
    return text[:300].rstrip(". ")
