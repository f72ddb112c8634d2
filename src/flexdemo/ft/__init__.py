"""Elastic, fault-tolerant replication on torchft (optional: ``pip install "flexdemo[ft]"``).

``flexdemo.prepare(model, ..., fault_tolerance=FaultTolerance(lighthouse=..., replica_id=...))``
makes every node a torchft replica group: the replicate dimension is the set of groups in the
current quorum, which may change at every step (see docs/elastic.md).
"""

from ..transport import PeerLostError
from .config import FaultTolerance, TorchFTMissingError, require_torchft


def __getattr__(name: str):
    if name == "ManagerTransport":  # re-exported from flexdemo.transport, loaded on first use
        from ..transport import ManagerTransport
        return ManagerTransport
    if name in ("ElasticSession", "QuorumTimeoutError", "LighthouseUnreachableError",
                "LighthouseLostError", "DuplicateReplicaIdError", "TorchFTVersionError"):
        from . import session
        return getattr(session, name)
    raise AttributeError(name)


__all__ = ["DuplicateReplicaIdError", "ElasticSession", "FaultTolerance",
           "LighthouseLostError", "LighthouseUnreachableError", "ManagerTransport",
           "PeerLostError", "QuorumTimeoutError", "TorchFTMissingError", "TorchFTVersionError",
           "require_torchft"]
