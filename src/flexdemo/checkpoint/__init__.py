"""Checkpoints: flexdemo's own (save, verify, load, find the newest) and the optimizer's state
dict for ``torch.distributed.checkpoint`` (:mod:`flexdemo.checkpoint.dcp`).

The names below are the package's public face; other flexdemo packages import from here only.
Its modules, one job each:

* ``save_load``: :func:`save_checkpoint`, :func:`load_checkpoint`, :func:`verify_checkpoint`,
  :func:`read_info` (the directory layout of a checkpoint is in its docstring);
* ``files``: the files on disk, :func:`latest_checkpoint`, :class:`NotACheckpointError`;
* ``state``: a rank's state split into DCP tensors and back;
* ``agree``: one outcome on every rank, :class:`CheckpointError` (storage errors by cause);
* ``integrity``: the digests of every file, :func:`check_checkpoint`, what a failed write means;
* ``mismatch``: what differs from the job that loads it, :class:`CheckpointMismatchError`;
* ``dcp``: the optimizer's state dict in torch's layout, per-replica keys, and ``dcp.load``
  with flexdemo's checks first.
"""

from . import dcp
from .agree import CheckpointError
from .dcp import FlexOptimizer
from .files import FORMAT_VERSION, NotACheckpointError, latest_checkpoint
from .integrity import (
    MARKER_FILE,
    META_FILE,
    UNREADABLE,
    CheckpointStatus,
    check_checkpoint,
    describe_os_error,
)
from .mismatch import CheckpointMismatchError
from .save_load import load_checkpoint, read_info, save_checkpoint, verify_checkpoint

__all__ = [
    "FORMAT_VERSION", "MARKER_FILE", "META_FILE", "UNREADABLE", "CheckpointError",
    "CheckpointMismatchError", "CheckpointStatus", "FlexOptimizer", "NotACheckpointError",
    "check_checkpoint", "dcp", "describe_os_error", "latest_checkpoint", "load_checkpoint",
    "read_info", "save_checkpoint", "verify_checkpoint",
]
