"""The trainer behind ``flexdemo train``: one config, any number of ranks.

:class:`Trainer` builds the task and its model, calls :func:`flexdemo.prepare` (FSDP2 inside a
replica, the configured replicator across replicas), and runs the loop: learning-rate warm-up
and schedule, each rank reading its own data shard, evaluation every ``eval_every`` steps,
checkpoints every ``checkpoint_every`` steps. Its parts: :class:`TrainState` (what the loop
carries from step to step and across a resume) and :class:`Checkpointer` (which checkpoint
to resume from, when to save, atomic saves, pruning) in :mod:`flexdemo.app.train.checkpointer`, the
errors in :mod:`flexdemo.app.errors`, rank 0's outputs (:mod:`flexdemo.app.outputs`) and the
heartbeats that tell which rank was lost (:mod:`flexdemo.app.train.liveness`). :func:`train` is the
thin function for callers. Run it under ``torchrun``, under ``flexdemo cluster``, or as a
single process. The steps of the set-up (process group, task, model, checkpointer) and the
heartbeats that name a lost peer (:class:`~flexdemo.app.train.setup.LostPeers`, which the
trainer owns) are in :mod:`flexdemo.app.train.setup`.

Outputs under ``train.out`` (written by rank 0, except the checkpoints, which every rank
writes; with several machines ``out`` must be a shared folder):

* ``config.toml``: the resolved config (``flexdemo train out/config.toml`` reruns it);
* ``metrics.jsonl``: one line per step: ``step``, ``loss`` (rank 0's batch), ``lr``,
  ``bytes_sent``/``bytes_received`` (rank 0, over the replicate dimension: the slow link),
  ``comm_seconds`` (inside the replicators' collectives, and the loop's agreement on a
  signal after each step, where a rank waits for a slower one), ``compute_seconds`` (the rest of
  the step: data, forward, backward with FSDP's own traffic, the optimizer),
  ``step_seconds``, ``cpu_seconds`` (the rank's CPU time in the step, all its threads: a
  measure of work that another job on the machine does not inflate, unlike ``step_seconds``),
  ``train_seconds`` (cumulative, evaluation and checkpoints excluded),
  ``bytes_sent_total`` and ``tokens_total`` (rank 0's training tokens so far); evaluation
  steps add ``val_loss`` (and ``val_accuracy``), averaged over all ranks, and
  ``job_tokens_total`` (every rank's tokens so far). A step's line is written before its
  checkpoint, so after a crash and a resume every step appears exactly once;
* ``summary.json``: the final figures (also printed);
* ``tensorboard/``: the same scalars, if tensorboard is installed;
* ``checkpoints/step_NNNNNN``: model, optimizer (with every replica's replicator state),
  data position, RNG state and step, via :mod:`flexdemo.checkpoint`.

Devices (``train.device``): ``auto`` (CUDA when available), ``cpu`` (gloo) or ``cuda`` (each
rank on ``cuda:LOCAL_RANK``, NCCL); batches, losses and every sum over ranks live on that
device, and on CUDA the losses are read once every ``log_every`` steps (and at evaluations and
checkpoints), not after each step. ``train.precision = "bf16"`` trains with FSDP2 mixed
precision (bf16 compute, fp32 gradients and master weights). A run whose mesh has a single
replica (e.g. ``torchrun --nproc-per-node 4`` on one node: replicate 1 x shard 4) says so once.

A run with a pace (``strategy.replicator_kwargs.pace``: DiLoCo's replicas of different speeds)
is measured in syncs, every rank stopping at the same one; evaluations, checkpoints and the
agreement on a signal happen at syncs (an evaluation's sums and the agreement are reduced while
the next period runs and read at the sync after: no rank waits there for the slowest
replica's outer step), and the learning rate follows the run's progress
(:mod:`flexdemo.app.train.speeds`, which also holds ``train.slowdown``, a benchmark's slower
rank). Its metrics lines are rank 0's own steps, with ``sync`` and ``progress`` (the step of
the run's schedule), and ``summary.json`` has ``pace`` and every rank's own figures
(``per_rank``: steps, compute seconds per step, tokens).

Resuming (``resume = true``) restores all of it; on CPU the resumed run's losses equal an
uninterrupted run's bit for bit. A checkpoint already at ``train.steps`` leaves nothing to
train (the outputs stay as they are); one past it is refused (:class:`UsageError`).
When a peer dies, every surviving rank stops with an error
that names the lost rank (found through heartbeats in the rendezvous store, with one verdict
shared by all survivors) instead of hanging; collectives give up after ``train.timeout``
seconds (else ``FLEXDEMO_TIMEOUT``, else the library's default). Storage faults (a full disk,
an unwritable output folder, a damaged checkpoint) stop every rank with one line naming the
path and the cause.
"""

