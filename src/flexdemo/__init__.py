"""flexdemo: DeMo, FlexDeMo and DeToNATION replication for training across slow links."""

from . import compat
from .buffers import BufferSync
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .compress import BlockDCT, plan_chunks
from .ft import FaultTolerance
from .lion import Lion
from .mesh import build_mesh, init_distributed, mesh_shape
from .muon import MuonAdamW
from .optim import DeMo, DeToNATION
from .replicate import (
    CorruptPayloadError,
    DeMoReplicator,
    DiLoCoReplicator,
    FullReplicator,
    NonFiniteGradientError,
    NoReplication,
    PhasedReplicator,
    RandomReplicator,
    Replicator,
    SlicingReplicator,
    StridingReplicator,
    make_replicator,
)
from .sharding import NoReplicationWarning, prepare
from .simulate import SimulatedReplicas
from .transport import CommStats, InProcessHub

__version__ = "0.1.0"

__all__ = [
    "BlockDCT", "BufferSync", "CommStats", "CorruptPayloadError", "DeMo", "DeMoReplicator",
    "DeToNATION",
    "DiLoCoReplicator", "FaultTolerance", "FullReplicator", "InProcessHub", "Lion", "MuonAdamW",
    "NoReplication",
    "NoReplicationWarning", "NonFiniteGradientError", "PhasedReplicator", "RandomReplicator",
    "Replicator",
    "SimulatedReplicas", "SlicingReplicator", "StridingReplicator", "build_mesh", "compat",
    "init_distributed", "latest_checkpoint", "load_checkpoint", "make_replicator", "mesh_shape",
    "plan_chunks", "prepare", "save_checkpoint",
]
