"""Training frameworks that would wrap the model in DistributedDataParallel, made to leave the
cross-replica exchange to flexdemo's optimizer (docs/integrations.md).

Each module imports its framework when it is imported itself (never at ``import flexdemo``)
and, when the framework is missing, says in one line which extra to install:

* :mod:`flexdemo.integrations.hf`: ``FlexTrainer``, a Hugging Face ``Trainer``
  (``pip install "flexdemo[hf]"``);
* :mod:`flexdemo.integrations.accelerate`: ``prepare(accelerator, model, optimizer, ...)``
  (``pip install "flexdemo[hf]"``);
* :mod:`flexdemo.integrations.lightning`: ``FlexStrategy``, a Lightning strategy
  (``pip install "flexdemo[lightning]"``).

All three keep what the framework does for data (each rank reads its own shard of the
dataset: a sampler over all ranks, as DDP's) and drop only the DDP wrap. Each runs the same
number of steps on every rank, so each refuses a DiLoCo pace that is not lockstep
(:func:`check_lockstep`) before the first step.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch.distributed as dist
import torch.nn as nn


class IntegrationMissingError(ImportError):
    """The framework an integration module drives is not installed."""


def require(module: str, extra: str, integration: str) -> ModuleType:
    """``import module``, or an :class:`IntegrationMissingError` naming the extra, in one
    line."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise IntegrationMissingError(
            f"flexdemo.integrations.{integration} needs {module.partition('.')[0]} "
            f"({e.msg}); install it: pip install \"flexdemo[{extra}]\"") from None


def check_prepared(model: object, where: str) -> nn.Module:
    """``model`` if :func:`flexdemo.prepare` returned it, else a ``TypeError`` saying what to
    pass instead."""
    if not isinstance(model, nn.Module) or not getattr(model, "_flexdemo_prepared", False):
        raise TypeError(f"{where} takes the model flexdemo.prepare() returned (got "
                        f"{type(model).__name__}): model, opt = flexdemo.prepare(model, ...) "
                        "first, then give both to the framework")
    return model


def check_data_split(processes: int, where: str, fix: str) -> None:
    """Refuse a framework that sees fewer processes than the job has (on a CPU-only machine
    Accelerate takes a torchrun job for one process unless told to use the CPU): every rank
    would read the same data, and the replicas would exchange the same gradient."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if processes != world:
        raise ValueError(f"{where} sees {processes} process(es) of this job's {world}, so every "
                         f"rank would read the same data; {fix}")


def check_lockstep(optimizer: object, where: str) -> None:
    """Refuse an optimizer whose replicators include a DiLoCo pace that is not lockstep
    (``pace=`` with counts not all equal, or measured: ``"fixed"``, ``"adaptive"``): the
    framework runs the same number of steps on every rank, so a replica would wait at a sync
    its peers never reach. A check of settings every rank shares: no collective."""
    for rep in getattr(optimizer, "replicators", ()):
        pace = getattr(rep, "pace", None)
        if pace is not None and not pace.lockstep:
            raise ValueError(
                f"{where} runs the same number of steps on every rank, but the optimizer's "
                f"{getattr(rep, 'name', type(rep).__name__)} has pace={pace!r}, which gives "
                "each replica its own inner steps per period (only equal given counts keep "
                "them in step): a replica would wait at a sync its peers never reach; train "
                "it with `flexdemo train` (which counts a paced run in syncs) or your own loop "
                "that steps until the pace's sync (docs/stragglers.md), or drop pace=")


__all__ = ["IntegrationMissingError", "check_data_split", "check_lockstep", "check_prepared",
           "require"]
