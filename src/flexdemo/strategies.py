"""Named strategies: a replicator, a base optimizer and its learning rate, in one word.

A :class:`Strategy` bundles what :func:`flexdemo.prepare` takes (replicator and its settings,
base optimizer and its settings, learning rate) with a mesh layout (``hybrid``: FSDP2 inside a
node, the replicator across nodes; ``dp``: shard 1, every rank a replica). :data:`STRATEGIES`
is the one table of them that ``flexdemo bench``, ``flexdemo simulate``,
``examples/train_gpt.py`` and ``benchmarks/bench_wire.py`` read; adding one is one entry. A
token may add replicator settings after the name, e.g. ``flexdemo:topk=16:values=int2``
(:func:`parse_strategy`); :func:`check_strategy` also builds the replicator once, so bad
settings fail before anything trains.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field, replace
from typing import Any

from .replicate import FRONTIER, make_replicator

__all__ = ["STRATEGIES", "Strategy", "check_strategy", "parse_strategy"]


@dataclass(frozen=True)
class Strategy:
    """One named strategy: ``about`` (one line for ``--help``), the ``replicator`` and base
    ``optimizer`` by name, the learning rate ``lr``, ``replicator_kwargs``, the mesh ``layout``
    (``"hybrid"`` or ``"dp"``), ``optimizer_kwargs`` and a plot ``color``. Its fields map onto
    :func:`flexdemo.prepare`'s arguments of the same names."""

    about: str
    replicator: str
    optimizer: str
    lr: float
    replicator_kwargs: dict[str, Any] = field(default_factory=dict)
    layout: str = "hybrid"
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)
    """Settings of the base optimizer (e.g. Muon's ``momentum``)."""
    color: str | None = None
    """Its colour in the bench's plots (None: one from a fallback cycle)."""
    batches: str = "equal"
    """How the app sizes each replica's batch (``train.batches``): ``"equal"``, or
    ``"balanced"``: in proportion to each replica's measured speed (for an exchange at every
    step weighted by tokens; other callers of the table train at equal batches)."""

    def settings(self) -> dict[str, Any]:
        """The ``[strategy]`` section of a training config."""
        out: dict[str, Any] = {"replicator": self.replicator, "optimizer": self.optimizer,
                               "lr": self.lr}
        if self.replicator_kwargs:
            out["replicator_kwargs"] = dict(self.replicator_kwargs)
        if self.optimizer_kwargs:
            out["optimizer_kwargs"] = dict(self.optimizer_kwargs)
        return out


# DeMo for short runs: momentum decay 0.9 (the paper's 0.999 remembers ~1000 steps, longer
# than these runs), the top 64 of 4096 DCT coefficients per 64x64 block, sign-SGD at lr 1e-3;
# measured on the 150-step GPT/mini job: val loss 2.40 against 2.65 with the paper's settings;
# in benchmarks/quality.py on that horizon (2 seeds, best lr 1e-3) decay 0.9 beats 0.999 at
# topk 64 (2.547 against 2.638, AdamW 2.505); over 300 steps 0.999 wins (benchmarks/RESULTS.md)
_SHORT_RUN_DEMO = {"topk": 64, "decay": 0.9}

