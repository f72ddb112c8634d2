"""Joining a multi-rank job with a bounded wait: every rank registers in the rendezvous store
and beats there while it waits for the others, so that a peer that never arrives, or dies
before the job is assembled, is named by rank (and node) within seconds instead of after the
whole collective timeout. With a run secret (``FLEXDEMO_SECRET``) the job's keys carry a
suffix derived from it and every verdict is signed, so that someone else who reaches the store
cannot stop the start-up with a false one (docs/security.md)."""

from __future__ import annotations

import ipaddress
import json
import math
import os
import socket
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from .heartbeat import BEAT_SECONDS, STALE_SECONDS, Beat, StallWatch
from .secret import SECRET_ENV, RunSecret, resolve_secret
from .store import host_store, listen_address

__all__ = ["JOIN_TIMEOUT_ENV", "DEFAULT_JOIN_SECONDS", "JoinError", "Joined", "agent_store", "join",
           "join_store", "join_timeout_from_env", "store_host_died"]

JOIN_TIMEOUT_ENV = "FLEXDEMO_JOIN_TIMEOUT"
DEFAULT_JOIN_SECONDS = 30.0
"""How long a rank waits for a peer that has not arrived at all (counted from the moment it
started waiting itself), unless ``FLEXDEMO_JOIN_TIMEOUT`` says otherwise; never longer than
the collective timeout."""
VERDICT_PURPOSE = "startup-verdict"
"""What a start-up verdict's MAC is for (:meth:`flexdemo.secret.RunSecret.sign`)."""
KEY_PURPOSE = "startup-key"
"""What the MAC that makes a verdict's key unguessable is for (the job's other keys live
under :meth:`flexdemo.secret.RunSecret.scope`)."""
FORGED_WARNING = ("flexdemo: ignored a start-up verdict in the store that is not signed with "
                  "the run secret (key {key}); someone else can write to this job's store: see "
                  "docs/security.md")
EVERY_INTERFACE_NOTE = ("flexdemo: the job's store (rank 0) listens on every interface, port "
                        "{port}, not only on MASTER_ADDR: {why}; set MASTER_ADDR to this "
                        "node's address on the job's network to bind it (docs/security.md)")
"""What rank 0 says at start-up where it cannot host the job's store on MASTER_ADDR only."""
OPEN_NOTE = ("flexdemo: this job is open (no FLEXDEMO_SECRET): its store at {addr}:{port} and "
             "gloo's connections between ranks accept anyone who reaches them, without "
             "authentication or encryption; join the nodes by a VPN and set a run secret "
             "(docs/security.md)")
"""What rank 0 says at start-up of a job whose store is reached beyond loopback, without a
run secret."""


class JoinError(TimeoutError):
    """Peers missing at start-up; ``missing`` lists their ranks, ``died`` those of them that
    had arrived and then stopped beating."""

    def __init__(self, message: str, missing: list[int], died: list[int]) -> None:
        super().__init__(message)
        self.missing, self.died = missing, died