from __future__ import annotations

import json
import os
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...checkpoint import describe_os_error
from ...ft.session import (
    DuplicateReplicaIdError,
    LighthouseLostError,
    QuorumTimeoutError,
    UntrustedPeerError,
)
from ...replicate import NonFiniteGradientError
from ...secret import SECRET_ENV
from ...sharding import NoReplicationWarning
from ...transport import PeerLostError
from ..config.files import config_to_dict, to_toml
from ..config.schema import Config
from ..device import resolve_device, to_device
from ..errors import StartupError, TrainingError, UsageError, nonfinite_message
from ..outputs import (
    MetricsLog,
    Progress,
    check_output_folder,
    format_summary,
    strict_json,
    write_atomic,
)
from ..schedule import lr_at
from ..tasks import ShardSampler, Task
from . import readout
from .checkpointer import (
    Checkpointer,
    TrainState,
    rank0_decides,
    sum_over_ranks,
)
from .liveness import is_comm_error
from .preempt import LighthouseLost, Preempted, StopRequest
from .setup import (
    Echo,
    LostPeers,
    build_task_for,
    check_batch,
    join_group,
    new_checkpointer,
    prepare_model,
    single_replica_note,
    timeout_seconds,
)
from .speeds import BatchBalance, PacedRun, Slowdown, crossed

__all__ = ["Checkpointer", "PeerLostError", "Preempted", "StartupError", "TrainState",
           "Trainer", "TrainingError", "UsageError", "lr_at", "timeout_seconds", "train"]

ELASTIC_WAITS = ("quorum_seconds", "commit_seconds")
"""Under fault tolerance: the seconds a step waits for its quorum and its commit vote."""
PER_RANK = ("steps", "steps_this_run", "compute_seconds", "tokens", "train_seconds", "batch")
"""Each rank's own figures in ``summary.json``'s ``per_rank`` (compute seconds per step)."""
ELASTIC_METRICS = ("replicas", "failed_commits", *ELASTIC_WAITS, "snapshot_seconds")
"""The fault-tolerance figures each ``metrics.jsonl`` line carries in an elastic run."""


# ---------------------------------------------------------------------- the trainer
def _local_numel(model: torch.nn.Module) -> int:
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel()
               for p in model.parameters())


