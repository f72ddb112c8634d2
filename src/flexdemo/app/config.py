"""Training configuration: sections ``task``, ``strategy``, ``mesh``, ``train``,
``fault_tolerance`` and ``resume``.

A config is a TOML file (or YAML, with pyyaml installed, or JSON)::

    resume = false                 # true: continue from the latest checkpoint in train.out

    [task]
    name = "gpt"                   # gpt | vit | t5
    model = "mini"                 # the task's size preset

    [strategy]
    replicator = "demo"            # demo | full | none | random | striding | slicing | diloco
    optimizer = "sgd"              # sgd (sign-SGD with demo) | adamw | adam | lion | muon
    lr = 3e-3

    [strategy.replicator_kwargs]
    topk = 32

    [mesh]
    replicate = 2                  # omitted or "auto": from the world size
    shard = 2                      # omitted or "auto": ranks per node

    [train]
    steps = 200
    device = "auto"                # auto (CUDA when available) | cpu | cuda
    precision = "fp32"             # fp32 | bf16 (mixed precision, fp32 master weights)

Every key has a default (:class:`Config`); overrides ``section.key=value`` (the value in TOML
syntax, bare words are strings) replace single keys. An override that switches
``strategy.replicator`` (or ``strategy.optimizer``) to another one also drops the file's
``replicator_kwargs`` (``optimizer_kwargs``), which belong to the old one, unless the overrides
set them too. :func:`load_config` checks names, types
and ranges and raises :class:`ConfigError` with a one-line message that names the key and, for
a misspelt key, the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..ft.config import FaultTolerance
from ..mesh import mesh_shape
from ..optim import BASE_OPTIMIZERS, make_base_optimizer
from ..replicate import REPLICATORS, make_replicator
from .device import DEVICES, PRECISIONS, check_device
from .schedule import SCHEDULES
from .tasks import TASKS, task_presets

__all__ = ["MIN_CORPUS_BYTES", "Config", "ConfigError", "FaultToleranceConfig", "MeshConfig",
           "StrategyConfig", "TaskConfig", "TrainConfig", "apply_overrides", "check_mesh",
           "choices", "config_from_dict", "config_to_dict", "fault_tolerance", "load_config",
           "parse_override", "read_config_file", "to_toml", "validate"]


class ConfigError(ValueError):
    """An invalid configuration; the message is one line meant for the user."""


@dataclass
class TaskConfig:
    """What to train: the task, its model preset and data options."""

    name: str = "gpt"
    """``gpt`` (byte-level LM on the stdlib sources), ``vit`` (scikit-learn digits) or ``t5``
    (span corruption on the stdlib sources; needs transformers)."""
    model: str = "tiny"
    """Size preset of the task's model (gpt: tiny, mini, small; vit: tiny, small;
    t5: tiny, mini)."""
    corpus_bytes: int = 2_000_000
    """gpt, t5: bytes of training text read from the standard library's sources."""
    seq_len: int = 0
    """gpt, t5: tokens (bytes) per example; 0 keeps the preset's."""
    patch: int = 4
    """vit: patch edge in pixels (the images are 8x8: 4 gives 4 patches, 2 gives 16)."""
    val_fraction: float = 0.2
    """vit: fraction of the digits held out for validation (a fixed split)."""
    noise_density: float = 0.15
    """t5: fraction of each example's bytes masked out."""
    mean_span: float = 3.0
    """t5: mean length of a masked span."""


@dataclass
class StrategyConfig:
    """How replicas stay in sync: replicator, base optimizer and their settings."""

    replicator: str = "demo"
    replicator_kwargs: dict = field(default_factory=dict)
    optimizer: str = "sgd"
    optimizer_kwargs: dict = field(default_factory=dict)
    lr: float = 3e-3
    weight_decay: float = 0.0
    nonfinite: str = "raise"
    """``raise`` stops on a NaN/Inf gradient; ``skip`` skips such steps on every replica."""


@dataclass
class MeshConfig:
    """The ``(replicate, shard)`` layout of the ranks; ``None`` (omitted, or ``"auto"``)
    derives a size from the world size and the ranks per node."""

    replicate: int | None = None
    shard: int | None = None


