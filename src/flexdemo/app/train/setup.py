"""The steps of a :class:`~flexdemo.app.train.trainer.Trainer`'s set-up, each with its own
arguments: joining the process group (:func:`join_group`), checking the batch against the
data (:func:`check_batch`), the model and the optimizer (:func:`prepare_model`, through
:func:`flexdemo.prepare`) and the checkpointer (:func:`new_checkpointer`); and
:class:`LostPeers`, which the trainer owns: the heartbeats and the one line that names a lost
peer."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch

from ...checkpoint import save_checkpoint
from ...ft.session import LighthouseUnreachableError, TorchFTVersionError
from ...heartbeat import STALE_SECONDS
from ...join import JoinError
from ...mesh import init_distributed, is_timeout, timeout_from_env, timeout_note
from ...sharding import prepare
from ...transport import PeerLostError
from ..config.checks import fault_tolerance
from ..config.schema import Config, ConfigError
from ..errors import StartupError, TrainingError, UsageError
from ..tasks import ShardSampler, Task, build_task, task_options
from .checkpointer import (
    Checkpointer,
    checkpoint_meta,
)
from .liveness import Heartbeat, is_comm_error, short_error

__all__ = ["Echo", "LostPeers", "build_task_for", "check_batch", "join_group", "new_checkpointer",
           "prepare_model", "single_replica_note", "timeout_seconds"]


Echo = Callable[[str], None]


def timeout_seconds(cfg: Config) -> float:
    """``train.timeout``, else ``FLEXDEMO_TIMEOUT``, else the library's default
    (:data:`flexdemo.mesh.DEFAULT_TIMEOUT_SECONDS`)."""
    if cfg.train.timeout:
        return float(cfg.train.timeout)
    try:
        return timeout_from_env().total_seconds()
    except ValueError as e:
        raise TrainingError(str(e)) from None


def join_group(device: torch.device, timeout: float) -> None:
    """Join (or create) the process group; a peer missing at start-up raises
    :class:`StartupError` naming it."""
    try:
        init_distributed(device, timedelta(seconds=timeout))
    except JoinError as e:
        raise StartupError(str(e), e.missing) from None
    except ValueError as e:
        raise UsageError(str(e)) from None
    except TimeoutError as e:
        raise TrainingError(str(e)) from None


def build_task_for(cfg: Config, device: torch.device) -> Task:
    """The config's task on ``device`` (a missing extra or a bad setting: one line)."""
    try:
        task = build_task(cfg.task, seed=cfg.train.seed)
    except (ModuleNotFoundError, ValueError) as e:  # a missing extra, a bad setting
        raise UsageError(f"task {cfg.task.name!r}: {e}") from None
    except RuntimeError as e:
        raise TrainingError(f"task {cfg.task.name!r}: {e}") from None
    task.device = device
    return task


def check_batch(cfg: Config, task: Task, world: int) -> None:
    """Refuse a ``train.batch`` larger than the smallest rank's share of the training
    data (as :class:`ShardSampler` shares it); every rank computes the same verdict."""
    items, batch = task.num_train_items, cfg.train.batch
    share = ShardSampler.smallest_share(items, world)
    if batch <= share:
        return
    ranks = f" over {world} ranks" if world > 1 else ""
    more = " (task.corpus_bytes)" if "corpus_bytes" in task_options(cfg.task.name) else ""
    if share == 0:
        raise UsageError(f"task {cfg.task.name!r}: its {items} training items cannot "
                         f"be shared{ranks}: every rank needs at least one; use more "
                         f"data{more} or fewer ranks")
    raise UsageError(f"train.batch={batch} is larger than a rank's share of the training "
                     f"data ({share} of {items} items{ranks}); set train.batch to at most "
                     f"{share}, or use more data{more}")


def single_replica_note(cfg: Config, world: int, layout: dict[str, int]) -> str:
    """The note for a run whose mesh has a single replica (nothing to exchange)."""
    what = f"a single replica, so replicator {cfg.strategy.replicator!r} exchanges nothing"
    if world == 1:
        return (f"note: one process: {what}; launch several ranks (torchrun, flexdemo "
                "cluster) to train replicas")
    shard = layout["shard"]
    split = next(p for p in range(2, world + 1) if world % p == 0)
    return (f"note: mesh replicate 1 x shard {shard}: {what} (the {world} ranks shard "
            "one model with FSDP). mesh.shard defaults to the ranks per node; set "
            f"mesh.replicate (e.g. mesh.replicate={split}) to replicate across the ranks "
            "of one node, or run on several nodes")


