"""``"auto"``: measure the link and the step, choose the strategy that fits, say why.

``flexdemo.prepare(model, "auto", optimizer=...)`` (or ``SimulatedReplicas(...,
replicator="auto")``, or ``strategy.replicator = "auto"`` in the app) builds an
:class:`AutoReplicator`: a bounded probe of the replicate group's link at set-up
(:mod:`.link`), the compute time of the first steps, and the choice (:mod:`.choose`) of the
best-ranked strategy in ``quality_ranking.json`` (the quality benchmark's tables, with their
provenance) whose exposed communication fits the step's budget, logged in one line. See
``docs/auto.md``.
"""

from ..replicate import REPLICATORS
from .choose import (
    RANKING_FILE,
    Candidate,
    Decision,
    Sizing,
    SizingTransport,
    choose,
    load_ranking,
    size_candidate,
)
from .link import FALLBACK_LINK, PROBE_BYTES, Link, parse_link, probe_link
from .replicator import AutoReplicator

REPLICATORS["auto"] = AutoReplicator

__all__ = ["FALLBACK_LINK", "PROBE_BYTES", "RANKING_FILE", "AutoReplicator", "Candidate",
           "Decision", "Link", "Sizing", "SizingTransport", "choose", "load_ranking",
           "parse_link", "probe_link", "size_candidate"]
