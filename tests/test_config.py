"""Config files, overrides and validation, and the one-line errors of ``flexdemo train``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from flexdemo.app.cli import main
from flexdemo.app.config.checks import config_from_dict, validate
from flexdemo.app.config.files import apply_overrides, load_config, parse_override, to_toml
from flexdemo.app.config.schema import Config, ConfigError
from flexdemo.app.tasks import GPTTaskConfig, TaskConfig
from flexdemo.app.tasks.base import must

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))


def write(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def error_of(data: dict, world: int = 1) -> str:
    with pytest.raises(ConfigError) as e:
        validate(config_from_dict(data), world)
    return str(e.value)


def test_defaults_are_valid():
    cfg = load_config()
    assert cfg == Config()
    assert cfg.task.name == "gpt" and cfg.strategy.replicator == "demo"
    assert cfg.mesh.replicate is None and cfg.resume is False


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_are_valid(path):
    cfg = load_config(path, world_size=4)
    assert cfg.train.steps >= 1


def test_toml_file_and_overrides(tmp_path):
    p = write(tmp_path, """
resume = true
[task]
name = "vit"
model = "tiny"
[strategy]
replicator = "demo"
lr = 1e-2
[strategy.replicator_kwargs]
topk = 16
[mesh]
replicate = 2
shard = "auto"
[train]
steps = 10
""")
    cfg = load_config(p, ["train.steps=50", "strategy.replicator_kwargs.chunk=32",
                          "train.out=runs/x y", "strategy.lr=3e-3", "resume=false"],
                      world_size=4)
    assert cfg.task.name == "vit" and cfg.train.steps == 50
    assert cfg.strategy.replicator_kwargs == {"topk": 16, "chunk": 32}
    assert cfg.strategy.lr == 3e-3 and cfg.train.out == "runs/x y"
    assert cfg.mesh.replicate == 2 and cfg.mesh.shard is None and cfg.resume is False


def test_switching_replicator_drops_its_kwargs(tmp_path):
    p = write(tmp_path, '[strategy]\nreplicator = "demo"\nreplicator_kwargs = {topk = 8}\n'
                        'optimizer = "adamw"\noptimizer_kwargs = {betas = [0.9, 0.95]}\n')
    cfg = load_config(p, ["strategy.replicator=full"])
    assert cfg.strategy.replicator_kwargs == {}
    assert cfg.strategy.optimizer_kwargs == {"betas": [0.9, 0.95]}
    cfg = load_config(p, ["strategy.replicator=full", "strategy.replicator_kwargs={values='bf16'}",
                          "strategy.optimizer=sgd"])
    assert cfg.strategy.replicator_kwargs == {"values": "bf16"}
    assert cfg.strategy.optimizer_kwargs == {}
    assert load_config(p, ["strategy.replicator=demo"]).strategy.replicator_kwargs == {"topk": 8}


def test_override_values_are_toml():
    assert parse_override("train.steps=50") == (["train", "steps"], 50)
    assert parse_override("strategy.lr=1e-3") == (["strategy", "lr"], 1e-3)
    assert parse_override("strategy.replicator=full") == (["strategy", "replicator"], "full")
    assert parse_override("train.tensorboard=false")[1] is False
    assert parse_override("strategy.replicator_kwargs={topk=16}")[1] == {"topk": 16}
    assert parse_override('train.out="a=b"')[1] == "a=b"
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_override("train.steps")
    with pytest.raises(ConfigError, match="empty key"):
        parse_override("train.=3")
    # replacing the replicator keeps unrelated keys and can clear its kwargs
    data = apply_overrides({"strategy": {"replicator": "demo", "replicator_kwargs": {"topk": 8}}},
                           ["strategy.replicator=full", "strategy.replicator_kwargs={}"])
    assert data["strategy"] == {"replicator": "full", "replicator_kwargs": {}}


@pytest.mark.parametrize("data, expected", [
    ({"train": {"stpes": 5}}, "unknown key 'train.stpes' (did you mean 'train.steps'?)"),
    ({"trian": {"steps": 5}}, "unknown section 'trian' (did you mean 'train'?)"),
    ({"optimiser": 1}, "unknown key 'optimiser'"),
    ({"train": {"steps": "abc"}}, "train.steps: expected an integer, got 'abc' (a string)"),
    ({"train": {"steps": 1.5}}, "train.steps: expected an integer, got 1.5"),
    ({"train": {"steps": True}}, "train.steps: expected an integer, got True"),
    ({"strategy": {"lr": "fast"}}, "strategy.lr: expected a number, got 'fast'"),
    ({"train": {"tensorboard": "yes"}}, "train.tensorboard: expected true or false"),
    ({"strategy": {"replicator_kwargs": 3}}, "strategy.replicator_kwargs: expected a table"),
    ({"train": 5}, "[train] must be a table"),
    ({"resume": 3}, "resume: expected true, false or a checkpoint path"),
    ({"mesh": {"shard": "two"}}, "mesh.shard: expected an integer or 'auto', got 'two'"),
])
def test_names_and_types_are_checked(data, expected):
    assert expected in error_of(data)


@pytest.mark.parametrize("data, expected", [
    ({"strategy": {"replicator": "ful"}}, "strategy.replicator: unknown value 'ful' (did you "
                                          "mean 'full'?)"),
    ({"task": {"name": "bert"}}, "task.name: unknown value 'bert'"),
    ({"task": {"model": "huge"}}, "task.model: unknown value 'huge'; choose one of tiny, mini"),
    ({"task": {"name": "vit", "model": "mini"}}, "choose one of tiny, small"),
    ({"train": {"schedule": "linear"}}, "train.schedule: unknown value 'linear'"),
    ({"train": {"steps": 0}}, "train.steps: must be an integer >= 1, got 0"),
    ({"train": {"warmup": -1}}, "train.warmup: must be an integer >= 0"),
    ({"train": {"steps": 10, "stop_at": 20}}, "train.stop_at"),
    ({"strategy": {"lr": 0}}, "strategy.lr: must be a number > 0"),
    ({"task": {"name": "vit", "patch": 3}}, "task.patch: must be a divisor of 8"),
    ({"strategy": {"replicator": "full", "replicator_kwargs": {"topk": 8}}},
     "strategy.replicator_kwargs for 'full'"),
    ({"strategy": {"replicator_kwargs": {"topk": 0}}}, "topk must be an integer >= 1"),
    ({"strategy": {"optimizer": "sgd", "optimizer_kwargs": {"betas": [0.9, 0.9]}}},
     "strategy.optimizer_kwargs for 'sgd'"),
    ({"strategy": {"optimizer_kwargs": {"lr": 0.1}}}, "give the learning rate as strategy.lr"),
])
def test_values_are_checked(data, expected):
    assert expected in error_of(data)


def test_impossible_mesh_shapes():
    assert "replicate=3 does not divide the world size 4" in error_of(
        {"mesh": {"replicate": 3}}, world=4)
    assert "choose sizes whose product is 4" in error_of(
        {"mesh": {"replicate": 2, "shard": 3}}, world=4)
    assert "mesh.shard: must be an integer >= 1" in error_of({"mesh": {"shard": 0}}, world=4)
    assert "single process" in error_of({"mesh": {"replicate": 2}}, world=1)
    validate(config_from_dict({"mesh": {"replicate": 2, "shard": 2}}), 4)
    validate(config_from_dict({"mesh": {"replicate": 4, "shard": 1}}), 4)


def test_error_messages_are_one_line():
    for data in ({"train": {"stpes": 1}}, {"mesh": {"replicate": 3}},
                 {"strategy": {"replicator": "full", "replicator_kwargs": {"topk": 8}}}):
        assert "\n" not in error_of(data, world=4)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(write(tmp_path, "[train\nsteps = 1"))
    with pytest.raises(ConfigError, match="unknown config format"):
        load_config(write(tmp_path, "x", "c.ini"))


def test_yaml_and_json(tmp_path):
    cfg = load_config(write(tmp_path, json.dumps({"train": {"steps": 7}}), "c.json"))
    assert cfg.train.steps == 7
    pytest.importorskip("yaml", reason="YAML configs need pyyaml")
    cfg = load_config(write(tmp_path, "task:\n  name: vit\ntrain:\n  steps: 9\n", "c.yaml"))
    assert cfg.task.name == "vit" and cfg.train.steps == 9
    with pytest.raises(ConfigError, match="unknown key 'train.step'"):
        load_config(write(tmp_path, "train:\n  step: 9\n", "d.yml"))


def test_to_toml_round_trips(tmp_path):
    cfg = load_config(None, ["strategy.replicator=diloco", "strategy.optimizer=adamw",
                             "strategy.replicator_kwargs={inner_steps=5, exchange_kwargs="
                             "{values=\"int4\"}}", "mesh.replicate=2", 'train.out="a \\"b\\""'],
                      world_size=2)
    again = load_config(write(tmp_path, to_toml(cfg)), world_size=2)
    assert again == cfg


# ---------------------------------------------------------------------- the command line
def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["train", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_reports_bad_config_in_one_line(capsys, tmp_path):
    cfg = write(tmp_path, "[train]\nsteps = 5\n")
    for argv, expected in [
        ((str(cfg), "train.stpes=1"), "unknown key 'train.stpes' (did you mean 'train.steps'?)"),
        ((str(cfg), "strategy.replicator=ful"), "did you mean 'full'?"),
        ((str(cfg), "train.steps=abc"), "expected an integer"),
        ((str(cfg), "mesh.replicate=3"), "does not divide the world size 1"),
        ((str(tmp_path / "nope.toml"),), "does not exist"),
        ((str(cfg), "train.steps"), "is not an override"),
        ((str(cfg), "train.device=gpu"), "train.device: unknown value 'gpu'"),
        ((str(cfg), "train.precision=fp16"), "train.precision: unknown value 'fp16'"),
    ]:
        code, out, err = run_cli(capsys, *argv)
        assert code == 2, (argv, err)
        assert err.startswith("flexdemo train: error: ") and expected in err, err
        assert err.count("\n") == 1 and "Traceback" not in err


def test_cli_print_config(capsys, tmp_path):
    code, out, err = run_cli(capsys, "strategy.replicator=full", "strategy.optimizer=adamw",
                             "--resume", "--print-config")
    assert code == 0, err
    cfg = load_config(write(tmp_path, out))
    assert cfg.strategy.replicator == "full" and cfg.resume is True
    code, out, _ = run_cli(capsys, "--resume", "runs/x/checkpoints", "--print-config")
    assert code == 0 and 'resume = "runs/x/checkpoints"' in out
    code, out, _ = run_cli(capsys, "--resume", "train.steps=7", "--print-config")
    assert code == 0 and "resume = true" in out and "steps = 7" in out


def test_cli_help_teaches(capsys):
    for cmd in ("train", "bench"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert "examples:" in out
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(c in out for c in ("train", "bench", "cluster"))


def test_non_utf8_config_file_is_one_line(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes("[train]\n# Gr\xfc\xdfe\nsteps = 3\n".encode("latin-1"))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "not UTF-8" in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


def test_an_override_never_replaces_a_malformed_section(tmp_path):
    path = write(tmp_path, 'strategy = "demo"\n[train]\nsteps = 3\n')
    with pytest.raises(ConfigError, match=r"strategy is 'demo' \(a string\), not a table"):
        load_config(path, ["strategy.lr=0.01"])
    with pytest.raises(ConfigError, match="not a table"):
        apply_overrides({"train": 5}, ["train.steps=2"])
    assert apply_overrides({}, ["train.steps=2"]) == {"train": {"steps": 2}}


def test_task_choices_come_from_the_task_registry(monkeypatch):
    from flexdemo.app import tasks

    assert tasks.TASK_NAMES == tuple(tasks.TASKS) == ("gpt", "vit", "t5")
    assert "choose one of gpt, vit, t5" in error_of({"task": {"name": "bert"}})
    # one entry in the table makes a task valid in configs and buildable
    built = []
    spec = tasks.TaskSpec("a test task", ("one",), tasks.TaskConfig,
                          lambda c, seed: built.append((c.model, seed)) or "task")
    monkeypatch.setitem(tasks.TASKS, "toy", spec)
    cfg = load_config(None, ["task.name=toy", "task.model=one"])
    assert tasks.build_task(cfg.task, seed=3) == "task" and built == [("one", 3)]
    assert "choose one of one" in error_of({"task": {"name": "toy", "model": "two"}})


@dataclass
class _ToyTaskConfig(TaskConfig):
    """A task's own section with a key no other task has, declared here alone."""

    name: str = "toy"
    depth: int = 2

    def check(self) -> None:
        must("depth", self.depth >= 1, "at least 1", self.depth)


