"""Small self-contained training tasks for examples, ``flexdemo train`` and benchmarks.

``gpt`` (byte-level GPT on the standard library's sources), ``vit`` (a small ViT on
scikit-learn's digits) and ``t5`` (span corruption with a tiny ``transformers`` T5; optional
extra ``t5``). Nothing is downloaded. :func:`build_task` makes one from a ``[task]`` config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .base import ShardSampler, Task, eval_indices
from .gpt import (
    GPT,
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
from .t5 import T5Task, have_transformers
from .text import ByteWindows, GPTTask
from .vit import PRESETS as VIT_PRESETS
from .vit import ViT, ViTConfig, ViTTask, vit_config


@dataclass(frozen=True)
class TaskSpec:
    """One entry of :data:`TASKS`: what the task is, its model presets, the ``[task]`` keys
    it reads, and how to build it from a ``[task]`` config."""

    about: str
    presets: tuple[str, ...]
    options: tuple[str, ...]
    build: Callable[[Any, int], Task]
    """``build(task_config, seed)``: the task, data loaded, model not built yet."""


# the tasks: adding one is one entry here (plus its module, and its new [task] keys, if any)
TASKS: dict[str, TaskSpec] = {
    "gpt": TaskSpec(
        "byte-level GPT on the standard library's sources", tuple(PRESETS),
        ("model", "corpus_bytes", "seq_len"),
        lambda c, seed: GPTTask(c.model, c.corpus_bytes, c.seq_len)),
    "vit": TaskSpec(
        "a small ViT on scikit-learn's digits", tuple(VIT_PRESETS),
        ("model", "patch", "val_fraction"),
        lambda c, seed: ViTTask(c.model, c.patch, c.val_fraction)),
    "t5": TaskSpec(
        "span corruption with a tiny transformers T5 (needs the t5 extra)", tuple(T5_PRESETS),
        ("model", "corpus_bytes", "seq_len", "noise_density", "mean_span"),
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


def build_task(cfg: Any, seed: int = 0) -> Task:
    """The task a ``[task]`` config describes (data loaded, model not built yet)."""
    return _spec(cfg.name).build(cfg, seed)


__all__ = ["GPT", "PRESETS", "TASKS", "TASK_NAMES", "ByteWindows", "GPTConfig", "GPTTask",
           "ShardSampler", "T5Task", "Task", "TaskSpec", "ViT", "ViTConfig", "ViTTask",
           "build_task", "data_generator", "eval_indices", "evaluate", "get_batch", "gpt_config",
           "have_transformers", "load_corpus", "num_params", "stdlib_files", "task_options",
           "task_presets", "vit_config"]
