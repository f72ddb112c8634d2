"""Named DiLoCo settings: a paper's name runs that paper's algorithm with its published
defaults; our own variants carry names of their own.

Each is a :class:`~flexdemo.replicate.diloco.DiLoCoReplicator` with these settings, for any
inner optimizer (``prepare(model, "muloco", optimizer="muon")`` is MuLoCo; ``optimizer=
"adamw"`` its AdamW variant). The papers' presets (``tests/test_parity.py`` checks each
against a reference written from the paper's description):

* ``"diloco"`` (the class itself, not in this table): DiLoCo's outer Nesterov step, lr 0.7,
  momentum 0.9, every ``inner_steps`` (100 by default) steps, an fp32 mean;
* ``"muloco"``: MuLoCo's exchange, every 30 steps: the pseudo-gradient accumulated in an
  error-feedback buffer (``e = 0.9 e + delta``), each tensor of it coded in 2 bits with a
  statistical codebook of its own (4 bins of 1.5 std around the tensor's mean, decoded to
  the bins' fp32 means: ``"stat2-tensor"``), what was sent leaving the buffer, the peers'
  values gathered and averaged, and an outer Nesterov step (lr 0.7, momentum 0.6);
* ``"sparseloco"``: SparseLoCo's: the pseudo-gradient accumulated in an error-feedback buffer
  (decay 0.95, in place of outer momentum: outer lr 1.0, none), no transform, each tensor cut
  into chunks whose sides are the largest divisors up to 64 of its own (1-D and small tensors
  alike), the top ``64 x chunk / 4096`` of each chunk sent (rounded, at least 1: 64 of a full
  64 x 64 chunk) with one 2-bit codebook per tensor (``"stat2-tensor"``), each coordinate
  averaged over the replicas that sent it, every 30 steps. The authors' production run also
  clips each peer's contribution to the median norm: ``exchange_kwargs={"clip": "median"}``
  (ours clips a peer's whole payload, theirs each tensor).

Our variants, measured (``benchmarks/archive/results-until-2026-12-07.md``) under the names
the papers now hold:

* ``"diloco-avg"``: DiLoCo with plain averaging (outer lr 1.0, no momentum): the class's
  default until issue 57, and the ``"diloco"`` of the runs measured before;
* ``"muloco-int4"``: a dense int4 exchange (a scale per 128 values), averaged by
  reduce-scatter (at most two payloads per rank whatever the number of replicas), no error
  feedback, every 30 steps, outer Nesterov 0.7 / 0.6: the ``"muloco"`` preset measured before;
* ``"sparseloco-dct"``: the top 64 of the 4096 DCT coefficients of each 64 x 64 block (the
  small and 1-D tensors batched into blocks, sides that 64 does not divide padded, ``k``
  fixed), 12-bit indices, stat2 values (a codebook per block), error feedback 0.95, the mean
  over all replicas (a coordinate one of two replicas sent gets half its step), outer lr 1.0,
  every 30 steps: the ``"sparseloco"`` preset measured before (in the quality benchmark the
  DCT beat plain blocks and the mean over the replicas beat the mean over the senders).

Settings given with the name override the preset's; ``exchange_kwargs`` are merged into the
preset's own (``replicator_kwargs={"exchange_kwargs": {"topk": 128}}`` keeps the rest).
"""

from __future__ import annotations

from typing import Any

from .diloco import DiLoCoReplicator

_SPARSE_DCT = {"topk": 64, "chunk": 64, "values": "stat2", "decay": 0.95}

FRONTIER: dict[str, dict[str, Any]] = {
    # the papers' algorithms with their published defaults
    "muloco": {"inner_steps": 30, "outer_lr": 0.7, "outer_momentum": 0.6,
               "exchange": "full",
               "exchange_kwargs": {"values": "stat2-tensor", "error_feedback": 0.9}},
    "sparseloco": {"inner_steps": 30, "outer_lr": 1.0, "outer_momentum": 0.0,
                   "exchange": "topk",
                   "exchange_kwargs": {"topk": 64, "chunk": 64, "chunking": "divisor",
                                       "small": "separate", "values": "stat2-tensor",
                                       "decay": 0.95, "mean": "senders"}},
    # our variants (what the names above meant before issue 57)
    "diloco-avg": {"outer_lr": 1.0, "outer_momentum": 0.0},
    "muloco-int4": {"inner_steps": 30, "outer_lr": 0.7, "outer_momentum": 0.6,
                    "exchange": "full", "exchange_kwargs": {"values": "int4",
                                                            "reduce": "scatter"}},
    "sparseloco-dct": {"inner_steps": 30, "outer_lr": 1.0, "outer_momentum": 0.0,
                       "exchange": "demo", "exchange_kwargs": dict(_SPARSE_DCT)},
}


def frontier_settings(name: str, **overrides) -> dict[str, Any]:
    """The DiLoCo settings of preset ``name`` with ``overrides`` (``exchange_kwargs`` merged
    into the preset's; a new ``exchange`` replaces the preset's ``exchange_kwargs``)."""
    if name not in FRONTIER:
        raise ValueError(f"unknown frontier preset {name!r}; choose one of {sorted(FRONTIER)}")
    base = {**FRONTIER[name]}
    if "exchange" in overrides and overrides["exchange"] != base.get("exchange", "full"):
        base.pop("exchange_kwargs", None)
    merged = {**base.get("exchange_kwargs", {}), **(overrides.pop("exchange_kwargs", None) or {})}
    out = {**base, **overrides}
    if merged:
        out["exchange_kwargs"] = merged
    return out


def frontier_preset(name: str, **overrides) -> DiLoCoReplicator:
    """The DiLoCo replicator of preset ``name`` (see the module), ``overrides`` as
    :func:`frontier_settings`."""
    return DiLoCoReplicator(**frontier_settings(name, **overrides))


def muloco(**overrides) -> DiLoCoReplicator:
    """MuLoCo (see the module): 2-bit values with a codebook per tensor and error feedback
    0.9, gathered, every 30 steps, outer Nesterov 0.7 / 0.6."""
    return frontier_preset("muloco", **overrides)


def sparseloco(**overrides) -> DiLoCoReplicator:
    """SparseLoCo (see the module): the top 64 of each chunk up to 64 x 64 (k scaled), no
    transform, 2-bit values with a codebook per tensor, error feedback 0.95, the mean over the
    senders, every 30 steps, outer lr 1.0."""
    return frontier_preset("sparseloco", **overrides)
