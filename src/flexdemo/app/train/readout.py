"""What the training loop reads back from its ranks: the steps' losses (one host transfer for
many steps) and the validation figures, summed over the ranks at once or, at a paced run's
sync, launched there and landed at the next sync (:class:`InFlight`), so that no rank waits
at an evaluation for the slowest replica's outer step."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .checkpointer import TrainState

__all__ = ["InFlight", "evaluate", "land", "launch", "read_losses", "validation"]


def read_losses(records: list[dict[str, Any]], device: torch.device, state: TrainState
                ) -> list[dict[str, Any]]:
    """The losses of ``records`` as floats (those not read yet), read in one host transfer.
    On CUDA the time this waits for the GPU's queued work is charged to the last record's
    step and to ``state`` (so the step and train seconds add up to the wall-clock time of the
    steps)."""
    unread = [r for r in records if isinstance(r["loss"], torch.Tensor)]
    if not unread:
        return records
    t0 = time.perf_counter()
    values = torch.stack([r["loss"] for r in unread]).float().tolist()
    for r, v in zip(unread, values):
        r["loss"] = v
    if device.type != "cpu":
        waited = time.perf_counter() - t0
        last = records[-1]
        last["step_seconds"] += waited
        last["compute_seconds"] += waited
        state.train_seconds += waited
        last["train_seconds"] = state.train_seconds
    return records


def validation(total: dict[str, float]) -> dict[str, float]:
    """The validation figures from the sums over the ranks (``loss_sum``, ``count``,
    ``job_tokens``, and ``correct`` where the task counts it)."""
    out = {"val_loss": total["loss_sum"] / max(total["count"], 1.0),
           "job_tokens_total": int(total["job_tokens"])}
    if "correct" in total:
        out["val_accuracy"] = total["correct"] / max(total["count"], 1.0)
    return out


@dataclass
class InFlight:
    """An evaluation whose sums are being reduced: its record, the sums' keys, the summed
    tensor and the all-reduce's handle (None in a job of one rank)."""

    record: dict[str, Any]
    keys: list[str]
    sums: torch.Tensor
    work: Any


def launch(record: dict[str, Any], sums: dict[str, float], device: torch.device) -> InFlight:
    """Start summing this rank's ``sums`` over the ranks without waiting (every rank launches
    it at the same sync), for ``record``'s line."""
    keys = sorted(sums)
    t = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=device)
    work = (dist.all_reduce(t, async_op=True)
            if dist.is_initialized() and dist.get_world_size() > 1 else None)
    return InFlight(record, keys, t, work)


def evaluate(sums: dict[str, float], device: torch.device) -> dict[str, float]:
    """:func:`validation` of this rank's ``sums`` summed over every rank, waited for (a
    collective: :func:`launch` and :func:`land` at once)."""
    return land(launch({}, sums, device))


def land(held: InFlight) -> dict[str, float]:
    """The validation figures of an evaluation launched at an earlier sync (it has landed,
    or lands now), written into its record too."""
    if held.work is not None:
        held.work.wait()
    val = validation(dict(zip(held.keys, held.sums.tolist())))
    held.record.update(val)
    return val
