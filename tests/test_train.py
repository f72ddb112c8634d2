"""The trainer (flexdemo.app.train.trainer) and its schedule: a short run per task, checkpoints and
resume, FLEXDEMO_TIMEOUT, storage faults, and ranks killed mid-run."""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_util import kill_and_hear, reap, run_world, spawn_ranks

from flexdemo.app.config.files import load_config
from flexdemo.app.errors import TrainingError, UsageError
from flexdemo.app.schedule import lr_at
from flexdemo.app.tasks import have_transformers
from flexdemo.app.train.setup import timeout_seconds
from flexdemo.app.train.trainer import train
from flexdemo.tools.ranks import free_port

ROOT = Path(__file__).parent.parent
PY = sys.executable
# a small, quick GPT run; checkpoints every 3 steps
GPT_QUICK = ["task.model=tiny", "task.corpus_bytes=200000", "train.batch=4", "train.warmup=2",
             "train.eval_every=5", "train.eval_batches=2", "train.log_every=5",
             "train.tensorboard=false", "train.threads=0"]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------- pieces
def test_lr_schedule():
    lrs = [lr_at(s, 100, 1.0, warmup=10, schedule="cosine", min_lr=0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lr_at(50, 100, 2.0, warmup=0, schedule="constant") == 2.0
    assert lr_at(0, 1, 1.0, warmup=0) == pytest.approx(1.0)


# ---------------------------------------------------------------------- one run per task
def test_gpt_run_writes_metrics_summary_and_logs(tmp_path, single_process, capsys):
    out = tmp_path / "gpt"
    cfg = load_config(ROOT / "configs/gpt.toml",
                      GPT_QUICK + ["train.steps=6", f"train.out={out}", "train.tensorboard=true",
                                   "train.checkpoint_every=0"])
    summary = train(cfg)
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 7))
    for key in ("loss", "lr", "bytes_sent", "bytes_received", "compute_seconds",
                "comm_seconds", "step_seconds", "cpu_seconds", "train_seconds"):
        assert all(isinstance(r[key], (int, float)) for r in rows), key
    assert all(r["cpu_seconds"] > 0 for r in rows)  # the step's work, on this process's clock
    assert "val_loss" in rows[4] and "val_loss" in rows[5] and "val_loss" not in rows[0]
    assert rows[-1]["loss"] < math.log(256) and rows[0]["lr"] < rows[2]["lr"]
    saved = json.loads((out / "summary.json").read_text())
    assert saved["steps"] == 6 and saved["val_loss"] == summary["val_loss"] < math.log(256)
    assert load_config(out / "config.toml") == cfg
    printed = capsys.readouterr().out
    assert "summary" in printed and "val loss" in printed and "step 5/6" in printed
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        assert "TensorBoard logs skipped" in printed
    else:
        assert any((out / "tensorboard").iterdir())


def test_vit_learns_digits(tmp_path, single_process):
    cfg = load_config(ROOT / "configs/vit.toml",
                      ["train.steps=120", "train.eval_every=0", "train.checkpoint_every=0",
                       "train.tensorboard=false", "train.progress=false", "train.threads=0",
                       f"train.out={tmp_path}"])
    summary = train(cfg, echo=lambda text: None)
    assert summary["val_accuracy"] > 0.6, summary  # chance is 0.1
    assert "val_accuracy" in metrics(tmp_path)[-1]


@pytest.mark.skipif(not have_transformers(),
                    reason="the t5 task needs transformers (pip install 'flexdemo[t5]')")
def test_t5_span_corruption_runs(tmp_path, single_process):
    cfg = load_config(ROOT / "configs/t5.toml",
                      ["train.steps=4", "train.warmup=1", "train.batch=4", "train.eval_every=0",
                       "train.eval_batches=1", "train.checkpoint_every=0", "task.seq_len=64",
                       "task.corpus_bytes=100000", "train.tensorboard=false",
                       "train.progress=false", "train.threads=0", f"train.out={tmp_path}"])
    summary = train(cfg, echo=lambda text: None)
    assert math.isfinite(summary["val_loss"]) and summary["val_loss"] < 7


