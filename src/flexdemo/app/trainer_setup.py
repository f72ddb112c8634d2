"""The trainer's set-up and its messages about lost peers: joining the process group,
building the task, the model and the optimizer (:func:`flexdemo.prepare`), the checkpointer,
the output folder and the resume; a lost peer named in one line. :class:`TrainerSetUp` is
the base of :class:`flexdemo.app.trainer.Trainer`, which runs the loop."""

from __future__ import annotations

import os
import sys
import time
import warnings
import zlib
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint import describe_os_error, save_checkpoint
from ..ft.session import LighthouseUnreachableError, TorchFTVersionError
from ..heartbeat import STALE_SECONDS
from ..join import JoinError
from ..mesh import init_distributed, is_timeout, timeout_from_env, timeout_note
from ..sharding import NoReplicationWarning, prepare
from ..transport import PeerLostError
from .checkpointer import (
    Checkpointer,
    TrainState,
    checkpoint_meta,
    rank0_decides,
)
from .config import Config, ConfigError
from .config_checks import fault_tolerance
from .config_files import to_toml
from .device import resolve_device
from .errors import StartupError, TrainingError, UsageError
from .liveness import Heartbeat, is_comm_error, short_error
from .outputs import (
    MetricsLog,
    Progress,
    check_output_folder,
    write_atomic,
)
from .preempt import StopRequest
from .tasks import ShardSampler, Task, build_task, task_options

__all__ = ["TrainerSetUp", "timeout_seconds"]


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