def test_a_task_declares_its_own_keys_beside_it(monkeypatch, tmp_path):
    from flexdemo.app import tasks

    spec = tasks.TaskSpec("a test task", ("one",), _ToyTaskConfig, lambda c, seed: c.depth)
    monkeypatch.setitem(tasks.TASKS, "toy", spec)
    cfg = load_config(None, ["task.name=toy", "task.model=one", "task.depth=3"])
    assert cfg.task == _ToyTaskConfig(model="one", depth=3)
    assert tasks.build_task(cfg.task) == 3 and tasks.task_options("toy") == ("model", "depth")
    again = load_config(write(tmp_path, to_toml(cfg)))  # written and read back
    assert again == cfg
    assert error_of({"task": {"name": "toy", "model": "one", "depth": 0}}) == (
        "task.depth: must be at least 1, got 0")
    assert "did you mean 'task.depth'?" in error_of({"task": {"name": "toy", "dpeth": 1}})
    text = error_of({"task": {"name": "toy", "seq_len": 8}})
    assert "gpt and t5's" in text and "the toy task takes model, depth" in text
    text = error_of({"task": {"name": "gpt", "depth": 4}})  # the new key is the toy task's
    assert "task.depth: the gpt task has no such setting (it is toy's)" in text
    switched = load_config(write(tmp_path, to_toml(cfg)), ["task.name=gpt", "task.model=mini"])
    assert switched.task == GPTTaskConfig(model="mini")  # the toy task's depth dropped
    assert tasks.task_config("toy", depth=5) == _ToyTaskConfig(depth=5)  # built in code
    wrong = Config(task=_ToyTaskConfig(name="gpt", model="mini"))  # built by hand, mismatched
    with pytest.raises(ConfigError, match="the gpt task's section is GPTTaskConfig"):
        validate(wrong)


