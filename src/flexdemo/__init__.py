"""flexdemo: DeMo, FlexDeMo and DeToNATION replication for training across slow links."""

from .comm import CommStats
from .compress import BlockDCT, plan_chunks
from .mesh import build_mesh, init_distributed, mesh_shape
from .optim import DeMo, DeToNATION
from .prepare import prepare
from .replicate import (
    DeMoReplicator,
    DiLoCoReplicator,
    FullReplicator,
    NonFiniteGradientError,
    NoReplication,
    RandomReplicator,
    Replicator,
    SlicingReplicator,
    StridingReplicator,
    make_replicator,
)

__version__ = "0.1.0"

__all__ = [
    "BlockDCT", "CommStats", "DeMo", "DeMoReplicator", "DeToNATION", "DiLoCoReplicator",
    "FullReplicator",
    "NoReplication", "NonFiniteGradientError", "RandomReplicator", "Replicator",
    "SlicingReplicator", "StridingReplicator", "build_mesh", "init_distributed",
    "make_replicator", "mesh_shape", "plan_chunks", "prepare",
]
