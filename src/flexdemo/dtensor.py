"""The rank-local part of a tensor that may be a DTensor (FSDP2's sharded parameters and
gradients), without importing ``torch.distributed.tensor``."""

from __future__ import annotations

import torch

__all__ = ["local_tensor"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a DTensor (a view sharing its storage, outside autograd), or
    ``t`` itself. Recognised by the ``_local_tensor`` attribute, which among tensors only
    DTensor has, so this also works where ``torch.distributed`` is not built."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t
