"""The rank-local part of a tensor that may be a DTensor (FSDP2's sharded parameters and
gradients), and whether it is one, without importing ``torch.distributed.tensor`` (with sympy,
about a second of CPU in every process that imports flexdemo; it loads with DCP or FSDP)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["is_dtensor", "local_tensor"]


def is_dtensor(t: object) -> TypeGuard[DTensor]:
    """``isinstance(t, DTensor)``. No DTensor exists before ``torch.distributed.tensor`` is
    imported (FSDP2, DCP and DTensor's own constructors import it), so when it is not loaded
    the answer is False, and this does not load it."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a DTensor (a view sharing its storage, outside autograd), or
    ``t`` itself. Recognised by the ``_local_tensor`` attribute, which among tensors only
    DTensor has, so this also works where ``torch.distributed`` is not built."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t
