"""The trainer behind ``flexdemo train``: one config, any number of ranks.

:func:`train` builds the task and its model, calls :func:`flexdemo.prepare` (FSDP2 inside a
replica, the configured replicator across replicas), and runs the loop: learning-rate warm-up
and schedule, each rank reading its own data shard, evaluation every ``eval_every`` steps,
checkpoints every ``checkpoint_every`` steps. Run it under ``torchrun``, under
``flexdemo cluster``, or as a single process.

Outputs under ``train.out`` (written by rank 0, except the checkpoints, which every rank
writes; with several machines ``out`` must be a shared folder):

* ``config.toml``: the resolved config (``flexdemo train out/config.toml`` reruns it);
* ``metrics.jsonl``: one line per step: ``step``, ``loss`` (rank 0's batch), ``lr``,
  ``bytes_sent``/``bytes_received`` (rank 0, over the replicate dimension: the slow link),
  ``comm_seconds`` (inside the replicators' collectives), ``compute_seconds`` (the rest of
  the step: data, forward, backward with FSDP's own traffic, the optimizer),
  ``step_seconds``, ``train_seconds`` (cumulative, evaluation and checkpoints excluded) and
  ``bytes_sent_total``; evaluation steps add ``val_loss`` (and ``val_accuracy``), averaged
  over all ranks;
* ``summary.json``: the final figures (also printed);
* ``tensorboard/``: the same scalars, if tensorboard is installed;
* ``checkpoints/step_NNNNNN``: model, optimizer (with every replica's replicator state),
  data position, RNG state and step, via :mod:`flexdemo.checkpoint`.

Resuming (``resume = true``) restores all of it; on CPU the resumed run's losses equal an
uninterrupted run's bit for bit. When a peer dies, every rank stops with an error that names
the lost rank (found through a heartbeat in the rendezvous store) instead of hanging;
collectives give up after ``train.timeout`` seconds.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import prepare
from ..checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from ..mesh import timeout_from_env
from ..replicate import NonFiniteGradientError
from .config import Config, config_to_dict, to_toml
from .tasks import ShardSampler, build_task

__all__ = ["PeerLostError", "TrainingError", "lr_at", "train"]

CHECKPOINT_RE = re.compile(r"step_(\d+)$")


class TrainingError(RuntimeError):
    """Training cannot start or go on; the message is meant for the user."""


class PeerLostError(TrainingError):
    """A peer died or became unreachable; ``lost_ranks`` names it when it can be told."""

    def __init__(self, message: str, lost_ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.lost_ranks = lost_ranks or []


def lr_at(step: int, steps: int, base: float, warmup: int = 0, schedule: str = "cosine",
          min_lr: float = 0.1) -> float:
    """Learning rate of step ``step`` (from 0): linear warm-up over ``warmup`` steps, then
    constant or a cosine decay that reaches ``min_lr * base`` at the last step."""
    if warmup and step < warmup:
        return base * (step + 1) / warmup
    if schedule == "constant":
        return base
    span = max(steps - warmup - 1, 1)
    frac = min(max(step - warmup, 0) / span, 1.0)
    return base * (min_lr + (1.0 - min_lr) * 0.5 * (1.0 + math.cos(math.pi * frac)))


def timeout_seconds(cfg: Config) -> float:
    """``train.timeout``, else ``FLEXDEMO_TIMEOUT``, else the library's default
    (:data:`flexdemo.mesh.DEFAULT_TIMEOUT_SECONDS`)."""
    if cfg.train.timeout:
        return float(cfg.train.timeout)
    try:
        return timeout_from_env().total_seconds()
    except ValueError as e:
        raise TrainingError(str(e)) from None


# ---------------------------------------------------------------------- liveness
class Heartbeat:
    """Each rank bumps a counter in the rendezvous store every ``interval`` seconds, so that
    after a failed collective the survivors can tell which ranks stopped."""

    PREFIX = "flexdemo/heartbeat/"

    def __init__(self, rank: int, world: int, interval: float = 1.0) -> None:
        self.rank, self.world, self.interval = rank, world, interval
        self.store = None
        if world > 1:
            try:
                self.store = dist.distributed_c10d._get_default_store()
            except Exception:  # noqa: BLE001 - no store: no diagnosis, training still runs
                self.store = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.store is not None:
            self._beat()
            self._thread = threading.Thread(target=self._run, name="flexdemo-heartbeat",
                                            daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        assert self.store is not None
        self.store.add(f"{self.PREFIX}{self.rank}", 1)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store is gone; diagnose() will say so
                return

    def stop(self) -> None:
        """Stop beating (before the process group goes away)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)

    def lost_ranks(self) -> tuple[list[int], str]:
        """``(ranks whose heartbeat stopped, a note)``; takes about three intervals."""
        if self.store is None:
            return [], "no rendezvous store to ask"
        try:
            keys = [f"{self.PREFIX}{r}" for r in range(self.world)]
            before = [self.store.add(k, 0) for k in keys]
            time.sleep(3 * self.interval)
            after = [self.store.add(k, 0) for k in keys]
        except Exception:  # noqa: BLE001 - the store's host (node 0) is unreachable
            if self.rank == 0:
                return [], "the rendezvous store is unreachable"
            return [0], "the rendezvous store on MASTER_ADDR is unreachable"
        lost = [r for r in range(self.world) if r != self.rank and after[r] == before[r]]
        return lost, ""


