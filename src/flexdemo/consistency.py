"""Replicas agree on their settings before the first step.

Ranks that exchange through a replicator must run the same algorithm: the same base optimizer
and its settings, the same non-finite policy, the same parameter shapes and the same replicator
chain (kinds, settings, payload sizes). Different settings otherwise surface late and
confusingly: payloads of different sizes abort inside the collective library, DiLoCo's syncs of
different periods pair up unrelated steps, different replicators wait for each other until the
timeout, and some differences (a seed, an outer learning rate, the base optimizer) train on
silently while the replicas drift apart.

:func:`check_same_settings` compares a digest of each setting across every group the chain
exchanges over (one all-gather of three integers per group when all agree, a second one of a
digest per setting to name the ones that differ) and raises the same ``ValueError`` on every
rank of a group that disagrees, at construction.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from .dtensor import local_tensor
from .replicate.base import Replicator, setting_names
from .transport import group_ranks, transport_for

_SIMPLE = (type(None), bool, int, float, str)


def _simple(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_simple(v) for v in value)
    return isinstance(value, _SIMPLE)


def replicator_settings(rep: Replicator, prefix: str) -> list[tuple[str, Any]]:
    """``(name, value)`` of a replicator's kind, its constructor settings that it keeps as
    attributes of the same name (nested replicators in turn) and its payload size."""
    out: list[tuple[str, Any]] = [(prefix, type(rep).__name__)]
    for name in setting_names(type(rep)):
        if name == "group":
            continue
        value = getattr(rep, name, getattr(rep, "_" + name, None))
        if isinstance(value, Replicator):
            out += replicator_settings(value, f"{prefix} {name}")
        elif _simple(value):
            out.append((f"{prefix} {name}", value))
        elif callable(settings := getattr(value, "settings", None)):  # DiLoCo's pace
            out.append((f"{prefix} {name}", settings()))
    if rep.shapes is not None:  # set up (a DiLoCo's exchange is not: its copies are)
        out.append((f"{prefix} payload bytes", rep.payload_bytes()))
    return out


def _comparable(value: Any) -> Any:
    """A value as replicas can compare it: a tensor by its values (not its device), other
    objects by their type (their ``repr`` may hold an address)."""
    if _simple(value):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    return type(value).__name__


def optimizer_settings(opt) -> list[tuple[str, Any]]:
    """What replicas of ``opt`` (a :class:`~flexdemo.optim.DeToNATION`) must share."""
    groups = [{k: _comparable(v) for k, v in sorted(g.items()) if k != "params"}
              for g in opt.base.param_groups]
    shapes = [tuple(local_tensor(p).shape) for p in opt.params]
    out: list[tuple[str, Any]] = [
        ("base optimizer", type(opt.base).__name__),
        ("base optimizer settings", groups),
        ("nonfinite", opt.nonfinite),
        ("parameter shapes", shapes),
    ]
    for i, rep in enumerate(opt.replicators):
        out += replicator_settings(rep, f"replicator {i}")
    return out


def _digest(value: Any) -> int:
    raw = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def _gather(values: list[int], group, device: torch.device) -> list[list[int]]:
    tr = transport_for(group)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    out = torch.empty(tr.size * len(values), dtype=torch.int64, device=device)
    work = tr.all_gather_into(out, mine)
    if work is not None:
        work.wait()
    return out.view(tr.size, len(values)).tolist()


def check_same_settings(opt, device: torch.device) -> None:
    """Raise ``ValueError`` on every rank of a replicator's group whose ranks were built with
    other settings than each other (see the module docstring)."""
    fields = optimizer_settings(opt)
    seen: set[int] = set()
    for rep in opt.replicators:
        group = rep.group
        tr = rep.transport  # bound in setup
        if tr.size <= 1 or id(group) in seen:
            continue
        seen.add(id(group))
        shape = [len(fields), _digest([k for k, _ in fields]), _digest(fields)]
        rows = _gather(shape, tr, device)
        if all(r == rows[0] for r in rows):
            continue
        ranks = group_ranks(tr)
        if any(r[:2] != rows[0][:2] for r in rows):  # other kinds: not comparable per setting
            odd = [ranks[i] for i, r in enumerate(rows) if r[:2] != rows[tr.rank][:2]]
            kinds = [v for k, v in fields if k == "base optimizer"
                     or k in {f"replicator {i}" for i in range(len(opt.replicators))}]
            raise ValueError(f"ranks {odd} built another optimizer than this rank (global rank "
                             f"{ranks[tr.rank]}: base optimizer and replicators {kinds}); every "
                             "rank that replicates with another must build it alike")
        per = _gather([_digest(v) for _, v in fields], tr, device)
        diff = [j for j in range(len(fields)) if any(r[j] != per[0][j] for r in per)]
        odd = sorted({ranks[i] for i, r in enumerate(per)
                      if any(r[j] != per[tr.rank][j] for j in diff)})
        said = ", ".join(f"{fields[j][0]} = {fields[j][1]!r}" for j in diff[:4])
        more = f" and {len(diff) - 4} more" if len(diff) > 4 else ""
        raise ValueError(f"ranks {odd} built the optimizer with other settings than this rank "
                         f"(global rank {ranks[tr.rank]}: {said}{more}); every rank that "
                         "replicates with another must build it alike")
