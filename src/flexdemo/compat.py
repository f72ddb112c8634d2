"""Names of the ``detonation`` package (DeToNATION's reference code), mapped onto flexdemo.

Thin aliases where a name maps one to one; the differences are stated in each docstring and in
docs/coming-from-demo.md. In short:

* sharding is FSDP2 (``fully_shard``), not FSDP1 ``HYBRID_SHARD``: ``fsdp_kwargs`` are
  ``fully_shard`` options, gradients arrive already reduce-scattered inside a replica, and
  there is no ``model.no_sync()``: accumulate gradients over micro-batches by calling
  ``backward()`` several times before one ``step()``;
* schedules count steps from 0: ``replicate_every=k`` exchanges on steps 0, k, 2k, ...
  (the reference counts from 1 and exchanges on its steps k, 2k, ..., i.e. our k-1, 2k-1, ...);
  ``skip_every`` agrees;
* ``sign`` belongs to the replicators that have one (DeMo, random, striding, slicing); the
  full replicator always passes the plain mean (the reference signs it under
  ``detonation_sign=True``).
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

import torch
import torch.distributed as dist
from torch import nn

from .optim import DeToNATION
from .replicate import DeMoReplicator as _DeMo
from .replicate import FullReplicator, NoReplication, Replicator
from .replicate import RandomReplicator as _Random
from .replicate import SlicingReplicator as _Slicing
from .replicate import StridingReplicator as _Striding
from .replicate.base import check_schedule
from .sharding import prepare

__all__ = ["DeMoReplicator", "DeToAdamW", "DeToSGD", "FullReplicator", "NoReplicator",
           "Optimizers", "RandomReplicator", "SlicingReplicator", "StridingReplicator",
           "prepare_detonation"]

NoReplicator = NoReplication


class Optimizers(Enum):
    """Base optimizers of :func:`prepare_detonation`."""

    SGD = "sgd"
    AdamW = "adamw"


def DeMoReplicator(compression_decay: float = 0.999, compression_topk: int = 32,
                   compression_chunk: int = 64) -> _DeMo:
    """DeMo with the reference's argument names; fp32 values as in the reference."""
    return _DeMo(topk=compression_topk, chunk=compression_chunk, decay=compression_decay,
                 values="fp32")


def RandomReplicator(compression_decay: float = 0.999, compression_rate: float = 0.1,
                     seed: int = 42) -> _Random:
    """Random subsets with the reference's argument names."""
    return _Random(rate=compression_rate, decay=compression_decay, seed=seed)


def StridingReplicator(compression_decay: float = 0.999,
                       compression_rate: float = 0.1) -> _Striding:
    """Strided subsets with the reference's argument names (no ``compression_chunk``)."""
    return _Striding(rate=compression_rate, decay=compression_decay)


def SlicingReplicator(compression_decay: float = 0.999,
                      compression_rate: float = 0.1) -> _Slicing:
    """Contiguous slices with the reference's argument names (no ``compression_chunk``)."""
    return _Slicing(rate=compression_rate, decay=compression_decay)


def _schedule(reps: list[Replicator], replicate_every, skip_every, detonation_sign: bool
              ) -> list[Replicator]:
    n = len(reps)
    every = replicate_every if isinstance(replicate_every, list) else [replicate_every] * n
    skips = skip_every if isinstance(skip_every, list) else [skip_every] * n
    if len(every) != n or len(skips) != n:
        raise ValueError(f"replicate_every / skip_every need one value per replicator ({n})")
    for r, e, s in zip(reps, every, skips):
        s = 0 if s is None else s
        check_schedule(e, s)
        r.replicate_every, r.skip_every = e, s
        if hasattr(r, "sign"):
            r.sign = detonation_sign
    return reps


def _replicators(replicator) -> list[Replicator]:
    reps = replicator if isinstance(replicator, list) else [replicator]
    bad = [r for r in reps if not isinstance(r, Replicator)]
    if bad:
        raise TypeError(f"replicator must be a flexdemo Replicator (or a list), got "
                        f"{type(bad[0]).__name__}")
    return reps


