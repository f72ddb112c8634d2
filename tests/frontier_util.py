"""A model of 64 x 64 weights (whole 64 x 64 blocks for DeMo's exchange), its loss and
per-replica batches, for the tests of the byte frontier and the sparse reduce-scatter."""

from __future__ import annotations

import torch
from torch import nn


def tiny_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def batch(r: int, step: int):
    g = torch.Generator().manual_seed(1000 * r + step)
    return torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)