def env_seconds(name: str, default: float) -> float:
    """The environment variable ``name`` as a number of seconds > 0, ``default`` when unset.
    Raises ``ValueError`` naming the variable when it is something else."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{name}={raw!r} is not a number of seconds > 0; set it to e.g. "
                         f"{default:g}, or unset it for the default ({default:g} s)")
    return seconds


def join_timeout_from_env(limit: float) -> float:
    """``FLEXDEMO_JOIN_TIMEOUT`` seconds (else :data:`DEFAULT_JOIN_SECONDS`), at most
    ``limit``. Raises ``ValueError`` naming the variable when it is not a number > 0."""
    return min(env_seconds(JOIN_TIMEOUT_ENV, DEFAULT_JOIN_SECONDS), limit)


def _window_note(seconds: float, capped: bool) -> str:
    """How long was waited for a peer that never arrived, and which setting says so."""
    if capped:  # the collective timeout is shorter than the join window
        raw = os.environ.get("FLEXDEMO_TIMEOUT", "").strip()
        return f"{seconds:g} s (the collective timeout" + (f", FLEXDEMO_TIMEOUT={raw})"
                                                           if raw else ")")
    raw = os.environ.get(JOIN_TIMEOUT_ENV, "").strip()
    source = f"{JOIN_TIMEOUT_ENV}={raw}" if raw else f"set {JOIN_TIMEOUT_ENV} for slower starts"
    return f"{seconds:g} s ({source})"


def _launch_layout() -> tuple[int, int] | None:
    """``(node index, ranks per node)`` of this rank when the launcher says so (torchrun and
    ``flexdemo cluster`` set ``GROUP_RANK``/``NODE_RANK`` and ``LOCAL_WORLD_SIZE``)."""
    node = os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK"))
    per_node = os.environ.get("LOCAL_WORLD_SIZE")
    try:
        return (int(node), int(per_node)) if node is not None and per_node else None
    except ValueError:
        return None


def _loopback(addr: str) -> bool:
    """Whether ``addr`` is a loopback address here (a job on one machine)."""
    target = listen_address(addr)
    return not isinstance(target, str) and \
        ipaddress.ip_address(str(target[1][0]).partition("%")[0]).is_loopback


def _open_store(addr: str, port: int, rank: int, world: int, window: float,
                note: str) -> dist.Store:
    """The job's TCPStore: rank 0 hosts it (without waiting for the others) on the address
    ``addr`` only, where it can (:func:`~flexdemo.store.host_store`; where not, it says so
    once), or the agent of torchrun does; connecting gives up after ``window`` seconds,
    naming rank 0."""
    agent = agent_store()
    host = rank == 0 and not agent
    try:
        if host:
            store, why = host_store(addr, port, world, timedelta(seconds=window),
                                    wait_for_workers=False, multi_tenant=True)
            if why is not None:
                print(EVERY_INTERFACE_NOTE.format(port=store.port, why=why), file=sys.stderr,
                      flush=True)
            return store
        # wait for the port here: torch's own retries log C++ stacks and wait about twice
        # the timeout
        _wait_for_port(addr, port, window)
        return dist.TCPStore(addr, port, world, is_master=False,
                             timeout=timedelta(seconds=window), wait_for_workers=False,
                             multi_tenant=True)
    except (RuntimeError, TimeoutError) as e:
        who = "the launcher's store" if agent else "rank 0, which hosts the job's store,"
        if host:
            raise RuntimeError(f"rank 0 cannot host the job's store at {addr}:{port}: "
                               f"{' '.join(str(e).split())[:200]}") from None
        raise JoinError(f"rank {rank}: start-up: {who} did not answer at {addr}:{port} within "
                        f"{note}: rank 0 never arrived or died during "
                        "start-up, or MASTER_ADDR/MASTER_PORT are wrong",
                        [] if agent else [0], []) from None


def _wait_for_port(addr: str, port: int, window: float) -> None:
    """Return once ``addr:port`` accepts a connection; ``TimeoutError`` after ``window`` s."""
    deadline = time.monotonic() + window
    while True:
        try:
            with socket.create_connection((addr, port), timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise TimeoutError(str(e)) from None
            time.sleep(0.2)


def _describe(ranks: list[int], info: dict[int, str], layout: dict[int, tuple[int, int]]
              ) -> str:
    """``rank 3 (node 1, host h)``: the node and host where they are known."""
    per_node = {n for _, n in layout.values()}
    consistent = (len(per_node) == 1
                  and all(node == r // n for r, (node, n) in layout.items()))
    hosts = {node: info[r] for r, (node, _) in layout.items() if r in info}
    parts = []
    for r in ranks:
        where = []
        if consistent:
            node = r // next(iter(per_node))
            where.append(f"node {node}")
            host = info.get(r) or hosts.get(node)
        else:
            host = info.get(r)
        if host:
            where.append(f"host {host}")
        parts.append(f"rank {r}" + (f" ({', '.join(where)})" if where else ""))
    return ", ".join(parts)


def _scoped(prefix: str, secret: RunSecret | None) -> str:
    """Where the job's keys live: ``prefix``; with a run secret, one level below it named by
    the secret, which an outsider cannot guess (writes to the plain keys reach no rank)."""
    return prefix if secret is None else secret.scope(prefix)


class _ForgedVerdict(JoinError):
    """The outcome in the store is not signed with the run secret: every rank refuses."""


class _Outcome:
    """One outcome for every rank at the key ``plain``: the first rank to decide sets it
    (:meth:`settle`), every rank takes it. With a run secret it lives at a key of its own
    named by the secret (not listed in the store before a rank sets it) and is signed, naming
    that key: a value there that does not verify raises :class:`JoinError`, and one at
    ``plain`` is ignored with one warning line."""

    def __init__(self, store: dist.Store, plain: str, rank: int,
                 secret: RunSecret | None) -> None:
        self.store, self.plain, self.rank, self.secret = store, plain, rank, secret
        self.key = plain if secret is None else f"{plain}/{secret.mac(KEY_PURPOSE, plain)[:16]}"

    def read(self) -> str | None:
        """The outcome some rank set, or None while there is none."""
        if not self.store.check([self.key]):
            return None
        return self._open(self.store.get(self.key).decode())

    def settle(self, mine: str) -> str:
        """The outcome: the one some rank set already, else ``mine``."""
        if self.secret is not None:
            mine = self.secret.sign(VERDICT_PURPOSE, f"{self.key}\n{mine}")
        return self._open(self.store.compare_set(self.key, "", mine).decode())

    def _open(self, value: str) -> str:
        if self.secret is None:
            return value
        if self.store.check([self.plain]):  # someone else wrote the open run's key
            print(FORGED_WARNING.format(key=self.plain), file=sys.stderr, flush=True)
        key, _, text = (self.secret.open(VERDICT_PURPOSE, value) or "").partition("\n")
        if key != self.key:
            raise _ForgedVerdict(f"rank {self.rank}: start-up: the verdict in the job's store "
                                 f"(key {self.key}) is not signed with the run secret: someone "
                                 "else can write to this job's store and replaced it; restart "
                                 "the job and keep its store's port from others "
                                 "(docs/security.md)", [], [])
        return text


def _fingerprint(secret: RunSecret | None) -> str:
    return "none" if secret is None else secret.fingerprint


def _strangers(store: dist.Store, prefix: str, ranks: list[int],
               secret: RunSecret | None) -> list[int]:
    """Those of ``ranks`` that said at ``prefix`` (the open keys) that they run with another
    run secret than this rank, or one of the two with none (so that they never met)."""
    out = []
    for r in ranks:
        try:
            key = f"{prefix}secret/{r}"
            if store.check([key]) and store.get(key).decode() != _fingerprint(secret):
                out.append(r)
        except Exception:  # best effort: the message without it
            continue
    return out


class Joined:
    """A finished join whose heartbeat goes on while the process group is set up: a peer
    that dies between the join and the group's rendezvous (where gloo waits for it without
    any sign of life) is named by :meth:`lost_after_failure`, the same verdict on every
    survivor. Made by :func:`join`; call :meth:`stop` once the group exists or the error is
    raised. ``prefix``: the open run's keys; with ``secret`` they live below it
    (:attr:`prefix`)."""

    def __init__(self, store: dist.Store, rank: int, world: int, prefix: str, window: float,
                 note: str, secret: RunSecret | None = None) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.open_prefix, self.prefix, self.secret = prefix, _scoped(prefix, secret), secret
        self.window, self.note = window, note
        self.hosting = rank == 0 and not agent_store()
        self._watch = StallWatch()
        self._lock = threading.Lock()
        self._watching = threading.Event()  # set after the join: look at the peers' beats
        self.beat = Beat(store, f"{self.prefix}hb/{rank}", then=self._look,
                         name="flexdemo-join-beat")

    def _counters(self) -> dict[int, int]:
        return {r: self.store.add(f"{self.prefix}hb/{r}", 0) for r in range(self.world)
                if r != self.rank}

    def _look(self) -> bool:
        """The heartbeat thread, after each beat: once the join is done, record the peers'
        counters, so that a stall is known as soon as the group's set-up fails."""
        if self._watching.is_set():
            with self._lock:
                self._watch.stalled(self._counters())
        return False

    def watch_peers(self) -> None:
        """The join is done: from now on each beat also records the peers' heartbeats."""
        self._watching.set()

    def stop(self) -> None:
        """Stop beating (the group exists, or this rank gives up)."""
        self._watching.clear()
        self.beat.stop()

    def lost_after_failure(self) -> JoinError | None:
        """After the group's set-up failed on this rank: the :class:`JoinError` naming the
        peers whose heartbeat stopped for :data:`~flexdemo.heartbeat.STALE_SECONDS` since
        the join, or None when every peer still beats (or the store is gone: its host died,
        which the caller names). The first rank to decide publishes the verdict and every
        other takes it; the store's host waits (at most the join's window and
        :data:`~flexdemo.heartbeat.STALE_SECONDS`) until they did."""
        error: JoinError | None = None
        try:
            died = self._group_verdict()
        except JoinError as e:  # a verdict that is not signed with the run secret
            died, error = [], e
        except (RuntimeError, TimeoutError):  # the store went away: its host died
            return None
        # the message reads the store: before taking the verdict, after which its host may go
        if died:
            error = _join_error(self.store, self.prefix, self.rank, self.world, died, [], None)
        _hand_over(self.store, f"{self.prefix}group/", self.rank, self.world, died,
                   self.hosting, self.window + STALE_SECONDS)
        return error

    def _group_verdict(self) -> list[int]:
        """The peers that every survivor names as dead since the join (see
        :meth:`lost_after_failure`)."""
        outcome = _Outcome(self.store, f"{self.open_prefix}group/outcome", self.rank,
                           self.secret)
        deadline = time.monotonic() + STALE_SECONDS + 3 * BEAT_SECONDS
        while True:
            taken = outcome.read()
            if taken is not None:
                return json.loads(taken)
            now = time.monotonic()
            with self._lock:
                died = self._watch.stalled(self._counters(), now)
            if died or now >= deadline:
                return json.loads(outcome.settle(json.dumps(died)))
            time.sleep(BEAT_SECONDS / 4)


