"""flexdemo: DeMo, FlexDeMo and DeToNATION replication for training across slow links."""

from . import compat
from .auto import AutoReplicator
from .balance import balanced_batches, measured_batches
from .buffers import BufferSync
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .compress import BlockDCT, plan_chunks
from .ft import FaultTolerance
from .lion import Lion
from .memory import LiveBytes
from .mesh import build_mesh, init_distributed, mesh_shape
from .muon import MuonAdamW
from .optim import BASE_OPTIMIZERS, DeMo, DeToNATION
from .replicate import (
    REPLICATORS,
    CorruptPayloadError,
    DeMoReplicator,
    DiLoCoReplicator,
    FullReplicator,
    NonFiniteGradientError,
    NoReplication,
    Pace,
    PhasedReplicator,
    RandomReplicator,
    Replicator,
    SlicingReplicator,
    StridingReplicator,
    make_replicator,
)
from .sharding import NoReplicationWarning, prepare
from .simulate import SimulatedReplicas
from .strategies import STRATEGIES, Strategy, check_strategy, parse_strategy
from .transport import CommStats, InProcessHub
from .version import __version__ as __version__  # explicit re-export

__all__ = [
    "AutoReplicator", "BASE_OPTIMIZERS", "BlockDCT", "BufferSync", "CommStats",
    "CorruptPayloadError", "DeMo",
    "DeMoReplicator", "DeToNATION", "DiLoCoReplicator", "FaultTolerance", "FullReplicator",
    "InProcessHub", "Lion", "LiveBytes", "MuonAdamW", "NoReplication", "NoReplicationWarning",
    "NonFiniteGradientError", "Pace", "PhasedReplicator", "REPLICATORS", "RandomReplicator",
    "Replicator", "STRATEGIES", "SimulatedReplicas", "SlicingReplicator", "Strategy",
    "StridingReplicator", "balanced_batches", "build_mesh", "check_strategy", "compat",
    "init_distributed", "latest_checkpoint", "load_checkpoint", "make_replicator",
    "measured_batches", "mesh_shape", "parse_strategy", "plan_chunks", "prepare",
    "save_checkpoint",
]
