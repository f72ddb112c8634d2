"""Prototypes of the quality benchmark that did not help, kept so its rows can be run again.

They subclass :class:`~flexdemo.DeMoReplicator` and :class:`~flexdemo.DiLoCoReplicator` and
hook their private stages, which no public interface offers: this file is the one place in
``benchmarks/`` allowed to (``tests/test_benchmark_scripts.py`` holds the others to the
documented modules). Importing it registers ``demo-lookahead`` and ``diloco-keep`` in
:data:`flexdemo.REPLICATORS`, in this process and in the benchmark's workers.
"""

from __future__ import annotations

import torch

from flexdemo import REPLICATORS, DeMoReplicator, DiLoCoReplicator


class LookaheadDeMo(DeMoReplicator):
    """A prototype of Nesterov-style DeMo, kept here for the benchmark only (it did not help):
    each replica selects the top-k of the look-ahead ``decay * m_t + gain * s * DCT(g_t)``
    (Nesterov's ``beta * m_t + g_t``; ``m_t`` the momentum after this step's update) instead of
    ``m_t``, sends its values and subtracts them from ``m_t``. It hooks two private stages of
    :class:`DeMoReplicator` (no CUDA graphs, no compiled selection); ``gain=None`` selects
    from ``m_t`` itself, bitwise the plain replicator (a test holds it to that)."""

    def __init__(self, gain: float | None = 1.0, **kwargs) -> None:
        super().__init__(**{"graphs": False, **kwargs})
        if self.graphs or self.compile:
            raise ValueError("the look-ahead prototype runs eagerly: graphs=False, compile=False")
        self.gain = gain

    def _update_momentum(self, g, runs, lrs, decay, bad, classes=None) -> None:
        before = None if self.gain is None else g.coef.clone()
        super()._update_momentum(g, runs, lrs, decay, bad, classes)
        if before is None:
            g.look = g.coef.clone()
            return
        fresh = g.coef - decay * before  # s * DCT(g_t): linear, so padded units too
        g.look = decay * g.coef + self.gain * fresh

    def _select_topk(self, g, off_rows, bad):
        coef, g.coef = g.coef, g.look
        try:
            return super()._select_topk(g, off_rows, bad)
        finally:
            g.coef = coef
            del g.look


REPLICATORS.setdefault("demo-lookahead", LookaheadDeMo)  # this script's runs (and workers)


class KeepDiLoCo(DiLoCoReplicator):
    """A prototype of an eager-style overlapped sync, kept here for the benchmark only: when a
    fragment's sync lands ``tau`` steps after its launch, the replica takes the new global
    parameters plus its own progress since the launch (``local - local_at_launch``), instead
    of dropping those steps (``alpha = 0``) or mixing whole parameters (``alpha > 0``). The
    next pseudo-gradient counts that progress once, against the new global parameters.
    Replicas differ after a sync by their own ``tau`` steps. With ``tau = 0`` it is plain
    DiLoCo. No checkpoints (the launch copies are not saved)."""

    def _setup_state(self) -> None:
        super()._setup_state()
        if self.alpha != 0.0:
            raise ValueError("the keep prototype replaces the alpha mix: alpha=0")
        self._at_launch: dict[int, list[torch.Tensor]] = {}

    def _launch(self, p: int, step: int) -> None:
        if self.tau:
            self._at_launch[p] = [self._locals[i].clone() for i in self.parts[p]]
        super()._launch(p, step)

    def _apply(self, p: int, step: int) -> None:
        start = self._at_launch.pop(p, None)
        if start is None:
            return super()._apply(p, step)
        local = [self._locals[i] for i in self.parts[p]]
        moved = torch._foreach_sub(local, start)
        super()._apply(p, step)
        torch._foreach_add_(local, moved)


REPLICATORS.setdefault("diloco-keep", KeepDiLoCo)
