"""Faults as they happen to `flexdemo train --resume` and `flexdemo checkpoint verify`: real
processes on real files (permission bits included, with the capability that lets root read
anything dropped), each refusal one line with its exit code, never a traceback."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dist_util import reap, run_python, spawn_ranks

from flexdemo.app.cli import main
from flexdemo.app.config.files import load_config
from flexdemo.app.train.trainer import train
from flexdemo.tools.ranks import free_port

ROOT = Path(__file__).parent.parent
# the smallest quick GPT run (1249 training windows); checkpoints every 2 steps
SMALL = ["task.model=tiny", "task.corpus_bytes=20000", "task.seq_len=16", "train.batch=1",
         "train.warmup=0", "train.eval_every=0", "train.eval_batches=1",
         "train.tensorboard=false", "train.progress=false", "train.threads=1",
         "train.checkpoint_every=2", "train.keep_checkpoints=0"]
DROP = "cap_dac_override,cap_dac_read_search"


def flexdemo(args: list[str], prefix: tuple[str, ...] = (), env: dict | None = None,
             timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m flexdemo ARGS`` as one process (optionally under ``prefix``, a real exec;
    without, forked from the preloaded fork server: dist_util.run_python)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    if not prefix:
        return run_python(["-m", "flexdemo", *args], timeout=timeout, env=env)
    cmd = [sys.executable, "-m", "flexdemo", *args]
    return subprocess.run([*prefix, shlex.join(cmd)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def one_error(run: subprocess.CompletedProcess, command: str = "train") -> str:
    """The only stderr line, ``flexdemo COMMAND: error: ...``."""
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"flexdemo {command}: error: "), run.stderr
    return lines[0]


def trained(out: Path, steps: int, *more: str) -> None:
    run = flexdemo(["train", *SMALL, f"train.steps={steps}", f"train.out={out}", *more])
    assert run.returncode == 0, run.stderr[-3000:]


def two_rank_args(out: Path) -> list[str]:
    """``flexdemo train`` on 2 replicas of 1 rank for 4 steps (checkpoints at 2 and 4)."""
    return ["train", *SMALL, "train.steps=4", "mesh.replicate=2", "mesh.shard=1",
            f"train.out={out}"]


@pytest.fixture(scope="module")
def trained_copy(tmp_path_factory):
    """``copy(out, steps, ranks=1)``: a run trained for ``steps`` on ``ranks`` ranks, as
    :func:`trained` (1 rank) or :func:`two_rank_args` (2) leave it, copied to ``out``. Each
    kind is trained once for the module (a process costs seconds of CPU in imports alone) and
    every test damages its own copy of the files."""
    made: dict[tuple[int, int], Path] = {}

    def copy(out: Path, steps: int, ranks: int = 1) -> None:
        if (steps, ranks) not in made:
            src = tmp_path_factory.mktemp(f"trained-{steps}-{ranks}") / "run"
            if ranks == 1:
                trained(src, steps)
            else:
                assert steps == 4, steps
                _run_ok(ranks, two_rank_args(src))
            made[steps, ranks] = src
        shutil.copytree(made[steps, ranks], out)

    return copy


# ---------------------------------------------------------------------- item 1: requeues
@pytest.mark.multiprocess
def test_a_requeued_resume_after_every_checkpoint_was_damaged_refuses_again(tmp_path,
                                                                          trained_copy):
    """The first resume sets the damaged checkpoints aside and exits 2; the same command
    again (a requeue loop) used to say "no checkpoint yet; starting at step 0" and exit 0."""
    out = tmp_path / "run"
    trained_copy(out, 4)
    for ckpt in (out / "checkpoints").iterdir():
        (ckpt / "flexdemo.json").write_text("garbage")
    again = ["train", *SMALL, "train.steps=4", f"train.out={out}", "--resume"]
    first = flexdemo(again)
    assert first.returncode == 2 and "no intact checkpoint" in one_error(first)
    for _ in range(2):
        run = flexdemo(again)
        assert run.returncode == 2, run.stdout[-2000:]
        line = one_error(run)
        assert "step_000004.damaged" in line and "records steps up to 4" in line, line
        assert "train.overwrite=true" in line and "starting at step 0" not in run.stdout
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step_000002.damaged", "step_000004.damaged"]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4  # nothing lost
    fresh = flexdemo([*again, "train.overwrite=true"])
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert "train.overwrite=true: starting afresh at step 0" in fresh.stdout
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000002",
                                                                     "step_000004"]


@pytest.mark.multiprocess
def test_a_resume_with_logged_steps_and_no_checkpoint_refuses(tmp_path):
    out = tmp_path / "run"
    trained(out, 3, "train.checkpoint_every=0")
    run = flexdemo(["train", *SMALL, "train.steps=3", f"train.out={out}", "--resume"])
    assert run.returncode == 2, run.stdout[-2000:]
    line = one_error(run)
    assert "metrics.jsonl records steps up to 3" in line and "train.overwrite=true" in line


# ---------------------------------------------------------------------- item 2: no marker
@pytest.mark.multiprocess
def test_a_checkpoint_folder_without_its_marker_is_damaged(tmp_path, trained_copy):
    """A step_NNNNNN folder is only ever named so by a save that wrote its COMPLETE marker;
    one without it used to be skipped silently and overwritten by the next save."""
    out = tmp_path / "run"
    trained_copy(out, 4)
    newest = out / "checkpoints" / "step_000004"
    (newest / "COMPLETE").unlink()
    base = ["train", *SMALL, "train.steps=6", f"train.out={out}", "--resume"]
    refused = flexdemo([*base, "train.resume_fallback=false"])
    assert refused.returncode == 2
    line = one_error(refused)
    assert "step_000004 is damaged (no COMPLETE marker" in line, line
    assert newest.is_dir() and not (newest / "COMPLETE").exists()
    verify = flexdemo(["checkpoint", "verify", str(out)])
    assert verify.returncode == 1 and "step_000004  damaged: no COMPLETE marker" in verify.stdout
    run = flexdemo(base)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "step_000004 is damaged (no COMPLETE marker" in run.stdout
    assert "resuming from step_000002 instead" in run.stdout
    aside = out / "checkpoints" / "step_000004.damaged"
    assert aside.is_dir() and not (aside / "COMPLETE").exists()  # kept, not overwritten
    assert (newest / "COMPLETE").is_file()


# ---------------------------------------------------------------------- items 3, 4: permission
@pytest.fixture(scope="module")
def unprivileged(tmp_path_factory) -> tuple[str, ...]:
    """A command prefix under which permission bits hold (root without CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH; nothing for another user), checked on a real mode-000 file."""
    if os.geteuid() != 0:
        prefix: tuple[str, ...] = ()
    elif shutil.which("capsh"):
        prefix = (shutil.which("capsh") or "capsh", f"--drop={DROP}", "--", "-c")
    elif shutil.which("setpriv"):
        prefix = (shutil.which("setpriv") or "setpriv", "--inh-caps=-all",
                  "--bounding-set=-dac_override,-dac_read_search", "sh", "-c")
    else:
        pytest.skip("running as root without capsh (libcap2-bin) or setpriv (util-linux) to "
                    "drop CAP_DAC_OVERRIDE")
    probe = tmp_path_factory.mktemp("probe") / "secret"
    probe.write_text("x")
    probe.chmod(0)
    cmd = shlex.join([sys.executable, "-c", f"open({str(probe)!r}).read()"])
    run = subprocess.run([*prefix, cmd] if prefix else ["sh", "-c", cmd], capture_output=True,
                         text=True)
    if run.returncode == 0:
        pytest.skip(f"{prefix[0] if prefix else 'this user'} still reads a mode-000 file here "
                    "(the capabilities cannot be dropped in this container)")
    assert "PermissionError" in run.stderr, run.stderr
    return prefix


def _spawn_unprivileged(prefix: tuple[str, ...], world: int,
                        args: list[str]) -> list[subprocess.Popen]:
    """``world`` ranks of ``python -m flexdemo ARGS`` under ``prefix`` (as spawn_ranks)."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", FLEXDEMO_TIMEOUT="30")
        cmd = [sys.executable, "-m", "flexdemo", *args]
        procs.append(subprocess.Popen([*prefix, shlex.join(cmd)] if prefix else cmd, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return procs


def _communicate(procs: list[subprocess.Popen]) -> list[str]:
    try:
        return [p.communicate(timeout=120)[0] for p in procs]
    finally:
        reap(procs)


def _run_ok(world: int, args: list[str]) -> tuple[list[subprocess.Popen], list[str]]:
    """Run ``world`` ranks of ``flexdemo ARGS``, which must all exit 0."""
    procs = spawn_ranks(world, args)
    outputs = _communicate(procs)
    assert [p.returncode for p in procs] == [0] * world, outputs
    return procs, outputs


@pytest.mark.multiprocess
def test_a_file_this_user_may_not_read_is_permission_not_damage(tmp_path, unprivileged,
                                                                trained_copy):
    """2 ranks; the unreadable file is in rank 1's share of the digests. It used to be
    called damaged, and the checkpoint renamed step_000004.damaged."""
    out = tmp_path / "run"
    args = two_rank_args(out)
    trained_copy(out, 4, ranks=2)
    newest = out / "checkpoints" / "step_000004"
    files = sorted(json.loads((newest / "COMPLETE").read_text())["files"])
    locked = newest / next(f for f in files[1::2] if f.endswith(".distcp"))  # rank 1 checks it
    locked.chmod(0)
    procs = _spawn_unprivileged(unprivileged, 2, [*args, "train.steps=6", "--resume"])
    outputs = _communicate(procs)
    assert [p.returncode for p in procs] == [2, 2], outputs
    assert not any("Traceback" in text for text in outputs), outputs[0][-3000:]
    errors = [line for line in outputs[0].splitlines() if "error" in line]
    assert len(errors) == 1, outputs[0][-2000:]
    assert "permission denied" in errors[0] and locked.name in errors[0], errors[0]
    assert "nothing was renamed" in errors[0] and "damaged" not in errors[0], errors[0]
    assert sorted(p.name for p in newest.parent.iterdir()) == ["step_000002", "step_000004"]
    verify = flexdemo(["checkpoint", "verify", str(out)], unprivileged)
    assert verify.returncode == 1 and "Traceback" not in verify.stderr
    assert "step_000004  unreadable: permission denied" in verify.stdout, verify.stdout
    locked.chmod(0o644)  # readable again: it was never damaged, and resumes
    _, outputs = _run_ok(2, [*args, "train.steps=6", "--resume"])
    assert "resumed from" in outputs[0] and "step_000004" in outputs[0], outputs[0][-2000:]


@pytest.mark.multiprocess
@pytest.mark.parametrize("locked", ["run", "checkpoints", "step_000002", "COMPLETE"])
def test_verify_of_a_folder_this_user_may_not_read_is_one_line(tmp_path, unprivileged,
                                                              trained_copy, locked):
    out = tmp_path / "run"
    trained_copy(out, 2)
    target = {"run": out, "checkpoints": out / "checkpoints",
              "step_000002": out / "checkpoints" / "step_000002",
              "COMPLETE": out / "checkpoints" / "step_000002" / "COMPLETE"}[locked]
    target.chmod(0)
    try:
        run = flexdemo(["checkpoint", "verify", str(out)], unprivileged)
    finally:
        target.chmod(0o755)
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    if locked in ("run", "checkpoints"):
        assert run.returncode == 2
        line = one_error(run, "checkpoint")
        assert "permission denied" in line and "chmod" in line, line
    else:
        assert run.returncode == 1, run.stderr
        assert "step_000002  unreadable: permission denied" in run.stdout, run.stdout
        assert run.stderr.strip() == "1 of 1 checkpoint(s) unreadable", run.stderr


# ---------------------------------------------------------------------- item 5: no digests
def _strip_digests(ckpt: Path) -> None:
    """Make ``ckpt`` look written by a flexdemo before digests (its marker: step, time)."""
    marker = json.loads((ckpt / "COMPLETE").read_text())
    (ckpt / "COMPLETE").write_text(json.dumps({"step": marker["step"],
                                               "time": marker["time"]}))


def test_a_checkpoint_without_digests_loads_after_one_warning(tmp_path, single_process):
    """A digest-less checkpoint used to load without a word; with an unreadable
    flexdemo.json it was refused advising resume=true, which is what had been run."""
    out = tmp_path / "run"
    base = SMALL + ["train.steps=4", f"train.out={out}"]
    train(load_config(None, base), echo=lambda text: None)
    for ckpt in (out / "checkpoints").iterdir():
        _strip_digests(ckpt)
    said: list[str] = []
    summary = train(load_config(None, [*base, "train.steps=6", "resume=true"]),
                    echo=said.append)
    assert summary["resumed_from"].endswith("step_000004"), said
    warnings = [line for line in said if "records no digests" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: "), said
    # an unreadable flexdemo.json is damage: the resume falls back to step 2
    newest = out / "checkpoints" / "step_000006"
    _strip_digests(newest)
    (newest / "flexdemo.json").write_text("{not json")
    said.clear()
    summary = train(load_config(None, [*base, "train.steps=8", "resume=true"]),
                    echo=said.append)
    assert summary["resumed_from"].endswith("step_000004"), said
    moved = [line for line in said if "set aside" in line]
    assert len(moved) == 1 and "flexdemo.json is unreadable" in moved[0], said
    assert "resume=true" not in moved[0]


# ---------------------------------------------------------------------- item 6: said once
@pytest.mark.multiprocess
def test_each_damage_reason_is_named_once_on_two_ranks(tmp_path, trained_copy):
    """Every rank reads the marker: a bad one was named once per rank."""
    out = tmp_path / "run"
    args = two_rank_args(out)
    trained_copy(out, 4, ranks=2)
    (out / "checkpoints" / "step_000004" / "COMPLETE").write_text("{ garbage")
    procs = spawn_ranks(2, [*args, "train.steps=6", "--resume", "train.resume_fallback=false"])
    outputs = _communicate(procs)
    assert [p.returncode for p in procs] == [2, 2], outputs
    errors = [line for line in outputs[0].splitlines() if "error" in line]
    assert len(errors) == 1, outputs[0][-2000:]
    assert errors[0].count("unreadable (JSONDecodeError)") == 1, errors[0]


# ---------------------------------------------------------------------- item 7: start-up
@pytest.mark.parametrize("address", ["http://127.0.0.1:notaport", "http://127.0.0.1:99999",
                                     "://x", "env:http://127.0.0.1:0"])
def test_a_malformed_lighthouse_address_is_refused_at_once(tmp_path, address, monkeypatch,
                                                           capsys):
    """These used to fail after torchft's 60 s connect timeout, with exit code 1. The command
    runs in this process (the check comes before anything starts): a subprocess under a
    loaded machine once took longer than the test allowed."""
    args = ["train", *SMALL, "train.steps=2", f"train.out={tmp_path / 'run'}",
            "fault_tolerance.enabled=true", "fault_tolerance.replica_id=a"]
    if address.startswith("env:"):
        monkeypatch.setenv("TORCHFT_LIGHTHOUSE", address[4:])
        where = "$TORCHFT_LIGHTHOUSE"
    else:
        monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
        args.append(f"fault_tolerance.lighthouse={json.dumps(address)}")
        where = "fault_tolerance.lighthouse"
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    line = one_error(subprocess.CompletedProcess(args, 2, "", err))
    assert where in line and "is not a lighthouse address" in line, line
    assert "http://host:port" in line, line
    assert not (tmp_path / "run").exists()  # nothing started


@pytest.mark.multiprocess
def test_a_batch_larger_than_a_ranks_share_is_refused_on_every_rank(tmp_path):
    """1249 windows over 3 ranks: the smallest share is 416. A batch of 417 used to end in a
    traceback on every rank (rank 0 reporting the others as lost)."""
    args = ["train", *SMALL, "train.steps=2", "train.batch=417", "mesh.replicate=3",
            "mesh.shard=1", f"train.out={tmp_path / 'run'}"]
    procs = spawn_ranks(3, args)
    outputs = _communicate(procs)
    assert [p.returncode for p in procs] == [2, 2, 2], outputs
    assert not any("Traceback" in text or "lost" in text for text in outputs), outputs
    errors = [line for line in outputs[0].splitlines() if "error" in line]
    assert len(errors) == 1, outputs[0][-2000:]
    assert "train.batch=417" in errors[0] and "416 of 1249 items over 3 ranks" in errors[0]
    assert "at most 416" in errors[0], errors[0]
    assert not any("error" in text for text in outputs[1:]), outputs[1:]
    _run_ok(3, [*args, "train.batch=416"])  # the largest batch every rank can draw


# ---------------------------------------------------------------------- item 8: data changes
def test_a_resume_that_changes_seed_batch_or_corpus_says_so(tmp_path, single_process):
    out = tmp_path / "run"
    base = SMALL + [f"train.out={out}"]
    train(load_config(None, [*base, "train.steps=2"]), echo=lambda text: None)
    said: list[str] = []
    train(load_config(None, [*base, "train.steps=4", "resume=true"]), echo=said.append)
    assert not [line for line in said if "other data" in line], said
    said.clear()
    train(load_config(None, [*base, "train.steps=6", "resume=true", "train.seed=1",
                             "train.batch=2", "task.corpus_bytes=30000"]), echo=said.append)
    notes = [line for line in said if "other data" in line]
    assert len(notes) == 1, said
    for needle in ("train.seed 0 (now 1)", "train.batch 1 (now 2)",
                   "task.corpus_bytes 20000 (now 30000)", "training items 1249 (now"):
        assert needle in notes[0], notes[0]