# ---------------------------------------------------------------------- checkpoints
def test_checkpoint_guards(tmp_path, single_process):
    out = tmp_path / "run"
    base = GPT_QUICK + ["train.steps=4", "train.checkpoint_every=2", "train.progress=false",
                        f"train.out={out}"]
    quiet = {"echo": lambda text: None}
    train(load_config(ROOT / "configs/gpt.toml", base), **quiet)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000002",
                                                                       "step_000004"]
    # a fresh run must not silently replace an earlier run's checkpoints
    with pytest.raises(TrainingError, match="resume=true"):
        train(load_config(ROOT / "configs/gpt.toml", base), **quiet)
    # a checkpoint of another model is refused with a message, not a traceback
    with pytest.raises(TrainingError, match="cannot resume from .*step_000004"):
        train(load_config(ROOT / "configs/gpt.toml", base + ["task.model=mini",
                                                             "resume=true"]), **quiet)
    with pytest.raises(TrainingError, match="does not exist"):
        train(load_config(ROOT / "configs/gpt.toml", base + [f"resume='{tmp_path}/nope'"]),
              **quiet)
    # resuming at the end does nothing more; overwrite starts afresh
    summary = train(load_config(ROOT / "configs/gpt.toml", base + ["resume=true"]), **quiet)
    assert summary["steps_this_run"] == 0 and summary["resumed_from"].endswith("step_000004")
    summary = train(load_config(ROOT / "configs/gpt.toml", base + ["train.overwrite=true"]),
                    **quiet)
    assert summary["steps_this_run"] == 4


def _wait_for_metrics(procs, path, lines: int) -> None:
    """Wait (at most 120 s) until ``path`` holds ``lines`` metrics lines, every rank alive."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= lines:
            return
        assert all(p.poll() is None for p in procs), procs[0].communicate()[0]
        time.sleep(0.05)
    pytest.fail("the run made no progress")


def _train_worker(rank: int, world: int, path: str, overrides: list[str]) -> dict:
    """A rank of ``run_world``: train as ``flexdemo train path overrides`` would."""
    return train(load_config(path, overrides), echo=lambda text: None)


@pytest.mark.multiprocess
def test_killed_rank_ends_the_run_and_resume_matches_an_uninterrupted_run(tmp_path):
    """Two replicas (DeMo state differs per replica). Rank 1 is killed mid-run: rank 0 must
    stop (not hang) naming rank 1; resuming from the last checkpoint must then give the
    uninterrupted run's losses bit for bit."""
    cfg = str(ROOT / "configs/gpt.toml")
    common = GPT_QUICK + ["train.steps=300", "train.checkpoint_every=3", "mesh.replicate=2",
                          "train.progress=false"]
    ref, run = tmp_path / "reference", tmp_path / "killed"
    run_world(_train_worker, 2, cfg, [*common, "train.stop_at=15", f"train.out={ref}"])

    procs = spawn_ranks(2, ["train", cfg, *common, f"train.out={run}"])
    try:
        _wait_for_metrics(procs, run / "metrics.jsonl", 5)
        procs[1].send_signal(signal.SIGKILL)
        out, _ = procs[0].communicate(timeout=120)  # a hang guard: TimeoutExpired
    finally:
        reap(procs)
    assert procs[0].returncode == 1
    error = [line for line in out.splitlines() if "error" in line]
    assert error and "lost rank 1" in error[-1] and "resume=true" in error[-1], out[-2000:]
    assert "Traceback" not in out
    done = len(metrics(run))
    assert 5 <= done < 300

    resumed = run_world(_train_worker, 2, cfg,
                        [*common, "train.stop_at=15", f"train.out={run}", "resume=true"])
    assert resumed[0]["resumed_from"] and resumed[0]["steps_this_run"] < 15
    again, reference = metrics(run), metrics(ref)
    assert [r["step"] for r in again] == list(range(1, 16))
    assert [r["loss"] for r in again] == [r["loss"] for r in reference]
    assert again[-1]["val_loss"] == reference[-1]["val_loss"]


# ---------------------------------------------------------------------- FLEXDEMO_TIMEOUT
def _flexdemo(args: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PY, *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "src"), **env))


def test_timeout_variable_is_read_when_used_with_one_default(monkeypatch):
    from flexdemo.mesh import DEFAULT_TIMEOUT_SECONDS, timeout_from_env

    monkeypatch.delenv("FLEXDEMO_TIMEOUT", raising=False)
    assert timeout_from_env().total_seconds() == DEFAULT_TIMEOUT_SECONDS
    cfg = load_config(None, [])
    assert timeout_seconds(cfg) == DEFAULT_TIMEOUT_SECONDS  # the trainer has no default of its own
    monkeypatch.setenv("FLEXDEMO_TIMEOUT", "45")
    assert timeout_from_env().total_seconds() == 45 and timeout_seconds(cfg) == 45
    assert timeout_seconds(load_config(None, ["train.timeout=7"])) == 7
    for bad in ("abc", "0", "-5", "inf", "nan"):
        monkeypatch.setenv("FLEXDEMO_TIMEOUT", bad)
        with pytest.raises(ValueError, match=f"FLEXDEMO_TIMEOUT='{bad}' is not a number"):
            timeout_from_env()
        with pytest.raises(TrainingError, match="FLEXDEMO_TIMEOUT"):
            timeout_seconds(cfg)


