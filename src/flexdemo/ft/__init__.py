"""Elastic, fault-tolerant replication on torchft (optional: ``pip install "flexdemo[ft]"``).

``flexdemo.prepare(model, ..., fault_tolerance=FaultTolerance(lighthouse=..., replica_id=...))``
makes every node a torchft replica group: the replicate dimension is the set of groups in the
current quorum, which may change at every step (see docs/elastic.md). The optimizer it returns
is an :class:`ElasticOptimizer`: an :class:`ElasticSession` around a plain DeToNATION.
"""

from ..transport import PeerLostError
from .config import FaultTolerance, TorchFTMissingError, require_torchft
from .membership import UntrustedPeerError


def __getattr__(name: str):
    if name in ("ElasticOptimizer", "InnerOptimizer"):
        from . import optimizer
        return getattr(optimizer, name)
    if name == "Phase":
        from .phase import Phase
        return Phase
    if name == "ManagerTransport":  # re-exported from flexdemo.transport, loaded on first use
        from ..transport import ManagerTransport
        return ManagerTransport
    if name in ("ElasticSession", "QuorumTimeoutError", "LighthouseUnreachableError",
                "LighthouseLostError", "DuplicateReplicaIdError", "TorchFTVersionError"):
        from . import session
        return getattr(session, name)
    raise AttributeError(name)


__all__ = ["DuplicateReplicaIdError", "ElasticOptimizer", "ElasticSession", "FaultTolerance",
           "InnerOptimizer", "LighthouseLostError", "LighthouseUnreachableError",
           "ManagerTransport", "PeerLostError", "Phase", "QuorumTimeoutError",
           "TorchFTMissingError", "TorchFTVersionError", "UntrustedPeerError", "require_torchft"]