@dataclass
class TrainConfig:
    """The training loop: length, batch, schedule, evaluation, checkpoints and outputs."""

    steps: int = 100
    batch: int = 8
    """Examples per rank per step."""
    warmup: int = 10
    """Steps of linear learning-rate warm-up, at most ``steps`` (a larger value is refused;
    left at its default, it is cut to ``steps``)."""
    schedule: str = "cosine"
    """``cosine`` (decays to ``min_lr`` x lr at the last step) or ``constant``."""
    min_lr: float = 0.1
    """Final learning rate of the cosine schedule, as a fraction of ``strategy.lr``."""
    eval_every: int = 50
    """Evaluate every N steps (0: only after the last step)."""
    eval_batches: int = 4
    """Validation batches per rank per evaluation (vit: 0 means the whole split)."""
    checkpoint_every: int = 0
    """Save a checkpoint every N steps and after the last one (0: never)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep (0: all)."""
    stop_at: int = 0
    """Stop after this step (with a checkpoint, if enabled) although ``steps`` is larger, for
    time-sliced jobs; 0: run to the end. The schedule still follows ``steps``."""
    log_every: int = 10
    """Progress line every N steps when no progress bar is shown."""
    seed: int = 0
    out: str = "runs/train"
    overwrite: bool = False
    """Allow a fresh run to replace the checkpoints of an earlier run in ``out``."""
    max_skipped: float = 0.25
    """With ``strategy.nonfinite = "skip"``: stop (one line, exit code 1) once more than this
    fraction of ``steps`` was skipped for NaN/Inf gradients, instead of finishing as if the
    run trained; 1 never stops."""
    resume_fallback: bool = True
    """On resume, a checkpoint whose files do not match their recorded digests is set aside
    (renamed ``<name>.damaged``) and the newest intact one is used, with one line saying so;
    ``false``: refuse to start instead (exit code 2)."""
    threads: int = 0
    """torch threads per rank (0: torch's default, which follows OMP_NUM_THREADS; torchrun and
    flexdemo cluster set that to 1)."""
    timeout: float = 0.0
    """Seconds a collective may wait for a peer before the run stops (0: FLEXDEMO_TIMEOUT if
    set, else the library's default, :data:`flexdemo.mesh.DEFAULT_TIMEOUT_SECONDS`)."""
    tensorboard: bool = True
    progress: bool = True
    device: str = "auto"
    """``auto`` (CUDA when available, else CPU), ``cpu`` or ``cuda`` (each rank on
    ``cuda:LOCAL_RANK``, NCCL between ranks; gloo on the CPU)."""
    precision: str = "fp32"
    """``fp32``, or ``bf16``: bf16 parameters for forward and backward, gradients reduced and
    kept in fp32 next to fp32 master weights (FSDP2 mixed precision; the replicators see
    fp32)."""


@dataclass
class FaultToleranceConfig:
    """Elastic replication on torchft (:class:`flexdemo.FaultTolerance`, docs/elastic.md):
    each node is a replica group of its own. Empty strings and zeros take the library's
    defaults (the environment variables it reads)."""

    enabled: bool = False
    """``true``: pass the settings below to :func:`flexdemo.prepare` as ``fault_tolerance``
    (needs torchft: ``pip install "flexdemo[ft]"``)."""
    lighthouse: str = ""
    """``http://host:port`` of the lighthouse ("": ``$TORCHFT_LIGHTHOUSE``)."""
    replica_id: str = ""
    """This node's replica group, the same on all its ranks ("": ``$FLEXDEMO_REPLICA_ID``,
    then ``$REPLICA_GROUP_ID``)."""
    min_replicas: int = 1
    """The fewest replica groups a step may commit with."""
    timeout: float = 60.0
    """Seconds a collective, the commit vote or a healing transfer may take."""
    quorum_timeout: float = 0.0
    """Seconds to wait for ``min_replicas`` groups (0: ``timeout``)."""
    hostname: str = ""
    """The address this group's peers reach it at ("": ``$FLEXDEMO_FT_HOSTNAME``, else the
    host name)."""
    max_failed_commits: int = 0
    """Consecutive steps that may fail to commit before the run stops (0: no limit)."""