@pytest.mark.multiprocess
def test_bad_timeout_variable_breaks_neither_import_nor_help_and_train_says_why(tmp_path):
    env = {"FLEXDEMO_TIMEOUT": "abc"}  # imported, then `python -m flexdemo --help`, in one
    code = ("import runpy, sys\nimport flexdemo, flexdemo.app.cli\n"
            "sys.argv = ['flexdemo', '--help']\nrunpy.run_module('flexdemo', run_name='__main__')")
    helped = _flexdemo(["-c", code], env)
    assert helped.returncode == 0 and "train" in helped.stdout, helped.stderr
    run = _flexdemo(["-m", "flexdemo", "train", "train.steps=1", f"train.out={tmp_path}"], env)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "FLEXDEMO_TIMEOUT='abc'" in lines[0], run.stderr


@pytest.mark.multiprocess
def test_rendezvous_timeout_names_the_variable_and_the_peer():
    port = free_port()  # nothing listens there: rank 0 never comes
    code = ("import flexdemo\ntry:\n    flexdemo.init_distributed()\nexcept TimeoutError as e:\n"
            "    print('ERROR', e)\n")
    run = _flexdemo(["-c", code], {"FLEXDEMO_TIMEOUT": "2", "WORLD_SIZE": "2", "RANK": "1",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "TORCH_CPP_LOG_LEVEL": "FATAL"})
    error = [line for line in run.stdout.splitlines() if line.startswith("ERROR")]
    assert error, run.stdout + run.stderr[-2000:]
    assert f"127.0.0.1:{port}" in error[0] and "FLEXDEMO_TIMEOUT=2" in error[0], error


@pytest.mark.multiprocess
def test_world_size_without_torchrun_variables_names_them():
    code = ("import flexdemo\ntry:\n    flexdemo.init_distributed()\nexcept ValueError as e:\n"
            "    print('ERROR', e)\n")
    run = _flexdemo(["-c", code], {"WORLD_SIZE": "2"})
    error = [line for line in run.stdout.splitlines() if line.startswith("ERROR")]
    assert error and "RANK, MASTER_ADDR, MASTER_PORT" in error[0] and "torchrun" in error[0], (
        run.stdout + run.stderr[-2000:])


# ---------------------------------------------------------------------- crash after a save
class _FakeEvents:
    """Stands in for TensorBoard's SummaryWriter: one event list per log folder, purged of
    steps >= ``purge_step`` on reopening, as TensorBoard does."""

    logs: dict[str, list[tuple[str, int]]] = {}

    def __init__(self, logdir: str, purge_step: int | None = None) -> None:
        events = self.logs.setdefault(logdir, [])
        if purge_step is not None:
            events[:] = [e for e in events if e[1] < purge_step]
        self.events = events

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.events.append((tag, step))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_crash_right_after_a_checkpoint_loses_no_metrics_line(tmp_path, single_process,
                                                                 monkeypatch):
    import flexdemo.app.outputs as outputs
    import flexdemo.app.train.setup as trainer

    monkeypatch.setattr(outputs, "summary_writer", lambda: _FakeEvents)
    real_save = trainer.save_checkpoint

    def save_then_crash(path, *args, **kwargs):
        saved = real_save(path, *args, **kwargs)
        if Path(path).name == "step_000004":
            raise KeyboardInterrupt  # the process dies right after the checkpoint is written
        return saved

    out = tmp_path / "run"
    base = GPT_QUICK + ["train.steps=6", "train.checkpoint_every=2", "train.progress=false",
                        "train.tensorboard=true", f"train.out={out}"]
    monkeypatch.setattr(trainer, "save_checkpoint", save_then_crash)
    with pytest.raises(KeyboardInterrupt):
        train(load_config(ROOT / "configs/gpt.toml", base), echo=lambda text: None)
    monkeypatch.setattr(trainer, "save_checkpoint", real_save)
    summary = train(load_config(ROOT / "configs/gpt.toml", base + ["resume=true"]),
                    echo=lambda text: None)
    assert summary["resumed_from"].endswith("step_000004")
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4, 5, 6]
    losses = [step for tag, step in _FakeEvents.logs[str(out / "tensorboard")]
              if tag == "train/loss"]
    assert losses == [1, 2, 3, 4, 5, 6]


# ---------------------------------------------------------------------- storage faults
def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "simulated")


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text and "Traceback" not in text, text
    return text


