"""Bad input to ``flexdemo simulate``, ``bench`` and ``train`` gets one line and exit code 2
(never a traceback), and a finished run resumed again leaves its outputs alone."""

from __future__ import annotations

import inspect
import json
import re
import sys
from pathlib import Path

import pytest

from flexdemo.app.bench.run import BenchError, bench_options, run_config
from flexdemo.app.cli import main
from flexdemo.app.config.checks import config_from_dict, resolve, validate
from flexdemo.app.config.files import load_config
from flexdemo.app.config.schema import ConfigError
from flexdemo.app.outputs import strict_json
from flexdemo.replicate import DeMoReplicator

ROOT = Path(__file__).parent.parent
GPT = str(ROOT / "configs" / "gpt.toml")
QUICK = ["task.model=tiny", "task.corpus_bytes=100000", "train.batch=2", "train.warmup=1",
         "train.eval_every=3", "train.eval_batches=1", "train.tensorboard=false",
         "train.progress=false", "train.threads=0"]


def one_error_line(capsys, command: str) -> str:
    """The only stderr line, which must be ``flexdemo <command>: error: ...``."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith(f"flexdemo {command}: error: "), err
    return err.strip()


def strict_load(path: Path):
    """JSON as a strict parser reads it (no NaN or Infinity)."""
    def refuse(word: str):
        raise AssertionError(f"{path} holds {word}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


# ---------------------------------------------------------------------- simulate
@pytest.mark.parametrize("strategy, needle", [
    ("flexdemo:topk=0", "topk must be an integer >= 1, got 0"),
    ("flexdemo:topk=abc", "got 'abc'"),
    ("flexdemo:bogus=1", "has no setting 'bogus'"),
    # the preset's tau=1 does not fit H/F = 4/4 = 1: the line says to set tau, and how
    ("streaming-diloco-avg:inner_steps=4", "sets tau=1, which does not fit"),
    ("streaming-diloco-avg:inner_steps=6", "sets fragments=4"),
])
def test_simulate_bad_strategy_settings_are_one_line(capsys, monkeypatch, strategy, needle):
    import flexdemo.app.simulate.run as simulate

    def never(*args, **kwargs):
        raise AssertionError("replicas were built for a strategy that cannot work")

    monkeypatch.setattr(simulate, "SimulatedReplicas", never)
    assert main(["simulate", "--strategy", strategy, "--steps", "2",
                 "--corpus-bytes", "100000"]) == 2
    line = one_error_line(capsys, "simulate")
    assert f"strategy {strategy!r}" in line and needle in line, line


def test_simulate_suggested_streaming_fix_is_valid(capsys):
    assert main(["simulate", "--strategy", "streaming-diloco-avg:inner_steps=4",
                 "--steps", "2"]) == 2
    line = one_error_line(capsys, "simulate")
    fix = re.search(r"--strategy (\S+?)\)", line).group(1)
    assert fix == "streaming-diloco-avg:inner_steps=4:tau=0"
    from flexdemo import check_strategy

    assert check_strategy(fix).replicator_kwargs["tau"] == 0


def test_simulate_too_little_text_is_one_line(capsys):
    assert main(["simulate", "--corpus-bytes", "10", "--steps", "2"]) == 2
    line = one_error_line(capsys, "simulate")
    assert "--corpus-bytes must be at least 10000" in line and "got 10" in line


def test_simulate_summary_is_strict_json(tmp_path, capsys, monkeypatch):
    import flexdemo.app.simulate.run as simulate

    monkeypatch.setattr(simulate, "val_loss", lambda *args, **kwargs: float("nan"))
    out = tmp_path / "sim.json"
    assert main(["simulate", "--replicas", "2", "--steps", "1", "--batch", "1",
                 "--corpus-bytes", "20000", "--out", str(out)]) == 0
    summary = strict_load(out)
    assert summary["val_loss"] is None and summary["val_loss_per_replica"] == [None, None]


def test_strict_json_writes_null_for_nan_and_infinity():
    text = strict_json({"a": float("nan"), "b": [1.5, float("-inf")], "c": {"d": float("inf")}})
    assert json.loads(text) == {"a": None, "b": [1.5, None], "c": {"d": None}}


# ---------------------------------------------------------------------- bench
def test_bench_train_steps_override_is_honoured_or_refused(capsys):
    tiny = ["task.model=tiny"]
    o = bench_options(strategies="flexdemo", unshaped=True, overrides=["train.steps=3", *tiny])
    assert o.steps == 3 and o.base["train"]["steps"] == 3
    assert o.base["train"]["warmup"] == 3  # the bench's own warm-up (10) is cut to fit
    assert bench_options(strategies="flexdemo", steps=3, overrides=["train.steps=3"]).steps == 3
    with pytest.raises(BenchError, match="--steps 5 and train.steps=3 disagree"):
        bench_options(strategies="flexdemo", steps=5, overrides=["train.steps=3"])
    with pytest.raises(ConfigError, match="train.steps: must be an integer >= 1, got 'abc'.*"
                                          "--steps N"):
        bench_options(strategies="flexdemo", overrides=["train.steps=abc"])
    # a warm-up longer than the run is cut to the run, with a note
    o = bench_options(strategies="flexdemo", overrides=["train.steps=4", "train.warmup=8"])
    data = run_config(o, "flexdemo", "x")
    cfg, notes = resolve(config_from_dict(data), data)  # the one clamp, its note returned
    assert validate(cfg, 4).train.warmup == 4
    assert len(notes) == 1 and "the warm-up is cut to 4 steps" in notes[0]
    for argv, needle in ((["train.steps=abc"], "got 'abc'"),
                         (["train.steps=0"], "got 0"),
                         (["--steps", "5", "train.steps=3"], "disagree")):
        assert main(["bench", "--unshaped", "--strategies", "flexdemo", *argv]) == 2
        assert needle in one_error_line(capsys, "bench")


def test_bench_steps_of_a_config_file_unless_steps_is_given(tmp_path):
    cfg = tmp_path / "base.toml"
    cfg.write_text('[task]\nmodel = "tiny"\n\n[train]\nsteps = 7\nwarmup = 3\n')
    assert bench_options(strategies="flexdemo", config=str(cfg)).steps == 7
    assert bench_options(strategies="flexdemo", config=str(cfg), steps=4).steps == 4
    o = bench_options(strategies="flexdemo", config=str(cfg), steps=2)
    data = run_config(o, "flexdemo", "x")
    run = validate(resolve(config_from_dict(data), data)[0], 4)
    assert run.train.warmup == 2  # the file's warm-up of 3 is cut to the 2 steps asked for


# ---------------------------------------------------------------------- train
def test_warmup_longer_than_the_run_is_cut_with_a_note(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    cfg = load_config(GPT, ["train.steps=4"])  # configs/gpt.toml warms up for 20 steps
    assert validate(cfg, 4).train.warmup == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["flexdemo: note: train.warmup=20 is longer than train.steps=4; the warm-up "
                   "is cut to 4 steps (set train.warmup to choose another)"]
    # a warm-up nobody set (the default, 10) is cut to the run instead
    assert load_config(None, ["train.steps=4"]).train.warmup == 4
    assert load_config(None, ["train.steps=40"]).train.warmup == 10
    assert load_config(None, ["train.steps=4", "train.warmup=4"]).train.warmup == 4


def test_bad_paths_exit_2_with_one_line(tmp_path, capsys, single_process):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    base = ["train", GPT, *QUICK, "train.steps=1"]
    out = f"train.out={tmp_path / 'run'}"
    for argv, needle in (
            ([out, "resume=maybe"], "resume: checkpoint 'maybe' does not exist"),
            ([f"train.out={a_file}"], "is a file, not a folder; choose another train.out"),
            ([out, "--resume", str(tmp_path / "run" / "checkpoints" / "step_000001")],
             "step_000001' does not exist")):
        assert main(base + argv) == 2, argv
        line = one_error_line(capsys, "train")
        assert needle in line, line


def test_resuming_a_finished_run_trains_nothing_and_keeps_its_summary(tmp_path, capsys,
                                                                       single_process):
    run = tmp_path / "run"
    argv = ["train", GPT, *QUICK, "train.checkpoint_every=3", f"train.out={run}"]
    assert main(argv + ["train.steps=6"]) == 0
    summary = (run / "summary.json").read_bytes()
    metrics = (run / "metrics.jsonl").read_bytes()
    saved = strict_load(run / "summary.json")
    assert saved["steps"] == 6 and saved["val_loss"] > 0
    capsys.readouterr()

    assert main(argv + ["train.steps=6", "resume=true"]) == 0
    out = capsys.readouterr().out
    assert "already at step 6 of 6" in out and "nothing to train" in out, out
    assert "steps 7..6" not in out and "train loss" not in out
    assert (run / "summary.json").read_bytes() == summary
    assert (run / "metrics.jsonl").read_bytes() == metrics

    # a checkpoint past train.steps: one line naming both numbers and what to set
    assert main(argv + ["train.steps=4", "resume=true"]) == 2
    line = one_error_line(capsys, "train")
    assert "step_000006" in line and "at step 6, past train.steps=4" in line, line
    assert "set train.steps=6 or more" in line
    assert (run / "summary.json").read_bytes() == summary


def test_gpt_config_states_the_library_defaults_of_demo():
    text = (ROOT / "configs" / "gpt.toml").read_text()
    m = re.search(r"defaults: topk (\d+), chunk (\d+), decay ([\d.]+), values (\w+)", text)
    assert m is not None, "configs/gpt.toml should name DeMo's defaults"
    defaults = {k: p.default for k, p in inspect.signature(DeMoReplicator).parameters.items()}
    assert (int(m[1]), int(m[2]), float(m[3]), m[4]) == (
        defaults["topk"], defaults["chunk"], defaults["decay"], defaults["values"])


def test_train_overrides_may_follow_resume(capsys):
    code = main(["train", GPT, "--resume", "train.steps=30", "train.out=/tmp/elsewhere",
                 "--print-config"])
    out = capsys.readouterr().out
    assert code == 0 and "steps = 30" in out and 'out = "/tmp/elsewhere"' in out, out
    assert "resume = true" in out
    with pytest.raises(SystemExit) as info:
        main(["train", GPT, "--resume", "train.steps=30", "--bogus"])
    assert info.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_a_missing_optional_extra_is_a_usage_error(capsys, tmp_path, single_process,
                                                   monkeypatch):
    """The t5 task without transformers (made unimportable here, whether or not it is
    installed): one line naming the extra, exit code 2."""
    from flexdemo.app.tasks import t5

    monkeypatch.setattr(t5, "have_transformers", lambda: False)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    code = main(["train", str(ROOT / "configs" / "t5.toml"), f"train.out={tmp_path / 'o'}"])
    err = capsys.readouterr().err
    assert code == 2 and "pip install 'flexdemo[t5]'" in err and "Traceback" not in err, err
