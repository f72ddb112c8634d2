"""One replica group's membership in a fault-tolerant run: a torchft Manager per rank.

Each node is one torchft replica group (its ranks shard the model with FSDP2); the Manager of
rank ``r`` joins rank ``r`` of the other groups in a process group that is reconfigured at
every quorum. :class:`~flexdemo.ft.optimizer.ElasticOptimizer` steps a plain optimizer inside
a session's step::

    begin (quorum; a joiner heals here) -> start_step (snapshot) -> the optimizer's own step
    -> finish_step: should_commit: yes: keep the step; no: restore the snapshot

The session's place in that cycle is one :class:`Phase`. Under a DiLoCo pace a step that
exchanges nothing (an inner step before this group's sync: :meth:`ElasticSession.local_step`)
runs outside the cycle: no quorum, no snapshot, no vote; groups meet at their syncs
(:mod:`flexdemo.replicate.elastic_pace`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..store import host_store
from ..transport import ManagerTransport, PeerLostError
from .config import FaultTolerance
from .heal import HealRefusedError, HealServer, bind_address
from .lighthouse import lighthouse_answers
from .membership import UntrustedPeerError
from .phase import NEXT, Phase, StepUndo
from .state import (
    Snapshot,
    check_supported,
    heal_state,
    load_heal_state,
    rebind,
    restore,
    snapshot,
)
from .torchft_api import (
    TorchFTVersionError,
    apply_late_heal,
    count_every_group,
    new_manager,
    quorum_formed,
    set_async_quorum,
)
from .watcher import QuorumWatcher

if TYPE_CHECKING:
    from ..checkpoint import FlexOptimizer


class QuorumTimeoutError(TimeoutError):
    """Fewer than ``min_replicas`` replica groups were there for longer than the timeout."""


class LighthouseUnreachableError(ConnectionError):
    """The lighthouse did not answer."""


class LighthouseLostError(LighthouseUnreachableError):
    """The lighthouse stopped answering mid-run and did not come back within
    ``quorum_timeout``: the step in progress is not taken (the optimizer holds the last
    committed step). ``lost`` says so without the advice."""

    def __init__(self, lost: str) -> None:
        super().__init__(f"{lost}; start it again at that address (within quorum_timeout a "
                         "run goes on)")
        self.lost = lost


class DuplicateReplicaIdError(ValueError):
    """Two live replica groups of one quorum have the same replica id."""


__all__ = ["DuplicateReplicaIdError", "ElasticSession", "LighthouseLostError",
           "LighthouseUnreachableError", "Phase", "QuorumTimeoutError", "TorchFTVersionError",
           "UntrustedPeerError"]


def _store(hostname: str) -> tuple[str, int, object, str | None]:
    """This replica group's TCPStore: torchrun's (MASTER_ADDR/MASTER_PORT) when the node has
    several ranks, else one created here (a bare process has none), listening on
    ``hostname``'s address only where it can (:func:`flexdemo.store.host_store`). Returns
    ``(address, port, the store created here or None, why it listens on every interface)``."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port:
            raise ValueError("fault tolerance with several ranks per node needs the node's "
                             "TCPStore: launch each node with torchrun (MASTER_ADDR/"
                             "MASTER_PORT of the node)")
        return addr, int(port), None, None
    store, why = host_store(hostname, 0, None, wait_for_workers=False)
    return hostname, store.port, store, why


class _HealBeforeForward:
    """The forward pre-hook on the watched model while this group may have to heal: it forms
    the step's quorum (and heals) before the forward pass, wherever the loop's ``zero_grad()``
    is. A copy or a pickle of the model gets an inert one."""

    def __init__(self, session: ElasticSession | None) -> None:
        self.session = session

    def __call__(self, module, args) -> None:
        if self.session is not None and self.session.armed:
            self.session.begin()

    def __deepcopy__(self, memo) -> _HealBeforeForward:
        return _HealBeforeForward(None)

    def __reduce__(self):
        return _HealBeforeForward, (None,)