def test_full_disk_during_a_save_then_resume_from_the_previous_checkpoint(
        tmp_path, single_process, monkeypatch):
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    import flexdemo.app.train.setup as trainer

    out = tmp_path / "run"
    base = GPT_QUICK + ["train.steps=6", "train.checkpoint_every=2", "train.progress=false",
                        f"train.out={out}"]
    real_save = trainer.save_checkpoint

    def save(path, *args, **kwargs):
        if Path(path).name == "step_000004":  # the disk fills up during this save
            monkeypatch.setattr(dcp_filesystem, "_write_item", _no_space)
        return real_save(path, *args, **kwargs)

    monkeypatch.setattr(trainer, "save_checkpoint", save)
    with pytest.raises(TrainingError) as info:
        train(load_config(ROOT / "configs/gpt.toml", base), echo=lambda text: None)
    msg = _one_line(info)
    assert "no space left on device" in msg and "step_000004" in msg, msg
    assert "step_000002 is intact" in msg and "resume=true" in msg, msg
    monkeypatch.undo()
    summary = train(load_config(ROOT / "configs/gpt.toml", base + ["resume=true"]),
                    echo=lambda text: None)
    assert summary["resumed_from"].endswith("step_000002") and summary["steps"] == 6
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("damage", ["zeros-distcp", "garbage-json"])
def test_damaged_checkpoint_on_resume_falls_back_to_the_newest_intact_one(
        tmp_path, single_process, damage):
    """Zeros inside the newest checkpoint's data used to load silently (losses drifted);
    garbage in its flexdemo.json made resume skip it quietly and overwrite it later."""
    out = tmp_path / "run"
    base = GPT_QUICK + ["train.steps=6", "train.checkpoint_every=2", "train.progress=false",
                        "train.keep_checkpoints=0", f"train.out={out}"]
    ref = tmp_path / "ref"
    train(load_config(ROOT / "configs/gpt.toml", base[:-1] + [f"train.out={ref}"]),
          echo=lambda text: None)
    train(load_config(ROOT / "configs/gpt.toml", base + ["train.stop_at=4"]),
          echo=lambda text: None)
    newest = out / "checkpoints" / "step_000004"
    if damage == "zeros-distcp":
        (data,) = newest.glob("*.distcp")
        with open(data, "r+b") as f:
            f.seek(data.stat().st_size // 2)
            f.write(bytes(4096))
        what = data.name
    else:
        (newest / "flexdemo.json").write_text("{ garbage")
        what = "flexdemo.json"
    # told not to fall back: refused, naming the file; nothing moved
    with pytest.raises(UsageError) as info:
        train(load_config(ROOT / "configs/gpt.toml", base + ["resume=true",
                                                             "train.resume_fallback=false"]),
              echo=lambda text: None)
    msg = _one_line(info)
    assert "step_000004 is damaged" in msg and what in msg and "resume_fallback" in msg, msg
    assert newest.is_dir()
    said: list[str] = []
    summary = train(load_config(ROOT / "configs/gpt.toml", base + ["resume=true"]),
                    echo=said.append)
    lines = [line for line in said if line.startswith("resume:")]
    assert len(lines) == 1 and what in lines[0] and "resuming from step_000002" in lines[0], said
    assert summary["resumed_from"].endswith("step_000002")
    aside = out / "checkpoints" / "step_000004.damaged"
    assert aside.is_dir() and not (aside / "COMPLETE").read_text() == ""  # kept, not overwritten
    assert (newest / "COMPLETE").is_file()  # step 4 written afresh by the resumed run
    assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in metrics(ref)]


def test_every_checkpoint_damaged_is_refused(tmp_path, single_process):
    out = tmp_path / "run"
    base = GPT_QUICK + ["train.steps=4", "train.checkpoint_every=2", "train.progress=false",
                        f"train.out={out}"]
    train(load_config(ROOT / "configs/gpt.toml", base), echo=lambda text: None)
    for ckpt_dir in (out / "checkpoints").iterdir():
        (ckpt_dir / "flexdemo.json").write_text("garbage")
    with pytest.raises(UsageError) as info:
        train(load_config(ROOT / "configs/gpt.toml", base + ["resume=true"]),
              echo=lambda text: None)
    msg = _one_line(info)
    assert "no intact checkpoint" in msg and "step_000002 is damaged" in msg, msg
    assert "step_000004 is damaged" in msg and "train.overwrite=true" in msg, msg
    assert "starting at step 0" not in msg


