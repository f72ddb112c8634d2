"""Hugging Face Accelerate without DistributedDataParallel (``pip install "flexdemo[hf]"``).

Under several processes ``Accelerator.prepare(model, ...)`` wraps the model in DDP, which
all-reduces every gradient in full before the optimizer's step. :func:`prepare` prepares the
model as Accelerate prepares a model for evaluation (mixed precision and ``torch.compile`` as
configured, no DDP, no device move: ``flexdemo.prepare()`` placed it), then everything else
as usual: each rank's dataloader reads its own shard of the data, the optimizer and scheduler
are wrapped for gradient accumulation::

    model, opt = flexdemo.prepare(model, "demo", lr=1e-3)
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, opt, loader, sched = flexdemo.integrations.accelerate.prepare(
        accelerator, model, opt, loader, sched)

``accelerator.accumulate(model)`` then skips FSDP2's reduce-scatter inside a replica on the
micro-batches before the last (the model's ``no_sync()``); the exchange across replicas
happens once per optimizer step, in ``opt.step()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import torch.nn as nn

from . import check_data_split, check_lockstep, check_prepared, require

require("accelerate", "hf", "accelerate")


def keep_unwrapped(accelerator: Any, model: nn.Module) -> nn.Module:
    """Mark ``model`` (returned by ``flexdemo.prepare()``) as prepared by ``accelerator``
    without wrapping it in DDP: its later ``accelerator.prepare(model, ...)`` calls return it
    as it is. Returns the model (the same object unless Accelerate compiles it)."""
    check_prepared(model, "keep_unwrapped()")
    check_data_split(accelerator.num_processes, "the Accelerator",
                     "on a machine without GPUs build it with Accelerator(cpu=True)")
    if not hasattr(model, "no_sync"):  # what accelerate.accumulate() and Trainer call
        model.no_sync = _no_sync_for(model)  # an attribute of this model only
    return accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)


def _no_sync_for(model: nn.Module):
    def no_sync() -> contextlib.AbstractContextManager:
        """Micro-batches inside it skip FSDP2's reduce-scatter inside the replica (a no-op at
        shard=1); the gradients add up in ``.grad`` and the next one outside it reduces."""
        return _without_gradient_sync(model)
    return no_sync


@contextlib.contextmanager
def _without_gradient_sync(model: nn.Module) -> Iterator[None]:
    switch = cast(Any, model).set_requires_gradient_sync  # prepare() gives every model one
    switch(False)
    try:
        yield
    finally:
        switch(True)


def prepare(accelerator: Any, model: nn.Module, optimizer: Any, *objects: Any) -> tuple:
    """``accelerator.prepare(model, optimizer, *objects)`` for a model and optimizer from
    ``flexdemo.prepare()``, with the model left unwrapped (:func:`keep_unwrapped`). Returns
    them in the order given. A DiLoCo pace that is not lockstep is refused
    (:func:`flexdemo.integrations.check_lockstep`)."""
    check_lockstep(optimizer, "flexdemo.integrations.accelerate.prepare()")
    model = keep_unwrapped(accelerator, model)
    return tuple(accelerator.prepare(model, optimizer, *objects))


__all__ = ["keep_unwrapped", "prepare"]
