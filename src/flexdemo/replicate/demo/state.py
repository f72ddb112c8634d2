"""DeMo's checkpoint state: the momentum buffers, the dropped-payload counter, and in delayed
mode the exchange in flight and the verdict not yet judged (so a resumed run has the bits of
an uninterrupted one). Momentum saved before split tensors existed is converted on load."""

from __future__ import annotations

from typing import Any

import torch

from ...compress import BlockDCT
from ...transport import Pending
from .checks import arrived

# a DeMoReplicator (not imported: the replicator imports this module)
DeMo = Any


def save(rep: DeMo, sd: dict) -> dict:
    """``sd`` (the base class's state) with ``rep``'s momentum, counter and delayed state."""
    sd["delta"] = [d.reshape(d.shape[0], -1).clone() for d in rep.delta]
    sd["dropped_payloads"] = rep.dropped_payloads
    if rep._inflight is not None:
        step, handle, plan, row = rep._inflight
        gathered = handle.wait() if isinstance(handle, Pending) else handle
        rep._inflight = (step, gathered, plan, row)
        present = plan.key[0]
        sd["inflight"] = {"step": step, "gathered": gathered.clone(), "code": plan.code,
                          "present": list(present), "row": row}
    if rep._pending is not None:  # a verdict not yet judged: judged after a resume
        step, code, host = arrived(rep._pending)
        sd["verdict"] = {"step": step, "code": code, "rows": host.clone()}
    return sd


def _from_unsplit(rep: DeMo, deltas: list) -> list | None:
    """Momentum saved before tensors whose rows need padding were split (one buffer in
    the parameter's domain for each), in today's units: the tiling rows transformed,
    the rest as they were; None where ``deltas`` is not of that layout."""
    units = rep.units
    split = sum(u.part is not None and u.part[0] == 0 for u in units)
    if not split or len(deltas) != len(units) - split:
        return None
    out, theirs = [], iter(deltas)
    for j, u in enumerate(units):
        if u.part is None:
            out.append(next(theirs))
        elif u.part[0] == 0:
            whole, tile = next(theirs), u.part[1]
            rows = units[j + 1].part[1]
            if whole is None or whole.numel() != rows * u.plan.shape2d[1]:
                return None
            whole = whole.to(rep.device, torch.float32).reshape(rows, -1)
            basis = "dct" if rep.transform == "dct" else "identity"
            out.append(BlockDCT(u.plan, rep.device, basis=basis).encode(whole[:tile]))
            out.append(whole[tile:])
    return out


def check_loadable(rep: DeMo, sd: dict) -> list:
    """The momentum buffers of ``sd`` in ``rep``'s units (converted from the unsplit layout
    where needed); raises ValueError where they do not fit ``rep``."""
    deltas = sd["delta"]
    units = rep.units
    if len(deltas) != len(units):
        deltas = _from_unsplit(rep, deltas) or deltas
    if len(deltas) != len(units):
        raise ValueError(f"{rep.name}: state holds {len(deltas)} momentum buffers, this "
                         f"replicator has {len(units)} (another model or settings?)")
    for i, (u, theirs) in enumerate(zip(units, deltas)):
        if theirs is None or (theirs.shape[0], theirs.numel()) != (u.delta.shape[0],
                                                                    u.delta.numel()):
            raise ValueError(f"{rep.name}: momentum {i} has shape "
                             f"{None if theirs is None else tuple(theirs.shape)}, "
                             f"expected {tuple(u.delta.reshape(u.delta.shape[0], -1).shape)} "
                             "(another model or mesh?)")
    return deltas


def load(rep: DeMo, sd: dict, deltas: list) -> None:
    """``rep``'s momentum (``deltas``, from :func:`check_loadable`), counter and delayed
    state from ``sd``."""
    for u, theirs in zip(rep.units, deltas):
        u.delta.copy_(theirs.reshape(u.delta.shape))
    rep.dropped_payloads = int(sd.get("dropped_payloads", 0))
    verdict = sd.get("verdict")
    rep._pending = None
    if verdict is not None:
        rows = verdict["rows"].to("cpu", torch.int64)
        rows._flexdemo_host_copy = True
        rep._pending = (int(verdict["step"]), int(verdict["code"]), rows, None)
    inflight = sd.get("inflight")
    rep._inflight = None
    if inflight is not None:
        present = tuple(bool(p) for p in inflight.get("present", [True] * len(rep._shapes)))
        rep._inflight = (int(inflight["step"]), inflight["gathered"].to(rep.device),
                         rep.staging_plans.plan(present, None),
                         int(inflight.get("row", rep.rank)))
