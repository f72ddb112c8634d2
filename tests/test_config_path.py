"""One config path (issue 38, item 3): one typed tree, the environment read in one step, a
pure ``validate`` and the warm-up's one clamp."""

from __future__ import annotations

import ast
import copy
import dataclasses
import inspect

import pytest

from flexdemo.app.config import checks as config_checks
from flexdemo.app.config import files as config_files
from flexdemo.app.config.checks import (
    Environment,
    config_from_dict,
    read_environment,
    resolve,
    validate,
)
from flexdemo.app.config.files import load_config, to_toml
from flexdemo.app.config.schema import Config, ConfigError, FaultToleranceConfig, TrainConfig
from flexdemo.ft.config import FaultToleranceSettings

ENV_NAMES = ("RANK", "WORLD_SIZE", "TORCHFT_LIGHTHOUSE", "FLEXDEMO_REPLICA_ID",
             "REPLICA_GROUP_ID", "FLEXDEMO_FT_HOSTNAME")
NOTE = ("flexdemo: note: train.warmup=20 is longer than train.steps=4; the warm-up is cut to 4 "
        "steps (set train.warmup to choose another)")


@pytest.fixture
def clean_env(monkeypatch):
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# ---------------------------------------------------------------------- validate is pure
def test_validate_neither_prints_nor_changes_the_config(capsys, clean_env):
    """A warm-up longer than the run, fault tolerance set up: validate returns the config as
    it was, prints nothing."""
    cfg = config_from_dict({"train": {"steps": 4, "warmup": 20},
                            "fault_tolerance": {"enabled": True, "lighthouse": "h:1",
                                                "quorum_timeout": 5}})
    before = copy.deepcopy(cfg)
    assert validate(cfg, 1) is cfg
    assert cfg == before and cfg.train.warmup == 20
    assert capsys.readouterr() == ("", "")
    with pytest.raises(ConfigError):
        validate(config_from_dict({"train": {"steps": 0}}))
    assert capsys.readouterr() == ("", "")


def test_validate_reads_no_environment(clean_env):
    """The mesh is checked for the world size given, not for ``WORLD_SIZE``."""
    clean_env.setenv("WORLD_SIZE", "4")
    cfg = config_from_dict({"mesh": {"replicate": 2, "shard": 2}})
    with pytest.raises(ConfigError, match="^mesh: "):
        validate(cfg)  # one process by default
    assert validate(cfg, 4) is cfg


# ---------------------------------------------------------------------- the environment
def test_each_environment_variable_is_read_by_read_environment(clean_env):
    assert read_environment() == Environment()
    values = {"RANK": "3", "WORLD_SIZE": "8", "TORCHFT_LIGHTHOUSE": " http://h:9 ",
              "REPLICA_GROUP_ID": "g2", "FLEXDEMO_FT_HOSTNAME": "10.0.0.5"}
    for name, value in values.items():
        clean_env.setenv(name, value)
    assert read_environment() == Environment(rank=3, world_size=8, lighthouse="http://h:9",
                                             replica_id="g2", hostname="10.0.0.5")
    clean_env.setenv("FLEXDEMO_REPLICA_ID", "f1")  # flexdemo's own name comes first
    assert read_environment().replica_id == "f1"
    # a mapping given instead of os.environ; blanks and bad numbers are unset
    assert read_environment({"RANK": "x", "WORLD_SIZE": "2", "TORCHFT_LIGHTHOUSE": "  "}) == \
        Environment(rank=0, world_size=2)


def _environment_reads(module) -> list[str]:
    """The functions of ``module`` that use ``os.environ`` or ``os.getenv``."""
    found = []
    for fn in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(fn, ast.FunctionDef):
            for node in ast.walk(fn):
                if (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
                        and isinstance(node.value, ast.Name) and node.value.id == "os"):
                    found.append(fn.name)
    return found


def test_the_config_modules_read_the_environment_only_in_read_environment():
    assert set(_environment_reads(config_checks)) == {"read_environment"}
    assert _environment_reads(config_files) == []


def test_resolve_fills_fault_tolerance_from_the_environment_it_is_given(clean_env):
    env = Environment(lighthouse="http://h:9", replica_id="g2", hostname="10.0.0.5")
    cfg = config_from_dict({"fault_tolerance": {"enabled": True, "replica_id": "mine"}})
    out, notes = resolve(cfg, {}, env)
    ft = out.fault_tolerance
    assert (ft.lighthouse, ft.replica_id, ft.hostname) == ("http://h:9", "mine", "10.0.0.5")
    assert notes == [] and cfg.fault_tolerance.lighthouse is None  # a new config
    off, _ = resolve(config_from_dict({}), {}, env)  # not enabled: the environment unused
    assert off.fault_tolerance == FaultToleranceConfig()
    with pytest.raises(ConfigError, match=r"^\$TORCHFT_LIGHTHOUSE: 'h:0' is not a lighthouse"):
        resolve(cfg, {}, Environment(lighthouse="h:0"))
    # load_config reads the mapping it is given, not os.environ
    clean_env.setenv("TORCHFT_LIGHTHOUSE", "http://other:1")
    loaded = load_config(None, ["fault_tolerance.enabled=true"],
                         environ={"TORCHFT_LIGHTHOUSE": "http://h:9", "WORLD_SIZE": "1"})
    assert loaded.fault_tolerance.lighthouse == "http://h:9"


# ---------------------------------------------------------------------- the warm-up
def test_a_long_warmup_is_cut_once_with_the_same_note(capsys, clean_env):
    cfg = load_config(None, ["train.steps=4", "train.warmup=20"])
    assert cfg.train.warmup == 4
    assert capsys.readouterr().err.splitlines() == [NOTE]
    assert load_config(None, ["train.steps=4"]).train.warmup == 4  # the default: silently
    assert load_config(None, ["train.steps=4", "train.warmup=3"]).train.warmup == 3
    assert capsys.readouterr().err == ""
    # rank 0 says it; every rank cuts it
    quiet = load_config(None, ["train.steps=4", "train.warmup=20"], environ={"RANK": "1"})
    assert quiet.train.warmup == 4 and capsys.readouterr().err == ""
    # an invalid config: the error, no note
    with pytest.raises(ConfigError, match="train.stop_at"):
        load_config(None, ["train.steps=4", "train.warmup=20", "train.stop_at=9"])
    assert capsys.readouterr().err == ""


def test_the_warmup_clamp_is_one_rule():
    """resolve stores TrainConfig.warmup_steps, which the trainer reads for a config built in
    Python as well."""
    assert TrainConfig(steps=4, warmup=20).warmup_steps == 4
    assert TrainConfig(steps=40, warmup=20).warmup_steps == 20
    data = {"train": {"steps": 4, "warmup": 20}}
    cfg = config_from_dict(data)
    out, notes = resolve(cfg, data)
    assert out.train.warmup == cfg.train.warmup_steps == 4 and cfg.train.warmup == 20
    assert ["flexdemo: note: " + n for n in notes] == [NOTE]


# ---------------------------------------------------------------------- [fault_tolerance]
def test_the_section_is_the_librarys_settings_plus_enabled():
    names = [f.name for f in dataclasses.fields(FaultToleranceConfig)]
    assert names == [f.name for f in dataclasses.fields(FaultToleranceSettings)] + ["enabled"]
    assert issubclass(FaultToleranceConfig, FaultToleranceSettings)


def test_unset_is_none_and_a_files_empty_or_zero_still_means_unset(clean_env):
    cfg = load_config(None, ["fault_tolerance.quorum_timeout=0", "fault_tolerance.lighthouse=''",
                             "fault_tolerance.max_failed_commits=0"])
    ft = cfg.fault_tolerance
    assert (ft.quorum_timeout, ft.lighthouse, ft.max_failed_commits) == (None, None, None)
    assert cfg == Config()
    assert "quorum_timeout" not in to_toml(cfg)  # unset: left out (TOML has no null)
    set_ = load_config(None, ["fault_tolerance.quorum_timeout=90"])
    assert set_.fault_tolerance.quorum_timeout == 90.0 and "quorum_timeout = 90.0" in \
        to_toml(set_)
    assert FaultToleranceConfig(quorum_timeout=0.0).quorum_timeout is None  # built in Python


def test_fault_tolerance_passes_the_settings_unchanged(clean_env):
    pytest.importorskip("torchft")
    from flexdemo.app.config.checks import fault_tolerance

    cfg = load_config(None, ["fault_tolerance.enabled=true", "fault_tolerance.lighthouse=h:1",
                             "fault_tolerance.replica_id=A", "fault_tolerance.timeout=20",
                             "fault_tolerance.hostname=10.0.0.1"])
    ft = fault_tolerance(cfg)
    assert ft is not None and ft.quorum_timeout == 20.0  # unset: the library's default
    cfg.fault_tolerance.quorum_timeout = 7.5
    ft = fault_tolerance(cfg)
    assert ft is not None and ft.quorum_timeout == 7.5
