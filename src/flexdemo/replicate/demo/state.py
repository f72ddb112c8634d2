"""DeMo's checkpoint state: the momentum buffers and the dropped-payload counter (in delayed
mode the exchange in flight and the verdict not yet judged are the replicator's
:class:`~.delayed.InFlight`'s). Momentum saved before split tensors existed is converted on
load. The functions read the replicator's public attributes only."""

from __future__ import annotations

from typing import Any

import torch

from ...compress import BlockDCT

# a DeMoReplicator (not imported: the replicator imports this module)
DeMo = Any


def save(rep: DeMo, sd: dict, copy: bool = True) -> dict:
    """``sd`` (the base class's state) with ``rep``'s momentum (copied as ``(rows, -1)``, or
    the live buffers themselves when not ``copy``: a reshape of a non-contiguous buffer would
    copy it; :func:`check_loadable` takes either) and counter."""
    rep.host_momentum.settle()  # offload=True: every host copy complete
    sd["delta"] = ([d.reshape(d.shape[0], -1).clone() for d in rep.delta] if copy
                   else list(rep.delta))
    sd["dropped_payloads"] = rep.dropped_payloads
    return sd


def reset(rep: DeMo) -> None:
    """``rep``'s per-replica state from zero: the momentum, the delayed mode's exchange in
    flight and its verdict."""
    rep.host_momentum.settle()  # no group on its way back over the zeros
    with torch.no_grad():
        for d in rep.delta:
            d.zero_()
    rep.inflight.clear()


def live_tensors(rep: DeMo) -> list[torch.Tensor]:
    """The tensors of ``rep``'s state as they live (no copies): the momentum, and in delayed
    mode the payloads in flight."""
    return list(rep.delta) + rep.inflight.held()


def _runs(rep: DeMo) -> list[list]:
    """``rep``'s units by parameter: the units of one split parameter together, the others
    alone."""
    runs: list[list] = []
    for u in rep.units:
        prev = runs[-1][0] if runs else None
        if (u.part is not None and prev is not None and prev.part is not None
                and prev.members == u.members):
            runs[-1].append(u)
        else:
            runs.append([u])
    return runs


def _regrouped(rep: DeMo, deltas: list) -> list | None:
    """Momentum saved with other splits of the parameters, in today's units; None where
    ``deltas`` is of no known layout: the coefficients of a parameter's tiling rows in any
    number of buffers (block after block: saved under another ``group_numel``, or before
    tensors were split to fit one), or :func:`_from_per_param`'s layout."""
    out: list = []
    i = 0
    for run in _runs(rep):
        tiling = [u for u in run if not u.padded and not u.flat]
        if tiling:
            sizes, parts, got = [u.plan.num_blocks for u in tiling], [], 0
            width = tiling[0].plan.block_numel
            while got < sum(sizes) and i < len(deltas) and deltas[i] is not None \
                    and deltas[i].dim() == 2 and deltas[i].shape[1] == width:
                parts.append(deltas[i])
                got, i = got + deltas[i].shape[0], i + 1
            if got != sum(sizes):
                return _from_per_param(rep, deltas)
            out.extend(torch.cat(parts).split(sizes) if len(parts) > 1 or len(sizes) > 1
                       else parts)
        for _ in run[len(tiling):]:  # a padded rest, or a unit in the parameter's domain
            if i >= len(deltas):
                return _from_per_param(rep, deltas)
            out.append(deltas[i])
            i += 1
    return out if i == len(deltas) else _from_per_param(rep, deltas)


def _from_per_param(rep: DeMo, deltas: list) -> list | None:
    """Momentum saved before tensors whose rows need padding were split: one buffer per
    parameter, in the parameter's domain for those (their tiling rows are transformed)."""
    runs = _runs(rep)
    if len(deltas) != len(runs):
        return None
    out = []
    for run, theirs in zip(runs, deltas):
        if len(run) == 1 or not run[-1].padded:
            if len(run) > 1:  # a tiling parameter split since
                if theirs is None or theirs.shape[0] != sum(u.plan.num_blocks for u in run):
                    return None
                out.extend(theirs.split([u.plan.num_blocks for u in run]))
            else:
                out.append(theirs)
            continue
        rest, cols = run[-1], run[0].plan.shape2d[1]
        if theirs is None or theirs.numel() != rest.part[1] * cols:
            return None
        whole = theirs.to(rep.device, torch.float32).reshape(rest.part[1], cols)
        basis = "dct" if rep.transform == "dct" else "identity"
        out.extend(BlockDCT(u.plan, rep.device, basis=basis).encode(whole[u.part[0]: u.part[1]])
                   for u in run[:-1])
        out.append(whole[rest.part[0]:])
    return out


def check_loadable(rep: DeMo, sd: dict) -> list:
    """The momentum buffers of ``sd`` in ``rep``'s units (converted from the unsplit layout
    where needed); raises ValueError where they do not fit ``rep``."""
    deltas = sd["delta"]
    units = rep.units
    if len(deltas) != len(units):
        deltas = _regrouped(rep, deltas) or deltas
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
    """``rep``'s momentum (``deltas``, from :func:`check_loadable`) and counter from
    ``sd``."""
    rep.host_momentum.settle()
    for u, theirs in zip(rep.units, deltas):
        u.delta.copy_(theirs.reshape(u.delta.shape))
    rep.dropped_payloads = int(sd.get("dropped_payloads", 0))
