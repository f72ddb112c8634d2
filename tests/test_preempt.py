"""Preemption: SIGTERM/SIGINT make ``flexdemo train`` finish the step it is in, save it and
exit with code 3 on every rank at the same step; ``resume=true`` then continues bit for bit.
Real processes, real signals."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
from dist_util import Forked, reap, run_world, spawn_ranks
from test_train import GPT_QUICK, _train_worker, _wait_for_metrics, metrics

from flexdemo.app.config.files import load_config
from flexdemo.app.train.preempt import PREEMPTED_EXIT_CODE
from flexdemo.app.train.trainer import train
from flexdemo.checkpoint import MARKER_FILE

ROOT = Path(__file__).parent.parent
CFG = str(ROOT / "configs/gpt.toml")
STOPPED = re.compile(r"preempted: (SIG\w+): stopped after step (\d+) and saved (\S+); "
                     r"continue with resume=true")


def _stopped(outputs: list[str], signame: str) -> int:
    """The step every rank says it stopped after (the same on all of them)."""
    steps = set()
    for out in outputs:
        found = STOPPED.findall(out)
        assert len(found) == 1 and found[0][0] == signame, out[-2000:]
        steps.add(int(found[0][1]))
        assert "Traceback" not in out and "error" not in out, out[-2000:]
    assert len(steps) == 1, outputs
    return steps.pop()


def _saved_only(run: Path, step: int, finished: int) -> None:
    """The run's one checkpoint is complete and at ``step``, not before the ``finished`` steps
    logged when the signal was sent: no finished step was lost."""
    assert step >= finished >= 5
    ckpts = sorted((run / "checkpoints").iterdir())
    assert [p.name for p in ckpts] == [f"step_{step:06d}"]
    assert (ckpts[0] / MARKER_FILE).exists()
    assert [r["step"] for r in metrics(run)] == list(range(1, step + 1))


def _signal_ranks(run: Path, common: list[str], targets: list[int],
                  sig: int) -> tuple[list[str], int]:
    """Start 2 ranks, send ``sig`` to ``targets`` mid-run; their outputs and the number of
    steps logged before the signal."""
    procs = spawn_ranks(2, ["train", CFG, *common, f"train.out={run}"])
    try:
        _wait_for_metrics(procs, run / "metrics.jsonl", 5)
        finished = len(metrics(run))
        for r in targets:
            procs[r].send_signal(sig)
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        reap(procs)
    assert [p.returncode for p in procs] == [PREEMPTED_EXIT_CODE] * 2, outputs
    return outputs, finished


COMMON = GPT_QUICK + ["train.steps=300", "train.checkpoint_every=100", "mesh.replicate=2",
                      "train.progress=false"]


@pytest.mark.multiprocess
def test_sigterm_to_every_rank_saves_the_step_and_resume_matches(tmp_path):
    """SIGTERM to both ranks (as SLURM sends it): both exit 3 after the same step, whose
    checkpoint (not due by checkpoint_every) is complete; resuming gives the uninterrupted
    run's losses bit for bit (two replicas: DeMo's per-replica state is in the save)."""
    run, ref = tmp_path / "preempted", tmp_path / "reference"
    outputs, finished = _signal_ranks(run, COMMON, [0, 1], signal.SIGTERM)
    step = _stopped(outputs, "SIGTERM")
    assert step < 300
    _saved_only(run, step, finished)

    stop_at = [f"train.stop_at={step + 3}"]
    resumed = run_world(_train_worker, 2, CFG, [*COMMON, *stop_at, f"train.out={run}",
                                                "resume=true"])
    assert resumed[0]["resumed_from"].endswith(f"step_{step:06d}")
    assert resumed[0]["steps_this_run"] == 3
    run_world(_train_worker, 2, CFG, [*COMMON, *stop_at, f"train.out={ref}"])
    again, reference = metrics(run), metrics(ref)
    assert [r["step"] for r in again] == list(range(1, step + 4))
    assert [r["loss"] for r in again] == [r["loss"] for r in reference]
    assert again[-1]["val_loss"] == reference[-1]["val_loss"]


@pytest.mark.multiprocess
def test_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """SIGINT to rank 1 only: rank 0 learns of it through the per-step agreement; both stop
    after the same step, save it together and exit 3."""
    run = tmp_path / "run"
    outputs, finished = _signal_ranks(run, COMMON, [1], signal.SIGINT)
    _saved_only(run, _stopped(outputs, "SIGINT"), finished)


@pytest.mark.multiprocess
def test_one_process_sigterm_saves_even_without_periodic_checkpoints(tmp_path,
                                                                     single_process):
    """One process, train.checkpoint_every=0: SIGTERM still saves the step it finished; an
    in-process resume then matches an uninterrupted run bit for bit."""
    run, ref = tmp_path / "preempted", tmp_path / "reference"
    common = GPT_QUICK + ["train.steps=300", "train.checkpoint_every=0", "train.progress=false"]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = Forked(["-m", "flexdemo", "train", CFG, *common, f"train.out={run}"],
                  env=dict(env, OMP_NUM_THREADS="1"))
    try:
        _wait_for_metrics([proc], run / "metrics.jsonl", 5)
        finished = len(metrics(run))
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=120)[0]
    finally:
        reap([proc])
    assert proc.returncode == PREEMPTED_EXIT_CODE, out[-2000:]
    step = _stopped([out], "SIGTERM")
    _saved_only(run, step, finished)

    quiet = {"echo": lambda text: None}
    stop_at = [f"train.stop_at={step + 2}"]
    summary = train(load_config(CFG, [*common, *stop_at, f"train.out={run}", "resume=true"]),
                    **quiet)
    assert summary["steps_this_run"] == 2
    train(load_config(CFG, [*common, *stop_at, f"train.out={ref}"]), **quiet)
    assert [r["loss"] for r in metrics(run)] == [r["loss"] for r in metrics(ref)]
    assert metrics(run)[-1]["val_loss"] == metrics(ref)[-1]["val_loss"]


@pytest.mark.multiprocess
def test_a_paced_run_stops_every_rank_at_the_same_sync(tmp_path):
    """A DiLoCo pace (rank 0 takes 4 steps per period, rank 1 2): the ranks agree on a signal
    one sync late (launched at a sync, read at the next, no barrier after a sync). SIGTERM to
    rank 1 only: both exit 3 after the same sync, whose checkpoint is complete."""
    run = tmp_path / "paced"
    common = [*COMMON, "strategy.replicator=diloco",
              "strategy.replicator_kwargs={inner_steps=4, pace=[4, 2]}"]
    outputs, _ = _signal_ranks(run, common, [1], signal.SIGTERM)
    step = _stopped(outputs, "SIGTERM")
    assert step % 4 == 0 and step < 300  # the run's step at a sync: H x syncs
    ckpts = sorted((run / "checkpoints").iterdir())
    assert ckpts[-1].name == f"step_{step:06d}" and (ckpts[-1] / MARKER_FILE).exists()