STRATEGIES: dict[str, Strategy] = {
    "flexdemo": Strategy(
        "FlexDeMo: FSDP2 in a node, DeMo (top-64 DCT per block) across nodes, sign-SGD",
        "demo", "sgd", 1e-3, _SHORT_RUN_DEMO, color="#1f77b4"),
    "flexdemo-delayed": Strategy(
        "FlexDeMo whose exchange runs behind the next step's compute: each step applies the "
        "replicas' mean of the step before (overlap='delayed')",
        "demo", "sgd", 1e-3, {**_SHORT_RUN_DEMO, "overlap": "delayed"}, color="#aec7e8"),
    "demo-dp": Strategy(
        "DeMo on plain data parallelism (shard 1), sign-SGD",
        "demo", "sgd", 1e-3, _SHORT_RUN_DEMO, layout="dp", color="#2ca02c"),
    "demo-defaults": Strategy(
        "FlexDeMo at the library's DeMo defaults (top-16 DCT per block, int2 values), "
        "sign-SGD lr 3e-3", "demo", "sgd", 3e-3, color="#17becf"),
    "hsdp-adamw": Strategy(
        "hybrid-sharded AdamW, full fp32 gradient all-reduce across nodes",
        "full", "adamw", 1e-3, color="#d62728"),
    "no-sync": Strategy(
        "AdamW, FSDP2 in a node, no replication across nodes (replicas drift)",
        "none", "adamw", 1e-3, color="#7f7f7f"),
    "floor": Strategy(
        "no replication, plain SGD: the cheapest step (a timing floor)",
        "none", "sgd", 3e-3, color="#bcbd22"),
    # DiLoCo: an app strategy named like a paper runs that paper's algorithm (the replicator of
    # that name, flexdemo.replicate.frontier); "-avg" marks our plain averaging (outer lr 1, no
    # outer momentum), what the DiLoCo rows of benchmarks/RESULTS.md measured
    "diloco": Strategy(
        "DiLoCo: inner AdamW, a full sync every 20 steps, outer Nesterov lr 0.7 / momentum "
        "0.9 (the paper's outer step, H=20 for short runs)",
        "diloco", "adamw", 1e-3, {"inner_steps": 20}, color="#54278f"),
    "diloco-avg": Strategy(
        "DiLoCo with plain averaging (ours: outer lr 1, no outer momentum), inner AdamW, a "
        "full sync every 20 steps", "diloco-avg", "adamw", 1e-3, {"inner_steps": 20},
        color="#9467bd"),
    "diloco-avg-h100": Strategy(
        "DiLoCo with plain averaging (ours), inner AdamW, a full sync every 100 steps",
        "diloco-avg", "adamw", 1e-3, {"inner_steps": 100}, color="#8c564b"),
    "streaming-diloco-avg": Strategy(
        "Streaming DiLoCo's schedule (H=20, 4 fragments, tau=1) with an int4 exchange and "
        "plain averaging (ours; the paper takes an outer Nesterov step)",
        "diloco-avg", "adamw", 1e-3,
        {"inner_steps": 20, "fragments": 4, "tau": 1, "exchange_kwargs": {"values": "int4"}},
        color="#e377c2"),
    "diloco-avg-demo": Strategy(
        "DiLoCo with plain averaging (ours) whose pseudo-gradients cross as the DCT top-128 of "
        "each 64x64 block, with error feedback, every 20 steps", "diloco-avg", "adamw", 1e-3,
        {"inner_steps": 20, "exchange": "demo", "exchange_kwargs": {"topk": 128}},
        color="#ff7f0e"),
    # the Muon family (optimizer "muon": Muon on hidden matrices, AdamW on the rest; lr with
    # match_rms_adamw scaling); lrs from benchmarks/quality.py (benchmarks/RESULTS.md)
    "hsdp-muon": Strategy(
        "hybrid-sharded Muon + AdamW, full fp32 gradient all-reduce across nodes",
        "full", "muon", 1e-2, color="#8c1515"),
    # the papers' algorithms under their names, with Muon inner steps: the replicators
    # "muloco" and "sparseloco" (flexdemo.replicate.frontier, issue 57)
    "muloco": Strategy(
        "MuLoCo (the paper's exchange): 2-bit values with a codebook per tensor and error "
        "feedback 0.9, gathered, every 30 steps, outer Nesterov 0.7 / 0.6, Muon inner steps",
        "muloco", "muon", 1e-2, color="#31a354"),
    "sparseloco": Strategy(
        "SparseLoCo (the paper's): top-64 per chunk of up to 64x64 without a transform, 2-bit "
        "values with a codebook per tensor, error feedback 0.95, the mean over the senders, "
        "every 30 steps, Muon inner steps", "sparseloco", "muon", 1e-2, color="#006d2c"),
    # our variants, named for what they are; what the MuLoCo and SparseLoCo rows of
    # benchmarks/RESULTS.md measured (under the names "muloco" and "sparseloco" before issue 57)
    "muloco-int4": Strategy(
        "the 'muloco-int4' preset (ours): DiLoCo with Muon inner steps, int4 mean by "
        "reduce-scatter every 30 steps, outer Nesterov 0.7 / 0.6", "muloco-int4", "muon", 1e-2,
        color="#74c476"),
    "muloco-int4-h20": Strategy(
        "MuLoCo-style (ours, not the paper's exchange): DiLoCo with Muon inner steps, plain "
        "averaging every 20 steps, int4 exchange", "diloco-avg", "muon", 1e-2,
        {"inner_steps": 20, "exchange_kwargs": {"values": "int4"}}, color="#a1d99b"),
    "sparseloco-dct": Strategy(
        "the 'sparseloco-dct' preset (ours): DiLoCo with Muon inner steps, the top 64 of the "
        "DCT of each 64x64 block of the pseudo-gradient with error feedback, 2-bit codebook "
        "values, the mean over the replicas, every 30 steps",
        "sparseloco-dct", "muon", 1e-2, color="#00441b"),
    # replicas of different speeds (issue 55, docs/stragglers.md): the same exchanges, each
    # replica at its own pace (DiLoCo: its own inner steps per period, measured over its first
    # steps, or at every sync) or with a batch sized to its speed (an exchange at every step,
    # weighted by tokens)
    "muloco-int4-paced": Strategy(
        "the 'muloco-int4' preset (ours) with a pace: each replica syncs after its own inner "
        "steps (measured over the first 8: pace='fixed'), the mean weighted by steps",
        "muloco-int4", "muon", 1e-2, {"pace": "fixed"}, color="#c7e9c0"),
    "muloco-int4-adaptive": Strategy(
        "the 'muloco-int4' preset (ours) with an adaptive pace: each replica's inner steps "
        "measured again at every sync and changed past a tenth of its share "
        "(pace='adaptive'), the mean weighted by steps",
        "muloco-int4", "muon", 1e-2, {"pace": "adaptive"}, color="#807dba"),
    "muloco-int4-timed": Strategy(
        "the 'muloco-int4' preset (ours) with a timed pace (experimental): after the first "
        "period each replica syncs when its own clock says the period's time (the fastest "
        "replica's 30 steps) is up (pace='timed'), the mean weighted by the steps each took",
        "muloco-int4", "muon", 1e-2, {"pace": "timed"}, color="#3f007d"),
    "muloco-int4-fill": Strategy(
        "the 'muloco-int4' preset (ours) with a filling pace: the slowest replica takes its "
        "count and the others take steps until it arrives (pace='fill'), the mean weighted "
        "by the steps each took",
        "muloco-int4", "muon", 1e-2, {"pace": "fill"}, color="#e6550d"),
    "muloco-int4-fill-overlap": Strategy(
        "the 'muloco-int4-fill' strategy with each sync overlapped with the next 4 steps of "
        "the fastest replica (tau=4, each replica its share of them; keep_overlap: a replica "
        "keeps the steps it takes while its sync is in flight)",
        "muloco-int4", "muon", 1e-2, {"pace": "fill", "tau": 4, "keep_overlap": True},
        color="#a63603"),
    "muloco-paced": Strategy(
        "MuLoCo (the paper's exchange) with a pace: each replica syncs after its own inner "
        "steps (measured over the first 8: pace='fixed'), the mean weighted by steps",
        "muloco", "muon", 1e-2, {"pace": "fixed"}, color="#41ab5d"),
    "flexdemo-balanced": Strategy(
        "FlexDeMo with balanced batches: each replica's batch sized to its measured speed "
        "(train.batches='balanced'), the mean weighted by tokens",
        "demo", "sgd", 1e-3, {**_SHORT_RUN_DEMO, "weights": "tokens"}, batches="balanced",
        color="#6baed6"),
    # measured, not named: the link and the step decide among the quality ranking's entries
    # (flexdemo.auto, docs/auto.md), with Muon inner steps as in the ranking's tables
    "auto": Strategy(
        "auto: probe the link, time the first steps, then the best-ranked strategy (full "
        "sync, or our DiLoCo int4, muloco-int4 and sparseloco-dct variants, ...) whose "
        "exposed communication fits 5 percent of the step",
        "auto", "muon", 1e-2, color="#fd8d3c"),
    "flexdemo-muon": Strategy(
        "FlexDeMo with an orthogonalised step: DeMo top-64 DCT per block (decay 0.9) across "
        "nodes, the decoded mean orthogonalised (Muon without momentum) instead of sign()",
        "demo", "muon", 3e-2, {"topk": 64, "decay": 0.9, "sign": False, "scale_by_lr": False},
        optimizer_kwargs={"momentum": 0.0}, color="#756bb1"),
}


