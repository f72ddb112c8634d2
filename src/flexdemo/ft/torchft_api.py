"""flexdemo's one door to torchft: the only module that imports it or touches its internals.

The rest of :mod:`flexdemo.ft` drives torchft's ``Manager`` through its public API
(``start_quorum(allow_heal=...)``, ``wait_quorum``, ``num_participants``,
``participating_rank``, ``should_commit``, ``report_error``, ``errored``, ``wrap_future``,
``current_step``, ``load_state_dict``, ``register_state_dict_fn``, ``shutdown``) and the
process group it builds here. What torchft offers no public way to do is below, each internal
named in :data:`INTERNALS` and checked by :func:`check_internals` when a session starts, so a
torchft that renamed one is refused in one line instead of failing mid-run:

* the quorum behind the forward pass, chosen per quorum (``Manager._use_async_quorum``), and
  whether it has formed yet (``Manager._quorum_future``);
* a heal torchft made after the forward pass, applied at once (``Manager._healing``,
  ``Manager._apply_pending_state_dict``);
* every group of the quorum counted as a participant, a healing one too
  (``Manager._participating_replica_rank``, ``Manager._participating_replica_world_size``);
* the whole quorum (its replica ids and size), kept from ``ManagerClient._quorum`` through
  ``Manager._client``, and checked there before torchft acts on it (every member proves the
  run secret, :mod:`flexdemo.ft.membership`).

The checkpoint transport is flexdemo's own (:mod:`flexdemo.ft.heal` behind torchft's public
``CheckpointTransport`` interface): it binds the address the group advertises, authenticates
with the run secret and loads a healing state as data only (torchft's loads with
``weights_only=False`` and listens on every interface).

The process group is torchft's gloo group with each configuration under a store prefix of its
own (:func:`_process_group`), so that a lighthouse restarted mid-run, which numbers its quorums
from 1 again, cannot lead a group to another configuration's keys.

torchft's own logs are quiet here by default (:func:`configure_logs`): its Rust side at
``warn`` (``RUST_LOG``, read once, when torchft is first imported) and its Python loggers'
warnings and errors one line each, without tracebacks; ``verbose`` keeps them all.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
import sys
import warnings
import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ..secret import RunSecret
from .heal import HealServer, fetch
from .membership import check_members, display_id, prove_members, tag_replica_id

INTERNALS: dict[str, tuple[str, ...]] = {
    "Manager": ("_client", "_use_async_quorum", "_healing", "_apply_pending_state_dict",
                "_participating_replica_rank", "_participating_replica_world_size",
                "_quorum_future"),
    "ManagerClient": ("_quorum",),
}
"""Every torchft internal flexdemo uses, by torchft class, as torchft 0.2 has them."""

SUPPORTED = "torchft>=0.2,<0.3"
HEARTBEAT_INTERVAL = 0.5
"""Seconds between a replica group's heartbeats to the lighthouse (torchft's default: 0.1).
Each one wakes the Manager server's threads and the lighthouse's on the machines that train:
at 0.1 s they cost rank 0 a few ms of CPU per step. The lighthouse counts a group dead after
``--heartbeat_timeout_ms`` (torchft: 5 s, the bench's and the tests' 3 s) without one, so
0.5 s keeps 6 to 10 heartbeats within that (a timeout under 2 s would leave a loaded machine
little room); a dead group is seen at most 0.5 s sooner than the timeout says (before: 0.1 s)."""
LOGGERS = ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors")
"""torchft's Python loggers (``torchft`` is the parent of its modules' loggers)."""
IGNORED = ("Unable to reset NCCL flight recorder",)
"""torchft warnings that say nothing to a flexdemo user (gloo has no flight recorder), left
out unless ``verbose``."""


class TorchFTVersionError(RuntimeError):
    """The installed torchft lacks an internal flexdemo's fault tolerance drives."""


def check_internals(objects: dict[str, Any]) -> None:
    """Raise :class:`TorchFTVersionError` (one line naming what is missing and the torchft
    to install) unless each object of ``objects`` (keyed by its torchft class name, as in
    :data:`INTERNALS`) has every internal listed for it."""
    missing = [f"{cls}.{name}" for cls, obj in objects.items()
               for name in INTERNALS.get(cls, ()) if not hasattr(obj, name)]
    if missing:
        try:
            version = importlib.metadata.version("torchft")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
        raise TorchFTVersionError(
            f"torchft {version} lacks {', '.join(missing)}, which flexdemo's fault tolerance "
            f"drives (it is built on torchft 0.2); install it: pip install '{SUPPORTED}'")


