"""Rank 0's outputs of a training run: ``metrics.jsonl`` and TensorBoard, the progress line,
and the printed summary."""

from __future__ import annotations

import errno
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..checkpoint import describe_os_error
from .errors import TrainingError, UsageError

__all__ = ["MetricsLog", "Progress", "format_summary", "read_metrics", "strict_json",
           "summary_writer", "write_atomic"]

Echo = Callable[[str], None]


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v) for v in value]
    return value


def strict_json(value: Any, indent: int | None = None) -> str:
    """``value`` as strict JSON: NaN and infinities (which JSON has no words for) become
    ``null``."""
    return json.dumps(_finite_or_none(value), indent=indent, allow_nan=False)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file and rename it to ``path``: a failure (a full disk)
    leaves the old ``path`` as it was."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def summary_writer() -> type | None:
    """TensorBoard's ``SummaryWriter`` class, or None when tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter


def read_metrics(path: Path) -> list[dict]:
    """The lines of a ``metrics.jsonl`` up to the first cut one ([] when there is none)."""
    rows: list[dict] = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return rows


class MetricsLog:
    """Rank 0's ``metrics.jsonl`` and TensorBoard writer.

    On resume, lines up to the resume step are kept (later ones belong to the lost part of
    the run). A failure to write (a full disk) is reported once, with the path and the
    cause, and logging stops; training and checkpoints go on.
    """

    def __init__(self, out: Path, resume_step: int, tensorboard: bool, echo: Echo) -> None:
        self.path = out / "metrics.jsonl"
        self.echo = echo
        kept: list[str] = []
        if resume_step and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line).get("step", 0) <= resume_step:
                        kept.append(line)
                except json.JSONDecodeError:
                    break  # a line cut by the crash
        write_atomic(self.path, "".join(line + "\n" for line in kept))
        self.file = self._open()
        self.failed = False
        self.writer = None
        if tensorboard:
            writer = summary_writer()
            if writer is None:
                echo("note: TensorBoard logs skipped: tensorboard is not installed "
                     "(pip install tensorboard)")
            else:
                self.writer = writer(str(out / "tensorboard"), purge_step=resume_step + 1)

    def _open(self):
        return self.path.open("a")

    def write(self, record: dict) -> None:
        """Append one step's record."""
        if self.failed:
            return
        try:
            self.file.write(strict_json(record) + "\n")
            self.file.flush()
            if self.writer is not None:
                step = record["step"]
                for key, value in record.items():
                    if key not in ("step", "time") and isinstance(value, (int, float)):
                        group = "val" if key.startswith("val_") else "train"
                        self.writer.add_scalar(f"{group}/{key}", value, step)
                self.writer.flush()
        except OSError as e:
            self.failed = True
            self.echo(f"warning: step {record['step']}: cannot write {self.path}: "
                      f"{describe_os_error(e)}; metrics logging stops, training goes on")

    def close(self) -> None:
        try:
            self.file.close()
        except OSError:
            pass
        if self.writer is not None:
            self.writer.close()


class Progress:
    """Rank 0's progress: a tqdm bar on a terminal, plain lines every ``every`` steps
    otherwise (pipes, ``flexdemo cluster``)."""

    def __init__(self, total: int, start: int, every: int, enabled: bool,
                 echo: Callable[[str], None]) -> None:
        self.total, self.every, self.enabled, self.echo = total, every, enabled, echo
        self.start, self.t0 = start, time.perf_counter()
        self.bar = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def update(self, step: int, loss: float, lr: float, mb_sent: float,
               val: float | None = None) -> None:
        """After step ``step`` (1-based)."""
        if not self.enabled:
            return
        rate = (step - self.start) / max(time.perf_counter() - self.t0, 1e-9)
        if self.bar is not None:
            self.bar.update(1)
            post = {"loss": f"{loss:.4f}", "lr": f"{lr:.2e}", "sent": f"{mb_sent:.2f}MB"}
            if val is not None:
                post["val"] = f"{val:.4f}"
            self.bar.set_postfix(post, refresh=False)
            return
        if step % self.every and step != self.total and val is None:
            return
        eta = (self.total - step) / rate if rate > 0 else float("nan")
        line = (f"step {step:>{len(str(self.total))}}/{self.total} "
                f"({100 * step / self.total:3.0f}%) | {rate:5.2f} steps/s | loss {loss:.4f} | "
                f"lr {lr:.2e} | sent {mb_sent:8.2f} MB | eta {eta:4.0f}s")
        if val is not None:
            line += f" | val {val:.4f}"
        self.echo(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def format_summary(s: dict[str, Any]) -> str:
    """The printed summary."""
    lines = [
        "summary",
        f"  task        {s['task']}/{s['model']} ({s['params'] / 1e6:.3f}M params), world "
        f"{s['world']} = {s['mesh']['replicate']} x {s['mesh']['shard']}",
        f"  strategy    {s['replicator']} + {s['optimizer']}, lr {s['lr']:g}",
        f"  steps       {s['steps']}/{s['steps_total']} ({s['steps_this_run']} this run"
        + (f"; {s['skipped_steps']} skipped for NaN/Inf gradients" if s.get("skipped_steps")
           else "") + ")",
        f"  train loss  {s['train_loss']:.4f} (mean of the last steps over ranks)",
    ]
    pace = s.get("pace")
    if pace:
        lines.insert(3, f"  pace        {pace['syncs']} syncs of H={pace['inner_steps']}, counts "
                        f"{pace['counts']} per period; steps per rank "
                        f"{', '.join(map(str, s['per_rank']['steps']))}")
    if "val_loss" in s:
        acc = f", accuracy {s['val_accuracy']:.3f}" if "val_accuracy" in s else ""
        lines.append(f"  val loss    {s['val_loss']:.4f}{acc}")
    lines += [
        f"  time        {s['seconds']:.1f}s in all; per step {s['step_seconds'] * 1e3:.0f} ms "
        f"= compute {s['compute_seconds'] * 1e3:.0f} ms + communication "
        f"{s['comm_seconds'] * 1e3:.0f} ms",
        f"  sent        {s['bytes_sent_per_step'] / 1e6:.4f} MB per rank per step, "
        f"{s['mb_sent_total']:.2f} MB per rank in all",
        f"  outputs     {s['out']}/metrics.jsonl, summary.json",
    ]
    return "\n".join(lines)


# a path that cannot be a folder, or one this user may not write: the config's fault (exit
# code 2); a full disk or an I/O error: the run failed (1)
_BAD_PATH_ERRNOS = (errno.ENOTDIR, errno.ENOENT, errno.EEXIST, errno.EISDIR, errno.EACCES,
                    errno.EPERM, errno.EROFS, errno.ENAMETOOLONG)


def check_output_folder(out: Path) -> None:
    """Create ``out`` and write a probe file into it (rank 0's part of the trainer's check);
    raises :class:`UsageError` or :class:`TrainingError` naming the path and the cause."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"train.out {str(out)!r} is a file, not a folder; choose another "
                         "train.out")
    probe = out / f".write-test-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"flexdemo")
        probe.unlink()
    except OSError as e:
        kind = UsageError if e.errno in _BAD_PATH_ERRNOS else TrainingError
        raise kind(f"train.out {str(out)!r} is not a writable folder: "
                   f"{describe_os_error(e)}; choose another train.out") from None
