"""A small byte-level GPT and a corpus that needs no download (the stdlib's own sources).

The model is a pre-LayerNorm transformer: token and learned position embeddings, ``n_layer``
blocks (causal self-attention with ``F.scaled_dot_product_attention``, then a 4x GELU MLP) in
an ``nn.ModuleList`` called ``blocks`` (one FSDP unit each under :func:`flexdemo.prepare`), a
final LayerNorm and an untied output head over the 256 byte values.

The corpus is the ``.py`` files of the running Python's standard library, sorted by path and
split by file: every 10th file goes to validation. Files are concatenated as raw bytes.
"""

from __future__ import annotations

import functools
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model: vocabulary, depth, heads, width and context length."""

    vocab: int = 256
    n_layer: int = 6
    n_head: int = 6
    d_model: int = 384
    seq_len: int = 128

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by "
                             f"n_head={self.n_head}")


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=3, n_head=4, d_model=64, seq_len=64),      # ~0.19M parameters
    "mini": GPTConfig(n_layer=4, n_head=4, d_model=128, seq_len=128),    # ~0.87M parameters
    "small": GPTConfig(n_layer=6, n_head=6, d_model=384, seq_len=128),   # ~10.9M parameters
}


def gpt_config(name: str, **overrides) -> GPTConfig:
    """A preset configuration (``"tiny"``, ``"mini"``, ``"small"``), optionally modified."""
    if name not in PRESETS:
        raise ValueError(f"unknown GPT preset {name!r}; choose one of {sorted(PRESETS)}")
    cfg = PRESETS[name]
    if overrides:
        cfg = GPTConfig(**{**cfg.__dict__, **overrides})
    return cfg


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                 nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Byte-level GPT; ``forward(x, y=None)`` returns logits, or the mean loss when ``y`` is
    given."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.apply(self._init)
        # GPT-2 style: scale the residual projections down with depth
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        t = x.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=x.device)
        h = self.tok(x) + self.pos(pos)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.ln_f(h))
        if y is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def num_params(model: nn.Module) -> int:
    """Total number of parameter elements (global sizes, also for sharded DTensors)."""
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------- corpus
def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted by relative path (no site-packages)."""
    return list(_stdlib_files())


@functools.cache
def _stdlib_files() -> tuple[Path, ...]:
    """The walk behind :func:`stdlib_files`, once per process (a few seconds on a slow disk)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py")
             if "site-packages" not in p.relative_to(root).parts and p.is_file()]
    return tuple(sorted(files, key=lambda p: p.relative_to(root).as_posix()))


MIN_CORPUS_BYTES = 10_000
"""The fewest training bytes a task (``task.corpus_bytes``, ``flexdemo simulate
--corpus-bytes``) may read: validation takes a tenth of them and needs windows of a sequence's
length."""


def load_corpus(max_bytes: int = 4_000_000, val_bytes: int | None = None,
                val_every: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, val)`` uint8 tensors of stdlib source bytes.

    Every ``val_every``-th file (by sorted path) goes to validation. Reading stops once the
    training split holds ``max_bytes`` and validation ``val_bytes`` (default
    ``max_bytes // 10``); both are then cut to those sizes.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    val_bytes = max(max_bytes // 10, 1) if val_bytes is None else val_bytes
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    sizes = {"train": 0, "val": 0}
    caps = {"train": max_bytes, "val": val_bytes}
    for i, path in enumerate(stdlib_files()):
        split = "val" if i % val_every == val_every - 1 else "train"
        if sizes[split] >= caps[split]:
            if all(sizes[s] >= caps[s] for s in caps):
                break
            continue
        try:
            blob = path.read_bytes()
        except OSError:
            continue
        parts[split].append(blob)
        sizes[split] += len(blob)
    out = []
    for split in ("train", "val"):
        blob = b"".join(parts[split])[: caps[split]]
        if not blob:
            raise RuntimeError(f"no standard-library sources found for the {split} split")
        out.append(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
    return out[0], out[1]


def data_generator(seed: int, rank: int | None = None) -> torch.Generator:
    """A CPU generator seeded with ``seed + rank`` (rank defaults to the process's global rank),
    so each rank draws its own batches."""
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    return torch.Generator().manual_seed(seed + rank)


def get_batch(data: torch.Tensor, batch: int, seq_len: int,
              generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``data``: inputs ``x`` and next-byte targets ``y``, int64
    ``(batch, seq_len)``."""
    if data.numel() <= seq_len + 1:
        raise ValueError(f"corpus of {data.numel()} bytes is too short for seq_len={seq_len}")
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch,), generator=generator)
    offs = starts[:, None] + torch.arange(seq_len + 1)
    win = data[offs].long()
    return win[:, :-1].contiguous(), win[:, 1:].contiguous()


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, batches: int, batch: int = 8,
             seq_len: int | None = None, seed: int = 1234,
             device: torch.device | str | None = None) -> float:
    """Mean loss over ``batches`` random batches of ``data`` (fixed ``seed``), in eval mode,
    with the batches on ``device`` (default: the CPU).

    Under FSDP every rank of a shard group must call this the same number of times.
    """
    seq_len = seq_len or cast(GPT, model).cfg.seq_len  # the default needs a GPT
    gen = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    total = 0.0
    for _ in range(batches):
        x, y = get_batch(data, batch, seq_len, gen)
        if device is not None:
            x, y = x.to(device), y.to(device)
        total += float(model(x, y))
    model.train(was_training)
    return total / max(batches, 1)