# ---------------------------------------------------------------------- logs
_UUID = re.compile(r":[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class OneLineHandler(logging.Handler):
    """A torchft warning or error as one line on stderr, without its traceback (replica ids
    without torchft's uuid suffix); a line the same as the one before is not repeated."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.last = ""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            lines = [x.strip() for x in record.getMessage().splitlines() if x.strip()]
            text = display_id(_UUID.sub("", lines[0] if lines else record.levelname))
            if text == self.last or any(x in text for x in IGNORED):
                return
            self.last = text
            print(f"flexdemo: torchft {record.levelname.lower()}: {text}", file=sys.stderr,
                  flush=True)
        except Exception:  # logging must never raise
            self.handleError(record)


class _VerboseHandler(logging.StreamHandler):
    """torchft's log lines, whole, on stderr (``verbose``, where nothing else shows them)."""


def configure_logs(verbose: bool) -> None:
    """torchft's logs: quiet (warnings and errors only, one line each) unless ``verbose``.
    Call before torchft is first imported: its Rust side reads ``RUST_LOG`` then (a value
    the user set is kept)."""
    if not verbose:
        os.environ.setdefault("RUST_LOG", "warn")
        # torch's, when torchft's checkpoint transport loads a healing group's state
        warnings.filterwarnings("ignore", message="The given buffer is not writable",
                                module="torch.distributed._serialization")
    for name in LOGGERS:
        log = logging.getLogger(name)
        for h in [h for h in log.handlers if isinstance(h, (OneLineHandler, _VerboseHandler))]:
            log.removeHandler(h)
        if not verbose:
            log.setLevel(logging.WARNING)
            log.propagate = False
            log.addHandler(OneLineHandler())
            continue
        log.setLevel(logging.INFO)
        log.propagate = bool(logging.getLogger().handlers)  # the application's own handlers
        if not log.propagate:
            handler = _VerboseHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s "
                                                   "%(message)s"))
            log.addHandler(handler)


# ---------------------------------------------------------------------- the Manager
class QuorumRecorder:
    """The Manager's client, keeping the last quorum it returned (all its replica ids and
    its size, a healing group included) once ``check(replica_ids)`` passed it: a check that
    raises fails the quorum before torchft reconfigures its group or heals from a member."""

    def __init__(self, client, check: Callable[[list[str]], None] | None = None) -> None:
        self._client = client
        self._check = check
        self.last: Any = None  # torchft's QuorumResult

    def _quorum(self, *args, **kwargs):
        quorum = self._client._quorum(*args, **kwargs)
        if self._check is not None:
            self._check(list(getattr(quorum, "replica_ids", None) or []))
        self.last = quorum
        return quorum

    def __getattr__(self, name: str):
        return getattr(self._client, name)


def _checkpoint_transport(server: HealServer, requester: str, secret: RunSecret | None):
    """flexdemo's heal transport (:mod:`flexdemo.ft.heal`) as a torchft
    ``CheckpointTransport``: ``server`` serves this rank's state, :func:`~flexdemo.ft.heal.fetch`
    fetches a peer's, as ``requester``."""
    from torchft.checkpointing.transport import CheckpointTransport

    class _Transport(CheckpointTransport):
        def metadata(self) -> str:
            return server.address()

        def send_checkpoint(self, dst_ranks, step, state_dict, timeout) -> None:
            server.serve(step, state_dict)

        def disallow_checkpoint(self) -> None:
            server.stop_serving()

        def recv_checkpoint(self, src_rank, metadata, step, timeout):
            return fetch(metadata, step, requester, secret, timeout.total_seconds())

        def shutdown(self, wait: bool = True) -> None:
            server.shutdown(wait)

    return _Transport()


