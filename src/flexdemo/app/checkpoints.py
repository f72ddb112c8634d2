"""``flexdemo checkpoint verify PATH``: check every checkpoint of a run against its digests."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from ..checkpoint import (
    MARKER_FILE,
    UNREADABLE,
    CheckpointStatus,
    check_checkpoint,
    describe_os_error,
)

__all__ = ["add_checkpoint_parser", "checkpoints_under", "verify_all"]

CHECKPOINT_NAME = re.compile(r"step_\d+")

DESCRIPTION = """\
Check checkpoints against the SHA-256 digests recorded when they were written (each file is
read once). PATH is a run folder (train.out), its checkpoints/ folder, or one checkpoint.
Each checkpoint is listed as intact, damaged (with what is wrong; a step_NNNNNN folder
without its COMPLETE marker is damaged), unreadable (permission denied: this user may not
read it, which is no damage), incomplete (the temporary folder of a save that was
interrupted) or not verified (written before flexdemo recorded digests). Checkpoints that a
resume set aside (step_NNNNNN.damaged) are listed too.

exit codes: 0 every checkpoint intact, 1 a checkpoint is damaged or unreadable (or none was
found), 2 PATH does not exist or may not be read.
"""


def checkpoints_under(path: Path) -> list[Path]:
    """The checkpoint directories that ``path`` names: itself, or those in it (or in its
    ``checkpoints/`` folder), sorted by name."""
    if CHECKPOINT_NAME.match(path.name) or (path / MARKER_FILE).exists():
        return [path]
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = [d for d in folder.iterdir() if d.is_dir() and (d.name.startswith("step_")
                                                             or _has_marker(d))]
    return sorted(found, key=lambda d: d.name)


def _has_marker(folder: Path) -> bool:
    """Whether ``folder`` holds a marker (a folder this user may not look into is listed,
    as unreadable, when its name says it is a checkpoint)."""
    try:
        return (folder / MARKER_FILE).exists()
    except PermissionError:
        return False


def verify_all(path: Path) -> list[CheckpointStatus]:
    """The status of every checkpoint under ``path``."""
    out = []
    for d in checkpoints_under(path):
        status = check_checkpoint(d)
        if ".damaged" in d.name and status.state != "damaged":
            status.state = "damaged"
            status.problems.insert(0, "set aside by a resume that found it damaged")
        out.append(status)
    return out


def _error(text: str) -> None:
    print(f"flexdemo checkpoint: error: {text}", file=sys.stderr, flush=True)


def _cmd_verify(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    path = Path(args.path)
    try:
        is_folder = path.is_dir()
        statuses = verify_all(path) if is_folder else []
    except OSError as e:  # PATH, or its checkpoints/ folder, may not be listed
        _error(f"cannot read {path}: {describe_os_error(e)}; make it readable by this user "
               f"(e.g. chmod -R a+rX {path}) or run as the user that wrote it")
        return 2
    if not is_folder:
        _error(f"{str(path)!r} is not a folder (give a run folder, its checkpoints/ folder or "
               "one checkpoint)")
        return 2
    if not statuses:
        _error(f"no checkpoints under {path}")
        return 1
    width = max(len(str(s.path)) for s in statuses)
    for s in statuses:
        print(f"{str(s.path):<{width}}  {s.describe()}", flush=True)
    bad = {state: sum(s.state == state for s in statuses) for state in ("damaged", UNREADABLE)}
    if any(bad.values()):
        print("; ".join(f"{n} of {len(statuses)} checkpoint(s) {state}"
                        for state, n in bad.items() if n), file=sys.stderr, flush=True)
        return 1
    return 0


def add_checkpoint_parser(sub) -> None:
    """Add ``checkpoint verify`` to the ``flexdemo`` sub-commands."""
    c = sub.add_parser("checkpoint", help="check checkpoints against their recorded digests",
                       description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = c.add_subparsers(dest="action", metavar="ACTION", required=True)
    v = actions.add_parser("verify", help="list each checkpoint as intact or damaged",
                           description=DESCRIPTION,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("path", metavar="PATH", help="a run folder, its checkpoints/ or a checkpoint")
    v.set_defaults(func=_cmd_verify, subparser=v)