def _is_comm_error(e: BaseException) -> bool:
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e).lower()
    return any(s in text for s in ("gloo", "connection", "timed out", "timeout", "nccl",
                                   "peer", "socket", "broken pipe"))


# ---------------------------------------------------------------------- outputs
def summary_writer() -> type | None:
    """TensorBoard's ``SummaryWriter`` class, or None when tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter


class MetricsLog:
    """Rank 0's ``metrics.jsonl`` and TensorBoard writer."""

    def __init__(self, out: Path, resume_step: int, tensorboard: bool,
                 echo: Callable[[str], None]) -> None:
        self.path = out / "metrics.jsonl"
        kept: list[str] = []
        if resume_step and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line).get("step", 0) <= resume_step:
                        kept.append(line)
                except json.JSONDecodeError:
                    break  # a line cut by the crash
        self.path.write_text("".join(line + "\n" for line in kept))
        self.file = self.path.open("a")
        self.writer = None
        if tensorboard:
            writer = summary_writer()
            if writer is None:
                echo("note: TensorBoard logs skipped: tensorboard is not installed "
                     "(pip install tensorboard)")
            else:
                self.writer = writer(str(out / "tensorboard"), purge_step=resume_step + 1)

    def write(self, record: dict) -> None:
        """Append one step's record."""
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            step = record["step"]
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    group = "val" if key.startswith("val_") else "train"
                    self.writer.add_scalar(f"{group}/{key}", value, step)
            self.writer.flush()

    def close(self) -> None:
        self.file.close()
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


# ---------------------------------------------------------------------- checkpoints
def _checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.train.out) / "checkpoints"


def _existing_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and CHECKPOINT_RE.match(p.name)]
    return sorted(found, key=lambda p: int(CHECKPOINT_RE.match(p.name).group(1)))


def _resume_path(cfg: Config, echo: Callable[[str], None]) -> Path | None:
    if cfg.resume is False:
        return None
    if cfg.resume is True:
        found = latest_checkpoint(_checkpoint_root(cfg))
        if found is None:
            echo(f"resume: no checkpoint in {_checkpoint_root(cfg)} yet; starting at step 0")
        return found
    path = Path(cfg.resume)
    if not path.exists():
        raise TrainingError(f"resume: checkpoint {str(path)!r} does not exist")
    inner = latest_checkpoint(path)
    return inner if inner is not None else path


def _agreed_resume_path(cfg: Config, rank: int, world: int,
                        echo: Callable[[str], None]) -> Path | None:
    """Rank 0 picks the checkpoint to resume from; every rank gets its choice (or error)."""
    result: list[Any] = [None]
    if rank == 0:
        try:
            found = _resume_path(cfg, echo)
            result = [("ok", None if found is None else str(found))]
        except TrainingError as e:
            result = [("error", str(e))]
    if world > 1:
        dist.broadcast_object_list(result, src=0)
    kind, value = result[0]
    if kind == "error":
        raise TrainingError(value)
    return None if value is None else Path(value)


