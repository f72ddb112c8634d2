"""The trainer's checkpoints: :class:`TrainState` (what the loop carries across a resume)
and :class:`Checkpointer` (which checkpoint to resume from, checked against its digests, with
fallback; when to save; atomic saves and pruning; refusals in the config's words). Rank 0
decides what every rank must agree on (:func:`rank0_decides`)."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...checkpoint import (
    MARKER_FILE,
    META_FILE,
    UNREADABLE,
    CheckpointMismatchError,
    NotACheckpointError,
    describe_os_error,
    latest_checkpoint,
    load_checkpoint,
    read_info,
    save_checkpoint,
    verify_checkpoint,
)
from ..config.schema import Config
from ..errors import TrainingError, UsageError
from ..tasks import ShardSampler

__all__ = ["Checkpointer", "TrainState"]

Echo = Callable[[str], None]

CHECKPOINT_RE = re.compile(r"step_(\d+)$")
DAMAGED_RE = re.compile(r"step_(\d+)\.damaged(-\d+)?$")
LAYOUT_KEYS = ("world", "replicate")
"""Settings a resume may change: the number of replicas (:meth:`Checkpointer._check_layout`)."""
DATA_KEY = "data"
"""The settings of the data (seed, batch, corpus) in a checkpoint's meta: a resume may change
them, and says so in one line (:meth:`Checkpointer._note_data_changes`)."""


# ---------------------------------------------------------------------- agreement
def rank0_decides(rank: int, world: int, decide: Callable[[], Any]) -> Any:
    """Run ``decide`` on rank 0 and give every rank its result, or the same
    :class:`TrainingError` (a ``TrainingError``, :class:`UsageError` or ``OSError`` of
    ``decide`` on rank 0)."""
    result: list[Any] = [None]
    if rank == 0:
        try:
            result = [("ok", decide())]
        except UsageError as e:
            result = [("usage", str(e))]
        except TrainingError as e:
            result = [("error", str(e))]
        except OSError as e:
            result = [("error", describe_os_error(e))]
    if world > 1:
        dist.broadcast_object_list(result, src=0)
    kind, value = result[0]
    if kind == "usage":
        raise UsageError(value)
    if kind == "error":
        raise TrainingError(value)
    return value


def sum_over_ranks(values: list[float], device: torch.device | str = "cpu") -> list[float]:
    """``values`` summed over all ranks; the tensor lives on ``device`` (the training device:
    NCCL reduces CUDA tensors only)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


# ---------------------------------------------------------------------- state
@dataclass
class TrainState:
    """What the loop carries from step to step and across a resume (besides the model,
    optimizer, data position and RNG)."""

    step: int = 0
    train_seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    tokens: int = 0
    """This rank's training tokens so far (:meth:`~flexdemo.app.tasks.Task.batch_tokens`)."""
    batch: int = 0
    """This rank's balanced batch size once decided (``train.batches``); 0: ``train.batch``."""

    def state_dict(self) -> dict[str, Any]:
        return {"train_seconds": float(self.train_seconds), "bytes_sent": int(self.bytes_sent),
                "bytes_received": int(self.bytes_received), "tokens": int(self.tokens),
                "batch": int(self.batch)}

    @classmethod
    def from_extra(cls, step: int, extra: dict[str, Any]) -> TrainState:
        return cls(step, float(extra.get("train_seconds", 0.0)),
                   int(extra.get("bytes_sent", 0)), int(extra.get("bytes_received", 0)),
                   int(extra.get("tokens", 0)), int(extra.get("batch", 0)))


# ---------------------------------------------------------------------- checkpoints
def _existing_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if p.is_dir() and (m := CHECKPOINT_RE.match(p.name))]
    return [p for _, p in sorted(found, key=lambda sp: sp[0])]


def _candidates(root: Path) -> list[Path]:
    """The checkpoints under ``root`` (folders named ``step_NNNNNN``), newest step first. A
    save only gives a folder that name once it is complete, so one without its marker is
    damaged, not an interrupted save."""
    return list(reversed(_existing_checkpoints(root)))