class ElasticSession:
    """One replica group's quorums, heals and commit votes around a plain
    :class:`~flexdemo.optim.DeToNATION` (:meth:`attach`); the optimizer knows nothing of it.
    :class:`~flexdemo.ft.optimizer.ElasticOptimizer` drives it: :meth:`begin` (from
    ``zero_grad()``), :meth:`start_step`, the optimizer's own step, :meth:`finish_step`."""

    def __init__(self, config: FaultTolerance, replicators: list | None = None) -> None:
        if not isinstance(config, FaultTolerance):
            raise TypeError(f"fault_tolerance must be a flexdemo.FaultTolerance, got "
                            f"{type(config).__name__}")
        for rep in replicators or ():  # before any connection (DiLoCo's exchanges: attach)
            check_supported(rep)
            rep.enter_fault_tolerance()  # before set-up (a DiLoCo pace: quorums at syncs)
        self.config = config
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        hostname, quorum_timeout = config.hostname, config.quorum_timeout
        lighthouse, replica_id = config.lighthouse, config.replica_id
        assert hostname is not None and quorum_timeout is not None  # filled in by the config
        assert lighthouse is not None and replica_id is not None
        addr, port, self._own_store, store_note = _store(hostname)
        self.opt: FlexOptimizer | None = None
        self._phase = Phase.NEW
        self._launch_seconds = 0.0
        self._modules: list[torch.nn.Module] = []  # watch(): heal before their forward pass
        self._armed: list[Any] = []  # the armed forward pre-hooks' handles
        self._quorum_id = None
        self._lighthouse_lost = False  # said that the lighthouse does not answer
        # one thread watches every quorum wait (_waiting hands it the wait's job)
        self._watcher = QuorumWatcher(self._watcher_failed)
        self.participants = 0
        # the last step's vote (None before the first): a result, read by stats() and by the
        # next begin() (a group whose vote failed may have to heal), not a phase of the cycle
        self.committed: bool | None = None
        #: the last step ran outside a quorum (:meth:`local_step`)
        self.local = False
        self.failed_commits = 0
        self.quorum_seconds = 0.0
        self.commit_seconds = 0.0
        self.snapshot_seconds = 0.0
        self._spare: Snapshot | None = None  # the last undo copy: the next one reuses it
        secret = config.run_secret
        bind, bind_note = bind_address(hostname)
        self._heal = HealServer(bind, hostname, secret, config.timeout, config.verbose, _say)
        try:
            self.manager, pg, self._recorder = new_manager(
                lighthouse=lighthouse, replica_id=replica_id, hostname=hostname,
                min_replicas=config.min_replicas, timeout=config.timeout,
                quorum_timeout=quorum_timeout, rank=rank, world=world, store_addr=addr,
                store_port=port, max_failed_commits=config.max_failed_commits,
                verbose=config.verbose, heal_server=self._heal, secret=secret)
        except TorchFTVersionError:
            self._heal.shutdown(wait=False)
            raise
        except Exception as e:  # one line naming the lighthouse
            self._heal.shutdown(wait=False)
            raise LighthouseUnreachableError(
                f"replica group {config.replica_id!r} could not reach the torchft lighthouse "
                f"at {config.lighthouse} within {config.timeout:g} s ({_first_line(e)}); "
                "start one with `flexdemo lighthouse --min_replicas 1` or fix "
                "TORCHFT_LIGHTHOUSE") from None
        self.transport = ManagerTransport(self.manager, pg, config.timeout)
        if rank == 0:
            own = (addr, port, store_note) if self._own_store is not None else None
            _say(exposure(replica_id, secret, self._heal, bind_note, own))

    @property
    def phase(self) -> Phase:
        """Where this session is in its step (:class:`Phase`)."""
        return self._phase

    @property
    def armed(self) -> bool:
        """Whether the next forward pass of a watched model forms the quorum first
        (:meth:`watch`)."""
        return bool(self._armed)

    def _advance(self, to: Phase) -> None:
        if to not in NEXT[self._phase]:
            raise RuntimeError(f"fault tolerance: {self._phase.name} -> {to.name} is not a "
                               "step of the session's cycle")
        self._phase = to

    # ------------------------------------------------------------------ set-up
    def attach(self, opt: FlexOptimizer) -> None:
        """Bind to the optimizer: its state is what a joiner fetches."""
        try:
            for rep in opt.replicators:
                check_supported(rep)
            mesh = getattr(opt, "mesh", None)
            if mesh is not None and mesh["replicate"].size() > 1:
                raise ValueError(
                    f"under fault tolerance each node is one replica group and its own job "
                    f"(its ranks shard the model), but this job's mesh has "
                    f"{mesh['replicate'].size()} replicas: launch every node as a separate "
                    "torchrun job")
        except Exception:
            self.shutdown()
            raise
        self.opt = opt
        self.manager.register_state_dict_fn(
            "flexdemo", lambda s: load_heal_state(opt, s), lambda: heal_state(opt))
        for key, (load, save) in self.config.extra_state.items():
            self.manager.register_state_dict_fn(key, load, save)

    def watch(self, module: torch.nn.Module) -> None:
        """Heal before ``module``'s forward pass: while this group may have to heal (its first
        quorum, or the one after its own commit vote failed), the first forward pass of
        ``module`` forms the step's quorum first, if ``zero_grad()`` has not, so that a loop
        may call ``zero_grad()`` anywhere (or never). :func:`flexdemo.prepare` watches its
        model; a :class:`~flexdemo.optim.DeToNATION` built by hand has to be told."""
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"watch() takes the model (a torch.nn.Module), got "
                            f"{type(module).__name__}")
        self._modules.append(module)
        if self._armed or self._phase is Phase.NEW:
            self._disarm()
            self._arm()

    def _arm(self) -> None:
        """Form the next quorum before the next forward pass of the watched modules."""
        if not self._armed:  # first among the pre-hooks: before FSDP2 gathers the parameters
            self._armed = [m.register_forward_pre_hook(_HealBeforeForward(self), prepend=True)
                           for m in self._modules]

    def _disarm(self) -> None:
        for handle in self._armed:
            handle.remove()
        self._armed = []

    # ------------------------------------------------------------------ stepping
    def begin(self, *, heal_now: bool | None = None) -> None:
        """Start this step's quorum; called by ``zero_grad()``, by the watched model's forward
        pre-hook (:meth:`watch`) while this group may have to heal, or by ``step()`` if not
        yet. Where this group may have to heal (its first quorum, or the one after its own
        commit vote failed) the quorum is formed here, so that a joiner heals before its
        forward pass, never between it and its backward pass; otherwise torchft forms it
        behind the forward and backward passes and ``step()`` waits for it
        (:meth:`join_quorum`). ``heal_now`` overrides that choice (``False``: behind the
        forward pass even so, where torchft heals after it and the step is voted down).
        Refused in one line at the first step when no model is watched."""
        if self._phase not in (Phase.NEW, Phase.IDLE) or self.local_step():
            return
        assert self.opt is not None, "attach() the optimizer first"
        if not self._modules:
            self.shutdown()
            raise ValueError(
                "under fault tolerance the optimizer heals a replica group before its forward "
                "pass and needs the model for that: call opt.fault_tolerance.watch(model) "
                "before the first step (flexdemo.prepare does)")
        self._disarm()
        may_heal = self._phase is Phase.NEW or self.committed is False
        if heal_now is not None:
            may_heal = heal_now
        if self._phase is Phase.NEW:  # a resumed optimizer: the lighthouse sees its steps
            steps = self._voted_steps()
            if self.manager.current_step() != steps:
                self.manager.load_state_dict({"step": steps, "batches_committed": 0})
        t0 = time.perf_counter()
        set_async_quorum(self.manager, not may_heal)
        if may_heal:  # formed here and now
            with self._waiting():
                self._quorum()
        else:  # behind the forward pass
            self._quorum()
        self._advance(Phase.LAUNCHED)
        self._launch_seconds = time.perf_counter() - t0
        if may_heal:
            self.join_quorum()

    def local_step(self) -> bool:
        """Whether the next step runs outside any quorum (no quorum, undo copy or commit
        vote): under a DiLoCo pace, an inner step before this replica's sync
        (:mod:`flexdemo.replicate.elastic_pace`). Never a group's first step, nor one after a
        failed vote."""
        opt = self.opt
        return (opt is not None and self._phase is Phase.IDLE and self.committed is not False
                and bool(opt.replicators)
                and all(rep.local_next_step() for rep in opt.replicators))

    def _voted_steps(self) -> int:
        """The steps this optimizer's run has voted on: every step, or under a DiLoCo pace
        (votes at syncs only) its first step and each sync."""
        assert self.opt is not None
        paces = [getattr(rep, "pace", None) for rep in self.opt.replicators]
        synced = [p.synced for p in paces if p is not None and p.elastic]
        if not synced:
            return self.opt.steps
        return (1 if self.opt.steps else 0) + synced[0]

    def join_quorum(self) -> None:
        """Wait for this step's quorum and bind the replicators to it (``step()`` does; a loop
        may call it earlier). Waits while fewer than ``min_replicas`` groups are there, at
        most ``quorum_timeout`` seconds."""
        if self._phase in (Phase.NEW, Phase.IDLE):
            self.begin()
        if self._phase is not Phase.LAUNCHED:  # joined already (begin() may join)
            return
        assert self.opt is not None, "attach() the optimizer first"
        quorum_timeout = self.config.quorum_timeout
        assert quorum_timeout is not None  # filled in by the config
        t0 = time.perf_counter()
        deadline = time.monotonic() + quorum_timeout
        # formed already with enough groups (behind the forward pass, the usual case): there
        # is nothing to watch, and no hand-over to the watcher thread and back in the step
        if not (quorum_formed(self.manager) and self._enough_groups()):
            with self._waiting() as told:
                while not self._enough_groups():
                    if time.monotonic() >= deadline:
                        raise self._timeout_error(self.participants)
                    if not told.is_set():
                        self._say_waiting(told)
                    time.sleep(0.2)
                    set_async_quorum(self.manager, False)
                    self._quorum()
        self._refuse_untrusted()
        quorum = self._recorder.last
        # healed after its forward pass: its gradients are not the peers'
        stale = apply_late_heal(self.manager)
        self._check_unique_ids()
        # torchft counts only the groups at the newest step as this step's participants when
        # the quorum ran behind the forward pass, and its commit vote needs min_replicas of
        # them: a group that a joiner heals from would vote no, then heal from the joiner in
        # turn, and so on. Here a joiner heals before its forward pass and takes part in the
        # step, so every group of the quorum counts, as in the transport.
        count_every_group(self.manager, quorum.replica_rank, self.participants)
        rank = self.manager.participating_rank()
        assert rank is not None  # set just above
        self.transport.set_quorum(self.manager.num_participants(), rank)
        moved = self._replicas_moved()
        for rep in self.opt.replicators:
            rebind(rep)
            if moved:  # an exchange in flight went to other replicas: dropped everywhere
                rep.quorum_changed()
        self._after_membership_change()
        self.quorum_seconds = self._launch_seconds + time.perf_counter() - t0
        self._advance(Phase.STALE if stale else Phase.JOINED)

    def _refuse_untrusted(self) -> None:
        """Raise :class:`UntrustedPeerError` (one line) when a member of this quorum failed
        its proof of the run secret, or this quorum's heal was refused
        (:class:`~flexdemo.ft.heal.HealRefusedError`: a source without the run secret, a
        state that is not data, or of another step): nothing of it was loaded, and this group
        stops rather than go on with a state it did not heal to."""
        error = self.manager.errored()
        cause = getattr(error, "original_exception", None)
        if isinstance(cause, UntrustedPeerError):  # a member failed its proof (configure)
            self.shutdown()
            raise cause
        if isinstance(cause, HealRefusedError):
            self.shutdown()
            raise UntrustedPeerError(f"replica group {self.config.replica_id!r} refused to "
                                     f"heal: {cause}; this group stops (docs/security.md)")

    def _enough_groups(self) -> bool:
        """Wait for the quorum started last; whether it has ``min_replicas`` groups. Every
        group of the quorum counts, a healing one too (``participants``; the Manager's leave a
        healing group out when the quorum ran behind the forward pass)."""
        self._wait_quorum()
        self.participants = self._recorder.last.replica_world_size
        return self.participants >= self.config.min_replicas

    def _check_unique_ids(self) -> None:
        """Raise :class:`DuplicateReplicaIdError` (one line) when another live group of this
        quorum has this group's replica id (torchft tells them apart by a suffix)."""
        quorum = self._recorder.last
        ids = [r.split(":")[0] for r in getattr(quorum, "replica_ids", None) or []]
        mine = self.config.replica_id
        if ids.count(mine) > 1:
            self.shutdown()
            raise DuplicateReplicaIdError(
                f"replica id {mine!r} is used by {ids.count(mine)} live replica groups of the "
                "quorum: give every node its own replica_id (FLEXDEMO_REPLICA_ID)")

    def _replicas_moved(self) -> bool:
        """Whether this step's replicas may differ from those of the step before: a new
        quorum (a group left or joined; also the first), or a group of it heals (it is behind
        the others). Every member of the quorum reads the same answer from it."""
        quorum = self._recorder.last
        if quorum is None or quorum.quorum_id != self._quorum_id:
            return True
        return quorum.max_world_size < quorum.replica_world_size

    def _after_membership_change(self) -> None:
        """On a new membership (a first quorum, a group joined or left) every group meets in
        one tiny all-reduce: a group that sends its state to a joiner then waits until the
        joiner has it. Otherwise a group whose step has no exchange (DiLoCo's inner steps)
        would close its checkpoint server at its commit vote before the joiner had read it."""
        qid = self._recorder.last.quorum_id
        if qid == self._quorum_id:
            return
        self._quorum_id = qid
        if self.participants > 1:
            try:
                self.transport.all_reduce_sum_(torch.zeros(1))
            except PeerLostError:
                pass  # recorded by the Manager: this step's vote says no, and it is undone

    def _quorum(self) -> None:
        try:
            self.manager.start_quorum(allow_heal=True)
        except Exception as e:
            raise self._quorum_error(e) from None

    def _wait_quorum(self) -> None:
        try:
            self.manager.wait_quorum()
        except Exception as e:
            raise self._quorum_error(e) from None

    def _quorum_error(self, e: Exception) -> Exception:
        """A quorum's failure as one line: a member without the run secret, a timeout, a lost
        lighthouse, or ``e`` itself."""
        if isinstance(e, UntrustedPeerError):
            self.shutdown()
            return e
        text = str(e).lower()
        if "timeout" in text or "timed out" in text or "deadline" in text:
            if not lighthouse_answers(str(self.config.lighthouse)):
                return self._lost_error()
            return self._timeout_error(None)
        if "connect" in text or "unavailable" in text or "transport" in text:
            rank = dist.get_rank() if dist.is_initialized() else 0
            via = "" if rank == 0 else "its group's Manager server (on the group's rank 0) or "
            return LighthouseUnreachableError(
                f"rank {rank} of replica group {self.config.replica_id!r} lost {via}the "
                f"torchft lighthouse at {self.config.lighthouse} ({_first_line(e)})")
        return e

    @contextlib.contextmanager
    def _waiting(self) -> Iterator[threading.Event]:
        """Around a wait for a quorum: say that the lighthouse is lost as soon as it does not
        answer (and that it is back once the quorum forms), or once, if the wait is long,
        that this group is waiting for the others."""
        told, done = threading.Event(), threading.Event()
        watched = self._watcher.submit(lambda: self._watch(told, done))
        try:
            yield told
        finally:
            done.set()
            if watched:  # its last check is said before the lighthouse is said to be back
                self._watcher.wait()
        self._say_back()

    def _watcher_failed(self, e: Exception) -> None:
        """A watch that raised: said in one line; the watcher lives on for the next wait."""
        _say(f"the quorum watcher of replica group {self.config.replica_id!r} failed "
             f"({_first_line(e)}); going on")

    def _watch(self, told: threading.Event, done: threading.Event) -> None:
        """While a quorum is awaited (until ``done``): every 0.5 s, is the lighthouse there?"""
        quorum_timeout = self.config.quorum_timeout
        assert quorum_timeout is not None  # filled in by the config
        patience = time.monotonic() + min(5.0, quorum_timeout / 4)
        url = str(self.config.lighthouse)
        while not done.wait(0.5):
            if not lighthouse_answers(url, timeout=0.5):
                if not self._lighthouse_lost:
                    self._lighthouse_lost = True
                    _say(f"replica group {self.config.replica_id!r} lost the torchft lighthouse "
                         f"at {url}: waiting at most {quorum_timeout:g} s for it to answer "
                         "again at that address")
            elif time.monotonic() >= patience:
                self._say_waiting(told)

    def _say_waiting(self, told: threading.Event) -> None:
        if told.is_set():
            return
        told.set()
        _say(f"replica group {self.config.replica_id!r} is waiting for a quorum of "
             f"{self.config.min_replicas} replica group(s) at {self.config.lighthouse} (at "
             f"most {self.config.quorum_timeout:g} s)")

    def _say_back(self) -> None:
        """After a quorum: if the lighthouse was said to be lost, say that it is back."""
        if self._lighthouse_lost:
            self._lighthouse_lost = False
            _say(f"replica group {self.config.replica_id!r}: the torchft lighthouse at "
                 f"{self.config.lighthouse} answers again; going on")

    def _lost_error(self) -> LighthouseLostError:
        return LighthouseLostError(
            f"replica group {self.config.replica_id!r} lost the torchft lighthouse at "
            f"{self.config.lighthouse}: it did not answer for {self.config.quorum_timeout:g} s "
            "(quorum_timeout)")

    def _timeout_error(self, seen: int | None) -> QuorumTimeoutError:
        got = "" if seen is None else f" (only {seen} took part)"
        return QuorumTimeoutError(
            f"replica group {self.config.replica_id!r} waited {self.config.quorum_timeout:g} s "
            f"for a quorum of {self.config.min_replicas} replica group(s) at "
            f"{self.config.lighthouse}{got}; start more replica groups or lower min_replicas")

    def start_step(self) -> StepUndo:
        """Before the optimizer's own step: join this step's quorum (:meth:`join_quorum`) and
        copy what the step may change. Hand the result to :meth:`finish_step` after it."""
        self.join_quorum()
        opt = self.opt
        assert opt is not None, "attach() the optimizer first"
        stale = self._phase is Phase.STALE
        if stale:  # its gradients came from the state before its heal: it takes part in the
            with torch.no_grad():  # exchange with zero gradients and votes no after it, so the
                for p in opt.params:  # step is undone everywhere (an error reported before
                    if p.grad is not None:  # the exchange would make torchft skip its
                        p.grad.zero_()  # collectives, and the peers would wait for them)
        t0 = time.perf_counter()
        spare, self._spare = self._spare, None
        try:
            snap = snapshot(opt, spare)
        except PeerLostError:  # the step before's exchange in flight failed (recorded: this
            for rep in opt.replicators:  # step's vote says no); drop it, as a new quorum would
                rep.quorum_changed()
            snap = snapshot(opt, spare)
        self.snapshot_seconds = time.perf_counter() - t0
        self._advance(Phase.STEPPING)
        return StepUndo(snap, stale)

    def finish_step(self, undo: StepUndo, error: BaseException | None = None) -> bool:
        """After the optimizer's own step: the commit vote of every group. Committed, the step
        is kept; else ``undo`` is put back (bitwise, the step never happened) and this group
        may heal at its next quorum. ``error``: the step raised it (reported to the Manager:
        this group votes no; a :class:`~flexdemo.transport.PeerLostError` the Manager has
        recorded already). Returns whether the step was committed."""
        opt = self.opt
        assert opt is not None, "attach() the optimizer first"
        self._advance(Phase.IDLE)
        if error is not None and not isinstance(error, PeerLostError):
            self.manager.report_error(error if isinstance(error, Exception)
                                      else RuntimeError(str(error)))
        if undo.stale:
            self.manager.report_error(RuntimeError("this replica group healed after its "
                                                   "forward pass"))
        t0 = time.perf_counter()
        committed = bool(self.manager.should_commit())
        self.committed = committed
        self.commit_seconds = time.perf_counter() - t0
        if not committed:
            restore(opt, undo.snapshot)  # (then the next undo copy reuses only its parameters)
            self.failed_commits += 1
            self._arm()  # it may heal at its next quorum: before the next forward pass
        self._spare = undo.snapshot  # kept or put back: the next undo copy writes into it
        return committed

    def stats(self) -> dict:
        """The last step: replica groups that took part, whether it was committed (``local``:
        it ran outside a quorum, and these are the last vote's), and the seconds spent in the
        quorum, the commit vote and the copy kept to undo the step."""
        return {"replicas": self.participants, "committed": self.committed,
                "local": self.local,
                "quorum_seconds": self.quorum_seconds, "commit_seconds": self.commit_seconds,
                "snapshot_seconds": self.snapshot_seconds, "failed_commits": self.failed_commits}

    def shutdown(self) -> None:
        """Stop this group's Manager (its server and checkpoint transport) and the watcher."""
        self._watcher.close()
        self.manager.shutdown(wait=False)


