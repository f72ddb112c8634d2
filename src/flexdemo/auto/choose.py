"""The choice: the best-ranked strategy whose exposed communication fits the step's budget.

* The candidates and their order come from ``quality_ranking.json`` next to this module
  (:func:`load_ranking`): the quality benchmark's measured gap to full sync with the same inner
  optimizer, each entry with its provenance in ``benchmarks/archive/results-until-2026-12-07.md``.
* Their bytes are exact (:func:`size_candidate`): each candidate's replicator is set up on the
  model's local shapes, on the ``meta`` device, over a :class:`SizingTransport` of the group's
  size, and asked for its own :meth:`~flexdemo.replicate.Replicator.exchange_bytes` (DiLoCo:
  one per fragment, over a period of ``inner_steps``).
* A sync of ``B`` bytes in ``c`` collectives takes ``c * latency + B / bandwidth``; a sync that
  runs behind ``tau`` steps of compute (streaming DiLoCo's ``tau``, DeMo's
  ``overlap="delayed"``: 1) exposes only what exceeds ``tau * compute``
  (:meth:`Sizing.exposed_seconds`). The exposed share of a step is
  ``exposed / (compute + exposed)``.
* :func:`choose` takes the first candidate, in ranking order, whose share is within the budget;
  when none is, the one with the smallest share (the line says so).
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..replicate import make_replicator
from ..transport import Transport
from .link import Link

__all__ = ["RANKING_FILE", "Candidate", "Decision", "Sizing", "SizingTransport", "choose",
           "load_ranking", "size_candidate", "sync_slots"]

RANKING_FILE = Path(__file__).with_name("quality_ranking.json")


@dataclass(frozen=True)
class Candidate:
    """One entry of the ranking: a replicator by name and settings, its measured ``gap`` to
    full sync (0.059: 5.9% above) and where that number comes from (``provenance``)."""

    name: str
    label: str
    replicator: str
    replicator_kwargs: dict = field(default_factory=dict)
    gap: float = 0.0
    provenance: dict = field(default_factory=dict)


def load_ranking(path: str | Path | None = None) -> list[Candidate]:
    """The candidates of ``path`` (default: the package's ``quality_ranking.json``), in rank
    order (best measured quality first)."""
    data = json.loads(Path(path or RANKING_FILE).read_text())
    return [Candidate(**entry) for entry in data["entries"]]


class SizingTransport(Transport):
    """A group of ``size`` ranks that moves nothing: replicators set up over it (on ``meta``
    tensors) tell their exact payload sizes without a collective (``sizing_only``)."""

    sizing_only = True

    def __init__(self, size: int) -> None:
        self.size, self.rank = size, 0

    def global_rank(self, r: int) -> int:
        return r

    def all_reduce_sum_(self, buf, async_op=False):
        return None

    def all_gather_into(self, out, inp, async_op=False):
        return None

    def all_to_all_equal_(self, out, inp, async_op=False):
        return None


def sync_slots(candidate: Candidate) -> int:
    """How many syncs ``candidate`` has per period (its fragments), known before sizing."""
    return int(candidate.replicator_kwargs.get("fragments", 1))


@dataclass(frozen=True)
class Sizing:
    """What one rank sends for a candidate: ``syncs`` (bytes of each sync in a ``period`` of
    steps), each in ``collectives`` collectives, each running behind ``overlap`` steps."""

    period: int
    syncs: tuple[int, ...]
    collectives: int = 1
    overlap: int = 0

    @property
    def bytes_per_step(self) -> float:
        return sum(self.syncs) / self.period

    def exposed_seconds(self, link: Link, compute: float) -> float:
        """Communication per step that no compute hides, on ``link``."""
        hidden = self.overlap * compute
        return sum(max(0.0, link.seconds_for(b, self.collectives) - hidden)
                   for b in self.syncs) / self.period


def size_candidate(candidate: Candidate, shapes: list[torch.Size],
                   world: int) -> Sizing | None:
    """The exact bytes of ``candidate`` for these local parameter ``shapes`` and ``world``
    replicas, from its replicator's own accounting (set up on ``meta``, nothing allocated);
    None where its settings do not fit the model (e.g. more fragments than tensors)."""
    rep = make_replicator(candidate.replicator, **copy.deepcopy(candidate.replicator_kwargs))
    params = [torch.empty(s, device="meta") for s in shapes]
    try:
        rep.setup(list(shapes), torch.device("meta"), SizingTransport(world), params=params)
    except ValueError:
        return None
    exchanges = getattr(rep, "exchanges", None)
    if exchanges is not None:  # DiLoCo: every fragment once per period of inner_steps
        scatter = any(getattr(ex, "reduce", None) == "scatter" for ex in exchanges)
        return Sizing(int(rep.inner_steps),  # type: ignore[attr-defined]  # DiLoCo's
                      tuple(int(ex.exchange_bytes()) for ex in exchanges),
                      2 if scatter else 1, int(getattr(rep, "tau", 0)))
    scatter = getattr(rep, "reduce", None) == "scatter"
    delayed = getattr(rep, "overlap", "none") == "delayed"
    return Sizing(rep.replicate_every, (int(rep.exchange_bytes()),), 2 if scatter else 1,
                  1 if delayed else 0)


def _mb(nbytes: float) -> str:
    x = nbytes / 1e6
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def _ms(seconds: float) -> str:
    x = seconds * 1e3
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


@dataclass(frozen=True)
class Decision:
    """What ``"auto"`` chose and from what: the candidate (``name``, ``label``, its
    ``replicator`` and ``replicator_kwargs``), the inputs (``replicas``, ``link``,
    ``compute_seconds`` per step, ``budget``) and the result (``bytes_per_step`` one rank
    sends, ``exposed_seconds`` per step, ``reason``), taken at optimizer step ``step``;
    ``considered``: every candidate's name, bytes per step and exposed share."""

    name: str
    label: str
    replicator: str
    replicator_kwargs: dict
    replicas: int
    link: Link
    compute_seconds: float
    budget: float
    bytes_per_step: float = 0.0
    exposed_seconds: float = 0.0
    reason: str = ""
    step: int = 0
    considered: tuple = ()

    @property
    def exposed_share(self) -> float:
        """The exposed communication's share of a step."""
        total = self.compute_seconds + self.exposed_seconds
        return self.exposed_seconds / total if total > 0 else 0.0

    def line(self) -> str:
        """The one log line: ``auto: 97 Mbit/s, 0.4 ms between 4 replicas; compute 250
        ms/step -> muloco-int4 H=30 int4 (reduce-scatter) (0.011 MB/step, exposed comm 1.2%)``."""
        if self.replicas <= 1:
            return f"auto: a single replica, nothing to send -> {self.label} ({self.reason})"
        link = self.link
        where = {"given": " (given)", "in-band": " (in-band)"}.get(link.source, "")
        head = link.describe() + where
        if link.source == "fallback":
            head = f"assuming {link.describe()} ({self.reason.split(';')[0]})"
        out = (f"auto: {head} between {self.replicas} replicas; compute "
               f"{_ms(self.compute_seconds)} ms/step -> {self.label} "
               f"({_mb(self.bytes_per_step)} MB/step, exposed comm "
               f"{self.exposed_share * 100:.2g}%")
        if self.exposed_share > self.budget:
            out += f": nothing fits the {self.budget * 100:.2g}% budget, the least exposed"
        return out + ")"

    def as_dict(self) -> dict:
        """JSON values (checkpoints, metrics, the app's summary)."""
        out = asdict(self)
        out["link"] = self.link.as_dict()
        out["considered"] = [list(c) for c in self.considered]
        out["exposed_share"] = self.exposed_share
        return out

    @classmethod
    def from_dict(cls, d: dict) -> Decision:
        d = {k: v for k, v in d.items() if k != "exposed_share"}
        d["link"] = Link(**d["link"])
        d["considered"] = tuple(tuple(c) for c in d.get("considered", ()))
        return cls(**d)


def choose(candidates: list[Candidate], sizings: list[Sizing | None], link: Link,
           compute: float, replicas: int, budget: float = 0.05, step: int = 0,
           note: str = "") -> Decision:
    """The first of ``candidates`` (rank order) whose exposed communication on ``link`` is at
    most ``budget`` of a step of ``compute`` seconds; when none is, the least exposed.
    A candidate whose sizing is None does not apply (e.g. more fragments than tensors).
    ``note`` goes into the decision's ``reason`` (e.g. why the link is assumed)."""
    if len(candidates) != len(sizings):
        raise ValueError("choose() needs one sizing per candidate")
    rows = []
    for c, s in zip(candidates, sizings):
        if s is None:
            continue
        e = s.exposed_seconds(link, compute)
        share = e / (compute + e) if compute + e > 0 else 0.0
        rows.append((c, s, e, share))
    if not rows:
        raise ValueError("auto: no candidate applies to this model")
    fitting = [r for r in rows if r[3] <= budget]
    if fitting:
        pick, why = fitting[0], "the best measured quality within the budget"
    else:
        pick = min(rows, key=lambda r: r[3])  # ties: the better ranked (min keeps the first)
        why = "nothing fits the budget: the least exposed"
    c, s, e, _ = pick
    return Decision(c.name, c.label, c.replicator, copy.deepcopy(c.replicator_kwargs),
                    replicas, link, compute, budget, s.bytes_per_step, e,
                    f"{note}; {why}" if note else why, step,
                    tuple((r[0].name, r[1].bytes_per_step, r[3]) for r in rows))