class Trainer:
    """One training run as ``cfg`` says.

    Construction builds the task and the model and joins (or creates) the process group
    through :func:`flexdemo.prepare`; :meth:`run` trains and returns the summary (the same on
    every rank). Both raise :class:`TrainingError` (or, for a lost peer, the library's
    :class:`~flexdemo.transport.PeerLostError`) with a message for the user when training
    cannot go on. With ``exit_on_lost_peer`` (the command line), a rank blocked in a
    collective while its peers already named a lost rank prints that error and leaves the
    process at once (exit code 1). With ``handle_signals`` (the command line),
    SIGTERM and SIGINT stop the run after the step it is in, on every rank at the same step,
    with a checkpoint of that step: :meth:`run` raises :class:`Preempted`.
    """

    def __init__(self, cfg: Config, *, echo: Echo | None = None,
                 exit_on_lost_peer: bool = False, handle_signals: bool = False) -> None:
        self.cfg = cfg
        self.handle_signals = handle_signals
        self.stop: StopRequest | None = None
        self.echo = echo or (lambda text: print(text, flush=True))
        tc = cfg.train
        if tc.threads:
            torch.set_num_threads(tc.threads)
        self.timeout = timeout_seconds(cfg)
        self.t_start = time.perf_counter()
        try:
            self.device = resolve_device(tc.device)
        except ValueError as e:
            raise TrainingError(f"train.device: {e}") from None
        # the config's run secret signs the start-up and liveness verdicts too (they read
        # FLEXDEMO_SECRET); one given in the environment wins
        secret = cfg.fault_tolerance.secret
        if secret and not os.environ.get(SECRET_ENV, "").strip():
            os.environ[SECRET_ENV] = secret
        # before the task: reading data must not count against a peer's arrival
        join_group(self.device, self.timeout)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.skip_stop: str | None = None  # the line that stops a run of skipped steps
        self.checkpointer: Checkpointer | None = None
        self.peers = LostPeers(self.rank, self.world, self.timeout, exit_on_lost_peer)
        try:
            self._set_up()
        except BaseException:
            self.peers.stop()
            if self.stop is not None:
                self.stop.restore()
            raise

    def _set_up(self) -> None:
        """Build the task, the model and the optimizer (prepare), and the checkpointer."""
        cfg, tc = self.cfg, self.cfg.train
        self.task: Task = build_task_for(cfg, self.device)
        check_batch(cfg, self.task, self.world)  # before prepare()'s collectives: one verdict
        torch.manual_seed(tc.seed)
        model = self.task.build_model()
        self.n_params = sum(p.numel() for p in model.parameters())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", NoReplicationWarning)
            self.model, self.opt = prepare_model(cfg, model, self.task, self.device,
                                                 self.timeout, self.peers)
        self.say: Echo = self.echo if self.rank == 0 else (lambda text: None)
        # a pace: the run in syncs; a slowdown: an emulated slower rank (benchmarks)
        self.paced = PacedRun.of(self.opt, tc.steps, tc.stop_at, tc.pace_budget)
        self.slowdown = Slowdown.for_rank(tc.slowdown, tc.slow_ranks, self.rank, self.device)
        self.balance: BatchBalance | None = None  # train.batches = "balanced" (set in _run)
        mesh = self.opt.mesh
        self.layout = {"replicate": mesh["replicate"].size(), "shard": mesh["shard"].size()}
        if any(issubclass(w.category, NoReplicationWarning) for w in caught):
            self.say(single_replica_note(cfg, self.world, self.layout))
        for w in caught:  # anything else prepare() warned about goes on as usual
            if not issubclass(w.category, NoReplicationWarning):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        # CUDA: losses are read every log_every steps (a host read waits for the GPU)
        self.read_every = 1 if self.device.type == "cpu" else max(tc.log_every, 1)
        self.out = Path(tc.out)
        self.checkpointer = self.peers.checkpointer = new_checkpointer(
            cfg, self.rank, self.world, self.layout, self.task, self.say, self.echo)
        self.state = TrainState()
        self.metrics: MetricsLog | None = None
        self.progress: Progress | None = None
        # from here on a signal asks for a clean stop (before, it ends the process as usual)
        self.stop = StopRequest(self.world, self.device, self.timeout, self.handle_signals)

    @property
    def _batch(self) -> int:
        """This rank's batch size (balanced batches: its own once decided)."""
        return self.cfg.train.batch if self.balance is None else self.balance.batch

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

    # ------------------------------------------------------------------ the loop
    def _step(self, step: int, sampler: ShardSampler, t0: float | None = None,
              c0: float | None = None) -> dict[str, Any] | None:
        """One optimizer step; returns its metrics record, whose ``loss`` is still a tensor
        on the device (read in :func:`.readout.read_losses`, without a host read per step). None
        when fault tolerance undid the step (its commit vote failed). ``t0``: when the step
        began, if before this call (the quorum under fault tolerance is part of the step), and
        ``c0`` the process's CPU time then."""
        tc, sc = self.cfg.train, self.cfg.strategy
        at, span = ((step - 1, tc.steps) if self.paced is None
                    else (self.paced.position(), self.paced.span))
        lr = lr_at(at, span, sc.lr, tc.warmup_steps, tc.schedule, tc.min_lr)
        for g in self.opt.param_groups:
            g["lr"] = lr
        if t0 is None:
            t0 = time.perf_counter()
        if c0 is None:
            c0 = time.process_time()
        batch = to_device(self.task.train_batch(sampler.next(self._batch)), self.device)
        tokens = self.task.batch_tokens(batch)
        skipped_before = self.opt.skipped_steps
        try:
            self.opt.count_tokens(tokens)  # a pace weighing by tokens reads them; else no-op
            loss = self.task.loss(self.model, batch)
            loss.backward()
            if self.slowdown is not None:  # the slower device's forward and backward passes
                self.slowdown.before_step(t0)
            t_opt = time.perf_counter()
            self.opt.step()
            if self.paced is not None:
                self.paced.settle()  # the run's last sync: applied now, not tau steps later
        except NonFiniteGradientError as e:
            raise TrainingError(nonfinite_message(step, e)) from None
        stats = self.opt.last_step_stats()  # before zero_grad, which may form the next quorum
        if self.opt.fault_tolerance is None:  # else the loop's zero_grad, on the next step
            self.opt.zero_grad()
        if not stats.get("committed", True):  # undone (fault tolerance): the bytes were sent
            self.state.bytes_sent += stats["bytes_sent"]
            self.state.bytes_received += stats["bytes_received"]
            return None
        skipped = self.opt.skipped_steps - skipped_before
        limit = tc.max_skipped * tc.steps
        if skipped and self.opt.skipped_steps > limit and tc.max_skipped < 1:
            # this step's line and the summary are written before the run stops (see _run)
            self.skip_stop = (
                f"step {step}: {self.opt.skipped_steps} of {step} steps were skipped for "
                f"NaN/Inf gradients (strategy.nonfinite='skip'), more than train.max_skipped="
                f"{tc.max_skipped:g} of train.steps={tc.steps}; the run is not training: "
                "lower strategy.lr or clip gradients (or raise train.max_skipped)")
        # under fault tolerance the quorum and the commit vote are communication too
        comm = stats["comm_seconds"] + sum(stats.get(k, 0.0) for k in ELASTIC_WAITS)
        if self.slowdown is not None:  # an emulated slower rank: its sleep is compute time
            self.slowdown.after_step(t_opt, comm)  # (its optimizer step's)
        dt = time.perf_counter() - t0
        cpu = time.process_time() - c0
        s = self.state
        s.step = step
        s.train_seconds += dt
        s.bytes_sent += stats["bytes_sent"]
        s.bytes_received += stats["bytes_received"]
        s.tokens += tokens
        paced = {} if self.paced is None else {"sync": self.paced.syncs,
                                               "progress": self.paced.position()}
        if self.balance is not None:
            paced["batch"] = self._batch
        return {"step": step, "loss": loss.detach(), "lr": lr, "skipped": bool(skipped),
                "skipped_steps_total": self.opt.skipped_steps,
                "bytes_sent": stats["bytes_sent"], "bytes_received": stats["bytes_received"],
                "compute_seconds": dt - comm, "comm_seconds": comm, "step_seconds": dt,
                "cpu_seconds": cpu, "train_seconds": s.train_seconds,
                "bytes_sent_total": s.bytes_sent, "tokens_total": s.tokens, **paced,
                "time": time.time(),
                **{k: stats[k] for k in ELASTIC_METRICS + ("auto_choice",) if k in stats}}

    def _agree_on_stop(self, record: dict[str, Any], later: bool = False) -> str | None:
        """:meth:`StopRequest.agreed` after ``record``'s step; the time it takes (a rank
        waiting there for a slower one: a loop whose replicators do not exchange at every
        step runs in step with the slowest rank through it) is the step's communication.
        ``later`` (a paced run, at a sync): what the agreement launched at the sync before
        says, and this sync's launched (a stop one sync later, and no barrier after a sync
        that would keep the others waiting for the slowest replica's outer step)."""
        assert self.stop is not None  # built by _set_up
        t0 = time.perf_counter()
        if later:
            stop = self.stop.landed()
            if stop is None:
                self.stop.launch()
        else:
            stop = self.stop.agreed()
        waited = time.perf_counter() - t0
        record["step_seconds"] += waited
        record["comm_seconds"] += waited
        self.state.train_seconds += waited
        record["train_seconds"] = self.state.train_seconds
        return stop

    def _evaluation_sums(self) -> dict[str, float]:
        """This rank's share of the validation sums (and its training tokens so far)."""
        tc = self.cfg.train
        sums = dict(self.task.evaluate(self.model, self.rank, self.world, tc.eval_batches,
                                       tc.batch))
        sums["job_tokens"] = float(self.state.tokens)  # every rank's tokens so far, in the sum
        return sums

    def evaluate(self) -> dict[str, float]:
        """Validation loss (and accuracy) over every rank's share of the validation data."""
        return readout.evaluate(self._evaluation_sums(), self.device)

    def run(self) -> dict[str, Any]:
        """Train to ``train.stop_at`` (or ``train.steps``); returns the summary."""
        try:
            return self._run()
        except TrainingError:
            raise
        except (QuorumTimeoutError, DuplicateReplicaIdError, UntrustedPeerError) as e:
            raise TrainingError(str(e)) from None  # a fault-tolerant run's quorum: one line
        except Exception as e:
            if self.world > 1 and is_comm_error(e):
                raise self.peers.error(e) from e
            raise
        finally:
            self.peers.stop()
            if self.stop is not None:
                self.stop.restore()
            if self.progress is not None:
                self.progress.close()
            if self.metrics is not None:
                self.metrics.close()

    def _run(self) -> dict[str, Any]:
        tc, sc, say = self.cfg.train, self.cfg.strategy, self.say
        assert self.checkpointer is not None and self.stop is not None  # built by _set_up
        resume_from, sampler = self._resume()
        start = self.state.step
        last = tc.stop_at or tc.steps
        paced = self.paced
        if paced is not None:  # the run in syncs; a rank's own steps are opt.steps
            if resume_from is not None and paced.done:
                return self._nothing_to_train(min(paced.at, tc.steps), resume_from)
            start = self.state.step = self.opt.steps
        elif resume_from is not None and start >= last:
            return self._nothing_to_train(start, resume_from)
        if tc.batches == "balanced":
            self.balance = BatchBalance(tc.batch, self.rank, self.world, self.layout["shard"],
                                        start, self.task.num_train_items, self.state.batch)
        self._open_outputs()
        say(f"{self.task.describe()}")
        steps = (f"steps {start + 1}..{last} of {tc.steps}" if paced is None else
                 f"syncs {paced.syncs + 1}..{paced.last} of {paced.total}")
        say(f"{self.n_params / 1e6:.3f}M parameters; world {self.world} = mesh replicate "
            f"{self.layout['replicate']} x shard {self.layout['shard']}; {sc.replicator} + "
            f"{sc.optimizer} lr {sc.lr:g}; {steps}, batch "
            f"{tc.batch} per rank; {self.device.type} {tc.precision}; out {self.out}")
        if paced is not None:
            say(paced.note(tc.steps))
        total, done = ((tc.steps, start) if paced is None
                       else (paced.span, round(paced.position())))
        self.progress = Progress(total, done, tc.log_every, tc.progress and self.rank == 0, say)
        losses: list[float] = []
        step_s = comm_s = 0.0
        val: dict[str, float] = {}
        t_loop = time.perf_counter()
        pending: list[dict[str, Any]] = []
        held: readout.InFlight | None = None  # a paced run's evaluation in flight
        self.peers.loop_started()  # from here on, failed collectives tell of lost peers
        elastic = self.opt.fault_tolerance is not None
        step = start
        def write(records: list[dict[str, Any]]) -> None:
            nonlocal step_s, comm_s
            assert self.progress is not None
            for record in records:
                losses.append(record["loss"])
                step_s += record["step_seconds"]
                comm_s += record["comm_seconds"]
                if self.metrics is not None:
                    self.metrics.write(record)
                # a paced run: the run's progress (the schedule's step), not rank 0's own
                self.progress.update(round(record.get("progress", record["step"])),
                                     record["loss"], record["lr"],
                                     record["bytes_sent_total"] / 1e6, record.get("val_loss"))

        while step < last if paced is None else not paced.done:
            t_step = c_step = None
            position = sampler.state_dict()
            synced = 0 if paced is None else paced.applied
            try:
                if elastic:  # the quorum first (a joiner heals here): the step is opt.steps + 1
                    t_step, c_step = time.perf_counter(), time.process_time()
                    self.opt.zero_grad()
                    if self.opt.steps >= last:
                        break
                record = self._step(self.opt.steps + 1 if elastic or paced else step + 1,
                                    sampler, t_step, c_step)
            except LighthouseLostError as e:  # the step was not taken: save the one before
                sampler.load_state_dict(position)
                write(readout.read_losses(pending, self.device, self.state))
                raise self._lighthouse_lost(e, start, resume_from, sampler) from None
            if record is None:  # not committed under fault tolerance: undone, run again
                continue
            step = record["step"]
            pending.append(record)
            if self.balance is not None and self.balance.observe(
                    step, record["compute_seconds"], self.device):  # the sizes decided now
                self.state.batch = self.balance.batch
                say(f"balanced batches from step {step + 1}: {self.balance.sizes} per replica "
                    f"(train.batch={tc.batch} x {self.layout['replicate']} shared by speed)")
            if self.skip_stop is not None:  # too many skipped steps: lines, summary, one line
                write(readout.read_losses(pending, self.device, self.state))
                summary = self._summary(start, resume_from, losses, step_s, comm_s, val,
                                        time.perf_counter() - t_loop)
                self._write_summary({**summary, "stopped": self.skip_stop})
                raise TrainingError(self.skip_stop)
            # the run's step and the one before it; with a pace, at syncs only (the ranks'
            # steps differ: the collectives below pair up at syncs)
            if paced is None:
                mark, before, final = step, step - 1, step == last
            elif paced.applied > synced:
                mark, before, final = paced.at, paced.at - paced.inner_steps, paced.done
            else:
                mark, before, final = None, 0, False
            stop: str | None = None
            evaluate = checkpoint = False
            if mark is not None:
                # every rank, every step (sync): did any rank get SIGTERM/SIGINT? (then all
                # stop here)
                if not final:
                    stop = self._agree_on_stop(record, later=paced is not None)
                elif paced is not None:
                    self.stop.landed()  # the last one launched (the run ends here anyway)
                evaluate = crossed(tc.eval_every, before, mark) or final
                checkpoint = (bool(tc.checkpoint_every) and (
                    crossed(tc.checkpoint_every, before, mark) or final)) or stop is not None
            if held is not None and mark is not None:  # launched at the sync before
                val, held = readout.land(held), None
            if held is None and (evaluate or checkpoint or step % self.read_every == 0):
                # first: the steps' GPU time is theirs, not the evaluation's
                readout.read_losses(pending, self.device, self.state)
                if evaluate and paced is not None and not (final or checkpoint):
                    # no barrier after a sync: the sums are reduced while the next period
                    # runs and land at the next sync (this line and those after it wait)
                    held = readout.launch(pending[-1], self._evaluation_sums(), self.device)
                    write(pending[:-1])
                    pending = pending[-1:]
                else:
                    val = self.evaluate() if evaluate else {}
                    pending[-1].update(val)
                    write(pending)  # the lines go out before a checkpoint: a resume keeps them
                    pending = []
            if checkpoint:
                assert mark is not None
                saved = self.checkpointer.save(mark, self.model, self.opt, sampler, self.state)
                if stop is not None:
                    raise Preempted(mark, saved, stop)
        if held is not None:  # (a paced run ends with a sync's evaluation: not reached)
            val = readout.land(held)
            write(readout.read_losses(pending, self.device, self.state))
        loop_seconds = time.perf_counter() - t_loop
        self.progress.close()
        summary = self._summary(start, resume_from, losses, step_s, comm_s, val, loop_seconds)
        self._write_summary(summary)
        say(format_summary(summary))
        return summary

    def _write_summary(self, summary: dict[str, Any]) -> None:
        """``summary.json`` (rank 0; a failure to write it is a warning)."""
        if self.rank == 0:
            try:
                write_atomic(self.out / "summary.json", strict_json(summary, indent=2) + "\n")
            except OSError as e:
                self.say(f"warning: cannot write {self.out / 'summary.json'}: "
                         f"{describe_os_error(e)}")

    def _lighthouse_lost(self, e: LighthouseLostError, start: int, resume_from: Path | None,
                         sampler: ShardSampler) -> LighthouseLost:
        """The lighthouse is gone: save the last committed step (every rank of this group),
        as a preempted run does, so that a requeue resumes from it."""
        assert self.checkpointer is not None  # built by _set_up
        step = self.state.step
        latest = self.checkpointer.latest()
        saved: Path | None = resume_from  # nothing committed in this run: where it began
        if latest is not None and latest.name == f"step_{step:06d}":
            saved = latest  # saved at this step already
        elif step > start:
            saved = self.checkpointer.save(step, self.model, self.opt, sampler, self.state)
        return LighthouseLost(step, saved, e.lost)

    def _nothing_to_train(self, start: int, resume_from: Path) -> dict[str, Any]:
        """A resume from a checkpoint at or past the last step: nothing to train, and the
        outputs stay as they are (the summary returned is the saved one, when there is one).
        A checkpoint past ``train.steps`` is refused (:class:`UsageError`)."""
        tc = self.cfg.train
        if start > tc.steps:
            raise UsageError(
                f"cannot resume from {resume_from}: it is at step {start}, past "
                f"train.steps={tc.steps}; set train.steps={start} or more (more than {start} "
                "to train on), or start afresh with train.overwrite=true or another train.out")
        if start == tc.steps:
            self.say(f"already at step {start} of {tc.steps} ({resume_from}); nothing to train "
                     f"(outputs left as they are; to train on, raise train.steps above {start})")
        else:
            self.say(f"already at step {start} (train.stop_at={tc.stop_at}, train.steps="
                     f"{tc.steps}); nothing to train (outputs left as they are; to go on, raise "
                     "train.stop_at or set it to 0)")

        def read() -> dict[str, Any]:
            try:
                saved = json.loads((self.out / "summary.json").read_text())
            except (OSError, ValueError):
                return {}
            return saved if isinstance(saved, dict) else {}

        saved = rank0_decides(self.rank, self.world, read)
        return {"steps": start, "steps_total": tc.steps, "out": str(self.out), **saved,
                "steps_this_run": 0, "resumed_from": str(resume_from)}

    def _summary(self, start: int, resume_from: Path | None, losses: list[float],
                 step_s: float, comm_s: float, val: dict[str, float],
                 loop_seconds: float) -> dict[str, Any]:
        cfg, tc, sc, s = self.cfg, self.cfg.train, self.cfg.strategy, self.state
        step = max(s.step, start)
        ran = max(step - start, 0)
        tail = losses[-min(len(losses), 10):] or [float("nan")]
        # every rank's own figures, in the same sum: each rank fills its own slots
        n = len(PER_RANK)
        per = [0.0] * (n * self.world)
        per[self.rank * n:(self.rank + 1) * n] = [step, ran, step_s - comm_s, s.tokens,
                                                  s.train_seconds, self._batch]
        sums = sum_over_ranks([sum(tail) / len(tail), step_s, comm_s, s.bytes_sent,
                               s.bytes_received, *per], self.device)
        mean = [v / self.world for v in sums[:5]]
        ranks = {key: sums[5 + i::n] for i, key in enumerate(PER_RANK)}
        # per step: over every rank's steps (with a pace the ranks' steps differ)
        steps_all, ran_all = sum(ranks["steps"]) / self.world, sum(ranks["steps_this_run"])
        ran_all /= self.world
        paced = self.paced
        return {
            "task": cfg.task.name, "model": cfg.task.model, "params": self.n_params,
            "local_params": _local_numel(self.model), "world": self.world,
            "mesh": self.layout, "replicator": sc.replicator, "optimizer": sc.optimizer,
            "lr": sc.lr, "steps": step if paced is None else paced.at,
            "steps_total": tc.steps if paced is None else paced.span, "steps_this_run": ran,
            "skipped_steps": int(self.opt.skipped_steps),
            "resumed_from": str(resume_from) if resume_from else None,
            "batch_per_rank": tc.batch, "device": str(self.device), "precision": tc.precision,
            "train_loss": mean[0], **val,
            "seconds": time.perf_counter() - self.t_start, "loop_seconds": loop_seconds,
            "train_seconds": s.train_seconds,
            "step_seconds": mean[1] / max(ran_all, 1), "comm_seconds": mean[2] / max(ran_all, 1),
            "compute_seconds": (mean[1] - mean[2]) / max(ran_all, 1),
            "bytes_sent_per_step": mean[3] / max(steps_all, 1),
            "bytes_received_per_step": mean[4] / max(steps_all, 1),
            "mb_sent_total": mean[3] / 1e6, "out": str(self.out),
            "tokens_total": int(sum(ranks["tokens"])), "per_rank": _per_rank(ranks),
            **({} if paced is None else {"pace": {
                "inner_steps": paced.inner_steps, "counts": paced.counts(),
                "weights": paced.rep.pace.weights, "syncs": paced.syncs,
                "syncs_total": paced.total,
                # (sync, counts) at each measurement that set them (the adaptive mode's changes)
                "changes": [[j, list(c)] for j, c in getattr(paced.rep.pace, "changes", [])]}}),
            **{k: v for k, v in self.opt.last_step_stats().items()
               if k in ("auto_history", "auto_retune_seconds")},
            "config": config_to_dict(cfg),
        }


def _per_rank(ranks: dict[str, list[float]]) -> dict[str, list]:
    """``summary.json``'s ``per_rank`` from each rank's sums (:data:`PER_RANK`): counts as
    integers, compute seconds per step of this run."""
    out: dict[str, list] = {k: [int(v) for v in ranks[k]]
                            for k in ("steps", "steps_this_run", "tokens", "batch")}
    out["compute_seconds"] = [c / max(n, 1) for c, n in zip(ranks["compute_seconds"],
                                                             ranks["steps_this_run"])]
    out["train_seconds"] = list(ranks["train_seconds"])
    return out


def train(cfg: Config, *, echo: Echo | None = None, exit_on_lost_peer: bool = False,
          handle_signals: bool = False) -> dict[str, Any]:
    """Train as ``cfg`` says; returns the summary (the same on every rank).

    Joins (or creates) the process group. Raises :class:`TrainingError` (or, for a lost peer,
    :class:`~flexdemo.transport.PeerLostError`) with a user-facing message when training
    cannot go on, and
    :class:`Preempted` when ``handle_signals`` and a signal stopped it (checkpoint saved).
    """
    return Trainer(cfg, echo=echo, exit_on_lost_peer=exit_on_lost_peer,
                   handle_signals=handle_signals).run()
