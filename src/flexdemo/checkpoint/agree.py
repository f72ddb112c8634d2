"""Collectives of the checkpoint code: every rank learns whether any rank failed, and a
storage failure becomes the same :class:`CheckpointError` (one line, its cause) on every rank."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .integrity import DAMAGED, IO, storage_cause

__all__ = ["CheckpointError"]

# ---------------------------------------------------------------------------- process group
def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class CheckpointError(OSError):
    """Storage failed while saving or loading a checkpoint (a full disk, no permission, a
    missing file, a damaged checkpoint). Raised on every rank with the same one-line message,
    which names the path and the cause; a save that fails leaves the previous checkpoint
    untouched. ``cause`` is one of ``"no space"``, ``"permission"``, ``"missing"``,
    ``"damaged"`` or ``"I/O"``."""

    def __init__(self, message: str, cause: str = IO) -> None:
        super().__init__(message)
        self.cause = cause

    def __reduce__(self):
        return type(self), (str(self), self.cause)


def _storage_cause(e: BaseException) -> BaseException | None:
    """The storage error behind ``e``: an OSError itself, or the first one DCP collected."""
    if isinstance(e, OSError):
        return e
    # DCP's exception exists only once DCP is loaded (this does not load it)
    api = sys.modules.get("torch.distributed.checkpoint.api")
    if api is not None and isinstance(e, api.CheckpointException):
        for _rank, (exc, _trace) in sorted(e.failures.items()):
            return exc
    return None


def _classify(error: BaseException) -> tuple[str, str] | None:
    """``(cause, text)`` of a storage error, or None for other errors."""
    if isinstance(error, CheckpointError):
        return error.cause, str(error)
    storage = _storage_cause(error)
    if isinstance(storage, OSError):
        return storage_cause(storage)
    return None


def agree_on(error: BaseException | None, action: str, payload: Any = None) -> list:
    """Collective: every rank learns whether any rank failed, and gets every rank's payload.

    Raises on every rank if one failed, so no rank goes on into a collective that the others
    never join. A storage error (OSError, :class:`CheckpointError`) becomes the same
    :class:`CheckpointError` on every rank (the lowest failing rank's); otherwise the failing
    rank re-raises its own exception. Also serves as a barrier.
    """
    rank, world = rank_world()
    storage = _classify(error) if error is not None else None
    if storage is not None and not isinstance(error, CheckpointError):
        storage = (storage[0], f"{action}: {storage[1]}")
    if world == 1:
        if storage is not None:
            raise CheckpointError(storage[1], storage[0]) from None
        if error is not None:
            raise error
        return [payload]
    note: tuple[str, Any] | None = (None if error is None
                                    else ("error", f"{type(error).__name__}: {error}"))
    if storage is not None:
        note = ("storage", storage)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (note, payload))
    failed = {r: n for r, (n, _) in enumerate(gathered) if n is not None}
    if failed:
        on_disk = {r: n[1] for r, n in failed.items() if n[0] == "storage"}
        if on_disk:
            first = min(on_disk)
            cause, text = on_disk[first]
            where = f" (rank {first})" if world > 1 else ""
            raise CheckpointError(f"{text}{where}", cause) from None
        if error is not None:
            raise error
        first = min(failed)
        text = failed[first][1]
        cls = ValueError if text.startswith("ValueError") else RuntimeError
        raise cls(f"{action} failed on rank(s) {sorted(failed)}; rank {first}: {text}")
    return [p for _, p in gathered]


def dcp_call(fn, state: dict, action: str, directory: Path, **kwargs) -> None:
    """Run ``dcp.save`` / ``dcp.load`` (without a process group in a lone process). DCP's
    ``CheckpointException`` derives from ``BaseException`` and holds every rank's traceback;
    it becomes one :class:`CheckpointError` naming the cause (a full disk that torch's writer
    reports as a RuntimeError is told apart by a probe write into ``directory``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            fn(state, no_dist=not (dist.is_available() and dist.is_initialized()), **kwargs)
        except CheckpointException as e:
            cause = _storage_cause(e) or e  # DCP may have collected no failure
            kind, text = storage_cause(cause, directory if fn is dcp.save else None)
            if kind == DAMAGED:  # e.g. EOFError or an unpickling error from a cut file
                what = text.rstrip(": ")
                text = f"its data files (*.distcp) are truncated or corrupt ({what[:200]})"
            raise CheckpointError(f"{action}: {text}", kind) from None