def exposure(replica_id: str, secret, heal: HealServer, bind_note: str | None,
             own_store: tuple[str, int, str | None] | None) -> str:
    """The start-up line of a replica group: whether the run is authenticated, and what
    listens beyond loopback (docs/security.md). ``own_store``: the group's store created
    here (address, port, why it listens on every interface), None for torchrun's."""
    heal_at = (f"{heal.host}:{heal.port}" if heal.host else
               f"every interface, port {heal.port} ({bind_note}; set FLEXDEMO_FT_HOSTNAME to "
               "this node's address on the replica network to bind it)")
    if own_store is None:
        store = "torchrun's store on every interface"
    elif own_store[2] is None:
        store = f"its store on {own_store[0]}:{own_store[1]}"
    else:
        store = f"its store on every interface, port {own_store[1]} ({own_store[2]})"
    if secret is None:
        return (f"replica group {replica_id!r}: this run is OPEN (no FLEXDEMO_SECRET): anyone "
                "who reaches its ports can join the quorum, serve a heal or stop a group; "
                f"the heal server listens on {heal_at}, {store}, torchft's Manager server on "
                "every interface; none is authenticated (docs/security.md)")
    return (f"replica group {replica_id!r}: run secret {secret.fingerprint} (fingerprint): "
            f"quorum members and heals are authenticated; the heal server listens on "
            f"{heal_at}; {store} and torchft's Manager server on every interface are not "
            "authenticated: keep them behind a firewall or VPN (docs/security.md)")


def _say(text: str) -> None:
    print(f"flexdemo: {text}", file=sys.stderr, flush=True)


def _first_line(e: BaseException) -> str:
    lines = [x for x in str(e).strip().splitlines() if x.strip()]
    return lines[0].strip() if lines else type(e).__name__
