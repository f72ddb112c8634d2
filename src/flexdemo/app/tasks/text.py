"""The GPT task: next-byte prediction on the standard library's sources, cut into windows.

The corpus is :func:`flexdemo.app.tasks.gpt.load_corpus` (files split into train and validation by
path). Training items are the non-overlapping windows of ``seq_len + 1`` bytes (consecutive
windows share one byte: the last target of one is the first input of the next); each rank
trains on its own share of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .base import Task, TaskConfig, must, summed_eval_loss
from .gpt import GPT, MIN_CORPUS_BYTES, gpt_config, load_corpus


@dataclass
class GPTTaskConfig(TaskConfig):
    """The gpt task's ``[task]`` keys."""

    name: str = "gpt"
    corpus_bytes: int = 2_000_000
    """Bytes of training text read from the standard library's sources."""
    seq_len: int = 0
    """Tokens (bytes) per example; 0 keeps the preset's."""

    def check(self) -> None:
        must("corpus_bytes", self.corpus_bytes >= MIN_CORPUS_BYTES,
             f"at least {MIN_CORPUS_BYTES}", self.corpus_bytes)
        must("seq_len", 0 <= self.seq_len <= 4096, "0 (preset) or 1..4096", self.seq_len)


class ByteWindows:
    """Non-overlapping windows of ``length`` bytes (stride ``length - 1``) over a uint8
    tensor."""

    def __init__(self, data: torch.Tensor, length: int) -> None:
        if data.numel() < length:
            raise ValueError(f"{data.numel()} bytes of text are too few for windows of "
                             f"{length}; raise task.corpus_bytes")
        self.data, self.length = data, length
        self.count = (data.numel() - 1) // (length - 1)

    def __len__(self) -> int:
        return self.count

    def get(self, indices: torch.Tensor) -> torch.Tensor:
        """``(len(indices), length)`` int64 windows."""
        starts = indices.long() * (self.length - 1)
        return self.data[starts[:, None] + torch.arange(self.length)].long()


class GPTTask(Task):
    """Byte-level GPT (:class:`flexdemo.app.tasks.gpt.GPT`) on the stdlib sources."""

    name = "gpt"

    def __init__(self, model: str = "tiny", corpus_bytes: int = 2_000_000,
                 seq_len: int = 0) -> None:
        overrides = {"seq_len": seq_len} if seq_len else {}
        self.cfg = gpt_config(model, **overrides)
        self.preset = model
        self.train_data, self.val_data = load_corpus(corpus_bytes)
        self.train_windows = ByteWindows(self.train_data, self.cfg.seq_len + 1)
        self.val_windows = ByteWindows(self.val_data, self.cfg.seq_len + 1)

    def build_model(self) -> nn.Module:
        return GPT(self.cfg)

    @property
    def num_train_items(self) -> int:
        return len(self.train_windows)

    def train_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.train_windows.get(indices)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return model(x, y)

    def batch_tokens(self, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
        """The predicted tokens: every target of the batch."""
        return int(batch[1].numel())

    def evaluate(self, model: nn.Module, rank: int, world: int, batches: int,
                 batch_size: int) -> dict[str, float]:
        def batch_loss(idx: torch.Tensor) -> tuple[float, int]:
            w = self.val_windows.get(idx).to(self.device)
            return float(model(w[:, :-1], w[:, 1:])), w[:, 1:].numel()

        return summed_eval_loss(model, len(self.val_windows), rank, world, batches, batch_size,
                                batch_loss)

    def describe(self) -> str:
        c = self.cfg
        return (f"gpt/{self.preset}: byte-level GPT ({c.n_layer} layers, d_model {c.d_model}, "
                f"context {c.seq_len}) on {self.train_data.numel() / 1e6:.1f} MB of stdlib "
                f"sources ({self.num_train_items} training windows), "
                f"{self.val_data.numel() / 1e6:.2f} MB held out")