class TrainerSetUp:
    """The set-up of a :class:`~flexdemo.app.trainer.Trainer` (see there) and its messages
    about lost peers."""

    def __init__(self, cfg: Config, *, echo: Echo | None = None,
                 exit_on_lost_peer: bool = False, handle_signals: bool = False) -> None:
        self.cfg = cfg
        self.handle_signals = handle_signals
        self.stop: StopRequest | None = None
        self.echo = echo or (lambda text: print(text, flush=True))
        self.exit_on_lost_peer = exit_on_lost_peer
        tc = cfg.train
        if tc.threads:
            torch.set_num_threads(tc.threads)
        self.timeout = timeout_seconds(cfg)
        self.t_start = time.perf_counter()
        try:
            self.device = resolve_device(tc.device)
        except ValueError as e:
            raise TrainingError(f"train.device: {e}") from None
        self._join()  # before the task: reading data must not count against a peer's arrival
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.started = False  # the loop began: a lost peer is no longer a start-up failure
        self.skip_stop: str | None = None  # the line that stops a run of skipped steps
        self.checkpointer: Checkpointer | None = None
        # heartbeats from now on; until the loop starts they also watch for a peer that died
        # (a rank blocked in prepare()'s collectives learns it from its heartbeat thread)
        self.heartbeat = Heartbeat(self.rank, self.world,
                                   on_verdict=self._exit_with_verdict
                                   if exit_on_lost_peer else None,
                                   stale=STALE_SECONDS if exit_on_lost_peer else None)
        try:
            self._set_up()
        except BaseException:
            self.heartbeat.stop()
            if self.stop is not None:
                self.stop.restore()
            raise

    def _set_up(self) -> None:
        """Build the task, the model and the optimizer (prepare), and the checkpointer."""
        cfg, tc = self.cfg, self.cfg.train
        try:
            self.task: Task = build_task(cfg.task, seed=tc.seed)
        except (ModuleNotFoundError, ValueError) as e:  # a missing extra, a bad setting
            raise UsageError(f"task {cfg.task.name!r}: {e}") from None
        except RuntimeError as e:
            raise TrainingError(f"task {cfg.task.name!r}: {e}") from None
        self.task.device = self.device
        self._check_batch()  # before prepare()'s collectives: the same verdict on every rank
        torch.manual_seed(tc.seed)
        model = self.task.build_model()
        self.n_params = sum(p.numel() for p in model.parameters())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", NoReplicationWarning)
            self.model, self.opt = self._prepare(model)
        self.say: Echo = self.echo if self.rank == 0 else (lambda text: None)
        mesh = self.opt.mesh
        self.layout = {"replicate": mesh["replicate"].size(), "shard": mesh["shard"].size()}
        if any(issubclass(w.category, NoReplicationWarning) for w in caught):
            self.say(self._single_replica_note())
        for w in caught:  # anything else prepare() warned about goes on as usual
            if not issubclass(w.category, NoReplicationWarning):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        # CUDA: losses are read every log_every steps (a host read waits for the GPU)
        self.read_every = 1 if self.device.type == "cpu" else max(tc.log_every, 1)
        self.out = Path(tc.out)
        self.checkpointer = Checkpointer(self.out / "checkpoints", tc.checkpoint_every,
                                         tc.keep_checkpoints, self.rank, self.world,
                                         checkpoint_meta(cfg, self.world, self.layout,
                                                          self.task.num_train_items),
                                         self.say, self.echo, tc.resume_fallback,
                                         save=lambda *a, **k: save_checkpoint(*a, **k))
        self.state = TrainState()
        self.metrics: MetricsLog | None = None
        self.progress: Progress | None = None
        # from here on a signal asks for a clean stop (before, it ends the process as usual)
        self.stop = StopRequest(self.world, self.device, self.timeout, self.handle_signals)

    def _check_batch(self) -> None:
        """Refuse a ``train.batch`` larger than the smallest rank's share of the training
        data (as :class:`ShardSampler` shares it); every rank computes the same verdict."""
        items, batch = self.task.num_train_items, self.cfg.train.batch
        share = ShardSampler.smallest_share(items, self.world)
        if batch <= share:
            return
        ranks = f" over {self.world} ranks" if self.world > 1 else ""
        more = " (task.corpus_bytes)" if "corpus_bytes" in task_options(self.cfg.task.name) else ""
        if share == 0:
            raise UsageError(f"task {self.cfg.task.name!r}: its {items} training items cannot "
                             f"be shared{ranks}: every rank needs at least one; use more "
                             f"data{more} or fewer ranks")
        raise UsageError(f"train.batch={batch} is larger than a rank's share of the training "
                         f"data ({share} of {items} items{ranks}); set train.batch to at most "
                         f"{share}, or use more data{more}")

    def _single_replica_note(self) -> str:
        what = f"a single replica, so replicator {self.cfg.strategy.replicator!r} exchanges nothing"
        if self.world == 1:
            return (f"note: one process: {what}; launch several ranks (torchrun, flexdemo "
                    "cluster) to train replicas")
        shard = self.layout["shard"]
        split = next(p for p in range(2, self.world + 1) if self.world % p == 0)
        return (f"note: mesh replicate 1 x shard {shard}: {what} (the {self.world} ranks shard "
                "one model with FSDP). mesh.shard defaults to the ranks per node; set "
                f"mesh.replicate (e.g. mesh.replicate={split}) to replicate across the ranks "
                "of one node, or run on several nodes")

    def _join(self) -> None:
        """Join (or create) the process group; a peer missing at start-up raises
        :class:`StartupError` naming it."""
        try:
            init_distributed(self.device, timedelta(seconds=self.timeout))
        except JoinError as e:
            raise StartupError(str(e), e.missing) from None
        except ValueError as e:
            raise UsageError(str(e)) from None
        except TimeoutError as e:
            raise TrainingError(str(e)) from None

    def _prepare(self, model: torch.nn.Module):
        sc, tc = self.cfg.strategy, self.cfg.train
        try:
            ft = fault_tolerance(self.cfg)
        except ConfigError as e:
            raise UsageError(str(e)) from None
        try:
            return prepare(
                model, replicator=sc.replicator, optimizer=sc.optimizer, lr=sc.lr,
                replicate=self.cfg.mesh.replicate, shard=self.cfg.mesh.shard,
                weight_decay=sc.weight_decay,
                replicator_kwargs=dict(sc.replicator_kwargs) or None,
                optimizer_kwargs=dict(sc.optimizer_kwargs) or None,
                shard_units=self.task.shard_units(), nonfinite=sc.nonfinite,
                device=self.device, precision=tc.precision,
                timeout=timedelta(seconds=self.timeout), fault_tolerance=ft)
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
            if self.world > 1:  # a peer died during start-up: name it
                lost = self._peer_error(e)
                raise StartupError(str(lost), lost.lost_ranks) from None
            where = (f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
                     if "MASTER_ADDR" in os.environ else "the rendezvous")
            raise TrainingError(
                f"could not join the job at {where} within {timeout_note(self.timeout)} (a "
                "peer is missing or unreachable, or MASTER_ADDR/MASTER_PORT are wrong): "
                f"{short_error(e)}") from None

    # ------------------------------------------------------------------ set-up
    def _check_output_folder(self) -> None:
        """Rank 0 creates ``train.out`` and writes a probe file into it; every rank learns
        whether that worked (one line naming the path and the cause if not)."""
        rank0_decides(self.rank, self.world, lambda: check_output_folder(self.out))

    def _open_outputs(self) -> None:
        """Rank 0 writes ``config.toml`` and opens the metrics log (agreed like above)."""
        def make() -> None:
            try:
                write_atomic(self.out / "config.toml", to_toml(self.cfg))
                self.metrics = MetricsLog(self.out, self.state.step, self.cfg.train.tensorboard,
                                          self.say)
            except OSError as e:
                raise TrainingError(f"train.out {str(self.out)!r}: cannot write the outputs: "
                                    f"{describe_os_error(e)}") from None

        rank0_decides(self.rank, self.world, make)

    def _resume(self) -> tuple[Path | None, ShardSampler]:
        tc = self.cfg.train
        assert self.checkpointer is not None  # built by _set_up
        resume_from = self.checkpointer.resume_path(self.cfg.resume, tc.overwrite)
        if resume_from is None:
            self.checkpointer.clear_earlier_run(tc.overwrite, self.cfg.resume)
        self._check_output_folder()
        extra: dict[str, Any] = {}
        if resume_from is not None:
            self.state, extra = self.checkpointer.load(resume_from, self.model, self.opt)
            self.say(f"resumed from {resume_from} at step {self.state.step}")
        session = self.opt.fault_tolerance
        # elastic: every replica group (each numbered from rank 0) its own order of the data
        stream = 0 if session is None else zlib.crc32(session.config.replica_id.encode())
        sampler = ShardSampler(self.task.num_train_items, self.rank, self.world, tc.seed,
                               stream)
        if resume_from is not None:
            sampler.load_state_dict(extra["data"])
            torch.set_rng_state(extra["rng"])
        return resume_from, sampler

    # ------------------------------------------------------------------ lost peers
    def _peer_message(self, lost: list[int], note: str, first: str) -> str:
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

    def _peer_error(self, e: BaseException) -> PeerLostError:
        assert self.heartbeat is not None
        lost, note = self.heartbeat.lost_ranks()
        first = short_error(e)
        if is_timeout(e):
            first += f" (after {timeout_note(self.timeout)})"
        error = PeerLostError(self._peer_message(lost, note, first), lost)
        self.heartbeat.wait_for_survivors(lost)
        return error

    def _exit_with_verdict(self, lost: list[int]) -> None:
        """Heartbeat thread: peers named the lost ranks while this rank waits in a
        collective that cannot finish; say so and leave (the command line's behaviour)."""
        why = ("a peer's collective failed while this rank waited for it" if self.started
               else "its heartbeat stopped while the job was being set up")
        text = self._peer_message(lost, "", why)
        print(f"flexdemo train: error: {text}", file=sys.stderr, flush=True)
        assert self.heartbeat is not None
        self.heartbeat.wait_for_survivors(lost)
        sys.stdout.flush()
        os._exit(1 if self.started else 2)  # a job that never assembled: exit 2, as refused