def prepare_model(cfg: Config, model: torch.nn.Module, task: Task, device: torch.device,
                  timeout: float, peers: LostPeers):
    """:func:`flexdemo.prepare` as the config says: ``(model, optimizer)``; every failure
    one line (a peer that died meanwhile named by ``peers``)."""
    sc, tc = cfg.strategy, cfg.train
    try:
        ft = fault_tolerance(cfg)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    try:
        return prepare(
            model, replicator=sc.replicator, optimizer=sc.optimizer, lr=sc.lr,
            replicate=cfg.mesh.replicate, shard=cfg.mesh.shard,
            weight_decay=sc.weight_decay,
            replicator_kwargs=dict(sc.replicator_kwargs) or None,
            optimizer_kwargs=dict(sc.optimizer_kwargs) or None,
            shard_units=task.shard_units(), nonfinite=sc.nonfinite,
            device=device, precision=tc.precision,
            timeout=timedelta(seconds=timeout), fault_tolerance=ft)
    except TorchFTVersionError as e:  # an install to change, as for a missing extra
        raise UsageError(str(e)) from None
    except LighthouseUnreachableError as e:  # it names the lighthouse, not a rendezvous
        raise TrainingError(str(e)) from None
    except TimeoutError as e:
        raise TrainingError(str(e)) from None
    except ValueError as e:
        raise TrainingError(f"prepare: {e}") from None
    except Exception as e:
        if not is_comm_error(e):
            raise
        if peers.world > 1:  # a peer died during start-up: name it
            lost = peers.error(e)
            raise StartupError(str(lost), lost.lost_ranks) from None
        where = (f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
                 if "MASTER_ADDR" in os.environ else "the rendezvous")
        raise TrainingError(
            f"could not join the job at {where} within {timeout_note(timeout)} (a "
            "peer is missing or unreachable, or MASTER_ADDR/MASTER_PORT are wrong): "
            f"{short_error(e)}") from None


def new_checkpointer(cfg: Config, rank: int, world: int, layout: dict[str, int], task: Task,
                     say: Echo, echo: Echo) -> Checkpointer:
    """The run's :class:`Checkpointer` under ``train.out/checkpoints`` (it saves through this
    module's :func:`~flexdemo.checkpoint.save_checkpoint`)."""
    tc = cfg.train
    return Checkpointer(Path(tc.out) / "checkpoints", tc.checkpoint_every,
                        tc.keep_checkpoints, rank, world,
                        checkpoint_meta(cfg, world, layout, task.num_train_items),
                        say, echo, tc.resume_fallback,
                        save=lambda *a, **k: save_checkpoint(*a, **k))


class LostPeers:
    """The heartbeats of a run and what a rank says when a peer is lost: one line naming
    the lost ranks (from the heartbeats, the same verdict on every survivor), the start-up
    or the last checkpoint to resume from. With ``exit_on_lost_peer`` (the command line), a
    rank blocked in a collective while its peers already named a lost rank prints that line
    and leaves the process at once."""

    def __init__(self, rank: int, world: int, timeout: float, exit_on_lost_peer: bool) -> None:
        self.rank, self.world, self.timeout = rank, world, timeout
        self.started = False  # the loop began: a lost peer is no longer a start-up failure
        self.checkpointer: Checkpointer | None = None  # names the checkpoint to resume from
        # heartbeats from now on; until the loop starts they also watch for a peer that died
        # (a rank blocked in prepare()'s collectives learns it from its heartbeat thread)
        self.heartbeat = Heartbeat(rank, world,
                                   on_verdict=self.exit_with_verdict
                                   if exit_on_lost_peer else None,
                                   stale=STALE_SECONDS if exit_on_lost_peer else None)

    def loop_started(self) -> None:
        """The loop began: from here on, failed collectives tell of lost peers."""
        self.started = True
        self.heartbeat.watching.clear()

    def stop(self) -> None:
        """Stop the heartbeats."""
        self.heartbeat.stop()

    def message(self, lost: list[int], note: str, first: str) -> str:
        """The line naming the lost ranks (or the lost contact) after ``first``."""
        if lost:
            who = (f"lost rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} "
                   "(stopped responding; died or unreachable)")
        else:
            who = "lost contact with a peer" + (f" ({note})" if note else "")
        if not self.started:
            return (f"rank {self.rank}: start-up: {who}: {first}; restart the job once every "
                    "rank can start")
        latest = self.checkpointer.latest() if self.checkpointer is not None else None
        where = (f"; the last checkpoint is {latest} (continue with resume=true)"
                 if latest else "; no checkpoint was written")
        return f"rank {self.rank}: {who}: {first}{where}"

    def error(self, e: BaseException) -> PeerLostError:
        """The :class:`PeerLostError` for communication error ``e``, once the survivors
        agreed on the lost ranks."""
        lost, note = self.heartbeat.lost_ranks()
        first = short_error(e)
        if is_timeout(e):
            first += f" (after {timeout_note(self.timeout)})"
        error = PeerLostError(self.message(lost, note, first), lost)
        self.heartbeat.wait_for_survivors(lost)
        return error

    def exit_with_verdict(self, lost: list[int]) -> None:
        """Heartbeat thread: peers named the lost ranks while this rank waits in a
        collective that cannot finish; say so and leave (the command line's behaviour)."""
        why = ("a peer's collective failed while this rank waited for it" if self.started
               else "its heartbeat stopped while the job was being set up")
        text = self.message(lost, "", why)
        print(f"flexdemo train: error: {text}", file=sys.stderr, flush=True)
        self.heartbeat.wait_for_survivors(lost)
        sys.stdout.flush()
        os._exit(1 if self.started else 2)  # a job that never assembled: exit 2, as refused
