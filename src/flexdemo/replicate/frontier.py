"""Named DiLoCo settings at the byte frontier: ``"muloco"`` and ``"sparseloco"``.

Each is a :class:`~flexdemo.replicate.diloco.DiLoCoReplicator` with the settings that the
quality benchmark (``benchmarks/quality.py``, ``benchmarks/RESULTS.md``) put at the front of
validation loss against bytes per parameter per step, for any inner optimizer
(``prepare(model, "muloco", optimizer="muon")`` is MuLoCo; ``optimizer="adamw"`` its AdamW
variant):

* ``"muloco"``: a dense exchange of the pseudo-gradient, int4 with a scale per 128 values,
  averaged by reduce-scatter (each chunk's mean quantised again by its owner, then
  all-gathered: at most two payloads per rank whatever the number of replicas), every 30
  steps, and an outer Nesterov step (lr 0.7, momentum 0.6);
* ``"sparseloco"``: the pseudo-gradient accumulated in an error-feedback buffer (decay 0.95,
  which takes the place of outer momentum: outer lr 1.0, none), the top 64 of the 4096 DCT
  coefficients of each 64 x 64 block of it sent every 30 steps (12-bit indices, 2-bit values
  from a statistical codebook), averaged over the replicas. In the quality benchmark the DCT
  beat plain blocks, and the mean over all replicas beat the mean over the replicas that sent
  a coordinate (``exchange="topk"`` and ``"mean": "senders"`` give SparseLoCo's own choices).
  Its mean is gathered (``n - 1`` payloads per rank); ``"reduce": "scatter"`` (by block
  owners, selected again) and ``"reduce": "shared"`` (one shared index set, the values
  averaged by block owners) keep the bytes per rank within 2x from 2 to 8 replicas.

Settings given with the name override the preset's; ``exchange_kwargs`` are merged into the
preset's own (``replicator_kwargs={"exchange_kwargs": {"topk": 128}}`` keeps the rest).
"""

from __future__ import annotations

from typing import Any

from .diloco import DiLoCoReplicator

FRONTIER: dict[str, dict[str, Any]] = {
    "muloco": {"inner_steps": 30, "outer_lr": 0.7, "outer_momentum": 0.6,
               "exchange": "full", "exchange_kwargs": {"values": "int4", "reduce": "scatter"}},
    "sparseloco": {"inner_steps": 30, "outer_lr": 1.0, "outer_momentum": 0.0,
                   "exchange": "demo",
                   "exchange_kwargs": {"topk": 64, "chunk": 64, "values": "stat2",
                                       "decay": 0.95}},
}


def frontier_settings(name: str, **overrides) -> dict[str, Any]:
    """The DiLoCo settings of preset ``name`` with ``overrides`` (``exchange_kwargs`` merged
    into the preset's; a new ``exchange`` replaces the preset's ``exchange_kwargs``)."""
    if name not in FRONTIER:
        raise ValueError(f"unknown frontier preset {name!r}; choose one of {sorted(FRONTIER)}")
    base = {**FRONTIER[name]}
    if "exchange" in overrides and overrides["exchange"] != base["exchange"]:
        base.pop("exchange_kwargs")
    merged = {**base.get("exchange_kwargs", {}), **(overrides.pop("exchange_kwargs", None) or {})}
    out = {**base, **overrides}
    if merged:
        out["exchange_kwargs"] = merged
    return out


def muloco(**overrides) -> DiLoCoReplicator:
    """MuLoCo's settings (see the module): int4 reduce-scatter every 30 steps, outer
    Nesterov 0.7 / 0.6; ``overrides`` as :func:`frontier_settings`."""
    return DiLoCoReplicator(**frontier_settings("muloco", **overrides))


def sparseloco(**overrides) -> DiLoCoReplicator:
    """SparseLoCo's settings (see the module): top-64 of 4096 with 2-bit codebook values and
    error feedback 0.95 every 30 steps, outer lr 1.0; ``overrides`` as
    :func:`frontier_settings`."""
    return DiLoCoReplicator(**frontier_settings("sparseloco", **overrides))
