"""What the trainer needs from a task, and the per-rank sampler that shards its data.

A task owns its data (loaded without any download) and builds its model. Training data is a
list of ``num_train_items`` examples; :class:`ShardSampler` gives each rank its own disjoint
share (items ``rank, rank + world, ...``) in a fresh seeded order every epoch. Its position
(epoch, index) is two integers, so a checkpoint can store it and a resumed run reads exactly
the batches an uninterrupted one would.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class TaskConfig:
    """The ``[task]`` section: which task and its model size preset. Each task subclasses it
    in its own module with the keys it reads (and ``name`` defaulting to its own name), and
    names the subclass in its :data:`~flexdemo.app.tasks.TASKS` entry."""

    name: str = "gpt"
    """The task: a key of :data:`~flexdemo.app.tasks.TASKS` (gpt, vit, t5)."""
    model: str = "tiny"
    """The task's model size preset (gpt: tiny, mini, small; vit: tiny, small; t5: tiny,
    mini)."""

    def check(self) -> None:
        """Raise ``ValueError("task.KEY: must be ..., got ...")`` for a value out of range
        (the preset and the name are checked against the registry elsewhere)."""


def must(key: str, ok: bool, need: str, value: Any) -> None:
    """The range check of :meth:`TaskConfig.check`: ``ValueError`` naming ``task.key`` unless
    ``ok``."""
    if not ok:
        raise ValueError(f"task.{key}: must be {need}, got {value!r}")


def eval_indices(n: int, rank: int, world: int, count: int, seed: int = 0) -> torch.Tensor:
    """A fixed spread-out choice of ``count`` of this rank's validation items (same at every
    evaluation); repeats items when the rank has fewer."""
    owned = torch.arange(rank, n, world)
    if owned.numel() == 0:
        owned = torch.arange(n)
    order = owned[torch.randperm(owned.numel(), generator=torch.Generator().manual_seed(seed))]
    reps = -(-count // order.numel())
    return order.repeat(reps)[:count]


@torch.no_grad()
def summed_eval_loss(model: nn.Module, n_items: int, rank: int, world: int, batches: int,
                     batch_size: int,
                     batch_loss: Callable[[torch.Tensor], tuple[float, int]]) -> dict[str, float]:
    """Loss summed over ``batches`` (at least one) batches of this rank's validation items
    (:func:`eval_indices`) in eval mode; ``batch_loss(indices)`` gives a batch's mean loss and
    the number of predictions it averages."""
    batches = max(batches, 1)
    idx = eval_indices(n_items, rank, world, batches * batch_size)
    was = model.training
    model.eval()
    loss_sum = count = 0.0
    try:
        for b in range(batches):
            loss, n = batch_loss(idx[b * batch_size:(b + 1) * batch_size])
            loss_sum += loss * n
            count += n
    finally:
        model.train(was)
    return {"loss_sum": loss_sum, "count": count}


class ShardSampler:
    """Indices of this rank's share of ``num_items`` training items, ``batch`` at a time.

    Rank ``rank`` of ``world`` owns items ``rank::world``; each epoch visits them in an order
    drawn from ``(seed, stream, rank, epoch)``. A batch never spans two epochs (the tail of an
    epoch that is shorter than a batch is skipped). ``stream`` tells apart jobs whose ranks
    are numbered alike: the replica groups of an elastic run, which come and go, each draw
    their own order of the same items.
    """

    def __init__(self, num_items: int, rank: int, world: int, seed: int = 0,
                 stream: int = 0) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in 0..{world - 1}, got {rank}")
        self.owned = torch.arange(rank, num_items, world)
        if self.owned.numel() == 0:
            raise ValueError(f"{num_items} training items cannot be shared by {world} ranks; "
                             "use more data")
        self.rank, self.world, self.seed, self.stream = rank, world, seed, stream
        self.epoch = 0
        self.index = 0
        self._order: torch.Tensor | None = None

    @staticmethod
    def smallest_share(num_items: int, world: int) -> int:
        """The fewest items any rank of ``world`` owns (rank ``r`` owns ``r::world``): the
        largest batch every rank can draw, known on each rank without asking the others."""
        return min(len(range(rank, num_items, world)) for rank in range(world))

    def _epoch_order(self) -> torch.Tensor:
        if self._order is None:
            gen = torch.Generator().manual_seed(
                (self.seed * 1_000_003 + self.rank * 7_919 + self.epoch * 104_729
                 + self.stream * 15_485_863) % 2**63)
            self._order = self.owned[torch.randperm(self.owned.numel(), generator=gen)]
        return self._order

    def next(self, batch: int) -> torch.Tensor:
        """The next ``batch`` item indices of this rank."""
        if batch > self.owned.numel():
            raise ValueError(f"batch {batch} exceeds this rank's {self.owned.numel()} training "
                             "items; lower train.batch or use more data")
        if self.index + batch > self.owned.numel():
            self.epoch += 1
            self.index = 0
            self._order = None
        out = self._epoch_order()[self.index:self.index + batch]
        self.index += batch
        return out

    def state_dict(self) -> dict[str, int]:
        """The position: ``{"epoch", "index"}``."""
        return {"epoch": int(self.epoch), "index": int(self.index)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position."""
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = None


class Task(ABC):
    """A training task: data, model, loss and evaluation.

    ``evaluate`` returns sums over this rank's validation examples (``loss_sum`` and ``count``,
    optionally ``correct``) so that the trainer can add them over all ranks. Under FSDP every
    rank must run the same number of forward passes: ``evaluate`` runs exactly ``batches``
    batches on every rank (or the same task-defined number).
    """

    name = "task"
    device: torch.device = torch.device("cpu")
    """Where the model lives (set by the trainer): ``evaluate`` moves its batches there;
    ``train_batch`` returns CPU tensors that the trainer moves."""

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A fresh model (initialised from torch's global RNG)."""

    @property
    @abstractmethod
    def num_train_items(self) -> int:
        """Number of training examples."""

    @abstractmethod
    def train_batch(self, indices: torch.Tensor) -> Any:
        """The training batch made of the items ``indices``."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Mean loss of ``model`` on ``batch``."""

    @abstractmethod
    def evaluate(self, model: nn.Module, rank: int, world: int, batches: int,
                 batch_size: int) -> dict[str, float]:
        """Sums over this rank's share of the validation data (see the class docstring)."""

    def batch_tokens(self, batch: Any) -> int:
        """The tokens a training batch trains on (default: its examples, the first
        dimension of its first tensor; text tasks: the predicted tokens), without reading the
        device. A pace weighing by tokens (``opt.count_tokens``) and the bench's goodput
        count them."""
        first = batch
        while isinstance(first, (tuple, list)):
            first = first[0]
        if isinstance(first, dict):
            first = next(iter(first.values()))
        return int(first.shape[0])

    def shard_units(self) -> Callable[[nn.Module], list[nn.Module]] | None:
        """Modules to shard as their own FSDP unit (``None``: :func:`flexdemo.prepare`'s
        default, the members of every ``nn.ModuleList``)."""
        return None

    def describe(self) -> str:
        """One line about the data."""
        return self.name
