"""The learning-rate schedule of the trainer and the examples."""

from __future__ import annotations

import math

__all__ = ["SCHEDULES", "lr_at"]

SCHEDULES = ("cosine", "constant")
"""After the warm-up: a cosine decay to ``min_lr`` x the base rate, or constant."""


def lr_at(step: float, steps: int, base: float, warmup: int = 0, schedule: str = "cosine",
          min_lr: float = 0.1) -> float:
    """Learning rate of step ``step`` (from 0; a fraction between steps too: a paced run's
    slower replicas): linear warm-up over ``warmup`` steps, then constant or a cosine decay
    that reaches ``min_lr * base`` at the last step."""
    if warmup and step < warmup:
        return base * (step + 1) / warmup
    if schedule == "constant":
        return base
    span = max(steps - warmup - 1, 1)
    frac = min(max(step - warmup, 0) / span, 1.0)
    return base * (min_lr + (1.0 - min_lr) * 0.5 * (1.0 + math.cos(math.pi * frac)))