def _no_sharding_group(group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        raise ValueError("sharding_parallel_group: flexdemo does not reduce-scatter gradients "
                         "itself; shard the model with FSDP2 (flexdemo.prepare, or fully_shard "
                         "yourself) so that gradients arrive sharded, and pass only "
                         "replication_parallel_group")


class _DeToBase(DeToNATION):
    _base = "sgd"

    def __init__(self, params: Iterable, detonation_weight_decay: float = 0.0,
                 detonation_sign: bool = True,
                 sharding_parallel_group: dist.ProcessGroup | None = None,
                 replication_parallel_group: dist.ProcessGroup | None = None,
                 replicator: Replicator | list[Replicator] | None = None,
                 replicate_every: int | list[int] = 1, skip_every: int | list | None = None,
                 **base_kwargs) -> None:
        _no_sharding_group(sharding_parallel_group)
        if isinstance(replication_parallel_group, list):
            raise ValueError("one replication_parallel_group per replicator: give each "
                             "flexdemo replicator its own group=... instead")
        reps = _schedule(_replicators(replicator or DeMoReplicator()), replicate_every,
                         skip_every, detonation_sign)
        lr = base_kwargs.pop("lr", 1e-3)
        super().__init__(params, reps, base=self._base, lr=lr,
                         weight_decay=detonation_weight_decay,
                         group=replication_parallel_group, base_kwargs=base_kwargs)


class DeToSGD(_DeToBase):
    """The reference's ``DeToSGD`` arguments on :class:`~flexdemo.DeToNATION` with SGD.
    Other keywords (``lr``, ``momentum``, ...) go to SGD."""

    _base = "sgd"


class DeToAdamW(_DeToBase):
    """The reference's ``DeToAdamW`` arguments on :class:`~flexdemo.DeToNATION` with AdamW.
    Other keywords (``lr``, ``betas``, ...) go to AdamW."""

    _base = "adamw"


def prepare_detonation(model: nn.Module, optimizer: Optimizers | str = Optimizers.SGD,
                       replicator: Replicator | list[Replicator] | None = None,
                       sharding_group_size: int | None = None,
                       replication_group_size: int | None = None,
                       sharding_parallel_group: dist.ProcessGroup | None = None,
                       replication_parallel_group: dist.ProcessGroup | None = None,
                       fsdp_kwargs: dict | None = None, **detonation_kwargs
                       ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The reference's ``prepare_detonation`` on :func:`flexdemo.prepare`.

    Group sizes map to ``shard`` / ``replicate`` (same defaults: shard = ranks per node);
    process groups are not accepted (give ``flexdemo.prepare`` a mesh instead).
    ``fsdp_kwargs`` are FSDP2 ``fully_shard`` options. ``detonation_kwargs``:
    ``detonation_weight_decay``, ``detonation_sign``, ``replicate_every``, ``skip_every``;
    the rest (``lr``, ``momentum``, ``betas``, ...) go to the base optimizer.
    """
    if sharding_parallel_group is not None or replication_parallel_group is not None:
        raise ValueError("prepare_detonation: pass sharding_group_size / "
                         "replication_group_size, or build a DeviceMesh with "
                         "flexdemo.build_mesh and call flexdemo.prepare(model, mesh=mesh)")
    base = optimizer.value if isinstance(optimizer, Optimizers) else optimizer
    kw = dict(detonation_kwargs)
    reps = _schedule(_replicators(replicator or DeMoReplicator()),
                     kw.pop("replicate_every", 1), kw.pop("skip_every", None),
                     kw.pop("detonation_sign", True))
    wd = kw.pop("detonation_weight_decay", 0.0)
    lr = kw.pop("lr", 1e-3)
    return prepare(model, reps, base, lr, replicate=replication_group_size,
                   shard=sharding_group_size, weight_decay=wd, optimizer_kwargs=kw or None,
                   fsdp_kwargs=fsdp_kwargs)