def test_output_folder_faults_are_one_line(tmp_path, single_process, monkeypatch):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    quiet = {"echo": lambda text: None}
    for out, needle in ((a_file, "is a file"), (a_file / "sub", "not a directory")):
        with pytest.raises(TrainingError) as info:
            train(load_config(ROOT / "configs/gpt.toml", GPT_QUICK + [
                "train.steps=1", "train.warmup=1", f"train.out={out}"]), **quiet)
        msg = _one_line(info)
        assert str(out) in msg and needle in msg.lower(), msg
    denied = OSError(errno.EACCES, os.strerror(errno.EACCES), str(tmp_path / "ro"))
    monkeypatch.setattr(Path, "write_bytes", lambda self, data: (_ for _ in ()).throw(denied))
    with pytest.raises(TrainingError) as info:
        train(load_config(ROOT / "configs/gpt.toml", GPT_QUICK + [
            "train.steps=1", "train.warmup=1", f"train.out={tmp_path / 'ro'}"]), **quiet)
    msg = _one_line(info)
    assert "ro" in msg and "permission denied" in msg, msg


def test_full_disk_while_logging_warns_once_and_training_goes_on(tmp_path, single_process,
                                                                 monkeypatch):
    import flexdemo.app.outputs as outputs

    class FullDisk:
        def write(self, text):
            _no_space()

        def flush(self):
            pass

        def close(self):
            pass

    monkeypatch.setattr(outputs.MetricsLog, "_open", lambda self: FullDisk())
    said: list[str] = []
    summary = train(load_config(ROOT / "configs/gpt.toml", GPT_QUICK + [
        "train.steps=3", "train.progress=false", f"train.out={tmp_path}"]), echo=said.append)
    assert summary["steps"] == 3
    warnings = [line for line in said if line.startswith("warning")]
    assert len(warnings) == 1 and "no space left on device" in warnings[0], said
    assert "step 1" in warnings[0] and "metrics.jsonl" in warnings[0] and "\n" not in warnings[0]


# ---------------------------------------------------------------------- the lost rank
@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh", [["mesh.replicate=2", "mesh.shard=2"], []],
                         ids=["2x2", "auto-4x1"])
def test_killed_rank_of_four_is_the_only_one_named_by_every_survivor(tmp_path, mesh):
    """Four bare processes, one rank per launcher, a 2 x 2 mesh (some survivors wait in
    collectives with other survivors) or the default 4 x 1: rank 2 is killed. Every survivor
    stops (a hang guard of 120 s) naming rank 2 and no other rank (survivors that leave first
    must not be counted as lost, and rank 0's exit must not take the store from the others),
    with no C++ stack frames."""
    out = tmp_path / "run"
    procs = spawn_ranks(4, ["train", str(ROOT / "configs/gpt.toml"), *GPT_QUICK,
                            "train.steps=300", *mesh, "train.progress=false",
                            f"train.out={out}"])
    try:
        _wait_for_metrics(procs, out / "metrics.jsonl", 3)
        kill_and_hear(procs, 2)
    finally:
        reap(procs)


def _rerecord(path: Path) -> None:
    """Record the digest of an edited file in its checkpoint's marker (a genuine change)."""
    from flexdemo.checkpoint.integrity import file_digest

    marker_path = path.parent / "COMPLETE"
    marker = json.loads(marker_path.read_text())
    marker["files"][path.name] = file_digest(path)
    marker_path.write_text(json.dumps(marker))


def test_resume_with_another_mesh_says_which_config_keys(tmp_path, single_process):
    out = tmp_path / "run"
    base = GPT_QUICK + ["train.steps=2", "train.checkpoint_every=2", "train.progress=false",
                        f"train.out={out}"]
    train(load_config(ROOT / "configs/gpt.toml", base), echo=lambda text: None)
    meta_path = out / "checkpoints" / "step_000002" / "flexdemo.json"
    meta = json.loads(meta_path.read_text())
    meta.update(world_size=4, mesh_shape=[2, 2])  # as if written by a 2 x 2 job
    meta_path.write_text(json.dumps(meta))
    _rerecord(meta_path)
    with pytest.raises(TrainingError) as info:
        train(load_config(ROOT / "configs/gpt.toml", base + ["resume=true"]),
              echo=lambda text: None)
    msg = _one_line(info)
    assert "mesh.replicate=2 mesh.shard=2" in msg and "4 ranks" in msg, msg
    assert "prepare(" not in msg, msg