def _prune(root: Path, keep: int) -> None:
    if keep <= 0:
        return
    for old in _existing_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------- helpers
def _sum_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def _local_numel(model: torch.nn.Module) -> int:
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel()
               for p in model.parameters())


def _evaluate(task, model, cfg: Config, rank: int, world: int) -> dict[str, float]:
    sums = task.evaluate(model, rank, world, cfg.train.eval_batches, cfg.train.batch)
    keys = sorted(sums)
    total = dict(zip(keys, _sum_over_ranks([sums[k] for k in keys])))
    out = {"val_loss": total["loss_sum"] / max(total["count"], 1.0)}
    if "correct" in total:
        out["val_accuracy"] = total["correct"] / max(total["count"], 1.0)
    return out


def _say_rank0(rank: int, echo: Callable[[str], None]) -> Callable[[str], None]:
    return echo if rank == 0 else (lambda text: None)


# ---------------------------------------------------------------------- the loop
def train(cfg: Config, *, echo: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train as ``cfg`` says; returns the summary (the same on every rank).

    Joins (or creates) the process group. Raises :class:`TrainingError` (or its subclass
    :class:`PeerLostError`) with a user-facing message when training cannot go on.
    """
    echo = echo or (lambda text: print(text, flush=True))
    tc, sc = cfg.train, cfg.strategy
    if tc.threads:
        torch.set_num_threads(tc.threads)
    timeout = timeout_seconds(cfg)
    t_start = time.perf_counter()
    try:
        task = build_task(cfg.task, seed=tc.seed)
    except (ModuleNotFoundError, ValueError, RuntimeError) as e:
        raise TrainingError(f"task {cfg.task.name!r}: {e}") from None
    torch.manual_seed(tc.seed)
    model = task.build_model()
    n_params = sum(p.numel() for p in model.parameters())
    try:
        model, opt = prepare(
            model, replicator=sc.replicator, optimizer=sc.optimizer, lr=sc.lr,
            replicate=cfg.mesh.replicate, shard=cfg.mesh.shard, weight_decay=sc.weight_decay,
            replicator_kwargs=dict(sc.replicator_kwargs) or None,
            optimizer_kwargs=dict(sc.optimizer_kwargs) or None,
            shard_units=task.shard_units(), nonfinite=sc.nonfinite,
            timeout=timedelta(seconds=timeout))
    except ValueError as e:
        raise TrainingError(f"prepare: {e}") from None
    except Exception as e:
        if not (_is_comm_error(e) or isinstance(e, TimeoutError)):
            raise
        where = (f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
                 if "MASTER_ADDR" in os.environ else "the rendezvous")
        raise TrainingError(
            f"could not join the job at {where} within "
            f"{timeout:g}s (a peer is missing or unreachable, or MASTER_ADDR/MASTER_PORT are "
            f"wrong): {_short(e)}") from None
    rank, world = dist.get_rank(), dist.get_world_size()
    say = _say_rank0(rank, echo)
    mesh = opt.mesh
    layout = {"replicate": mesh["replicate"].size(), "shard": mesh["shard"].size()}
    out = Path(tc.out)
    root = _checkpoint_root(cfg)
    heartbeat = Heartbeat(rank, world)
    metrics: MetricsLog | None = None
    progress: Progress | None = None
    try:
        # ---------------------------------------------------------------- resume
        resume_from = _agreed_resume_path(cfg, rank, world, say)
        start = 0
        carry = {"train_seconds": 0.0, "bytes_sent": 0, "bytes_received": 0}
        sampler_state = None
        extra: dict[str, Any] = {}
        # rank 0's view decides (every rank must take the same branch)
        old = _sum_over_ranks([float(rank == 0 and resume_from is None
                                     and bool(_existing_checkpoints(root)))])[0] > 0
        if old:
            if not tc.overwrite:
                raise TrainingError(
                    f"{root} holds checkpoints of an earlier run; continue it with resume=true,"
                    " or start afresh with train.overwrite=true (deletes them) or another "
                    "train.out")
            if rank == 0:
                shutil.rmtree(root)
            dist.barrier()
        if resume_from is not None:
            start, extra = _load(resume_from, model, opt, cfg, world, layout)
            sampler_state = extra["data"]
            carry = {k: type(v)(extra.get(k, v)) for k, v in carry.items()}
            say(f"resumed from {resume_from} at step {start}")
        sampler = ShardSampler(task.num_train_items, rank, world, tc.seed)
        if sampler_state is not None:
            sampler.load_state_dict(sampler_state)
        if resume_from is not None:
            torch.set_rng_state(extra["rng"])
        last = tc.stop_at or tc.steps
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.toml").write_text(to_toml(cfg))
            metrics = MetricsLog(out, start, tc.tensorboard, say)
        say(f"{task.describe()}")
        say(f"{n_params / 1e6:.3f}M parameters; world {world} = mesh replicate "
            f"{layout['replicate']} x shard {layout['shard']}; {sc.replicator} + "
            f"{sc.optimizer} lr {sc.lr:g}; steps {start + 1}..{last} of {tc.steps}, batch "
            f"{tc.batch} per rank; out {out}")
        progress = Progress(tc.steps, start, tc.log_every, tc.progress and rank == 0, say)

        # ---------------------------------------------------------------- steps
        losses: list[float] = []
        step_s = comm_s = 0.0
        train_seconds = carry["train_seconds"]
        sent_total, recv_total = carry["bytes_sent"], carry["bytes_received"]
        val: dict[str, float] = {}
        step = start
        t_loop = time.perf_counter()
        for step in range(start + 1, last + 1):
            lr = lr_at(step - 1, tc.steps, sc.lr, min(tc.warmup, tc.steps), tc.schedule,
                       tc.min_lr)
            for g in opt.param_groups:
                g["lr"] = lr
            t0 = time.perf_counter()
            batch = task.train_batch(sampler.next(tc.batch))
            try:
                loss = task.loss(model, batch)
                loss.backward()
                opt.step()
            except NonFiniteGradientError as e:
                raise TrainingError(f"step {step}: {e}") from None
            opt.zero_grad()
            loss_value = float(loss.detach())
            dt = time.perf_counter() - t0
            stats = opt.last_step_stats()
            train_seconds += dt
            step_s += dt
            comm_s += stats["comm_seconds"]
            sent_total += stats["bytes_sent"]
            recv_total += stats["bytes_received"]
            losses.append(loss_value)
            record = {"step": step, "loss": loss_value, "lr": lr,
                      "bytes_sent": stats["bytes_sent"],
                      "bytes_received": stats["bytes_received"],
                      "compute_seconds": dt - stats["comm_seconds"],
                      "comm_seconds": stats["comm_seconds"], "step_seconds": dt,
                      "train_seconds": train_seconds, "bytes_sent_total": sent_total}
            val = {}
            if (tc.eval_every and step % tc.eval_every == 0) or step == last:
                val = _evaluate(task, model, cfg, rank, world)
                record.update(val)
            if metrics is not None:  # before the checkpoint: a resume keeps lines <= its step
                metrics.write(record)
            if tc.checkpoint_every and (step % tc.checkpoint_every == 0 or step == last):
                _save(root, model, opt, step, sampler, train_seconds, sent_total, recv_total,
                      cfg, world, layout, rank, tc.keep_checkpoints)
            if progress is not None:
                progress.update(step, loss_value, lr, sent_total / 1e6, val.get("val_loss"))
        loop_seconds = time.perf_counter() - t_loop
        progress.close()

        # ---------------------------------------------------------------- summary
        ran = max(step - start, 0)
        tail = losses[-min(len(losses), 10):] or [float("nan")]
        sums = _sum_over_ranks([sum(tail) / len(tail), step_s, comm_s, sent_total, recv_total])
        mean = [v / world for v in sums]
        summary: dict[str, Any] = {
            "task": cfg.task.name, "model": cfg.task.model, "params": n_params,
            "local_params": _local_numel(model), "world": world, "mesh": layout,
            "replicator": sc.replicator, "optimizer": sc.optimizer, "lr": sc.lr,
            "steps": step, "steps_total": tc.steps, "steps_this_run": ran,
            "resumed_from": str(resume_from) if resume_from else None,
            "batch_per_rank": tc.batch,
            "train_loss": mean[0], **val,
            "seconds": time.perf_counter() - t_start, "loop_seconds": loop_seconds,
            "train_seconds": train_seconds,
            "step_seconds": mean[1] / max(ran, 1), "comm_seconds": mean[2] / max(ran, 1),
            "compute_seconds": (mean[1] - mean[2]) / max(ran, 1),
            "bytes_sent_per_step": mean[3] / max(step, 1),
            "bytes_received_per_step": mean[4] / max(step, 1),
            "mb_sent_total": mean[3] / 1e6, "out": str(out),
            "config": config_to_dict(cfg),
        }
        if rank == 0:
            (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        say(format_summary(summary))
        return summary
    except TrainingError:
        raise
    except Exception as e:
        if world > 1 and _is_comm_error(e):
            raise _peer_error(e, heartbeat, rank, root) from e
        raise
    finally:
        heartbeat.stop()
        if progress is not None:
            progress.close()
        if metrics is not None:
            metrics.close()


def _short(e: BaseException) -> str:
    """The first useful part of a c10d/gloo error, on one line."""
    text = re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", " ".join(str(e).split()))
    text = text.split(" Exception raised from ")[0].split(" This is typically")[0]
    return text[:300].rstrip(". ")


def _peer_error(e: BaseException, heartbeat: Heartbeat, rank: int, root: Path) -> PeerLostError:
    lost, note = heartbeat.lost_ranks()
    first = _short(e)
    if lost:
        who = (f"lost rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} "
               "(stopped responding; died or unreachable)")
    else:
        who = "lost contact with a peer" + (f" ({note})" if note else "")
    ckpts = _existing_checkpoints(root)
    where = (f"; the last checkpoint is {ckpts[-1]} (continue with resume=true)"
             if ckpts else "; no checkpoint was written")
    return PeerLostError(f"rank {rank}: {who}: {first}{where}", lost)


def _meta(cfg: Config, world: int, layout: dict) -> dict:
    return {"task": cfg.task.name, "model": cfg.task.model, "world": world,
            "replicate": layout["replicate"], "shard": layout["shard"],
            "replicator": cfg.strategy.replicator, "optimizer": cfg.strategy.optimizer}


def _save(root: Path, model, opt, step: int, sampler, train_seconds: float, sent: int,
          received: int, cfg: Config, world: int, layout: dict, rank: int, keep: int) -> Path:
    extra = {"data": sampler.state_dict(), "rng": torch.get_rng_state(),
             "train_seconds": float(train_seconds), "bytes_sent": int(sent),
             "bytes_received": int(received), "meta": _meta(cfg, world, layout)}
    path = save_checkpoint(root / f"step_{step:06d}", model, opt, step=step, extra=extra)
    if rank == 0:
        _prune(root, keep)
    return path


def _load(path: Path, model, opt, cfg: Config, world: int, layout: dict) -> tuple[int, dict]:
    try:
        info = load_checkpoint(path, model, opt)
    except Exception as e:  # noqa: BLE001 - any failure here is "cannot resume from it"
        raise TrainingError(f"cannot resume from {path}: {' '.join(str(e).split())[:400]}") \
            from None
    extra = info.get("extra") or {}
    meta = extra.get("meta") or {}
    want = _meta(cfg, world, layout)
    diff = [f"{k} {meta[k]!r} (now {want[k]!r})" for k in want
            if k in meta and meta[k] != want[k]]
    if diff:
        raise TrainingError(f"cannot resume from {path}: it was written with "
                            f"{', '.join(diff)}")
    if "data" not in extra or "rng" not in extra:
        raise TrainingError(f"cannot resume from {path}: it holds no data position or RNG "
                            "state (not written by flexdemo train?)")
    return int(info["step"]), extra


def format_summary(s: dict[str, Any]) -> str:
    """The printed summary."""
    lines = [
        "summary",
        f"  task        {s['task']}/{s['model']} ({s['params'] / 1e6:.3f}M params), world "
        f"{s['world']} = {s['mesh']['replicate']} x {s['mesh']['shard']}",
        f"  strategy    {s['replicator']} + {s['optimizer']}, lr {s['lr']:g}",
        f"  steps       {s['steps']}/{s['steps_total']} ({s['steps_this_run']} this run)",
        f"  train loss  {s['train_loss']:.4f} (mean of the last steps over ranks)",
    ]
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
