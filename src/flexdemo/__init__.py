"""flexdemo: DeMo, FlexDeMo and DeToNATION replication for training across slow links."""

from . import compat
from .buffers import BufferSync
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .comm import CommStats
from .compress import BlockDCT, plan_chunks
from .mesh import build_mesh, init_distributed, mesh_shape
from .optim import DeMo, DeToNATION
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
from .sharding import NoReplicationWarning, prepare

__version__ = "0.1.0"

__all__ = [
    "BlockDCT", "BufferSync", "compat", "CommStats", "DeMo", "DeMoReplicator", "DeToNATION",
    "DiLoCoReplicator", "FullReplicator", "NoReplication", "NoReplicationWarning",
    "NonFiniteGradientError", "RandomReplicator", "Replicator", "SlicingReplicator",
    "StridingReplicator", "build_mesh", "init_distributed", "latest_checkpoint",
    "load_checkpoint", "make_replicator", "mesh_shape", "plan_chunks", "prepare",
    "save_checkpoint",
]