def test_heartbeat_verdict_is_shared_and_reaches_a_rank_blocked_in_a_collective():
    """Four ranks' heartbeats over one store: rank 2 dies; rank 3 noticed the failure first
    and left (its heartbeat stopped, but it is not lost); rank 0 diagnoses; rank 1, blocked in
    a collective, learns the verdict from its heartbeat thread."""
    from flexdemo.app.train.liveness import Heartbeat

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 4, is_master=True, wait_for_workers=False)
    stores = [server] + [dist.TCPStore("127.0.0.1", port, 4, is_master=False)
                         for _ in range(3)]
    heard: list[list[int]] = []
    beats = [Heartbeat(r, 4, interval=0.1, store=stores[r],
                       on_verdict=heard.append if r == 1 else None) for r in range(4)]
    try:
        beats[2].stop()  # rank 2 dies
        beats[3].store.set(f"{Heartbeat.PREFIX}noticed/3", "1")  # rank 3 noticed, then left
        beats[3].stop()
        assert beats[0].lost_ranks() == ([2], "")
        deadline = time.monotonic() + 60  # a hang guard: ticks every 0.1 s, even under load
        while not heard and time.monotonic() < deadline:
            time.sleep(0.05)
        assert heard == [[2]]
        # rank 0 hosts the store: it waits for survivors that did not take the verdict yet
        assert beats[0].wait_for_survivors([2], limit=0.3) is False
        assert beats[3].lost_ranks() == ([2], "")  # a late survivor takes the same verdict
        assert beats[0].wait_for_survivors([2], limit=30) is True
    finally:
        for b in beats:
            b.stop()


