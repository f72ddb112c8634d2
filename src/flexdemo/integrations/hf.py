"""The Hugging Face ``Trainer`` without DistributedDataParallel (``pip install "flexdemo[hf]"``).

The ``Trainer`` hands its model to ``Accelerator.prepare``, which wraps it in DDP under
several processes: every gradient would be all-reduced in full before the optimizer's step.
:class:`FlexTrainer` takes the model and optimizer ``flexdemo.prepare()`` returned, keeps the
model out of DDP (:func:`flexdemo.integrations.accelerate.keep_unwrapped`) and changes nothing
else: the distributed sampler (each rank reads its own shard of the data), the lr scheduler,
gradient clipping, gradient accumulation (one exchange per optimizer step; the micro-batches
before the last skip FSDP2's reduce-scatter inside a replica), evaluation and logging are the
``Trainer``'s::

    model, opt = flexdemo.prepare(model, "demo", lr=1e-3)
    trainer = FlexTrainer(model=model, args=TrainingArguments(...), optimizers=(opt, None),
                          train_dataset=train, eval_dataset=val)
    trainer.train()                       # or trainer.train(resume_from_checkpoint=True)

Checkpoints: the ``Trainer`` saves the optimizer's state from rank 0 only, but each rank's
state is its own (DeMo's momentum, DiLoCo's replica). :class:`FlexTrainer` saves model and
optimizer with :func:`flexdemo.save_checkpoint` on every rank, in ``checkpoint-N/flexdemo``
(beside the Trainer's own files: weights, scheduler, RNG states, trainer state), and resumes
from it with :func:`flexdemo.load_checkpoint`: the next steps are bitwise those of the run
that saved it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..checkpoint import load_checkpoint, save_checkpoint
from . import check_data_split, check_lockstep, check_prepared, require

require("transformers", "hf", "hf")

from transformers import Trainer  # noqa: E402  # after the check

from .accelerate import keep_unwrapped  # noqa: E402  # (needs accelerate: the same extra)

CHECKPOINT_DIR = "flexdemo"  # inside the Trainer's checkpoint-N folder
SCHEDULER_NAME = "scheduler.pt"  # the Trainer's name for it


class FlexTrainer(Trainer):
    """A ``transformers.Trainer`` for a model and optimizer from ``flexdemo.prepare()``:
    ``FlexTrainer(model=model, args=..., optimizers=(opt, scheduler_or_None), ...)``; every
    other argument is the ``Trainer``'s. The model is not wrapped in DDP; ``opt.step()``
    exchanges across replicas."""

    def __init__(self, model: nn.Module | None = None, args: Any = None, *,
                 optimizers: tuple = (None, None), **kwargs: Any) -> None:
        prepared = check_prepared(model, "FlexTrainer")
        opt = optimizers[0] if isinstance(optimizers, (tuple, list)) and optimizers else None
        if opt is None or not hasattr(opt, "last_step_stats"):
            raise TypeError("FlexTrainer takes the optimizer flexdemo.prepare() returned: "
                            "FlexTrainer(model=model, optimizers=(opt, None), ...); the "
                            "Trainer's own optimizer would not exchange across replicas")
        check_lockstep(opt, "FlexTrainer")
        super().__init__(model=model, args=args, optimizers=optimizers, **kwargs)
        check_data_split(self.args.world_size, "the Trainer",
                         "on a machine without GPUs pass TrainingArguments(use_cpu=True)")
        self.flexdemo_optimizer = opt
        keep_unwrapped(self.accelerator, prepared)

    # ---------------------------------------------------------------- checkpoints per rank
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Every rank saves model and optimizer (collective); rank 0 the scheduler."""
        save_checkpoint(Path(output_dir) / CHECKPOINT_DIR, self.model,
                        self.flexdemo_optimizer, step=self.state.global_step)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The Trainer's weights file, from the whole parameters: a sharded model's (shard > 1)
        are gathered to rank 0 first, by every rank (the Trainer would gather on rank 0
        alone)."""
        if state_dict is None and _sharded(self.model):
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )
            state_dict = get_model_state_dict(self.model, options=StateDictOptions(
                full_state_dict=True, cpu_offload=True))
        super()._save(output_dir, state_dict=state_dict)

    def _load_from_checkpoint(self, resume_from_checkpoint: str,
                              model: nn.Module | None = None) -> None:
        """The weights of a FlexTrainer checkpoint come back with the optimizer's state
        (every replica its own, sharded or not), in :meth:`_load_optimizer_and_scheduler`."""
        if (model is None or model is self.model) and (
                Path(resume_from_checkpoint) / CHECKPOINT_DIR).is_dir():
            return
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Model and optimizer from ``checkpoint/flexdemo`` (every rank its own), the
        scheduler from the Trainer's file."""
        if checkpoint is None:
            return
        path = Path(checkpoint) / CHECKPOINT_DIR
        if not path.is_dir():
            raise ValueError(f"{checkpoint} holds no {CHECKPOINT_DIR}/ folder: it was not "
                             "written by FlexTrainer, and a Trainer's optimizer.pt holds rank "
                             "0's optimizer state only; resume from a FlexTrainer checkpoint")
        load_checkpoint(path, self.model, self.flexdemo_optimizer)
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


def _sharded(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


__all__ = ["CHECKPOINT_DIR", "FlexTrainer"]
