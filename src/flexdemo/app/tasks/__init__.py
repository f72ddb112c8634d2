"""Small self-contained training tasks for examples, ``flexdemo train`` and benchmarks.

``gpt`` (byte-level GPT on the standard library's sources), ``vit`` (a small ViT on
scikit-learn's digits) and ``t5`` (span corruption with a tiny ``transformers`` T5; optional
extra ``t5``). Nothing is downloaded. :func:`build_task` makes one from a ``[task]`` config.
"""

from __future__ import annotations

from typing import Any

from .base import ShardSampler, Task
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
from .text import GPTTask
from .vit import PRESETS as VIT_PRESETS
from .vit import ViT, ViTConfig, ViTTask, vit_config

TASK_NAMES = ("gpt", "vit", "t5")


def task_presets(name: str) -> tuple[str, ...]:
    """The model size presets of task ``name``."""
    table = {"gpt": PRESETS, "vit": VIT_PRESETS, "t5": T5_PRESETS}
    if name not in table:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASK_NAMES)}")
    return tuple(table[name])


def build_task(cfg: Any, seed: int = 0) -> Task:
    """The task a ``[task]`` config describes (data loaded, model not built yet)."""
    if cfg.name == "gpt":
        return GPTTask(cfg.model, cfg.corpus_bytes, cfg.seq_len)
    if cfg.name == "vit":
        return ViTTask(cfg.model, cfg.patch, cfg.val_fraction)
    if cfg.name == "t5":
        return T5Task(cfg.model, cfg.corpus_bytes, cfg.seq_len, cfg.noise_density,
                      cfg.mean_span, seed)
    raise ValueError(f"unknown task {cfg.name!r}; choose one of {', '.join(TASK_NAMES)}")


__all__ = ["GPT", "PRESETS", "TASK_NAMES", "GPTConfig", "GPTTask", "ShardSampler", "T5Task",
           "Task", "ViT", "ViTConfig", "ViTTask", "build_task", "data_generator", "evaluate",
           "get_batch", "gpt_config", "have_transformers", "load_corpus", "num_params",
           "stdlib_files", "task_presets", "vit_config"]