def join(rank: int, world: int, addr: str, port: int, timeout: timedelta,
         window: float | None = None, secret: str | RunSecret | None = None) -> Joined:
    """Open the job's store and wait until all ``world`` ranks registered there. A peer that
    registered and whose heartbeat stopped for :data:`~flexdemo.heartbeat.STALE_SECONDS`
    died; one that did not register within ``window`` seconds (default
    :func:`join_timeout_from_env`) never arrived: both raise :class:`JoinError` naming them
    by rank (and node, where known), the same verdict on every survivor. Returns the
    :class:`Joined` (its store's timeout set to ``timeout``), still beating. ``secret``:
    the run secret (default ``FLEXDEMO_SECRET``; :func:`~flexdemo.secret.resolve_secret`),
    under which the job's keys are named and its verdicts signed."""
    secret = resolve_secret(secret)
    limit = timeout.total_seconds()
    wanted = join_timeout_from_env(float("inf")) if window is None else window
    window = min(wanted, limit)
    note = _window_note(window, capped=wanted > limit)
    store = _open_store(addr, port, rank, world, window, note)
    if rank == 0 and secret is None and world > 1 and not _loopback(addr):
        print(OPEN_NOTE.format(addr=addr, port=port), file=sys.stderr, flush=True)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"flexdemo/join/{attempt}/"
    keys = _scoped(prefix, secret)  # with a secret: where the job's keys live
    layout = _launch_layout()
    node = "" if layout is None else f"{layout[0]},{layout[1]}"
    store.set(f"{prefix}secret/{rank}", _fingerprint(secret))  # to name a mismatch
    store.set(f"{keys}info/{rank}", f"{socket.gethostname()}|{node}")
    joined = Joined(store, rank, world, prefix, window, note, secret)
    store.add(f"{keys}arrived", 1)
    agent = agent_store()
    done = False
    try:
        verdict = _wait_for_all(store, prefix, rank, world, window, note, secret)
        if verdict is not None:
            raise _verdict_error(store, keys, rank, world, verdict, hosting=joined.hosting,
                                 strangers=_strangers(store, prefix, verdict["absent"], secret))
        done = True
    except _ForgedVerdict:  # every rank reads it: the store's host waits until they did
        _hand_over(store, keys, rank, world, [], joined.hosting, 15.0)
        raise
    except (RuntimeError, TimeoutError) as e:  # the store went away: its host died
        if agent or isinstance(e, JoinError):
            raise
        raise store_host_died(rank, addr, port) from None
    finally:
        if not done:
            joined.stop()
    store.set_timeout(timeout)
    joined.watch_peers()
    return joined