def _value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def parse_strategy(token: str) -> Strategy:
    """A strategy by name, with optional replicator settings after it:
    ``flexdemo:values=int2:topk=16``. Raises ``ValueError`` with a one-line message."""
    name, *settings = token.split(":")
    if name not in STRATEGIES:
        close = difflib.get_close_matches(name, list(STRATEGIES), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown strategy {name!r}{hint}; choose from "
                         f"{', '.join(STRATEGIES)}")
    kwargs = dict(STRATEGIES[name].replicator_kwargs)
    for item in settings:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"bad setting {item!r} in {token!r}; write key=value")
        kwargs[key] = _value(value)
    return replace(STRATEGIES[name], replicator_kwargs=kwargs)


def _diloco_fit(kwargs: dict[str, Any]) -> dict[str, int]:
    """For DiLoCo settings whose ``fragments``/``tau`` do not fit ``inner_steps``: the
    largest fragment count (at most the given one) dividing ``inner_steps`` and the largest
    ``tau`` (at most the given one) below ``inner_steps / fragments``; only changed keys."""
    h, f, tau = kwargs.get("inner_steps", 100), kwargs.get("fragments", 1), kwargs.get("tau", 0)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (h, f, tau)):
        return {}
    if h < 1 or f < 1 or tau < 0:
        return {}
    f2 = max(d for d in range(1, min(f, h) + 1) if h % d == 0)
    tau2 = min(tau, h // f2 - 1)
    return {k: v for k, v, old in (("fragments", f2, f), ("tau", tau2, tau)) if v != old}


def check_strategy(token: str) -> Strategy:
    """:func:`parse_strategy`, then build its replicator once to check the settings (before
    anything trains). Raises ``ValueError`` with a one-line message that names the token and,
    where the preset's own settings clash with the ones given, which to set as well."""
    strategy = parse_strategy(token)
    kwargs = strategy.replicator_kwargs
    try:
        make_replicator(strategy.replicator, **kwargs)
    except (TypeError, ValueError) as e:
        text = " ".join(str(e).split())
        name, *given = token.split(":")
        preset = STRATEGIES[name].replicator_kwargs
        own = {item.partition("=")[0] for item in given}
        kept = {k: v for k, v in preset.items()
                if k not in own and re.search(rf"(?<![\w']){re.escape(k)}\b(?!')", text)}
        hint = ""
        if strategy.replicator == "diloco" or strategy.replicator in FRONTIER:  # DiLoCo
            fix = _diloco_fit({**FRONTIER.get(strategy.replicator, {}), **kwargs})
            kept = {k: preset[k] for k in fix if k in preset and k not in own} or kept
            if fix and not set(fix) & own:
                try:
                    make_replicator(strategy.replicator, **{**kwargs, **fix})
                except (TypeError, ValueError):
                    fix = {}
                if fix:
                    extra = ":".join(f"{k}={v}" for k, v in fix.items())
                    hint = f", e.g. --strategy {token}:{extra}"
        if kept:
            settings = ", ".join(f"{k}={v}" for k, v in kept.items())
            one = len(kept) == 1
            text += (f" (the strategy {name!r} sets {settings}, which {'does' if one else 'do'} "
                     f"not fit the settings given; set {'it' if one else 'them'} too{hint})")
        raise ValueError(f"strategy {token!r}: {text}") from None
    return strategy
