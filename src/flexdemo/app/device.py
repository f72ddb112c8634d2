"""Where the application trains: ``device = "auto" | "cpu" | "cuda"`` and ``precision``.

``auto`` means CUDA when this machine has a usable GPU, else the CPU. On CUDA every rank takes
``cuda:LOCAL_RANK`` (torchrun's variable: one GPU per rank of a node) and the process group
uses NCCL; on the CPU it uses gloo (:func:`flexdemo.mesh.backend_for`). Several emulated nodes
on one machine (``flexdemo bench``) share its GPUs: there ``FLEXDEMO_CUDA_BY_RANK=1`` makes a
rank take ``cuda:RANK`` instead, so no two ranks use one GPU.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["BY_RANK_ENV", "DEVICES", "PRECISIONS", "check_device", "resolve_device",
           "to_device"]

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("fp32", "bf16")
BY_RANK_ENV = "FLEXDEMO_CUDA_BY_RANK"


def _index_variable() -> str:
    return "RANK" if os.environ.get(BY_RANK_ENV, "").strip() in ("1", "true") else "LOCAL_RANK"


def check_device(name: str) -> None:
    """Raise ``ValueError`` (one line) if ``name`` is not a device this process can use."""
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; choose one of {', '.join(DEVICES)}")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return
    if not torch.cuda.is_available():
        build = (f"torch {torch.__version__} is built without CUDA"
                 if torch.version.cuda is None else "no CUDA device is visible")
        raise ValueError(f"device 'cuda' asked for, but {build}; use device \"cpu\" (or "
                         "\"auto\": CUDA when available)")
    var = _index_variable()
    index, count = int(os.environ.get(var, "0")), torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"{var}={index} needs GPU {index}, but this machine shows {count}; "
                         f"run at most {count} rank(s) per node (torchrun --nproc-per-node)")


def resolve_device(name: str) -> torch.device:
    """The device of this rank for ``name`` (checked by :func:`check_device`)."""
    check_device(name)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get(_index_variable(), "0")))


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` (a tensor, or tuples/lists/dicts of them) on ``device`` (copies to CUDA do
    not block the host)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=device.type == "cuda")
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch
