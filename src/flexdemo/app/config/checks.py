"""Checking a configuration, in three steps that :func:`~flexdemo.app.config.files.load_config`
runs in order: :func:`config_from_dict` builds the sections from raw data (names and types),
:func:`resolve` fills in what the file left open (the environment's values, read once by
:func:`read_environment`, and the warm-up cut to the run: the config's one clamp), and
:func:`validate` checks ranges and choices without changing or printing anything. Errors are
one-line :class:`~flexdemo.app.config.schema.ConfigError` messages that name the key and, for a
misspelt key, the closest valid one. :func:`fault_tolerance` builds the library's
:class:`flexdemo.FaultTolerance` from ``[fault_tolerance]``, the only place that does."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import types
import typing
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import torch

from ...ft.config import (
    HOSTNAME_ENV,
    LIGHTHOUSE_ENV,
    REPLICA_ID_ENVS,
    FaultTolerance,
    FaultToleranceSettings,
)
from ...mesh import mesh_shape
from ...optim import make_base_optimizer
from ...replicate import make_replicator
from ..device import check_device
from ..tasks import TASKS, TaskConfig, task_options, task_presets
from .schema import (
    SECTIONS,
    TOP_LEVEL,
    Config,
    ConfigError,
    FaultToleranceConfig,
    MeshConfig,
    StrategyConfig,
    choices,
)

__all__ = ["Environment", "check_mesh", "config_from_dict", "describe", "fault_tolerance",
           "read_environment", "resolve", "validate"]


def _suggest(key: str, valid: list[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return f" (did you mean '{prefix}{close[0]}'?)"
    return f"; valid keys: {', '.join(valid)}"


def describe(value: Any) -> str:
    """``value`` and its TOML kind, for a message: ``'x' (a string)``."""
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             dict: "a table", list: "an array"}
    return f"{value!r} ({names.get(type(value), type(value).__name__)})"


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check ``value`` against a field's annotation (int, float, str, bool, dict, unions)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if type(None) in options and (value is None or
                                      (isinstance(value, str) and value.lower() == "auto")):
            return None
        errors = []
        for opt in options:
            if opt is type(None):
                continue
            try:
                return _coerce(value, opt, where)
            except ConfigError as e:
                errors.append(e)
        wanted = " or ".join("'auto'" if o is type(None) else _type_name(o) for o in options)
        raise ConfigError(f"{where}: expected {wanted}, got {describe(value)}")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {describe(value)}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            return int(value)
        raise ConfigError(f"{where}: expected an integer, got {describe(value)}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{where}: expected a finite number, got {value!r}")
            return float(value)
        raise ConfigError(f"{where}: expected a number, got {describe(value)}")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {describe(value)}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected an array (e.g. [3]), got {describe(value)}")
        (item,) = typing.get_args(annotation)
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if annotation is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"{where}: expected a table (e.g. {{ topk = 16 }}), got "
                          f"{describe(value)}")
    raise TypeError(f"unsupported config annotation {annotation!r}")  # a bug, not user input


def _type_name(t: Any) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string",
            dict: "a table"}.get(t, getattr(t, "__name__", str(t)))


def _build_section(cls: type, raw: Any, name: str) -> Any:
    """``cls`` from the ``[name]`` table ``raw``; an unknown key names the fields of ``cls``."""
    if not isinstance(raw, dict):
        raise ConfigError(f"[{name}] must be a table of keys, got {describe(raw)}")
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        if key not in hints:
            raise ConfigError(f"unknown key '{name}.{key}'{_suggest(key, valid, name + '.')}")
        kwargs[key] = _coerce(value, hints[key], f"{name}.{key}")
    return cls(**kwargs)


def config_from_dict(data: dict) -> Config:
    """A :class:`Config` from a raw mapping: names and types are checked, ranges are not
    (see :func:`validate`)."""
    if not isinstance(data, dict):
        raise ConfigError(f"the config must be a mapping of sections, got {describe(data)}")
    kwargs: dict[str, Any] = {}
    valid = list(SECTIONS) + list(TOP_LEVEL)
    for key, value in data.items():
        if key == "task":
            kwargs[key] = _task_section(value)
        elif key in SECTIONS:
            kwargs[key] = _build_section(SECTIONS[key], value, key)
        elif key == "resume":
            if not isinstance(value, (bool, str)):
                raise ConfigError(f"resume: expected true, false or a checkpoint path, got "
                                  f"{describe(value)}")
            kwargs[key] = value
        else:
            what = "section" if isinstance(value, dict) else "key"
            raise ConfigError(f"unknown {what} '{key}'{_suggest(key, valid)}")
    return Config(**kwargs)


@dataclasses.dataclass(frozen=True)
class Environment:
    """The environment variables a config reads, read once by :func:`read_environment`."""

    rank: int = 0
    """``RANK``: only rank 0 prints the notes of :func:`resolve`."""
    world_size: int = 1
    """``WORLD_SIZE``: the ranks the mesh is checked for."""
    lighthouse: str | None = None
    """``$TORCHFT_LIGHTHOUSE``, for an enabled ``[fault_tolerance]`` without a lighthouse."""
    replica_id: str | None = None
    """``$FLEXDEMO_REPLICA_ID``, else ``$REPLICA_GROUP_ID``."""
    hostname: str | None = None
    """``$FLEXDEMO_FT_HOSTNAME``."""


def read_environment(environ: Mapping[str, str] | None = None) -> Environment:
    """The config's environment variables from ``environ`` (default ``os.environ``): the one
    place the configuration reads the environment. Unset or blank variables are ``None``."""
    env = os.environ if environ is None else environ

    def text(name: str) -> str | None:
        return env.get(name, "").strip() or None

    def number(name: str, default: int) -> int:
        try:
            return int(env.get(name, str(default)))
        except ValueError:
            return default

    replica = next((v for v in map(text, REPLICA_ID_ENVS) if v), None)
    return Environment(rank=number("RANK", 0), world_size=number("WORLD_SIZE", 1),
                       lighthouse=text(LIGHTHOUSE_ENV), replica_id=replica,
                       hostname=text(HOSTNAME_ENV))


def resolve(cfg: Config, given: Mapping[str, Any] | None = None,
            env: Environment | None = None) -> tuple[Config, list[str]]:
    """``cfg`` with what the file left open filled in, as a new config, and the notes for the
    user (printed by the caller, rank 0).

    ``given`` is the raw data ``cfg`` was built from: a ``train.warmup`` longer than
    ``train.steps`` is cut to the run (the config's one clamp, :attr:`TrainConfig.warmup_steps
    <flexdemo.app.config.schema.TrainConfig.warmup_steps>`), silently for the default, with a note
    when ``given`` sets it. ``env`` (:func:`read_environment`) fills an enabled
    ``[fault_tolerance]``'s unset lighthouse, replica id and hostname; a malformed
    ``$TORCHFT_LIGHTHOUSE`` is a :class:`ConfigError` naming it."""
    out = copy.deepcopy(cfg)
    notes = []
    tr = out.train
    if tr.warmup_steps != tr.warmup:
        train_given = (given or {}).get("train")
        if isinstance(train_given, dict) and "warmup" in train_given:
            notes.append(f"train.warmup={tr.warmup} is longer than train.steps={tr.steps}; the "
                         f"warm-up is cut to {tr.steps} steps (set train.warmup to choose "
                         "another)")
        tr.warmup = tr.warmup_steps
    ft = out.fault_tolerance
    if env is not None and ft.enabled:
        if ft.lighthouse is None and env.lighthouse is not None:
            _check_lighthouse(f"${LIGHTHOUSE_ENV}", env.lighthouse)
            ft.lighthouse = env.lighthouse
        ft.replica_id = ft.replica_id if ft.replica_id is not None else env.replica_id
        ft.hostname = ft.hostname if ft.hostname is not None else env.hostname
    return out, notes


def _task_section(raw: Any) -> TaskConfig:
    """The ``[task]`` table ``raw`` as its task's own section (the task's
    :attr:`~flexdemo.app.tasks.TaskSpec.config`); a key that only other tasks read is refused
    naming the keys this task takes."""
    if not isinstance(raw, dict):
        raise ConfigError(f"[task] must be a table of keys, got {describe(raw)}")
    name = _coerce(raw.get("name", TaskConfig.name), str, "task.name")
    _check_choice("task.name", name, tuple(TASKS))
    own = task_options(name)
    for key in raw:
        owners = [t for t in TASKS if key in task_options(t)]
        if key != "name" and key not in own and owners:
            raise ConfigError(
                f"task.{key}: the {name} task has no such setting (it is "
                f"{' and '.join(owners)}'s); the {name} task takes {', '.join(own)}: remove "
                f"task.{key}")
    return _build_section(TASKS[name].config, {**raw, "name": name}, "task")


def _check_choice(where: str, value: str, choices: tuple[str, ...] | list[str]) -> None:
    if value not in choices:
        hint = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.5)
        extra = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(f"{where}: unknown value {value!r}{extra}; choose one of "
                          f"{', '.join(choices)}")


def _check_range(where: str, ok: bool, need: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{where}: must be {need}, got {value!r}")


def validate(cfg: Config, world_size: int = 1) -> Config:
    """Check values and their combinations; ``world_size`` checks the mesh shape. Returns
    ``cfg``, unchanged: nothing is changed or printed (:func:`resolve` cuts a long warm-up,
    with a note); raises :class:`ConfigError`."""
    t, s, m, tr = cfg.task, cfg.strategy, cfg.mesh, cfg.train
    for where, valid in choices().items():
        section, key = where.split(".")
        _check_choice(where, getattr(getattr(cfg, section), key), valid)
    _check_choice("task.model", t.model, task_presets(t.name))
    wanted = TASKS[t.name].config
    if type(t) is not wanted:
        raise ConfigError(f"task: the {t.name} task's section is {wanted.__name__}, got "
                          f"{type(t).__name__}; build it with "
                          f"flexdemo.app.tasks.task_config({t.name!r}, ...)")
    try:
        t.check()
    except ValueError as e:
        raise ConfigError(str(e)) from None

    _check_range("strategy.lr", s.lr > 0, "a number > 0", s.lr)
    _check_range("strategy.weight_decay", s.weight_decay >= 0, "a number >= 0",
                 s.weight_decay)
    try:
        make_replicator(s.replicator, **s.replicator_kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"strategy.replicator_kwargs for {s.replicator!r}: {_one_line(e)} "
                          "(to drop kwargs meant for another replicator: "
                          "strategy.replicator_kwargs={})") from None
    _check_optimizer_kwargs(s)

    for name in ("steps", "batch"):
        _check_range(f"train.{name}", getattr(tr, name) >= 1, "an integer >= 1",
                     getattr(tr, name))
    for name in ("warmup", "eval_every", "eval_batches", "checkpoint_every",
                 "keep_checkpoints", "stop_at", "threads", "seed"):
        _check_range(f"train.{name}", getattr(tr, name) >= 0, "an integer >= 0",
                     getattr(tr, name))
    _check_range("train.log_every", tr.log_every >= 1, "an integer >= 1", tr.log_every)
    _check_range("train.stop_at", tr.stop_at <= tr.steps,
                 f"0 or at most train.steps={tr.steps}", tr.stop_at)
    _check_range("train.min_lr", 0.0 <= tr.min_lr <= 1.0, "between 0 and 1", tr.min_lr)
    _check_range("train.max_skipped", 0.0 <= tr.max_skipped <= 1.0, "between 0 and 1",
                 tr.max_skipped)
    _check_range("train.timeout", tr.timeout >= 0, "a number of seconds >= 0", tr.timeout)
    if tr.batches == "balanced" and "pace" in s.replicator_kwargs:
        raise ConfigError("train.batches='balanced' sizes the batches of exchanges at every "
                          "step; a DiLoCo pace (strategy.replicator_kwargs.pace) gives each "
                          "replica its own steps instead: choose one")
    if tr.pace_budget != "steps" and "pace" not in s.replicator_kwargs:
        raise ConfigError(f"train.pace_budget={tr.pace_budget!r} sets the length of a run with "
                          "a pace, and this strategy has none (strategy.replicator_kwargs.pace):"
                          " leave train.pace_budget at 'steps'")
    if cfg.fault_tolerance.enabled and "pace" in s.replicator_kwargs:
        raise ConfigError("flexdemo train does not run a DiLoCo pace under fault tolerance yet "
                          "(it counts a paced run in the syncs of a fixed group); the library "
                          "does (flexdemo.prepare(..., fault_tolerance=...) with pace="
                          "'adaptive', docs/stragglers.md): drop strategy.replicator_kwargs.pace"
                          " or fault_tolerance.enabled")
    _check_range("train.slowdown", tr.slowdown >= 1.0, "a factor >= 1 (1: off)", tr.slowdown)
    _check_range("train.slow_ranks", all(0 <= r < world_size for r in tr.slow_ranks)
                 and len(set(tr.slow_ranks)) == len(tr.slow_ranks),
                 f"distinct ranks of this job, 0..{world_size - 1}", tr.slow_ranks)
    try:
        check_device(tr.device)
    except ValueError as e:
        raise ConfigError(f"train.device: {e}") from None
    if not tr.out.strip():
        raise ConfigError("train.out: must name an output folder, e.g. \"runs/gpt\"")
    if isinstance(cfg.resume, str) and not cfg.resume.strip():
        raise ConfigError("resume: give true, false or a checkpoint path")

    _check_fault_tolerance(cfg.fault_tolerance)

    check_mesh(m, world_size)
    return cfg


def _check_fault_tolerance(ft: FaultToleranceConfig) -> None:
    _check_range("fault_tolerance.min_replicas", ft.min_replicas >= 1, "an integer >= 1",
                 ft.min_replicas)
    _check_range("fault_tolerance.timeout", ft.timeout > 0, "a number of seconds > 0",
                 ft.timeout)
    if ft.quorum_timeout is not None:  # None: unset (omitted, or 0)
        _check_range("fault_tolerance.quorum_timeout", ft.quorum_timeout > 0,
                     "a number of seconds >= 0 (0: fault_tolerance.timeout)", ft.quorum_timeout)
    if ft.max_failed_commits is not None:
        _check_range("fault_tolerance.max_failed_commits", ft.max_failed_commits > 0,
                     "an integer >= 0 (0: no limit)", ft.max_failed_commits)
    if ft.replica_id is not None:
        _check_range("fault_tolerance.replica_id", ":" not in ft.replica_id,
                     "a name without ':' (torchft appends ':<uuid>' to it)", ft.replica_id)
    if ft.lighthouse:
        _check_lighthouse("fault_tolerance.lighthouse", ft.lighthouse)


def lighthouse_problem(address: str) -> str | None:
    """What is wrong with a lighthouse address (``http://host:port``, or ``host:port``, to
    which :class:`flexdemo.FaultTolerance` adds ``http://``), or None."""
    url = address.strip() if "://" in address else f"http://{address.strip()}"
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError: not a number, or out of range
    except ValueError:
        return "its port must be a number from 1 to 65535"
    if parts.scheme not in ("http", "https"):
        return "it must start with http:// or https://"
    if not parts.hostname:
        return "it names no host"
    if port == 0:
        return "its port must be a number from 1 to 65535"
    return None


def _check_lighthouse(where: str, address: str) -> None:
    problem = lighthouse_problem(address)
    if problem is not None:
        raise ConfigError(f"{where}: {address!r} is not a lighthouse address: {problem}; give "
                          "http://host:port, where torchft_lighthouse listens")


def fault_tolerance(cfg: Config) -> FaultTolerance | None:
    """The :class:`flexdemo.FaultTolerance` that ``[fault_tolerance]`` asks for (None when not
    enabled): the one place the app builds it, its settings passed as they are (the section
    is the library's :class:`~flexdemo.ft.config.FaultToleranceSettings`). Raises
    :class:`ConfigError` with one line (torchft missing, no lighthouse or replica id)."""
    ft = cfg.fault_tolerance
    if not ft.enabled:
        return None
    settings = {f.name: getattr(ft, f.name) for f in dataclasses.fields(FaultToleranceSettings)}
    try:
        return FaultTolerance(**settings)
    except (ValueError, ModuleNotFoundError) as e:  # TorchFTMissingError: the extra to install
        raise ConfigError(f"fault_tolerance: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _check_optimizer_kwargs(s: StrategyConfig) -> None:
    if "lr" in s.optimizer_kwargs:
        raise ConfigError("strategy.optimizer_kwargs: give the learning rate as strategy.lr")
    if "weight_decay" in s.optimizer_kwargs and s.weight_decay:
        raise ConfigError("strategy: weight decay is given twice (strategy.weight_decay and "
                          "strategy.optimizer_kwargs.weight_decay); keep one")
    probe = torch.nn.Parameter(torch.zeros(1))
    kw = dict(s.optimizer_kwargs)
    if s.optimizer == "muon":  # names of the model's parameters: checked by prepare()
        kw.pop("muon_params", None)
    try:
        make_base_optimizer(s.optimizer, [probe], 1e-3, **kw)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"strategy.optimizer_kwargs for {s.optimizer!r}: {_one_line(e)}") \
            from None


def check_mesh(mesh: MeshConfig, world: int) -> tuple[int, int]:
    """Resolve the mesh for ``world`` ranks; raises :class:`ConfigError` when impossible."""
    for name in ("replicate", "shard"):
        v = getattr(mesh, name)
        if v is not None and v < 1:
            raise ConfigError(f"mesh.{name}: must be an integer >= 1 or \"auto\", got {v!r}")
    try:
        return mesh_shape(world, mesh.replicate, mesh.shard)
    except ValueError as e:
        hint = (" (this is a single process; launch more ranks with torchrun or flexdemo "
                "cluster, or leave mesh.replicate and mesh.shard at \"auto\")"
                if world == 1 else "")
        raise ConfigError(f"mesh: {_one_line(e)}{hint}") from None