def join_store(rank: int, world: int, addr: str, port: int, timeout: timedelta,
               window: float | None = None, secret: str | RunSecret | None = None
               ) -> dist.Store:
    """:func:`join`, then stop beating; returns the store for ``init_process_group``."""
    joined = join(rank, world, addr, port, timeout, window, secret)
    joined.stop()
    return joined.store


def agent_store() -> bool:
    """Whether the job's store is torchrun's agent's (``TORCHELASTIC_USE_AGENT_STORE``), not
    one that rank 0 hosts."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def store_host_died(rank: int, addr: str, port: int | str) -> JoinError:
    """What rank ``rank`` raises when the store rank 0 hosts went away during start-up."""
    return JoinError(f"rank {rank}: start-up: rank 0 (the host of the job's store at "
                     f"{addr}:{port}) died during start-up", [0], [0])


def _wait_for_all(store: dist.Store, prefix: str, rank: int, world: int,
                  window: float, note: str, secret: RunSecret | None = None) -> dict | None:
    """None once every rank arrived; else the verdict (``died``, ``absent``, ``waited``).
    One outcome for all: the first rank to decide sets it ("ok", or its verdict) and every
    rank follows it, so that no rank goes on while another gives up."""
    start = time.monotonic()
    watch = StallWatch()
    next_look = start
    keys = _scoped(prefix, secret)
    outcome = _Outcome(store, f"{prefix}outcome", rank, secret)

    def verdict(taken: str) -> dict | None:
        return None if taken == "ok" else json.loads(taken)

    while True:
        taken = outcome.read()
        if taken is not None:
            return verdict(taken)
        if store.add(f"{keys}arrived", 0) >= world:
            return verdict(outcome.settle("ok"))
        now = time.monotonic()
        if now < next_look:
            time.sleep(0.2)
            continue
        next_look = now + BEAT_SECONDS
        arrived = [r for r in range(world) if store.check([f"{keys}info/{r}"])]
        died = watch.stalled({r: store.add(f"{keys}hb/{r}", 0) for r in arrived if r != rank},
                             now)
        absent = [r for r in range(world) if r not in arrived]
        if died or (absent and now - start > window):
            return verdict(outcome.settle(json.dumps({"died": died, "absent": absent,
                                                      "waited": None if died else note})))


def _verdict_error(store: dist.Store, prefix: str, rank: int, world: int, verdict: dict,
                   hosting: bool, limit: float = 15.0, strangers: list[int] | None = None
                   ) -> JoinError:
    """The error for ``verdict``; the store's host first waits (at most ``limit`` s) until
    every other survivor took it, since its exit takes the store down. ``strangers``: absent
    ranks that run with another run secret."""
    error = _join_error(store, prefix, rank, world, verdict["died"], verdict["absent"],
                        verdict["waited"], strangers or [])
    _hand_over(store, prefix, rank, world, error.missing, hosting, limit)
    return error


def _hand_over(store: dist.Store, prefix: str, rank: int, world: int, missing: list[int],
               hosting: bool, limit: float) -> None:
    """Say that this rank took the verdict; the store's host (``hosting``) waits at most
    ``limit`` s until every survivor did, since its exit takes the store down."""
    try:
        store.set(f"{prefix}taken/{rank}", "1")
        others = [r for r in range(world) if r != rank and r not in missing]
        deadline = time.monotonic() + limit
        while hosting and time.monotonic() < deadline:
            if all(store.check([f"{prefix}taken/{r}"]) for r in others):
                break
            time.sleep(0.1)
    except Exception:  # best effort: the verdict stands
        pass


def _join_error(store: dist.Store, prefix: str, rank: int, world: int, died: list[int],
                absent: list[int], waited: str | None, strangers: list[int] | None = None
                ) -> JoinError:
    """The one line naming the dead and absent ranks (``waited``: how long the wait for the
    absent ones ran; None: they may still come, but a dead peer ends the start-up;
    ``strangers``: those absent ones that run with another run secret)."""
    info: dict[int, str] = {}
    layout: dict[int, tuple[int, int]] = {}
    for r in range(world):
        try:
            if not store.check([f"{prefix}info/{r}"]):
                continue
            host, _, node = store.get(f"{prefix}info/{r}").decode().partition("|")
        except Exception:  # best effort: the names without hosts
            continue
        info[r] = host
        if node:
            n, per_node = node.split(",")
            layout[r] = (int(n), int(per_node))
    missing = sorted(died + absent)
    strangers = [r for r in strangers or [] if r in absent]
    absent = [r for r in absent if r not in strangers]
    said = []
    if died:
        said.append(f"{_describe(died, info, layout)} died during start-up (arrived, then its "
                    f"heartbeat stopped for {STALE_SECONDS:g} s)")
    if absent and waited is not None:
        said.append(f"{_describe(absent, info, layout)} never arrived within {waited}")
    elif absent:
        said.append(f"{_describe(absent, info, layout)} had not arrived yet")
    if strangers:
        said.append(f"{_describe(strangers, info, layout)} started with another "
                    f"{SECRET_ENV} than this rank (or one of the two without): give every rank "
                    "the same")
    return JoinError(f"rank {rank}: start-up: {'; '.join(said)}; {world - len(missing)} of "
                     f"{world} ranks are here. Restart the job once every rank can start",
                     missing, died)