def _process_group(timeout: timedelta):
    """torchft's reconfigurable gloo group, each configuration under a store prefix of its own.

    torchft names a configuration's keys in the TCPStore by the quorum id alone. A restarted
    lighthouse numbers its quorums from 1 again, so a group could meet the keys that an
    earlier configuration with the same id left there (the addresses of a dead peer or of an
    aborted group) and fail to connect. The prefix gains the quorum's newest step and its
    members (replica ids with their uuids), which every member reads alike from the quorum."""
    from torchft.process_group import ProcessGroupGloo, create_store_client

    class _Gloo(ProcessGroupGloo):
        recorder: QuorumRecorder | None = None
        prove: Callable[[Any, str, int, int, list[str]], None] | None = None

        def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                      *args, **kwargs) -> None:
            quorum = self.recorder.last if self.recorder is not None else None
            if quorum is not None:
                ids = list(getattr(quorum, "replica_ids", None) or [])
                members = ",".join(sorted(ids))
                store_addr = (f"{store_addr}/step{quorum.max_step}/"
                              f"{zlib.crc32(members.encode()):08x}")
                if self.prove is not None and world_size > 1:  # before the group meets
                    store = create_store_client(f"{store_addr}/flexdemo-proof", timeout)
                    self.prove(store, store_addr, rank, world_size, ids)
            super().configure(store_addr, replica_id, rank, world_size, *args, **kwargs)

    return _Gloo(timeout=timeout)


def quorum_retries(quorum_timeout: float, every: float = 0.5) -> int:
    """How often the group's Manager server asks the lighthouse again within a quorum: about
    every ``every`` seconds, so that a lighthouse restarted on its address within
    ``quorum_timeout`` is found (torchft's default, none, waits out the whole timeout)."""
    return max(1, int(quorum_timeout / every))


def new_manager(*, lighthouse: str, replica_id: str, hostname: str, min_replicas: int,
                timeout: float, quorum_timeout: float, rank: int, world: int, store_addr: str,
                store_port: int, max_failed_commits: int | None, verbose: bool,
                heal_server: HealServer, secret: RunSecret | None = None):
    """A torchft ``Manager`` for this rank of a replica group and its process group (gloo),
    its internals checked (:class:`TorchFTVersionError`) and its client recording each
    quorum (:class:`QuorumRecorder`) once every member proved ``secret`` (where there is
    one). Heals go through ``heal_server`` and :func:`~flexdemo.ft.heal.fetch`. Returns
    ``(manager, process_group, recorder)``."""
    configure_logs(verbose)
    from torchft.manager import Manager

    step_timeout = timedelta(seconds=timeout)
    pg = _process_group(step_timeout)
    tagged = tag_replica_id(replica_id, secret)
    transport = _checkpoint_transport(heal_server, tagged, secret)
    manager = Manager(
        pg=pg, load_state_dict=None, state_dict=None, min_replica_size=min_replicas,
        use_async_quorum=False, timeout=step_timeout,
        quorum_timeout=timedelta(seconds=quorum_timeout), connect_timeout=step_timeout,
        rank=rank, world_size=world, store_addr=store_addr, store_port=store_port,
        lighthouse_addr=lighthouse, replica_id=tagged, hostname=hostname,
        checkpoint_transport=transport, max_retries=max_failed_commits,
        quorum_retries=quorum_retries(quorum_timeout),
        heartbeat_interval=timedelta(seconds=HEARTBEAT_INTERVAL))
    try:
        check_internals({"Manager": manager, "ManagerClient": manager._client})
    except TorchFTVersionError:
        manager.shutdown(wait=False)
        raise

    def check(replica_ids: list[str]) -> None:
        check_members(replica_ids, secret, replica_id, lighthouse)

    if secret is not None:
        def prove(store, scope: str, rank: int, world: int, replica_ids: list[str]) -> None:
            prove_members(store, secret, tagged, scope, rank, world, replica_ids, replica_id)

        pg.prove = prove
    recorder = pg.recorder = manager._client = QuorumRecorder(manager._client, check)
    return manager, pg, recorder


def set_async_quorum(manager, behind_forward: bool) -> None:
    """Whether the next ``start_quorum`` runs behind the forward pass (torchft reads this
    Manager setting at each quorum)."""
    manager._use_async_quorum = behind_forward


def quorum_formed(manager) -> bool:
    """Whether the quorum started last has formed (or failed): ``wait_quorum`` would return
    (or raise) at once."""
    future = manager._quorum_future
    return future is not None and future.done()


def apply_late_heal(manager) -> bool:
    """Apply at once the state torchft fetched for this group in a quorum that ran behind
    its forward pass; whether there was one."""
    if not manager._healing:
        return False
    manager._apply_pending_state_dict()
    manager._healing = False
    return True


def count_every_group(manager, rank: int, world: int) -> None:
    """Make every group of the quorum a participant of this step (rank ``rank`` of
    ``world``): torchft counts only those at the newest step when the quorum ran behind
    the forward pass, and its commit vote needs ``min_replicas`` of them."""
    manager._participating_replica_rank = rank
    manager._participating_replica_world_size = world
