"""T5 span-corruption pre-training on the standard library's sources (needs ``transformers``).

The model is ``transformers.T5ForConditionalGeneration`` built from a small local
``T5Config`` (never ``from_pretrained``: nothing is downloaded). Tokens are bytes, as in
ByT5: ids 0, 1, 2 are pad, end-of-sequence and unknown, byte ``b`` is ``b + 3``, and
``sentinels`` sentinel ids follow the 259 byte ids.

Span corruption (Raffel et al. 2020): of each example of ``seq_len`` bytes, ``noise_density``
is masked in spans of mean length ``mean_span``; the input keeps the rest with one sentinel per
masked span, the target lists each sentinel followed by the bytes it hides. The masks are drawn
from the example's index and the seed, so a resumed run sees the same examples. Input and
target lengths are fixed by ``seq_len`` (no padding).
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .base import Task, must, summed_eval_loss
from .gpt import load_corpus
from .text import ByteWindows, GPTTaskConfig

PAD, EOS, UNK = 0, 1, 2
BYTE_OFFSET = 3
SENTINEL0 = BYTE_OFFSET + 256

MISSING_TRANSFORMERS = ("the t5 task needs the optional extra 't5' (transformers): "
                        "pip install 'flexdemo[t5]'")


def have_transformers() -> bool:
    """True when ``transformers`` can be imported."""
    return importlib.util.find_spec("transformers") is not None


@dataclass
class T5TaskConfig(GPTTaskConfig):
    """The t5 task's ``[task]`` keys: the gpt task's text keys and the masking."""

    name: str = "t5"
    noise_density: float = 0.15
    """Fraction of each example's bytes masked out."""
    mean_span: float = 3.0
    """Mean length of a masked span."""

    def check(self) -> None:
        super().check()
        if self.seq_len:
            must("seq_len", self.seq_len >= 8, "at least 8 for t5", self.seq_len)
        must("noise_density", 0.0 < self.noise_density < 1.0, "between 0 and 1",
             self.noise_density)
        must("mean_span", self.mean_span >= 1.0, "at least 1", self.mean_span)


@dataclass(frozen=True)
class T5Size:
    """Shape of the T5 model (see ``transformers.T5Config``)."""

    d_model: int = 64
    d_ff: int = 256
    d_kv: int = 16
    num_heads: int = 4
    num_layers: int = 2
    num_decoder_layers: int = 2
    seq_len: int = 128


PRESETS: dict[str, T5Size] = {
    "tiny": T5Size(),                                                         # ~0.25M params
    "mini": T5Size(d_model=128, d_ff=512, d_kv=32, num_heads=4, num_layers=4,
                   num_decoder_layers=4),                                      # ~1.9M params
}


def t5_config(name: str, sentinels: int):
    """A ``transformers.T5Config`` for a preset and a byte vocabulary with ``sentinels``."""
    if name not in PRESETS:
        raise ValueError(f"unknown T5 preset {name!r}; choose one of {sorted(PRESETS)}")
    try:
        from transformers import T5Config
    except ModuleNotFoundError:
        raise ModuleNotFoundError(MISSING_TRANSFORMERS) from None
    s = PRESETS[name]
    return T5Config(vocab_size=SENTINEL0 + sentinels, d_model=s.d_model, d_ff=s.d_ff,
                    d_kv=s.d_kv, num_heads=s.num_heads, num_layers=s.num_layers,
                    num_decoder_layers=s.num_decoder_layers, dropout_rate=0.0,
                    feed_forward_proj="relu", pad_token_id=PAD, eos_token_id=EOS,
                    decoder_start_token_id=PAD, tie_word_embeddings=True, use_cache=False)


def _segment_lengths(num_items: int, num_segments: int, gen: torch.Generator) -> torch.Tensor:
    """Random split of ``num_items`` into ``num_segments`` non-empty parts."""
    cuts = torch.randperm(num_items - 1, generator=gen)[:num_segments - 1] + 1
    bounds = torch.cat([torch.tensor([0]), cuts.sort().values, torch.tensor([num_items])])
    return bounds.diff()


def span_counts(length: int, noise_density: float, mean_span: float) -> tuple[int, int]:
    """``(noise tokens, spans)`` for an example of ``length`` tokens."""
    num_noise = min(max(int(round(length * noise_density)), 1), length - 1)
    num_spans = max(min(int(round(num_noise / mean_span)), num_noise, length - num_noise), 1)
    return num_noise, num_spans


def noise_mask(length: int, noise_density: float, mean_span: float,
               gen: torch.Generator) -> torch.Tensor:
    """Boolean mask of the masked positions: alternating kept/masked spans, starting kept."""
    num_noise, num_spans = span_counts(length, noise_density, mean_span)
    noise = _segment_lengths(num_noise, num_spans, gen)
    keep = _segment_lengths(length - num_noise, num_spans, gen)
    lengths = torch.stack([keep, noise], dim=1).reshape(-1)
    flags = torch.tensor([False, True]).repeat(num_spans)
    return flags.repeat_interleave(lengths)


