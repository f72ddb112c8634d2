"""Reading and writing configuration files (TOML, YAML, JSON), ``section.key=value``
overrides, and :func:`load_config`, which puts them together with the checks: raw data, then
one typed tree (:func:`~flexdemo.app.config.checks.config_from_dict`), resolved once against
the environment (:func:`~flexdemo.app.config.checks.resolve`), then checked
(:func:`~flexdemo.app.config.checks.validate`)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..tasks import task_options
from .checks import config_from_dict, describe, read_environment, resolve, validate
from .schema import Config, ConfigError

__all__ = ["apply_overrides", "config_to_dict", "load_config", "parse_override",
           "read_config_file", "to_toml"]


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
    except Exception:  # not TOML: a bare word is a string
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
                    raise ConfigError(f"override {text!r}: {where} is {describe(nxt)}, not a "
                                      f"table; fix [{where}] in the config file first")
                nxt = {}
                node[part] = nxt
            node = nxt
        node[parts[-1]] = value
    return out


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                *, world_size: int | None = None,
                environ: Mapping[str, str] | None = None) -> Config:
    """Read ``path`` (or start from the defaults), apply ``overrides``, resolve against
    ``environ`` (default ``os.environ``, read once; ``world_size`` default ``WORLD_SIZE``)
    and validate. The notes of :func:`~flexdemo.app.config.checks.resolve` go to stderr on
    rank 0."""
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
    # likewise an override that switches the task drops the file's keys of the old task
    old_task = (data.get("task") or {}).get("name") if isinstance(data, dict) else None
    task = new.get("task")
    if "task.name" in keys and isinstance(task, dict) and task.get("name") != old_task:
        own = task_options(str(task.get("name")))
        for key in [k for k in task if k != "name" and k not in own and f"task.{k}" not in keys]:
            task.pop(key)
    env = read_environment(environ)
    cfg, notes = resolve(config_from_dict(new), new, env)
    validate(cfg, env.world_size if world_size is None else world_size)
    if env.rank == 0:
        for note in notes:
            print(f"flexdemo: note: {note}", file=sys.stderr, flush=True)
    return cfg


# ---------------------------------------------------------------------- writing
def config_to_dict(cfg: Config) -> dict:
    """The config as plain data (``None`` sizes become ``"auto"``; other unset keys, ``None``,
    are left out, as TOML has no null). The run secret is never written out: a rerun reads
    it from ``$FLEXDEMO_SECRET`` or a config of its own."""
    data = dataclasses.asdict(cfg)  # [task]: the fields of the task's own section
    data["fault_tolerance"].pop("secret", None)
    for key in ("replicate", "shard"):
        if data["mesh"][key] is None:
            data["mesh"][key] = "auto"
    return {k: {kk: vv for kk, vv in v.items() if vv is not None} if isinstance(v, dict) else v
            for k, v in data.items()}


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
