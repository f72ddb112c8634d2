"""A small Vision Transformer on scikit-learn's bundled digits (8x8 grey images, 10 classes).

The 1797 images ship with scikit-learn (:func:`sklearn.datasets.load_digits`); nothing is
downloaded. The split is fixed: a permutation drawn from seed 0 holds out ``val_fraction`` of
the images, independent of the training seed. Pixels are standardised with the training
split's mean and standard deviation.

The model cuts an image into ``patch x patch`` patches, embeds them linearly, prepends a class
token, adds learned position embeddings, runs ``depth`` pre-LayerNorm transformer blocks (an
``nn.ModuleList`` named ``blocks``: one FSDP unit each) and classifies the class token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import Task, TaskConfig, eval_indices, must

IMAGE = 8
CLASSES = 10


@dataclass
class ViTTaskConfig(TaskConfig):
    """The vit task's ``[task]`` keys."""

    name: str = "vit"
    patch: int = 4
    """Patch edge in pixels (the images are 8x8: 4 gives 4 patches, 2 gives 16)."""
    val_fraction: float = 0.2
    """Fraction of the digits held out for validation (a fixed split)."""

    def check(self) -> None:
        must("patch", self.patch in (1, 2, 4, 8), "a divisor of 8 (2 or 4)", self.patch)
        must("val_fraction", 0.0 < self.val_fraction < 1.0, "between 0 and 1",
             self.val_fraction)


@dataclass(frozen=True)
class ViTConfig:
    """Shape of the ViT: patch edge, width, depth, heads and MLP width factor."""

    patch: int = 4
    dim: int = 64
    depth: int = 4
    heads: int = 4
    mlp_ratio: int = 2

    def __post_init__(self) -> None:
        if IMAGE % self.patch:
            raise ValueError(f"patch={self.patch} must divide the image edge {IMAGE} (2 or 4)")
        if self.dim % self.heads:
            raise ValueError(f"dim={self.dim} is not divisible by heads={self.heads}")


PRESETS: dict[str, ViTConfig] = {
    "tiny": ViTConfig(dim=64, depth=4, heads=4, mlp_ratio=2),     # ~0.14M parameters
    "small": ViTConfig(dim=128, depth=6, heads=4, mlp_ratio=4),   # ~1.2M parameters
}


def vit_config(name: str, **overrides) -> ViTConfig:
    """A preset (``"tiny"``, ``"small"``), optionally modified (e.g. ``patch=4``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown ViT preset {name!r}; choose one of {sorted(PRESETS)}")
    cfg = PRESETS[name]
    return ViTConfig(**{**cfg.__dict__, **overrides}) if overrides else cfg


class ViTBlock(nn.Module):
    """Pre-LayerNorm block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim), nn.GELU(),
                                 nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class ViT(nn.Module):
    """``forward(images)`` with ``images`` of shape ``(B, 8, 8)`` or ``(B, 1, 8, 8)`` returns
    ``(B, 10)`` logits."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        n = (IMAGE // cfg.patch) ** 2
        self.embed = nn.Linear(cfg.patch * cfg.patch, cfg.dim)
        self.cls = nn.Parameter(torch.zeros(1, 1, cfg.dim))
        self.pos = nn.Parameter(torch.randn(1, n + 1, cfg.dim) * 0.02)
        self.blocks = nn.ModuleList(ViTBlock(cfg) for _ in range(cfg.depth))
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, CLASSES)

    def patches(self, images: torch.Tensor) -> torch.Tensor:
        """``(B, patches, patch*patch)``: the image cut into patches, row by row."""
        p = self.cfg.patch
        x = images.reshape(images.shape[0], IMAGE // p, p, IMAGE // p, p)
        return x.permute(0, 1, 3, 2, 4).reshape(images.shape[0], -1, p * p)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = self.embed(self.patches(images))
        h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], dim=1) + self.pos
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h[:, 0]))


def load_digits_split(val_fraction: float = 0.2) -> tuple[torch.Tensor, torch.Tensor,
                                                         torch.Tensor, torch.Tensor]:
    """``(train_x, train_y, val_x, val_y)``: digits as float ``(N, 8, 8)`` (pixels scaled to
    zero mean and unit variance over the training split) and int64 labels, split by a fixed
    permutation (seed 0)."""
    try:
        from sklearn.datasets import load_digits
    except ModuleNotFoundError:
        raise ModuleNotFoundError("the vit task needs scikit-learn (its bundled digits): "
                                  "pip install scikit-learn") from None
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    n_val = max(1, int(round(len(y) * val_fraction)))
    val, train = order[:n_val], order[n_val:]
    mean, std = x[train].mean(), x[train].std()  # standardised with the training split's stats
    x = (x - mean) / std
    return x[train], y[train], x[val], y[val]


class ViTTask(Task):
    """Digit classification with a small ViT; evaluation reports loss and accuracy."""

    name = "vit"

    def __init__(self, model: str = "tiny", patch: int = 4, val_fraction: float = 0.2) -> None:
        self.cfg = vit_config(model, patch=patch)
        self.preset = model
        self.train_x, self.train_y, self.val_x, self.val_y = load_digits_split(val_fraction)

    def build_model(self) -> nn.Module:
        return ViT(self.cfg)

    @property
    def num_train_items(self) -> int:
        return len(self.train_y)

    def train_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.train_x[indices], self.train_y[indices]

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, rank: int, world: int, batches: int,
                 batch_size: int) -> dict[str, float]:
        """``batches`` batches of this rank's validation images; ``batches=0``: all of the
        validation split, each image counted once over all ranks."""
        n = len(self.val_y)
        if batches > 0:
            idx = eval_indices(n, rank, world, batches * batch_size)
            weight = torch.ones(idx.numel())
        else:  # every rank runs the same number of batches; padding items get weight 0
            per_rank = -(-n // world)
            owned = torch.arange(rank, n, world)
            idx = torch.cat([owned, torch.zeros(per_rank - owned.numel(), dtype=torch.long)])
            weight = torch.cat([torch.ones(owned.numel()),
                                torch.zeros(per_rank - owned.numel())])
        was = model.training
        model.eval()
        dev = self.device
        sums = torch.zeros(2, dtype=torch.float64, device=dev)  # loss, correct: one host read
        for start in range(0, idx.numel(), batch_size):
            i = idx[start:start + batch_size]
            w = weight[start:start + batch_size].to(dev)
            y = self.val_y[i].to(dev)
            logits = model(self.val_x[i].to(dev)).float()
            losses = F.cross_entropy(logits, y, reduction="none")
            sums[0] += (losses * w).sum()
            sums[1] += ((logits.argmax(1) == y).float() * w).sum()
        model.train(was)
        loss_sum, correct = sums.tolist()
        return {"loss_sum": loss_sum, "count": float(weight.sum()), "correct": correct}

    def describe(self) -> str:
        c = self.cfg
        return (f"vit/{self.preset}: ViT ({c.depth} blocks, dim {c.dim}, {c.patch}x{c.patch} "
                f"patches) on scikit-learn digits: {self.num_train_items} training, "
                f"{len(self.val_y)} validation images")
