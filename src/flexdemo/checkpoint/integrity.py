"""Integrity of checkpoints on disk: digests of every file, and what a failed write means.

A checkpoint written by :func:`flexdemo.checkpoint.save_checkpoint` records, in its
``COMPLETE`` marker, the size and SHA-256 of every file in it (``.metadata``, each rank's
``*.distcp`` and ``ranks/rank<r>.pkl``, ``flexdemo.json``) and which rank wrote which file.
Checking a checkpoint reads each file once, streaming (``sha256sum`` gives the same digests).

:func:`check_checkpoint` says whether one checkpoint directory is intact, damaged (with what
is wrong, file by file), unreadable (permission denied: nothing is wrong with it that a
``chmod`` cannot fix), incomplete (the temporary folder of an interrupted save) or unverified
(written before digests were recorded). :func:`storage_cause` turns the exceptions that
torch and the operating system raise while writing or reading into one of a few causes (no
space, permission, missing, damaged, I/O) with a one-line description.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DIGEST", "UNREADABLE", "CheckpointStatus", "check_checkpoint", "check_files",
           "file_digest", "record_files", "storage_cause"]

DIGEST = "sha256"
MARKER_FILE = "COMPLETE"
META_FILE = "flexdemo.json"
SCRATCH = re.compile(r"\.(tmp|old)-\d+$")
"""Names of the temporary / replaced folders of a save, never loaded."""
_CHUNK = 1 << 20
UNREADABLE = "unreadable"
"""The state of a checkpoint whose files this process may not read (permission)."""

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
    ``root``: one short phrase per damaged file; empty if every file matches. A file this
    process may not read raises ``PermissionError`` (that is no damage)."""
    problems = []
    for name in sorted(table):
        want = table[name]
        if not isinstance(want, dict):
            problems.append(f"{name}'s entry in the {MARKER_FILE} marker is not a table")
            continue
        try:
            got = file_digest(root / name)
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        except PermissionError:
            raise  # not damage: check_checkpoint reports it as unreadable
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
    ``"unreadable"`` (permission denied; not damaged), ``"incomplete"`` (the temporary folder
    of an interrupted save) or ``"unverified"`` (no digests)."""

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

    @property
    def reason(self) -> str:
        """What is wrong, without the state (the part of :meth:`describe` after it)."""
        return self.describe().split(": ", 1)[-1]


def read_marker(path: Path) -> tuple[dict | None, str | None]:
    """``(the marker's content, None)``, or ``(None, what is wrong with it)``. A marker this
    process may not read raises ``PermissionError``."""
    marker = path / MARKER_FILE
    if not marker.is_file():
        if SCRATCH.search(path.name):
            return None, f"no {MARKER_FILE} marker (an interrupted save)"
        return None, (f"no {MARKER_FILE} marker, which every save writes before the folder "
                      "gets its name (copied in part, or the marker was removed?)")
    try:
        data = json.loads(marker.read_text())
    except PermissionError:
        raise
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
    the files when ``world`` ranks share the work; all of them by default). A folder without
    its marker is incomplete when it is a save's temporary folder, else damaged; a file this
    process may not read makes it unreadable (permission), not damaged."""
    path = Path(path)
    try:
        return _check(path, rank, world)
    except PermissionError as e:
        return CheckpointStatus(path, UNREADABLE,
                                [f"permission denied ({e.filename or path})"])


def _check(path: Path, rank: int, world: int) -> CheckpointStatus:
    marker, wrong = read_marker(path)
    if marker is None:
        state = "incomplete" if SCRATCH.search(path.name) else "damaged"
        return CheckpointStatus(path, state, [wrong or "unreadable"])
    step = marker.get("step") if isinstance(marker.get("step"), int) else None
    table = marker_files(marker)
    if table is None:
        problem = _meta_problem(path)
        if problem is not None:
            return CheckpointStatus(path, "damaged", [problem], step)
        return CheckpointStatus(path, "unverified", step=step)
    mine = {name: table[name] for name in share(table, rank, world)}
    problems = check_files(path, mine)
    if rank == 0:
        recorded = set(table)
        for f in sorted(path.glob("*.distcp")):
            if f.name not in recorded:
                problems.append(f"{f.name} was not written by this save")
    size = sum(int(v.get("size", 0)) for v in table.values() if isinstance(v, dict))
    return CheckpointStatus(path, "damaged" if problems else "intact", problems, step,
                            len(table), size)


def _meta_problem(path: Path) -> str | None:
    """What is wrong with the metadata of a checkpoint without digests (its
    ``flexdemo.json`` and DCP's ``.metadata``), or None. ``PermissionError`` passes."""
    try:
        meta = json.loads((path / META_FILE).read_text())
    except FileNotFoundError:
        return f"{META_FILE} is missing"
    except PermissionError:
        raise
    except (OSError, ValueError) as e:
        return f"{META_FILE} is unreadable ({type(e).__name__})"
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        return f"{META_FILE} is not a flexdemo checkpoint's metadata"
    if not (path / ".metadata").is_file():
        return ".metadata is missing"
    return None
