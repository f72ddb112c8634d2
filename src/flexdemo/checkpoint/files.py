"""A checkpoint's files on disk: names, durable writes, scratch directories of interrupted
saves, the metadata, and which directories are complete checkpoints."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .integrity import MARKER_FILE, META_FILE, SCRATCH

__all__ = ["FORMAT_VERSION", "META_FILE", "RANKS_DIR", "NotACheckpointError", "latest_checkpoint"]

FORMAT_VERSION = 1
RANKS_DIR = "ranks"
_SCRATCH = SCRATCH  # temporary / replaced directories, never loaded


# ---------------------------------------------------------------------------- files
def fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_scratch(root: Path) -> None:
    """Remove temporary and replaced checkpoint directories left by an interrupted save."""
    if not root.is_dir():
        return
    for d in root.iterdir():
        if _SCRATCH.search(d.name) and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)


def rank_file_path(path: Path, rank: int) -> Path:
    return path / RANKS_DIR / f"rank{rank:05d}.pkl"


def _read_meta(path: Path) -> dict | None:
    """The metadata of a complete checkpoint at ``path``, or None."""
    try:
        if not (path / MARKER_FILE).is_file() or not (path / ".metadata").is_file():
            return None
        meta = json.loads((path / META_FILE).read_text())
        return meta if isinstance(meta, dict) else None
    except (OSError, ValueError):
        return None


class NotACheckpointError(ValueError):
    """``path`` holds no complete checkpoint; ``reason`` says why and ``hint`` what to do
    in the library's words (callers with other words, such as the command line, use
    ``reason`` with their own advice)."""

    def __init__(self, reason: str, hint: str) -> None:
        super().__init__(f"{reason}; {hint}")
        self.reason, self.hint = reason, hint

    def __reduce__(self):
        return type(self), (self.reason, self.hint)


def require_complete(path: Path) -> dict:
    hint = "use flexdemo.checkpoint.latest_checkpoint(root) to find the newest complete one"
    if not path.is_dir():
        raise NotACheckpointError(f"no checkpoint at {path}: the directory does not exist",
                                  hint)
    if _SCRATCH.search(path.name):
        raise NotACheckpointError(f"{path} is not a complete flexdemo checkpoint but the "
                                  "temporary directory of an interrupted save", hint)
    meta = _read_meta(path)
    if meta is None:
        if latest_checkpoint(path) is not None:
            raise NotACheckpointError(f"{path} is a directory of checkpoints, not a checkpoint",
                                      f"pass latest_checkpoint({str(path)!r}) or one of its "
                                      "step directories")
        raise NotACheckpointError(f"{path} is not a complete flexdemo checkpoint (no "
                                  f"{MARKER_FILE} marker, or unreadable {META_FILE}): its save "
                                  "was interrupted or it was written by something else", hint)
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {path} has format {meta.get('format')!r}, this flexdemo "
                         f"reads format {FORMAT_VERSION}; load it with the flexdemo version that "
                         f"wrote it ({meta.get('flexdemo_version')})")
    return meta


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint under ``root`` with the highest step (newest on ties), or None.

    Directories without the completion marker (interrupted saves) and temporary directories
    are ignored.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    best, best_key = None, None
    for d in root.iterdir():
        if _SCRATCH.search(d.name) or not d.is_dir():
            continue
        meta = _read_meta(d)
        if meta is None or not isinstance(meta.get("step"), int):
            continue
        try:
            stamp = json.loads((d / MARKER_FILE).read_text()).get("time", 0.0)
        except (OSError, ValueError, AttributeError):
            stamp = 0.0
        key = (meta["step"], float(stamp), d.name)
        if best_key is None or key > best_key:
            best, best_key = d, key
    return best