def corrupt(tokens: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` for one example: masked spans become sentinels in the input;
    the labels list each sentinel with the tokens it replaced; both end with EOS."""
    starts = mask & ~torch.cat([torch.tensor([False]), mask[:-1]])
    sentinel = SENTINEL0 + starts.long().cumsum(0) - 1
    inp = torch.where(starts, sentinel, tokens)[~mask | starts]
    # per position: (sentinel if a span starts here, the token if it is masked), -1 = nothing
    pairs = torch.stack([torch.where(starts, sentinel, -1), torch.where(mask, tokens, -1)], 1)
    tgt = pairs.reshape(-1)
    eos = torch.tensor([EOS])
    return torch.cat([inp, eos]), torch.cat([tgt[tgt >= 0], eos])


class T5Task(Task):
    """Span-corruption pre-training of a tiny T5 on the stdlib's bytes (loss per target
    token)."""

    name = "t5"

    def __init__(self, model: str = "tiny", corpus_bytes: int = 2_000_000, seq_len: int = 0,
                 noise_density: float = 0.15, mean_span: float = 3.0, seed: int = 0) -> None:
        if not have_transformers():
            raise ModuleNotFoundError(MISSING_TRANSFORMERS)
        # A T5Block returns its attention position bias, a slice (a view) that later blocks
        # only read; FSDP2 warns about views out of sharded modules because an in-place op on
        # them would skip its hook. None happens here (per-block sharding gives the same losses
        # as sharding the model whole), so that warning is silenced.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPT5Block\) "
                                r"returned a view tensor", category=UserWarning)
        self.preset = model
        self.seq_len = seq_len or PRESETS[model].seq_len
        self.noise_density, self.mean_span, self.seed = noise_density, mean_span, seed
        _, spans = span_counts(self.seq_len, noise_density, mean_span)
        self.config = t5_config(model, sentinels=spans)
        self.train_data, self.val_data = load_corpus(corpus_bytes)
        # windows of seq_len bytes (ByteWindows' stride is length - 1; +1 keeps them disjoint)
        self.train_windows = ByteWindows(self.train_data, self.seq_len + 1)
        self.val_windows = ByteWindows(self.val_data, self.seq_len + 1)

    def build_model(self) -> nn.Module:
        from transformers import T5ForConditionalGeneration

        model = T5ForConditionalGeneration(self.config)
        # transformers draws the (tied) embedding and output head with std 1, which starts the
        # loss near 30; std 0.02 starts it near log(vocabulary), like the other tasks
        nn.init.normal_(model.shared.weight, std=0.02)
        return model

    @property
    def num_train_items(self) -> int:
        return len(self.train_windows)

    def _examples(self, windows: ByteWindows, indices: torch.Tensor,
                  salt: int) -> tuple[torch.Tensor, torch.Tensor]:
        raw = windows.get(indices)[:, :self.seq_len] + BYTE_OFFSET
        inputs, labels = [], []
        for i, tokens in zip(indices.tolist(), raw):
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + salt) * 2**24 + i)
            mask = noise_mask(self.seq_len, self.noise_density, self.mean_span, gen)
            x, y = corrupt(tokens, mask)
            inputs.append(x)
            labels.append(y)
        return torch.stack(inputs), torch.stack(labels)

    def train_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._examples(self.train_windows, indices, salt=1)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return model(input_ids=x, labels=y).loss

    def evaluate(self, model: nn.Module, rank: int, world: int, batches: int,
                 batch_size: int) -> dict[str, float]:
        def batch_loss(idx: torch.Tensor) -> tuple[float, int]:
            x, y = self._examples(self.val_windows, idx, salt=2)
            x, y = x.to(self.device), y.to(self.device)
            return float(model(input_ids=x, labels=y).loss), y.numel()

        return summed_eval_loss(model, len(self.val_windows), rank, world, batches, batch_size,
                                batch_loss)

    def shard_units(self) -> Callable[[nn.Module], list[nn.Module]]:
        """The encoder's and decoder's ``T5Block``s (not the layers nested inside them)."""
        def blocks(model: nn.Module) -> list[nn.Module]:
            t5: Any = model  # a T5ForConditionalGeneration
            return [*t5.encoder.block, *t5.decoder.block]

        return blocks

    def describe(self) -> str:
        c = self.config
        noise, spans = span_counts(self.seq_len, self.noise_density, self.mean_span)
        return (f"t5/{self.preset}: T5 ({c.num_layers}+{c.num_decoder_layers} layers, d_model "
                f"{c.d_model}, byte vocabulary {c.vocab_size}) span corruption on stdlib "
                f"sources: {self.seq_len} bytes per example, {noise} masked in {spans} spans, "
                f"{self.num_train_items} training examples")
