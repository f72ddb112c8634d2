"""Integrity of checkpoints on disk: digests of every file, and what a failed write means.

A checkpoint written by :func:`flexdemo.checkpoint.save_checkpoint` records, in its
``COMPLETE`` marker, the size and SHA-256 of every file in it (``.metadata``, each rank's
``*.distcp`` and ``ranks/rank<r>.pkl``, ``flexdemo.json``) and which rank wrote which file.
Checking a checkpoint reads each file once, streaming (``sha256sum`` gives the same digests).

:func:`check_checkpoint` says whether one checkpoint directory is intact, damaged (with what
is wrong, file by file), incomplete (an interrupted save) or unverified (written before
digests were recorded). :func:`storage_cause` turns the exceptions that torch and the
operating system raise while writing or reading into one of a few causes (no space,
permission, missing, damaged, I/O) with a one-line description.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DIGEST", "CheckpointStatus", "check_checkpoint", "check_files", "file_digest",
           "record_files", "storage_cause"]

DIGEST = "sha256"
MARKER_FILE = "COMPLETE"
_CHUNK = 1 << 20

NO_SPACE, PERMISSION, MISSING, DAMAGED, IO = ("no space", "permission", "missing", "damaged",
                                              "I/O")
_ERRNO_CAUSE = {errno.ENOSPC: NO_SPACE, errno.EDQUOT: NO_SPACE, errno.EFBIG: NO_SPACE,
                errno.EACCES: PERMISSION, errno.EPERM: PERMISSION, errno.EROFS: PERMISSION,
                errno.ENOENT: MISSING, errno.ENOTDIR: MISSING}


def file_digest(path: str | os.PathLike) -> dict:
    """``{"size": bytes, "sha256": hex}`` of a file, read once in 1 MiB pieces."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while True:
            piece = f.read(_CHUNK)
            if not piece:
                break
            size += len(piece)
            h.update(piece)
    return {"size": size, DIGEST: h.hexdigest()}


def record_files(root: Path, names: Iterable[str]) -> dict[str, dict]:
    """The digests of ``names`` (paths relative to ``root``), by name."""
    return {name: file_digest(root / name) for name in sorted(names)}


def check_files(root: Path, table: dict[str, dict]) -> list[str]:
    """What is wrong with the files of ``table`` (name -> recorded size and digest) under
    ``root``: one short phrase per damaged file; empty if every file matches."""
    problems = []
    for name in sorted(table):
        want = table[name]
        try:
            got = file_digest(root / name)
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        except OSError as e:
            problems.append(f"{name} cannot be read ({describe_os_error(e)})")
            continue
        if isinstance(want.get("size"), int) and got["size"] < want["size"]:
            problems.append(f"{name} is truncated ({got['size']} of {want['size']} bytes)")
        elif got["size"] != want.get("size"):
            problems.append(f"{name} has {got['size']} bytes, {want.get('size')} were written")
        elif got[DIGEST] != want.get(DIGEST):
            problems.append(f"{name}'s content differs from what was written (its {DIGEST} "
                            "does not match)")
    return problems


def describe_os_error(e: BaseException) -> str:
    """One line for a storage error: the cause (e.g. "no space left on device") and the file."""
    if isinstance(e, OSError) and e.strerror:
        cause = e.strerror[0].lower() + e.strerror[1:]
        return f"{cause} ({e.filename})" if e.filename else cause
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]


def _probe(directory: Path) -> OSError | None:
    """Write and remove 64 KiB in ``directory`` (or the nearest existing parent): the OSError
    that a write there raises now, or None if it works."""
    d = directory
    while not d.is_dir() and d != d.parent:
        d = d.parent
    probe = d / f".flexdemo-probe-{uuid.uuid4().hex}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * (64 << 10))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return e
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return None


