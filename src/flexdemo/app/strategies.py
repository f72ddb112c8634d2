"""The named strategies: one table for ``flexdemo bench``, ``examples/train_gpt.py`` and
``benchmarks/bench_wire.py``.

A strategy is a replicator, a base optimizer and its learning rate, replicator settings, and
a mesh layout (``hybrid``: FSDP2 inside a node, the replicator across nodes; ``dp``: shard 1,
every rank a replica). Adding one is one entry in :data:`STRATEGIES`. A token may add
replicator settings after the name, e.g. ``flexdemo:topk=16:values=int2``
(:func:`parse_strategy`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["STRATEGIES", "Strategy", "parse_strategy"]


@dataclass(frozen=True)
class Strategy:
    """One named strategy (see the module docstring)."""

    about: str
    replicator: str
    optimizer: str
    lr: float
    replicator_kwargs: dict[str, Any] = field(default_factory=dict)
    layout: str = "hybrid"
    color: str | None = None
    """Its colour in the bench's plots (None: one from a fallback cycle)."""

    def settings(self) -> dict[str, Any]:
        """The ``[strategy]`` section of a training config."""
        out: dict[str, Any] = {"replicator": self.replicator, "optimizer": self.optimizer,
                               "lr": self.lr}
        if self.replicator_kwargs:
            out["replicator_kwargs"] = dict(self.replicator_kwargs)
        return out


# DeMo for short runs: momentum decay 0.9 (the paper's 0.999 remembers ~1000 steps, longer
# than these runs), the top 64 of 4096 DCT coefficients per 64x64 block, sign-SGD at lr 1e-3;
# measured on the 150-step GPT/mini job: val loss 2.40 against 2.65 with the paper's settings;
# in benchmarks/quality.py on that horizon (2 seeds, best lr 1e-3) decay 0.9 beats 0.999 at
# topk 64 (2.547 against 2.638, AdamW 2.505); over 300 steps 0.999 wins (README)
_SHORT_RUN_DEMO = {"topk": 64, "decay": 0.9}

STRATEGIES: dict[str, Strategy] = {
    "flexdemo": Strategy(
        "FlexDeMo: FSDP2 in a node, DeMo (top-64 DCT per block) across nodes, sign-SGD",
        "demo", "sgd", 1e-3, _SHORT_RUN_DEMO, color="#1f77b4"),
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
    "diloco": Strategy(
        "DiLoCo: inner AdamW, full sync (outer averaging) every 20 steps",
        "diloco", "adamw", 1e-3, {"inner_steps": 20}, color="#9467bd"),
    "diloco-h100": Strategy(
        "DiLoCo with a full sync every 100 steps",
        "diloco", "adamw", 1e-3, {"inner_steps": 100}, color="#8c564b"),
    "streaming-diloco": Strategy(
        "Streaming DiLoCo: H=20, 4 fragments, tau=1, int4 exchange",
        "diloco", "adamw", 1e-3,
        {"inner_steps": 20, "fragments": 4, "tau": 1, "exchange_kwargs": {"values": "int4"}},
        color="#e377c2"),
    "demo-diloco": Strategy(
        "DiLoCo whose pseudo-gradients cross as the DCT top-128 of each 64x64 block, with "
        "error feedback", "diloco", "adamw", 1e-3,
        {"inner_steps": 20, "exchange": "demo", "exchange_kwargs": {"topk": 128}},
        color="#ff7f0e"),
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