@dataclass
class Config:
    """A whole training configuration."""

    task: TaskConfig = field(default_factory=TaskConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    resume: bool | str = False
    """``true``: continue from the newest checkpoint in ``train.out`` (fresh start if there is
    none); a path: that checkpoint (or the newest one under that folder)."""


MIN_CORPUS_BYTES = 10_000
"""The fewest bytes ``task.corpus_bytes`` (and ``flexdemo simulate --corpus-bytes``) may read:
validation takes a tenth of them and needs windows of a sequence's length."""

SECTIONS: dict[str, type] = {"task": TaskConfig, "strategy": StrategyConfig,
                             "mesh": MeshConfig, "train": TrainConfig,
                             "fault_tolerance": FaultToleranceConfig}
TOP_LEVEL = ("resume",)
def choices() -> dict[str, tuple[str, ...]]:
    """The valid values of the keys with a fixed set of them, read from the registries (tasks,
    base optimizers, schedules) when asked, so that an entry added there is valid here."""
    return {"task.name": tuple(TASKS), "strategy.optimizer": tuple(BASE_OPTIMIZERS),
            "strategy.replicator": tuple(sorted(REPLICATORS)),
            "strategy.nonfinite": ("raise", "skip"), "train.schedule": SCHEDULES,
            "train.device": DEVICES, "train.precision": PRECISIONS}


# ---------------------------------------------------------------------- reading files
def _toml_module():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise ConfigError("reading TOML on Python 3.10 needs tomli: pip install tomli") \
                from None
    return tomllib


def read_config_file(path: str | os.PathLike) -> dict:
    """The raw mapping in a ``.toml``, ``.yaml``/``.yml`` or ``.json`` file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist" if not p.exists()
                          else f"config path {str(p)!r} is not a file")
    suffix = p.suffix.lower()
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                          f"{e.start}); save the config file as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read it: {e.strerror or e}") from None
    if suffix == ".toml":
        tomllib = _toml_module()
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: invalid TOML: {e}") from None
    elif suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ModuleNotFoundError:
            raise ConfigError(f"{p}: YAML configs need pyyaml (pip install pyyaml), or write "
                              "the config as TOML") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: invalid YAML: {' '.join(str(e).split())}") from None
        data = {} if data is None else data
    elif suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: invalid JSON: {e}") from None
    else:
        raise ConfigError(f"{p}: unknown config format {suffix or '(no suffix)'!r}; use .toml, "
                          ".yaml/.yml or .json")
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the config must be a mapping of sections, got "
                          f"{type(data).__name__}")
    return data


# ---------------------------------------------------------------------- overrides
def parse_override(text: str) -> tuple[list[str], Any]:
    """``"train.steps=50"`` -> ``(["train", "steps"], 50)``.

    The value is read as a TOML value (numbers, booleans, quoted strings, ``[...]`` arrays,
    ``{...}`` inline tables); anything else is taken as a bare string.
    """
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value, e.g. "
                          "train.steps=50")
    key, raw = text.split("=", 1)
    key, raw = key.strip(), raw.strip()
    parts = key.split(".")
    if not key or any(not part for part in parts):
        raise ConfigError(f"override {text!r} has an empty key; write section.key=value, e.g. "
                          "strategy.replicator=full")
    try:
        value = _toml_module().loads(f"v = {raw}")["v"]
    except Exception:  # noqa: BLE001 - not TOML: a bare word is a string
        value = raw
    return parts, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """A copy of ``data`` with ``section.key=value`` overrides applied (checked later)."""
    out = json.loads(json.dumps(data, default=str)) if data else {}
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for i, part in enumerate(parts[:-1]):
            nxt = node.get(part)
            if not isinstance(nxt, dict):
                if nxt is not None:  # never replace a malformed section silently
                    where = ".".join(parts[: i + 1])
                    raise ConfigError(f"override {text!r}: {where} is {_describe(nxt)}, not a "
                                      f"table; fix [{where}] in the config file first")
                nxt = {}
                node[part] = nxt
            node = nxt
        node[parts[-1]] = value
    return out


# ---------------------------------------------------------------------- checking
def _suggest(key: str, valid: list[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return f" (did you mean '{prefix}{close[0]}'?)"
    return f"; valid keys: {', '.join(valid)}"


def _describe(value: Any) -> str:
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
        raise ConfigError(f"{where}: expected {wanted}, got {_describe(value)}")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {_describe(value)}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            return int(value)
        raise ConfigError(f"{where}: expected an integer, got {_describe(value)}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{where}: expected a finite number, got {value!r}")
            return float(value)
        raise ConfigError(f"{where}: expected a number, got {_describe(value)}")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {_describe(value)}")
    if annotation is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"{where}: expected a table (e.g. {{ topk = 16 }}), got "
                          f"{_describe(value)}")
    raise TypeError(f"unsupported config annotation {annotation!r}")  # a bug, not user input


def _type_name(t: Any) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string",
            dict: "a table"}.get(t, getattr(t, "__name__", str(t)))


def _build_section(cls: type, raw: Any, name: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"[{name}] must be a table of keys, got {_describe(raw)}")
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
        raise ConfigError(f"the config must be a mapping of sections, got {_describe(data)}")
    kwargs: dict[str, Any] = {}
    valid = list(SECTIONS) + list(TOP_LEVEL)
    for key, value in data.items():
        if key in SECTIONS:
            kwargs[key] = _build_section(SECTIONS[key], value, key)
        elif key == "resume":
            if not isinstance(value, (bool, str)):
                raise ConfigError(f"resume: expected true, false or a checkpoint path, got "
                                  f"{_describe(value)}")
            kwargs[key] = value
        else:
            what = "section" if isinstance(value, dict) else "key"
            raise ConfigError(f"unknown {what} '{key}'{_suggest(key, valid)}")
    cfg = Config(**kwargs)
    if "warmup" not in data.get("train", {}):  # the default warm-up never exceeds the run
        cfg.train.warmup = min(cfg.train.warmup, max(cfg.train.steps, 0))
    return cfg


def _check_choice(where: str, value: str, choices: tuple[str, ...] | list[str]) -> None:
    if value not in choices:
        hint = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.5)
        extra = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(f"{where}: unknown value {value!r}{extra}; choose one of "
                          f"{', '.join(choices)}")


def _check_range(where: str, ok: bool, need: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{where}: must be {need}, got {value!r}")


def validate(cfg: Config, world_size: int | None = None) -> Config:
    """Check values and their combinations; ``world_size`` (default ``WORLD_SIZE`` or 1)
    checks the mesh shape. Returns ``cfg``; raises :class:`ConfigError`."""
    t, s, m, tr = cfg.task, cfg.strategy, cfg.mesh, cfg.train
    for where, valid in choices().items():
        section, key = where.split(".")
        _check_choice(where, getattr(getattr(cfg, section), key), valid)
    _check_choice("task.model", t.model, task_presets(t.name))
    _check_range("task.corpus_bytes", t.corpus_bytes >= MIN_CORPUS_BYTES,
                 f"at least {MIN_CORPUS_BYTES}", t.corpus_bytes)
    _check_range("task.seq_len", 0 <= t.seq_len <= 4096, "0 (preset) or 1..4096", t.seq_len)
    if t.name == "t5" and t.seq_len:
        _check_range("task.seq_len", t.seq_len >= 8, "at least 8 for t5", t.seq_len)
    _check_range("task.patch", t.patch in (1, 2, 4, 8), "a divisor of 8 (2 or 4)", t.patch)
    _check_range("task.val_fraction", 0.0 < t.val_fraction < 1.0, "between 0 and 1",
                 t.val_fraction)
    _check_range("task.noise_density", 0.0 < t.noise_density < 1.0, "between 0 and 1",
                 t.noise_density)
    _check_range("task.mean_span", t.mean_span >= 1.0, "at least 1", t.mean_span)

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
    if tr.warmup > tr.steps >= 1:  # a config's warm-up meant for longer runs: cut, with a note
        if os.environ.get("RANK", "0") == "0":
            print(f"flexdemo: note: train.warmup={tr.warmup} is longer than train.steps="
                  f"{tr.steps}; the warm-up is cut to {tr.steps} steps (set train.warmup to "
                  "choose another)", file=sys.stderr, flush=True)
        tr.warmup = tr.steps
    _check_range("train.log_every", tr.log_every >= 1, "an integer >= 1", tr.log_every)
    _check_range("train.stop_at", tr.stop_at <= tr.steps,
                 f"0 or at most train.steps={tr.steps}", tr.stop_at)
    _check_range("train.min_lr", 0.0 <= tr.min_lr <= 1.0, "between 0 and 1", tr.min_lr)
    _check_range("train.max_skipped", 0.0 <= tr.max_skipped <= 1.0, "between 0 and 1",
                 tr.max_skipped)
    _check_range("train.timeout", tr.timeout >= 0, "a number of seconds >= 0", tr.timeout)
    try:
        check_device(tr.device)
    except ValueError as e:
        raise ConfigError(f"train.device: {e}") from None
    if not tr.out.strip():
        raise ConfigError("train.out: must name an output folder, e.g. \"runs/gpt\"")
    if isinstance(cfg.resume, str) and not cfg.resume.strip():
        raise ConfigError("resume: give true, false or a checkpoint path")

    _check_fault_tolerance(cfg.fault_tolerance)

    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    check_mesh(m, world)
    return cfg


def _check_fault_tolerance(ft: FaultToleranceConfig) -> None:
    _check_range("fault_tolerance.min_replicas", ft.min_replicas >= 1, "an integer >= 1",
                 ft.min_replicas)
    _check_range("fault_tolerance.timeout", ft.timeout > 0, "a number of seconds > 0",
                 ft.timeout)
    _check_range("fault_tolerance.quorum_timeout", ft.quorum_timeout >= 0,
                 "a number of seconds >= 0 (0: fault_tolerance.timeout)", ft.quorum_timeout)
    _check_range("fault_tolerance.max_failed_commits", ft.max_failed_commits >= 0,
                 "an integer >= 0 (0: no limit)", ft.max_failed_commits)
    _check_range("fault_tolerance.replica_id", ":" not in ft.replica_id,
                 "a name without ':' (torchft appends ':<uuid>' to it)", ft.replica_id)


def fault_tolerance(cfg: Config) -> FaultTolerance | None:
    """The :class:`flexdemo.FaultTolerance` that ``[fault_tolerance]`` asks for (None when not
    enabled), its defaults read from the environment now; raises :class:`ConfigError` with
    one line (torchft missing, no lighthouse or replica id given or set)."""
    ft = cfg.fault_tolerance
    if not ft.enabled:
        return None
    try:
        return FaultTolerance(
            lighthouse=ft.lighthouse or None, replica_id=ft.replica_id or None,
            min_replicas=ft.min_replicas, timeout=ft.timeout,
            quorum_timeout=ft.quorum_timeout or None, hostname=ft.hostname or None,
            max_failed_commits=ft.max_failed_commits or None)
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


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                *, world_size: int | None = None) -> Config:
    """Read ``path`` (or start from the defaults), apply ``overrides`` and validate."""
    data = read_config_file(path) if path is not None else {}
    overrides = list(overrides or [])
    new = apply_overrides(data, overrides)
    # an override that switches the replicator (or optimizer) drops the file's kwargs for the
    # old one, unless the overrides give new kwargs
    keys = {".".join(parse_override(o)[0][:2]) for o in overrides}
    for name in ("replicator", "optimizer"):
        old_value = (data.get("strategy") or {}).get(name) if isinstance(data, dict) else None
        new_value = (new.get("strategy") or {}).get(name)
        if (f"strategy.{name}" in keys and f"strategy.{name}_kwargs" not in keys
                and old_value != new_value and isinstance(new["strategy"], dict)):
            new["strategy"].pop(f"{name}_kwargs", None)
    return validate(config_from_dict(new), world_size)


# ---------------------------------------------------------------------- writing
def config_to_dict(cfg: Config) -> dict:
    """The config as plain data (``None`` sizes become ``"auto"``)."""
    data = dataclasses.asdict(cfg)
    for key in ("replicate", "shard"):
        if data["mesh"][key] is None:
            data["mesh"][key] = "auto"
    return data


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def _toml_key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else json.dumps(k)


def to_toml(cfg: Config | dict) -> str:
    """The config as TOML text (readable back by :func:`load_config`)."""
    data = config_to_dict(cfg) if isinstance(cfg, Config) else cfg
    lines = [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in data.items()
             if not isinstance(v, dict)]
    for section, body in data.items():
        if not isinstance(body, dict):
            continue
        lines += ["", f"[{section}]"]
        lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in body.items()]
    return "\n".join(lines).lstrip("\n") + "\n"