def _set_aside_ones(root: Path) -> list[Path]:
    """The checkpoints a resume set aside as damaged (``step_NNNNNN.damaged``...)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if DAMAGED_RE.match(p.name) and p.is_dir())


def _last_logged_step(metrics: Path) -> int:
    """The highest step in a ``metrics.jsonl`` (0 if none, or if it cannot be read)."""
    try:
        lines = metrics.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return 0
    last = 0
    for line in lines:
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int) and not isinstance(step, bool):
            last = max(last, step)
    return last


def _permission_refusal(what: str, why: str, root: Path) -> UsageError:
    """The one line for checkpoints this process may not read: no damage, nothing renamed."""
    return UsageError(f"cannot resume: {what}: {why}; that is no damage and nothing was "
                      f"renamed: make {root} readable by this user (e.g. chmod -R a+rX {root}) "
                      "or run as the user that wrote it, then resume again")


def _set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint to ``<name>.damaged`` (``.damaged-2``, ... if taken), so
    that it is neither loaded nor overwritten by a later save."""
    target, n = path.with_name(f"{path.name}.damaged"), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.damaged-{n}")
    os.replace(path, target)
    return target


class Checkpointer:
    """The trainer's checkpoints in ``root``: which one to resume from (rank 0 lists them,
    every rank checks its share of the files against their digests), when to save, atomic
    saves via :mod:`flexdemo.checkpoint`, pruning to the newest ``keep``, and messages in the
    config's words. ``tell`` prints on every rank; ``echo`` on rank 0."""

    def __init__(self, root: Path, every: int, keep: int, rank: int, world: int,
                 meta: dict[str, Any], echo: Echo, tell: Echo | None = None,
                 fallback: bool = True, save: Callable[..., Path] | None = None) -> None:
        self.root, self.every, self.keep = root, every, keep
        self.rank, self.world, self.meta, self.echo = rank, world, meta, echo
        self.tell = tell or echo
        self.fallback = fallback
        self._save = save or save_checkpoint  # (flexdemo.checkpoint's, unless given)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        return latest_checkpoint(self.root)

    def _find(self, resume: bool | str) -> tuple[list[str], bool]:
        """Rank 0: the checkpoints to try, newest first, and whether falling back to an older
        one is allowed (not for a checkpoint named explicitly)."""
        try:
            return self._find_paths(resume)
        except PermissionError as e:
            raise _permission_refusal(f"cannot list {e.filename or self.root}",
                                      "permission denied", self.root) from None

    def _find_paths(self, resume: bool | str) -> tuple[list[str], bool]:
        if resume is True:
            return [str(p) for p in _candidates(self.root)], True
        path = Path(str(resume))
        if not path.exists():
            latest = self.latest()
            hint = (f"; the newest checkpoint in {self.root} is {latest.name} (resume=true "
                    "continues from it)" if latest is not None else "")
            raise UsageError(f"resume: checkpoint {str(path)!r} does not exist; give true, "
                             f"false or the path of a checkpoint (or of a folder of them){hint}")
        if (path / MARKER_FILE).exists() or not _candidates(path):
            return [str(path)], False
        return [str(p) for p in _candidates(path)], True

    def _nothing_to_resume(self, overwrite: bool) -> None:
        """Rank 0, when ``resume=true`` finds no checkpoint: start at step 0, unless the run
        got further (checkpoints set aside as damaged, steps in ``metrics.jsonl``) and
        ``overwrite`` does not say to start afresh."""
        aside = [p.name for p in _set_aside_ones(self.root)]
        last = _last_logged_step(self.root.parent / "metrics.jsonl")
        found = ([f"{', '.join(aside)} set aside as damaged"] if aside else []) + (
            [f"{self.root.parent / 'metrics.jsonl'} records steps up to {last}"] if last else [])
        if not found:
            self.echo(f"resume: no checkpoint in {self.root} yet; starting at step 0")
            return
        if overwrite:
            self.echo(f"resume: no intact checkpoint in {self.root} ({'; '.join(found)}); "
                      "train.overwrite=true: starting afresh at step 0")
            return
        raise UsageError(f"cannot resume: no intact checkpoint in {self.root}, but the run got "
                         f"further ({'; '.join(found)}); starting at step 0 would lose that: "
                         "start afresh with train.overwrite=true or another train.out "
                         f"(flexdemo checkpoint verify {self.root.parent} lists what is left)")

    def resume_path(self, resume: bool | str, overwrite: bool = False) -> Path | None:
        """The checkpoint to resume from, the same on every rank: the newest whose files
        match their digests. A damaged one is set aside with one line on every rank, or
        refused (:class:`UsageError`) when ``train.resume_fallback`` is false, when it was
        named explicitly, or when no intact one is left (``overwrite``: start afresh then).
        One this process may not read is refused, nothing renamed."""
        if resume is False:
            return None
        found, may_fall_back = rank0_decides(self.rank, self.world,
                                              lambda: self._find(resume))
        damaged: list[tuple[Path, str]] = []
        chosen = None
        for text in found:
            path = Path(text)
            status = verify_checkpoint(path)
            if status.state == UNREADABLE:
                raise _permission_refusal(f"cannot read {path}", status.reason, self.root)
            if status.ok:
                chosen = path
                if status.state == "unverified":
                    self.echo(f"warning: {path} records no digests (written by an older "
                              "flexdemo), so its files cannot be checked; loading it as it is")
                break
            if status.state == "incomplete" and not may_fall_back:
                raise UsageError(f"cannot resume from {path}: it is incomplete "
                                 f"({status.reason}); resume=true uses the newest intact "
                                 "checkpoint, or start afresh with train.overwrite=true or "
                                 "another train.out")
            damaged.append((path, status.reason))
            if not (may_fall_back and self.fallback):
                break
        if not damaged:
            if chosen is None and resume is True:
                rank0_decides(self.rank, self.world, lambda: self._nothing_to_resume(overwrite))
            return chosen
        return self._after_damage(damaged, chosen, may_fall_back, overwrite)

    def _after_damage(self, damaged: list[tuple[Path, str]], chosen: Path | None,
                      may_fall_back: bool, overwrite: bool) -> Path | None:
        """Refuse, start afresh (``overwrite``) or set the damaged checkpoints aside and
        resume from ``chosen``; one line either way."""
        named = "; ".join(f"{p.name} is damaged ({why})" for p, why in damaged)
        fresh = "start afresh with train.overwrite=true or another train.out"
        if not may_fall_back:
            raise UsageError(f"cannot resume from {damaged[0][0]}: it is damaged "
                             f"({damaged[0][1]}); resume=true uses the newest intact "
                             f"checkpoint, or {fresh}")
        if not self.fallback:
            raise UsageError(f"cannot resume: {named}; train.resume_fallback=true resumes from "
                             f"the newest intact checkpoint instead, or {fresh}")
        if chosen is None and overwrite:
            self.echo(f"resume: no intact checkpoint in {self.root}: {named}; "
                      "train.overwrite=true: starting afresh at step 0")
            return None

        def set_aside() -> list[str]:
            return [_set_aside(p).name for p, _ in damaged]

        moved = rank0_decides(self.rank, self.world, set_aside)
        if chosen is None:
            raise UsageError(f"cannot resume: no intact checkpoint in {self.root}: {named} (set "
                             f"aside as {', '.join(moved)}); {fresh}")
        self.tell(f"resume: {named}; set aside as {', '.join(moved)}; resuming from "
                  f"{chosen.name} instead")
        return chosen

    def clear_earlier_run(self, overwrite: bool, resume: bool | str = False) -> None:
        """A fresh run: refuse to mix with an earlier run's checkpoints unless ``overwrite``
        (then delete them). Rank 0 looks; every rank takes the same branch."""
        def check() -> bool:
            existing = _existing_checkpoints(self.root)
            if not existing:
                if overwrite and _set_aside_ones(self.root):
                    shutil.rmtree(self.root)  # the damaged ones of the run started afresh
                    return True
                return False
            if not overwrite:
                if resume is not False:  # only interrupted saves: nothing to continue
                    raise UsageError(
                        f"{self.root} holds no complete checkpoint, only interrupted saves "
                        f"({', '.join(p.name for p in existing[-3:])}); start afresh with "
                        "train.overwrite=true (deletes them) or another train.out")
                raise UsageError(
                    f"{self.root} holds checkpoints of an earlier run; continue it with "
                    "resume=true, or start afresh with train.overwrite=true (deletes them) "
                    "or another train.out")
            shutil.rmtree(self.root)
            return True

        if rank0_decides(self.rank, self.world, check) and self.world > 1:
            dist.barrier()

    def due(self, step: int, last: int) -> bool:
        """Whether step ``step`` (1-based) ends with a checkpoint."""
        return bool(self.every) and (step % self.every == 0 or step == last)

    def save(self, step: int, model, opt, sampler: ShardSampler, state: TrainState) -> Path:
        """Save after step ``step`` (collective), then prune. A storage fault stops every
        rank with one line; the previous checkpoint stays usable."""
        previous = self.latest()
        extra = {"data": sampler.state_dict(), "rng": torch.get_rng_state(),
                 **state.state_dict(), "meta": self.meta}
        try:
            path = self._save(self.root / f"step_{step:06d}", model, opt, step=step,
                                   extra=extra, info={"settings": self.meta})
        except OSError as e:
            keep = (f"the previous checkpoint {previous} is intact (continue from it with "
                    "resume=true)" if previous else "no earlier checkpoint was written")
            raise TrainingError(f"step {step}: {' '.join(str(e).split())}; {keep}") from None
        if self.rank == 0 and self.keep > 0:
            for old in _existing_checkpoints(self.root)[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        return path

    def _check_layout(self, path: Path) -> None:
        """The mesh that wrote ``path`` against this job's, in config keys."""
        try:
            saved = json.loads((path / META_FILE).read_text())
            world, (rep, shard) = int(saved["world_size"]), saved["mesh_shape"]
        except (OSError, ValueError, KeyError, TypeError):
            return  # load_checkpoint says what is wrong with it
        want = (self.world, self.meta["replicate"], self.meta["shard"])
        if (world, rep, shard) == want:
            return
        if shard == want[2]:  # other replicas of the same shards: load_checkpoint regroups
            self.echo(f"note: {path} was written by {rep} replica(s), this job has {want[1]}: "
                      + (f"replicas {rep}..{want[1] - 1} start from replica 0's state, their "
                         "per-replica state (DeMo momentum, error feedback) from zero"
                         if want[1] > rep else
                         f"the state of replicas {want[1]}..{rep - 1} is dropped"))
            return
        raise UsageError(
            f"cannot resume from {path}: it was written by {world} rank(s) as mesh "
            f"replicate {rep} x shard {shard}, this job runs {self.world} rank(s) as "
            f"{want[1]} x {want[2]}; resume with mesh.shard={shard} (any mesh.replicate, "
            f"e.g. {world} ranks and mesh.replicate={rep} mesh.shard={shard}: each rank's "
            "shards cannot be regrouped into another shard size), or start afresh with "
            "train.overwrite=true or another train.out")

    def _refuse_settings(self, path: Path, diff: list[str]) -> UsageError:
        return UsageError(f"cannot resume from {path}: it was written with {', '.join(diff)}; "
                          "resume with those settings, or start afresh with "
                          "train.overwrite=true or another train.out")

    def _check_settings(self, path: Path, saved: dict | None) -> None:
        """The trainer settings that wrote ``path`` (task, model, replicator, optimizer)
        against this job's, old value against new."""
        if not isinstance(saved, dict):
            return
        diff = [f"{k} {saved[k]!r} (now {self.meta[k]!r})" for k in self.meta
                if k in saved and saved[k] != self.meta[k]
                and k not in (*LAYOUT_KEYS, DATA_KEY)]
        if diff:
            raise self._refuse_settings(path, diff)

    def _note_data_changes(self, path: Path, saved: dict | None) -> None:
        """One line when the resume reads other data than the run that wrote ``path`` (seed,
        batch, corpus): allowed, but the batches from here on differ from the
        uninterrupted run's."""
        old = saved.get(DATA_KEY) if isinstance(saved, dict) else None
        new = self.meta.get(DATA_KEY)
        if not isinstance(old, dict) or not isinstance(new, dict):
            return  # written before flexdemo recorded them
        diff = [f"{k} {old[k]!r} (now {new[k]!r})" for k in new
                if k in old and old[k] != new[k]]
        if diff:
            self.echo(f"note: resuming from {path.name} with other data: {', '.join(diff)}; "
                      "the batches from here on differ from those the run would have read")

    def load(self, path: Path, model, opt) -> tuple[TrainState, dict[str, Any]]:
        """Restore a checkpoint (collective; its digests were checked by
        :meth:`resume_path`); returns the train state and the saved extra."""
        self._check_layout(path)
        self._check_settings(path, (read_info(path) or {}).get("settings"))
        try:
            info = load_checkpoint(path, model, opt, verify=False)
        except CheckpointMismatchError as e:
            raise self._refuse_settings(path, [f"{what} {old} (now {new})"
                                               for what, old, new in e.differences]) from None
        except NotACheckpointError as e:  # the library's advice is for Python callers
            raise UsageError(f"cannot resume: {e.reason}; resume=true continues from the "
                             f"newest intact checkpoint (flexdemo checkpoint verify "
                             f"{self.root.parent} lists them), or start afresh with "
                             "train.overwrite=true or another train.out") from None
        except Exception as e:  # any failure here is "cannot resume from it"
            text = " ".join(str(e).split())[:400]
            if not text.startswith(("loading checkpoint", "restoring checkpoint")):
                text = f"cannot resume from {path}: {text}"
            raise TrainingError(text) from None
        extra = info.get("extra") or {}
        self._check_settings(path, extra.get("meta"))
        self._note_data_changes(path, extra.get("meta"))
        if "data" not in extra or "rng" not in extra:
            raise TrainingError(f"cannot resume from {path}: it holds no data position or RNG "
                                "state (not written by flexdemo train?)")
        return TrainState.from_extra(int(info["step"]), extra), extra


def checkpoint_meta(cfg: Config, world: int, layout: dict[str, int],
                     train_items: int | None = None) -> dict[str, Any]:
    """What a checkpoint records of the settings: those a resume must keep, the layout
    (:data:`LAYOUT_KEYS`) and the data (:data:`DATA_KEY`), which a resume may change."""
    return {"task": cfg.task.name, "model": cfg.task.model, "world": world,
            "replicate": layout["replicate"], "shard": layout["shard"],
            "replicator": cfg.strategy.replicator, "optimizer": cfg.strategy.optimizer,
            DATA_KEY: _data_settings(cfg, train_items)}


def _data_settings(cfg: Config, train_items: int | None) -> dict[str, Any]:
    """The settings that choose the batches, by config key: the seed, the batch, the
    ``[task]`` keys besides the name and model (the corpus), and the training items."""
    task = {f"task.{f.name}": getattr(cfg.task, f.name) for f in fields(cfg.task)
            if f.name not in ("name", "model")}
    out: dict[str, Any] = {"train.seed": cfg.train.seed, "train.batch": cfg.train.batch, **task}
    if train_items is not None:
        out["training items"] = train_items
    return out