def test_full_disk_when_resuming_keeps_the_metrics_file(tmp_path, single_process, monkeypatch):
    out = tmp_path / "run"
    base = GPT_QUICK + ["train.steps=4", "train.checkpoint_every=2", "train.progress=false",
                        f"train.out={out}"]
    train(load_config(ROOT / "configs/gpt.toml", base + ["train.stop_at=3"]),
          echo=lambda text: None)
    before = (out / "metrics.jsonl").read_text()
    real = Path.write_text

    def write_text(self, data, *args, **kwargs):
        if "metrics.jsonl" in self.name:
            real(self, data[: len(data) // 2], *args, **kwargs)  # cut off by the full disk
            _no_space()
        return real(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    with pytest.raises(TrainingError) as info:
        train(load_config(ROOT / "configs/gpt.toml", base + ["resume=true"]),
              echo=lambda text: None)
    assert "no space left on device" in _one_line(info)
    assert (out / "metrics.jsonl").read_text() == before
    assert sorted(p.name for p in out.iterdir() if "metrics" in p.name) == ["metrics.jsonl"]


# ---------------------------------------------------------------------- device, precision, mesh
def _local_tensors(model) -> list:
    return [(p.to_local() if hasattr(p, "to_local") else p).detach().clone()
            for p in model.parameters()]


def _bf16_worker(rank: int, world: int, path: str, overrides: list[str]) -> dict:
    import torch

    from flexdemo.app.train.trainer import Trainer

    lines: list[str] = []
    trainer = Trainer(load_config(path, overrides), echo=lines.append)
    summary = trainer.run()
    params = _local_tensors(trainer.model)  # the fp32 shards (a forward unshards in bf16)
    with torch.no_grad():
        logits = trainer.model(torch.zeros(1, 4, dtype=torch.long))
    return {"summary": summary, "params": params, "lines": lines,
            "compute_dtype": logits.dtype, "master_dtypes": {p.dtype for p in params}}


@pytest.mark.multiprocess
def test_bf16_on_cpu_two_replicas_stay_identical(tmp_path):
    """train.precision=bf16 on the CPU (FSDP2 mixed precision with gloo), 2 replicas of one
    rank each: compute in bf16, fp32 master weights, replicas bitwise equal, loss finite."""
    overrides = [*GPT_QUICK, "train.steps=4", "train.eval_every=2", "mesh.replicate=2",
                 "train.device=cpu", "train.precision=bf16", "train.progress=false",
                 f"train.out={tmp_path / 'run'}"]
    r0, r1 = run_world(_bf16_worker, 2, str(ROOT / "configs/gpt.toml"), overrides)
    assert r0["compute_dtype"] == torch.bfloat16
    assert r0["master_dtypes"] == {torch.float32}
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))
    s = r0["summary"]
    assert s["precision"] == "bf16" and s["device"] == "cpu" and s["mesh"] == {
        "replicate": 2, "shard": 1}
    assert math.isfinite(s["train_loss"]) and math.isfinite(s["val_loss"])
    assert s["bytes_sent_per_step"] > 0  # the replicas did exchange
    assert not any("single replica" in line for line in r0["lines"])


def _default_mesh_worker(rank: int, world: int, path: str, overrides: list[str],
                         example_args: list[str], none_out: str) -> dict:
    import importlib.util

    from flexdemo.app.train.trainer import Trainer

    lines: list[str] = []
    summary = Trainer(load_config(path, overrides), echo=lines.append).run()
    none_lines: list[str] = []
    Trainer(load_config(path, [*overrides, "strategy.replicator=none",
                               f"train.out={none_out}"]),
            echo=none_lines.append).run()
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples/train_gpt.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    results = example.main(example_args)  # ends the process group
    return {"mesh": summary["mesh"], "lines": lines, "none_lines": none_lines,
            "example_mesh": results[0]["mesh"]}


@pytest.mark.multiprocess
@pytest.mark.parametrize("local_world", [None, "1"], ids=["one-node", "one-rank-per-node"])
def test_default_mesh_is_the_same_for_train_and_the_example(tmp_path, local_world):
    """No mesh keys: shard = ranks per node (LOCAL_WORLD_SIZE, else the world), as in
    prepare(). flexdemo train and examples/train_gpt.py build the same mesh; a single
    replica is said once, on rank 0, unless the replicator is none."""
    out = tmp_path / "run"
    overrides = [*GPT_QUICK, "train.steps=2", "train.progress=false", f"train.out={out}"]
    example_args = ["--model", "tiny", "--steps", "2", "--batch", "2", "--corpus-bytes",
                    "200000", "--eval-batches", "1", "--strategies", "flexdemo", "--out",
                    str(tmp_path / "example.json")]
    env = {"LOCAL_WORLD_SIZE": local_world} if local_world else {}
    results = run_world(_default_mesh_worker, 2, str(ROOT / "configs/gpt.toml"), overrides,
                        example_args, str(tmp_path / "none"), env=env)
    want = {"replicate": 1, "shard": 2} if local_world is None else {"replicate": 2, "shard": 1}
    for r in results:
        assert r["mesh"] == r["example_mesh"] == want
        assert not any("single replica" in line for line in r["none_lines"])
    notes = [[line for line in r["lines"] if "single replica" in line] for r in results]
    if local_world is None:
        assert len(notes[0]) == 1 and notes[1] == [], notes
        assert "mesh.replicate=2" in notes[0][0] and "'demo' exchanges nothing" in notes[0][0]
    else:
        assert notes == [[], []]


def test_losses_read_in_windows_give_the_same_metrics(tmp_path, single_process):
    """The CUDA loop reads losses once every log_every steps instead of after each step;
    run on the CPU with that window (3, with evaluations and checkpoints in between), the
    metrics lines are those of the per-step loop: every step once, in order, same losses."""
    from flexdemo.app.train.trainer import Trainer

    runs = {}
    for every in (1, 3):
        out = tmp_path / f"every{every}"
        cfg = load_config(ROOT / "configs/gpt.toml",
                          [*GPT_QUICK, "train.steps=8", "train.eval_every=4",
                           "train.checkpoint_every=5", "train.progress=false",
                           "mesh.replicate=1", "mesh.shard=1", f"train.out={out}"])
        trainer = Trainer(cfg, echo=lambda text: None)
        trainer.read_every = every
        summary = trainer.run()
        runs[every] = (metrics(out), summary)
        dist.destroy_process_group()
    (lines1, s1), (lines3, s3) = runs[1], runs[3]
    assert [r["step"] for r in lines3] == list(range(1, 9))
    assert [r["loss"] for r in lines3] == [r["loss"] for r in lines1]
    assert [r.get("val_loss") for r in lines3] == [r.get("val_loss") for r in lines1]
    assert all(isinstance(r["loss"], float) for r in lines3)
    assert s3["train_loss"] == s1["train_loss"] and s3["val_loss"] == s1["val_loss"]


# ---------------------------------------------------------------------- refusals exit 2
SMALLEST = ["task.model=tiny", "task.corpus_bytes=20000", "train.batch=1", "train.warmup=0",
            "train.eval_every=0", "train.eval_batches=1", "train.tensorboard=false",
            "train.progress=false", "train.threads=1", "task.seq_len=16"]
REFUSALS = int(os.environ.get("FLEXDEMO_REFUSALS", "20"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("refusals", [
    pytest.param(4, id="each-once"),
    # the repetitions that caught a rare abort at shutdown: the longer tier (`-m long`)
    pytest.param(REFUSALS, id="repeated", marks=[pytest.mark.slow, pytest.mark.long])])
def test_refused_resume_exits_2_on_every_rank_every_time(tmp_path, refusals):
    """A resume with another replicator, optimizer, topk or mesh, refused ``refusals`` times
    over on 2 bare ranks (each kind once, or REFUSALS times in the longer tier): every rank
    exits 2 (never 134 from an abort at shutdown, never 1), with one line naming what differs,
    old against new, pointing at train.overwrite or another train.out and suggesting no older
    checkpoint (they all have the same mismatch)."""
    out = tmp_path / "run"
    args = ["train", *SMALLEST, "train.steps=4", "train.checkpoint_every=2", "mesh.replicate=2",
            "mesh.shard=1", f"train.out={out}"]
    procs = spawn_ranks(2, args)
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        reap(procs)
    assert [p.returncode for p in procs] == [0, 0], outputs
    changes = [(["strategy.replicator=full"], "replicator 'demo' (now 'full')"),
               (["strategy.optimizer=adamw"], "optimizer 'sgd' (now 'adamw')"),
               (["strategy.replicator_kwargs={topk=8}"], "replicator topk 16 (now 8)"),
               (["mesh.replicate=1", "mesh.shard=2"], "replicate 2 x shard 1")]
    for i in range(refusals):
        change, needle = changes[i % len(changes)]
        procs = spawn_ranks(2, [*args, *change, "--resume"])
        try:
            outputs = [p.communicate(timeout=120)[0] for p in procs]
        finally:
            reap(procs)
        codes = [p.returncode for p in procs]
        assert codes == [2, 2], (i, change, codes, outputs)
        for text in outputs:
            assert "terminate called" not in text and "Traceback" not in text, text[-2000:]
        errors = [line for line in outputs[0].splitlines() if "error" in line]
        assert len(errors) == 1, outputs[0][-2000:]
        assert needle in errors[0] and "step_000004" in errors[0], errors[0]
        assert "train.overwrite=true" in errors[0] and "step_000002" not in errors[0], errors[0]


# ---------------------------------------------------------------------- skipped steps
def test_skipped_steps_are_counted_and_a_run_that_skips_most_stops(tmp_path, single_process):
    """lr 1e30 makes every gradient from step 2 on NaN: with nonfinite='skip' the run used to
    finish with exit 0 and no word of it."""
    out = tmp_path / "run"
    base = GPT_QUICK + ["train.steps=8", "train.progress=false", "strategy.lr=1e30",
                        "train.warmup=0", "strategy.nonfinite=skip", f"train.out={out}"]
    with pytest.raises(TrainingError) as info:
        train(load_config(ROOT / "configs/gpt.toml", base), echo=lambda text: None)
    msg = _one_line(info)
    assert "step 4: 3 of 4 steps" in msg and "train.max_skipped=0.25" in msg, msg
    # the lines go as far as the message counts, and the summary says why the run stopped
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["skipped_steps_total"] == 3
    stopped = json.loads((out / "summary.json").read_text())
    assert stopped["skipped_steps"] == 3 and stopped["stopped"] == msg
    said: list[str] = []
    summary = train(load_config(ROOT / "configs/gpt.toml", base + ["train.max_skipped=1",
                                                                   "train.overwrite=true"]),
                    echo=said.append)
    rows = metrics(out)
    assert [r["skipped"] for r in rows][:1] == [False] and all(r["skipped"] for r in rows[1:])
    assert rows[-1]["skipped_steps_total"] == 7 and summary["skipped_steps"] == 7
    assert any("7 skipped for NaN/Inf gradients" in line for line in said), said


@pytest.mark.multiprocess
def test_resume_on_fewer_and_on_more_replicas(tmp_path):
    """`flexdemo train` saved by 2 replicas resumes on 1, and that on 2 again: each says how
    the replicas were regrouped, and the step count goes on from the checkpoint."""
    out = tmp_path / "run"
    args = ["train", *SMALLEST, "train.checkpoint_every=2", "mesh.shard=1",
            "train.eval_every=2", f"train.out={out}"]

    def run(world: int, steps: int, *more: str) -> list[str]:
        procs = spawn_ranks(world, [*args, f"train.steps={steps}",
                                    f"mesh.replicate={world}", *more])
        try:
            outputs = [p.communicate(timeout=120)[0] for p in procs]
        finally:
            reap(procs)
        assert [p.returncode for p in procs] == [0] * world, outputs
        return outputs

    run(2, 4)
    fewer = run(1, 6, "--resume")[0]
    assert "written by 2 replica(s), this job has 1" in fewer, fewer[-2000:]
    more = run(2, 8, "--resume")[0]
    assert "written by 1 replica(s), this job has 2" in more, more[-2000:]
    assert "replicas 1..1 start from replica 0's state" in more, more[-2000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert json.loads((out / "summary.json").read_text())["steps"] == 8


def test_auto_says_what_it_runs_in_the_metrics_and_the_summary(tmp_path, single_process):
    """strategy.replicator=auto on one process: one replica, so it sends nothing; each
    metrics line names what it runs and the summary holds its decisions."""
    out = tmp_path / "run"
    summary = train(load_config(ROOT / "configs/gpt.toml", GPT_QUICK + [
        "train.steps=3", "train.progress=false", "strategy.replicator=auto",
        "strategy.optimizer=adamw", f"train.out={out}"]), echo=lambda text: None)
    rows = metrics(out)
    assert len(rows) == 3 and all(r["auto_choice"] for r in rows), rows
    assert [h["event"] for h in summary["auto_history"]] == ["decision"]
    assert json.loads((out / "summary.json").read_text())["auto_history"] == \
        summary["auto_history"]
