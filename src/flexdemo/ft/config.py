"""The settings of a fault-tolerant run, and the check that torchft is installed."""

from __future__ import annotations

import importlib.util
import os
import socket
from dataclasses import dataclass, field

from ..secret import RunSecret, resolve_secret

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
REPLICA_ID_ENVS = ("FLEXDEMO_REPLICA_ID", "REPLICA_GROUP_ID")
HOSTNAME_ENV = "FLEXDEMO_FT_HOSTNAME"
INSTALL_HINT = 'pip install "flexdemo[ft]"'


class TorchFTMissingError(ModuleNotFoundError):
    """``fault_tolerance=`` was asked for but torchft is not installed."""


def require_torchft() -> None:
    """Raise :class:`TorchFTMissingError` (one line naming the extra) without torchft."""
    try:
        found = importlib.util.find_spec("torchft") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise TorchFTMissingError(f"fault tolerance needs torchft, which is not installed: "
                                  f"{INSTALL_HINT}")


def _env_replica_id() -> str | None:
    for name in REPLICA_ID_ENVS:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


@dataclass
class FaultToleranceSettings:
    """The settings of :class:`FaultTolerance` as plain data: no checks, no environment and
    no torchft (``None``: unset, the default :class:`FaultTolerance` fills in). The app's
    ``[fault_tolerance]`` section is this class plus ``enabled``."""

    lighthouse: str | None = None
    replica_id: str | None = None
    min_replicas: int = 1
    timeout: float = 60.0
    quorum_timeout: float | None = None
    hostname: str | None = None
    max_failed_commits: int | None = None
    verbose: bool = False
    secret: str | None = field(default=None, repr=False)


@dataclass
class FaultTolerance(FaultToleranceSettings):
    """Elastic, fault-tolerant replication on torchft: one replica group per node.

    Args:
        lighthouse: the torchft lighthouse, ``http://host:port`` (default:
            ``$TORCHFT_LIGHTHOUSE``).
        replica_id: this node's replica group, the same on all its ranks (default:
            ``$FLEXDEMO_REPLICA_ID``, then ``$REPLICA_GROUP_ID``).
        min_replicas: the fewest replica groups a step may commit with; with fewer the
            others wait, at most ``quorum_timeout`` seconds.
        timeout: seconds a collective, the commit vote or a healing transfer may take.
        quorum_timeout: seconds to wait for a quorum of ``min_replicas`` groups (default:
            ``timeout``).
        hostname: the address this group advertises to its peers (default:
            ``$FLEXDEMO_FT_HOSTNAME``, else the machine's host name); it must be reachable.
        max_failed_commits: consecutive steps that may fail to commit before the run stops
            (None: no limit).
        verbose: torchft's own logs in full (its Rust side's INFO lines, several per step,
            and its tracebacks); by default only its warnings and errors, one line each.
            Read when torchft is first imported in the process.
        secret: the run secret, the same on every node (default: ``$FLEXDEMO_SECRET``; at
            least 16 characters): every quorum member, heal and start-up verdict is
            authenticated with it, and a group without it is never counted or healed from
            (docs/security.md). Without one the run is open to anyone who reaches its ports.
    """

    extra_state: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        require_torchft()
        self.lighthouse = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "").strip() or None
        if not self.lighthouse:
            raise ValueError(f"fault tolerance needs a lighthouse: pass lighthouse='http://host:"
                             f"port' or set {LIGHTHOUSE_ENV} (start one with `flexdemo "
                             "lighthouse --min_replicas 1`)")
        if "://" not in self.lighthouse:
            self.lighthouse = f"http://{self.lighthouse}"
        self.replica_id = self.replica_id or _env_replica_id()
        if not self.replica_id:
            raise ValueError("fault tolerance needs a replica_id, the same on every rank of a "
                             f"node: pass replica_id=... or set {REPLICA_ID_ENVS[0]}")
        self.replica_id = str(self.replica_id)
        if ":" in self.replica_id:
            raise ValueError(f"replica_id {self.replica_id!r} must not contain ':' (torchft "
                             "appends ':<uuid>' to it)")
        if isinstance(self.min_replicas, bool) or not isinstance(self.min_replicas, int) \
                or self.min_replicas < 1:
            raise ValueError(f"min_replicas must be an integer >= 1, got {self.min_replicas!r}")
        for name in ("timeout", "quorum_timeout"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{name} must be seconds > 0, got {value!r}")
        if self.quorum_timeout is None:
            self.quorum_timeout = self.timeout
        self.hostname = (self.hostname or os.environ.get(HOSTNAME_ENV, "").strip()
                         or socket.gethostname())
        self.run_secret: RunSecret | None = resolve_secret(self.secret)  # SecretError: 1 line

    def register_state(self, key: str, load_state_dict, state_dict) -> None:
        """Extra state a joiner fetches from a healthy peer (an LR scheduler, a data loader):
        ``state_dict()`` on the peer, ``load_state_dict(state)`` on the joiner. Call before
        the optimizer is built."""
        if key in self.extra_state or key == "flexdemo":
            raise ValueError(f"state {key!r} is registered already")
        self.extra_state[key] = (load_state_dict, state_dict)