# ---------------------------------------------------------------------- device, precision
def test_device_and_precision_keys(monkeypatch):
    import torch

    from flexdemo.app.device import resolve_device

    cfg = load_config(None, ["train.device=cpu", "train.precision=bf16"])
    assert (cfg.train.device, cfg.train.precision) == ("cpu", "bf16")
    assert load_config().train.device == "auto" and load_config().train.precision == "fp32"
    assert resolve_device("cpu") == torch.device("cpu")
    for data, words in [({"train": {"device": "gpu"}}, ["train.device", "'gpu'",
                                                        "auto, cpu, cuda"]),
                        ({"train": {"precision": "fp16"}}, ["train.precision", "'fp16'",
                                                            "fp32, bf16"]),
                        ({"train": {"device": 0}}, ["train.device", "expected a string"])]:
        text = error_of(data)
        assert all(w in text for w in words) and "\n" not in text, text
    # without CUDA: auto is the CPU, and asking for cuda is one line that names the fix
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    text = error_of({"train": {"device": "cuda"}})
    assert text.startswith("train.device: device 'cuda' asked for") and "\n" not in text
    assert 'use device "cpu"' in text


def test_cuda_rank_beyond_the_gpus_is_one_line(monkeypatch):
    """cuda:LOCAL_RANK must exist (faked: two GPUs, LOCAL_RANK 2)."""
    import torch

    from flexdemo.app.device import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device("cuda") == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "2")
    text = error_of({"train": {"device": "auto"}})
    assert "LOCAL_RANK=2 needs GPU 2" in text and "--nproc-per-node" in text, text
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("FLEXDEMO_CUDA_BY_RANK", "1")  # the bench's emulated nodes
    assert resolve_device("cuda") == torch.device("cuda", 1)


