"""Small self-contained training tasks for examples, ``flexdemo train`` and benchmarks.

``gpt`` (byte-level GPT on the standard library's sources), ``vit`` (a small ViT on
scikit-learn's digits) and ``t5`` (span corruption with a tiny ``transformers`` T5; optional
extra ``t5``). Nothing is downloaded. :func:`build_task` makes one from a ``[task]`` config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from .base import ShardSampler, Task, TaskConfig, eval_indices, must
from .gpt import (
    GPT,
    MIN_CORPUS_BYTES,
    PRESETS,
    GPTConfig,
    data_generator,
    evaluate,
    get_batch,
    gpt_config,
    load_corpus,
    num_params,
    stdlib_files,
)
from .t5 import PRESETS as T5_PRESETS
from .t5 import T5Task, T5TaskConfig, have_transformers
from .text import ByteWindows, GPTTask, GPTTaskConfig
from .vit import PRESETS as VIT_PRESETS
from .vit import ViT, ViTConfig, ViTTask, ViTTaskConfig, vit_config


@dataclass(frozen=True)
class TaskSpec:
    """One entry of :data:`TASKS`: what the task is, its model presets, its ``[task]``
    section (a :class:`TaskConfig` subclass: the keys it reads, their defaults and ranges),
    and how to build it from that section."""

    about: str
    presets: tuple[str, ...]
    config: type[TaskConfig]
    build: Callable[[Any, int], Task]
    """``build(task_config, seed)``: the task, data loaded, model not built yet."""

    @property
    def options(self) -> tuple[str, ...]:
        """The ``[task]`` keys the task reads, besides ``name``."""
        return tuple(f.name for f in fields(self.config) if f.name != "name")


# the tasks: adding one is one entry here, beside its module (which holds its [task] section)
TASKS: dict[str, TaskSpec] = {
    "gpt": TaskSpec(
        "byte-level GPT on the standard library's sources", tuple(PRESETS), GPTTaskConfig,
        lambda c, seed: GPTTask(c.model, c.corpus_bytes, c.seq_len)),
    "vit": TaskSpec(
        "a small ViT on scikit-learn's digits", tuple(VIT_PRESETS), ViTTaskConfig,
        lambda c, seed: ViTTask(c.model, c.patch, c.val_fraction)),
    "t5": TaskSpec(
        "span corruption with a tiny transformers T5 (needs the t5 extra)", tuple(T5_PRESETS),
        T5TaskConfig,
        lambda c, seed: T5Task(c.model, c.corpus_bytes, c.seq_len, c.noise_density,
                               c.mean_span, seed)),
}
TASK_NAMES = tuple(TASKS)


def _spec(name: str) -> TaskSpec:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    return TASKS[name]


def task_presets(name: str) -> tuple[str, ...]:
    """The model size presets of task ``name``."""
    return _spec(name).presets


def task_options(name: str) -> tuple[str, ...]:
    """The ``[task]`` keys task ``name`` reads (besides ``name``); an unknown task has none
    (its name is refused elsewhere, naming the tasks)."""
    return TASKS[name].options if name in TASKS else ()


def task_config(name: str, **values: Any) -> TaskConfig:
    """The ``[task]`` section of task ``name``: its defaults, with ``values`` set."""
    return _spec(name).config(name=name, **values)


def build_task(cfg: TaskConfig, seed: int = 0) -> Task:
    """The task a ``[task]`` section describes (data loaded, model not built yet)."""
    return _spec(cfg.name).build(cfg, seed)


__all__ = ["GPT", "MIN_CORPUS_BYTES", "PRESETS", "TASKS", "TASK_NAMES", "ByteWindows",
           "GPTConfig", "GPTTask", "GPTTaskConfig", "ShardSampler", "T5Task", "T5TaskConfig",
           "Task", "TaskConfig", "TaskSpec", "ViT", "ViTConfig", "ViTTask", "ViTTaskConfig",
           "build_task", "data_generator", "eval_indices", "evaluate", "get_batch", "gpt_config",
           "have_transformers", "load_corpus", "must", "num_params", "stdlib_files", "task_config",
           "task_options", "task_presets", "vit_config"]
