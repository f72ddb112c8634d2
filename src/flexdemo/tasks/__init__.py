"""Small self-contained training tasks for examples and benchmarks."""

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

__all__ = ["GPT", "PRESETS", "GPTConfig", "data_generator", "evaluate", "get_batch",
           "gpt_config", "load_corpus", "num_params", "stdlib_files"]