def test_cli_cuda_without_cuda_is_one_line(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run_cli(capsys, "train.device=cuda")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("flexdemo train: error: train.device: device 'cuda' asked for")


class _Left(Exception):
    pass


@pytest.mark.parametrize("world", [1, 2])
def test_the_executable_skips_finalisation_only_after_a_multi_rank_run(monkeypatch, world):
    """After a finished multi-rank ``train`` the executable leaves through ``os._exit`` with the
    run's code (no interpreter finalisation to abort in); a one-process run exits normally."""
    import flexdemo.app.cli as cli
    import flexdemo.app.train.cli as cli_train

    monkeypatch.setattr(cli_train, "LEAVE_AT_ONCE", cli_train.threading.Event())
    monkeypatch.setattr(cli_train, "train", lambda cfg, exit_on_lost_peer, handle_signals: {})
    monkeypatch.setattr(cli_train.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(cli_train.dist, "get_world_size", lambda: world)
    torn = []
    monkeypatch.setattr(cli_train.dist, "destroy_process_group", lambda: torn.append(1))
    monkeypatch.setattr(cli, "main", lambda: cli_train._run_training(None))

    def fake_exit(code):
        raise _Left(code)

    monkeypatch.setattr(cli.os, "_exit", fake_exit)
    if world > 1:
        with pytest.raises(_Left) as left:
            cli.entry()
        assert left.value.args == (0,)
    else:
        with pytest.raises(SystemExit) as done:
            cli.entry()
        assert done.value.code == 0
    assert torn == [1]


# ---------------------------------------------------------------------- [fault_tolerance]
def test_fault_tolerance_section_maps_to_the_library(monkeypatch, tmp_path):
    """[fault_tolerance]: off by default (prepare() gets None); its keys map to
    flexdemo.FaultTolerance, empty values to the library's environment fallbacks; bad values
    and missing settings are one line naming the key."""
    pytest.importorskip("torchft")
    from flexdemo import FaultTolerance
    from flexdemo.app.config.checks import fault_tolerance

    for name in ("TORCHFT_LIGHTHOUSE", "FLEXDEMO_REPLICA_ID", "REPLICA_GROUP_ID",
                 "FLEXDEMO_FT_HOSTNAME"):
        monkeypatch.delenv(name, raising=False)
    assert fault_tolerance(load_config()) is None
    path = write(tmp_path, "[fault_tolerance]\nenabled = true\nlighthouse = '10.0.0.1:29510'\n"
                           "replica_id = 'node3'\nmin_replicas = 2\ntimeout = 30\n"
                           "hostname = '10.0.0.3'\nmax_failed_commits = 4\n")
    cfg = load_config(path)
    ft = fault_tolerance(cfg)
    assert isinstance(ft, FaultTolerance)
    assert (ft.lighthouse, ft.replica_id, ft.min_replicas, ft.timeout, ft.quorum_timeout,
            ft.hostname, ft.max_failed_commits) == ("http://10.0.0.1:29510", "node3", 2, 30.0,
                                                    30.0, "10.0.0.3", 4)
    assert load_config(write(tmp_path, to_toml(cfg), "again.toml")) == cfg  # config.toml

    # empty settings: the library's environment variables
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://10.0.0.9:1")
    monkeypatch.setenv("FLEXDEMO_REPLICA_ID", "node7")
    ft = fault_tolerance(load_config(None, ["fault_tolerance.enabled=true",
                                            "fault_tolerance.quorum_timeout=90"]))
    assert (ft.lighthouse, ft.replica_id, ft.quorum_timeout, ft.max_failed_commits) == \
        ("http://10.0.0.9:1", "node7", 90.0, None)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE")
    with pytest.raises(ConfigError) as e:
        fault_tolerance(load_config(None, ["fault_tolerance.enabled=true"]))
    assert str(e.value).startswith("fault_tolerance: fault tolerance needs a lighthouse")
    assert "\n" not in str(e.value)

    for override, expected in [
            ("fault_tolerance.min_replicas=0", "fault_tolerance.min_replicas: must be an "
                                               "integer >= 1, got 0"),
            ("fault_tolerance.timeout=0", "fault_tolerance.timeout: must be a number of "
                                          "seconds > 0"),
            ("fault_tolerance.quorum_timeout=-1", "fault_tolerance.quorum_timeout: must be"),
            ("fault_tolerance.max_failed_commits=-2", "fault_tolerance.max_failed_commits: "
                                                      "must be an integer >= 0"),
            ("fault_tolerance.replica_id='a:b'", "fault_tolerance.replica_id: must be a name "
                                                 "without ':'"),
            ("fault_tolerance.enabled=1", "fault_tolerance.enabled: expected true or false"),
            ("fault_tolerance.lighthose='x'", "unknown key 'fault_tolerance.lighthose' (did "
                                              "you mean 'fault_tolerance.lighthouse'?)")]:
        with pytest.raises(ConfigError) as e:
            load_config(None, [override])
        assert str(e.value).startswith(expected) and "\n" not in str(e.value), str(e.value)


@pytest.mark.multiprocess
@pytest.mark.parametrize("torchft", ["blocked", "installed"])
def test_train_passes_fault_tolerance_to_prepare_or_says_why_not(tmp_path, torchft):
    """flexdemo train with fault_tolerance.enabled=true builds flexdemo.FaultTolerance for
    prepare(): without torchft it stops in one line naming the extra, without a lighthouse in
    one line saying how to give one (exit code 2 both)."""
    if torchft == "installed":
        pytest.importorskip("torchft")
    block = "import sys; sys.modules['torchft'] = None\n" if torchft == "blocked" else ""
    args = ["train", "task.model=tiny", "task.corpus_bytes=20000", "train.steps=1",
            "train.progress=false", "train.tensorboard=false", f"train.out={tmp_path}",
            "fault_tolerance.enabled=true", "fault_tolerance.replica_id=A"]
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHFT_LIGHTHOUSE", "RANK", "WORLD_SIZE", "MASTER_ADDR")}
    r = subprocess.run([sys.executable, "-c", block + "from flexdemo.app.cli import main\n"
                        f"raise SystemExit(main({args!r}))"], capture_output=True, text=True,
                       timeout=120, env=dict(env, OMP_NUM_THREADS="1"))
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    want = ('fault tolerance needs torchft, which is not installed: pip install "flexdemo[ft]"'
            if torchft == "blocked" else "fault tolerance needs a lighthouse: pass lighthouse=")
    assert r.returncode == 2, r.stderr[-2000:]
    assert errors == [errors[0]] and errors[0].startswith(
        f"flexdemo train: error: fault_tolerance: {want}"), r.stderr[-2000:]


def test_each_task_owns_its_keys(tmp_path):
    """A [task] key that only another task reads is one line naming this task's keys; an
    override that switches the task drops the file's keys of the old one; the resolved
    config writes the task's own keys only (and reads back equal)."""
    from flexdemo.app.config.files import config_to_dict

    root = Path(__file__).parent.parent
    text = error_of({"task": {"name": "gpt", "patch": 2}})
    assert "task.patch" in text and "vit's" in text and "model, corpus_bytes, seq_len" in text
    text = error_of({"task": {"name": "vit", "noise_density": 0.2}})
    assert "t5's" in text and "model, patch, val_fraction" in text
    text = error_of({"task": {"name": "vit", "bogus": 1}})  # a key no task reads
    assert text.endswith("valid keys: name, model, patch, val_fraction"), text
    text = error_of({"task": {"name": "vit", "patchh": 2}})
    assert "did you mean 'task.patch'?" in text, text
    vit = write(tmp_path, "[task]\nname = 'vit'\npatch = 2\nval_fraction = 0.3\n")
    cfg = load_config(vit, ["task.name=gpt", "task.model=mini"])
    assert cfg.task == GPTTaskConfig(model="mini")  # vit's keys dropped
    cfg = load_config(root / "configs/t5.toml", ["task.name=gpt", "task.model=mini"])
    assert cfg.task.seq_len == 128  # gpt reads seq_len too: kept
    cfg = load_config(root / "configs/gpt.toml", ["task.name=t5", "task.model=tiny"])
    assert cfg.task.corpus_bytes == 2000000  # t5 reads corpus_bytes too: kept
    written = config_to_dict(load_config(root / "configs/vit.toml"))["task"]
    assert set(written) == {"name", "model", "patch", "val_fraction"}
