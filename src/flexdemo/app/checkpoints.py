"""``flexdemo checkpoint verify PATH``: check every checkpoint of a run against its digests."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..integrity import MARKER_FILE, CheckpointStatus, check_checkpoint

__all__ = ["add_checkpoint_parser", "checkpoints_under", "verify_all"]

DESCRIPTION = """\
Check checkpoints against the SHA-256 digests recorded when they were written (each file is
read once). PATH is a run folder (train.out), its checkpoints/ folder, or one checkpoint.
Each checkpoint is listed as intact, damaged (with what is wrong), incomplete (a save that
was interrupted) or not verified (written before flexdemo recorded digests). Checkpoints that
a resume set aside (step_NNNNNN.damaged) are listed too.

exit codes: 0 every checkpoint intact, 1 a checkpoint is damaged (or none was found),
2 PATH does not exist.
"""


def checkpoints_under(path: Path) -> list[Path]:
    """The checkpoint directories that ``path`` names: itself, or those in it (or in its
    ``checkpoints/`` folder), sorted by name."""
    if (path / MARKER_FILE).exists():
        return [path]
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = [d for d in folder.iterdir() if d.is_dir() and ((d / MARKER_FILE).exists()
                                                             or d.name.startswith("step_"))]
    return sorted(found, key=lambda d: d.name)


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


def _cmd_verify(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    path = Path(args.path)
    if not path.is_dir():
        print(f"flexdemo checkpoint: error: {str(path)!r} is not a folder (give a run folder, "
              "its checkpoints/ folder or one checkpoint)", file=sys.stderr, flush=True)
        return 2
    statuses = verify_all(path)
    if not statuses:
        print(f"flexdemo checkpoint: error: no checkpoints under {path}", file=sys.stderr,
              flush=True)
        return 1
    width = max(len(str(s.path)) for s in statuses)
    for s in statuses:
        print(f"{str(s.path):<{width}}  {s.describe()}", flush=True)
    damaged = [s for s in statuses if s.state == "damaged"]
    if damaged:
        print(f"{len(damaged)} of {len(statuses)} checkpoint(s) damaged", file=sys.stderr,
              flush=True)
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