def storage_cause(error: BaseException, directory: Path | None = None) -> tuple[str, str]:
    """``(cause, one line)`` for an error raised while writing to or reading from
    ``directory``: cause is ``"no space"``, ``"permission"``, ``"missing"``, ``"damaged"`` or
    ``"I/O"``.

    An ``OSError`` says its cause itself. torch's writers report a short write (a full disk)
    as a ``RuntimeError`` (``[enforce fail at inline_container.cc:...] unexpected pos``); for
    such errors a small write is tried in ``directory`` and its ``OSError``, if any, names the
    cause.
    """
    if isinstance(error, OSError):
        return _ERRNO_CAUSE.get(error.errno or 0, IO), describe_os_error(error)
    what = " ".join(f"{type(error).__name__}: {error}".split())
    if directory is not None:
        probed = _probe(directory)
        if probed is not None:
            cause = _ERRNO_CAUSE.get(probed.errno or 0, IO)
            free = ""
            if cause == NO_SPACE:
                try:
                    usage = os.statvfs(directory if directory.is_dir() else directory.parent)
                    free = (f", {usage.f_bavail * usage.f_frsize} of "
                            f"{usage.f_blocks * usage.f_frsize} bytes free")
                except OSError:
                    pass
            reason = probed.strerror or str(probed)  # an OSError may come without strerror
            return cause, f"{reason[:1].lower()}{reason[1:]} ({directory}{free})"
        if "unexpected pos" in what or "enforce fail" in what:
            return IO, f"a write came out short ({what[:200]})"
    return DAMAGED, what[:300]


@dataclass
class CheckpointStatus:
    """What :func:`check_checkpoint` found: ``state`` is ``"intact"``, ``"damaged"``,
    ``"incomplete"`` (no marker: an interrupted save) or ``"unverified"`` (no digests)."""

    path: Path
    state: str
    problems: list[str] = field(default_factory=list)
    step: int | None = None
    files: int = 0
    size: int = 0

    @property
    def ok(self) -> bool:
        """Whether it may be loaded (intact, or written before digests were recorded)."""
        return self.state in ("intact", "unverified")

    def describe(self) -> str:
        """One line: the state, and what is wrong (at most three problems)."""
        if self.state == "intact":
            return f"intact (step {self.step}, {self.files} files, {self.size / 1e6:.1f} MB)"
        if self.state == "unverified":
            return (f"not verified (step {self.step}: written before flexdemo recorded "
                    "digests)")
        more = (f"; and {len(self.problems) - 3} more" if len(self.problems) > 3 else "")
        return f"{self.state}: {'; '.join(self.problems[:3])}{more}"


def read_marker(path: Path) -> tuple[dict | None, str | None]:
    """``(the marker's content, None)``, or ``(None, what is wrong with it)``."""
    marker = path / MARKER_FILE
    if not marker.is_file():
        return None, f"no {MARKER_FILE} marker (an interrupted save)"
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError) as e:
        return None, f"its {MARKER_FILE} marker is unreadable ({type(e).__name__})"
    if not isinstance(data, dict):
        return None, f"its {MARKER_FILE} marker is not a JSON object"
    return data, None


def marker_files(marker: dict) -> dict[str, dict] | None:
    """The file table recorded in a marker, or None (a checkpoint without digests)."""
    files = marker.get("files")
    return files if isinstance(files, dict) else None


def share(names: Iterable[str], rank: int, world: int) -> list[str]:
    """The files rank ``rank`` of ``world`` checks, so that the ranks together read each once."""
    return sorted(names)[rank::world]


def check_checkpoint(path: str | os.PathLike, rank: int = 0, world: int = 1) -> CheckpointStatus:
    """Check the checkpoint at ``path`` against its recorded digests (this rank's share of
    the files when ``world`` ranks share the work; all of them by default)."""
    path = Path(path)
    marker, wrong = read_marker(path)
    if marker is None:
        state = "incomplete" if not (path / MARKER_FILE).exists() else "damaged"
        return CheckpointStatus(path, state, [wrong or "unreadable"])
    step = marker.get("step") if isinstance(marker.get("step"), int) else None
    table = marker_files(marker)
    if table is None:
        return CheckpointStatus(path, "unverified", step=step)
    mine = {name: table[name] for name in share(table, rank, world)}
    problems = check_files(path, mine)
    if rank == 0:
        recorded = set(table)
        for f in sorted(path.glob("*.distcp")):
            if f.name not in recorded:
                problems.append(f"{f.name} was not written by this save")
    size = sum(int(v.get("size", 0)) for v in table.values())
    return CheckpointStatus(path, "damaged" if problems else "intact", problems, step,
                            len(table), size)
