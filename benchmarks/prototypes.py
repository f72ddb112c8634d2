"""Prototypes of the quality benchmark that did not help, kept so its rows can be run again.

They subclass :class:`~flexdemo.DeMoReplicator` and :class:`~flexdemo.DiLoCoReplicator` and
hook their private stages, which no public interface offers: this file is the one place in
``benchmarks/`` allowed to (``tests/test_benchmark_scripts.py`` holds the others to the
documented modules). Importing it registers ``demo-lookahead``, ``diloco-keep`` and
``diloco-residual`` in :data:`flexdemo.REPLICATORS`, in this process and in the benchmark's
workers.
"""

from __future__ import annotations

import math

import torch

from flexdemo import REPLICATORS, DeMoReplicator, DiLoCoReplicator
from flexdemo.compress.blocks import BlockValueCodec
from flexdemo.replicate.diloco import _Sync


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


class ResidualDiLoCo(DiLoCoReplicator):
    """A prototype of sparse DiLoCo whose replicas keep their own unsent progress.

    SparseLoCo's compression is done here in the parameters' own layout: every sync adds this
    period's progress to an error-feedback buffer (``resid = decay * resid + progress``),
    sends the ``topk`` largest of each chunk of ``chunk * chunk`` entries of it (values
    through a block codec) and keeps the rest. The mean of what the replicas sent is taken
    by an fp32 exchange, but the bytes recorded are those of the sparse payload a gather would
    send (12-bit indices, the codec's values, ``n - 1`` payloads per rank). With
    ``keep=False`` every replica restarts from the global parameters (SparseLoCo); with
    ``keep=True`` it restarts from the global parameters minus its own residual, so the
    progress it has not sent yet stays in its parameters (replicas then differ by their
    residuals). No checkpoints (the residual and the start copy are not saved).
    """

    def __init__(self, topk: int = 64, chunk: int = 64, decay: float = 0.95,
                 values: str = "stat2", keep: bool = True, **kwargs) -> None:
        super().__init__(exchange="full", **kwargs)
        self.topk, self.block, self.decay, self.keep = topk, chunk * chunk, decay, keep
        self.codec = BlockValueCodec(values)

    def _setup_state(self) -> None:
        super()._setup_state()
        if self.alpha != 0.0 or self.tau != 0:
            raise ValueError("the residual prototype needs alpha=0 and tau=0")
        self._resid = [torch.zeros_like(g) for g in self.global_params]
        self._start = [g.clone() for g in self.global_params]
        blocks = sum(math.ceil(p.numel() / self.block) for p in self.global_params)
        self._payload = (32 + math.ceil(blocks * self.topk * 12 / 8)
                         + self.codec.nbytes(blocks, self.topk))

    def _sparsify(self, a: torch.Tensor) -> torch.Tensor:
        """The sent part of ``a``: its top-k per chunk, values as the peers decode them."""
        flat = a.reshape(-1)
        n = flat.numel()
        rows = torch.zeros(math.ceil(n / self.block) * self.block, device=a.device)
        rows[:n] = flat
        rows = rows.view(-1, self.block)
        k = min(self.topk, self.block)
        idx = rows.abs().topk(k, dim=1).indices
        vals = rows.gather(1, idx)
        buf = torch.zeros(self.codec.nbytes(*vals.shape), dtype=torch.uint8, device=a.device)
        sent = torch.zeros_like(rows).scatter_(1, idx, self.codec.encode(vals, buf))
        return sent.view(-1)[:n].view_as(a)

    def _launch(self, p: int, step: int) -> None:
        for i in self.parts[p]:
            progress = self._start[i] - self._locals[i]
            a = self._resid[i].mul_(self.decay).add_(progress)
            sent = self._sparsify(a)
            a.sub_(sent)
            self.pseudo[i].copy_(sent)
        ex = self.exchanges[p]
        pseudo = [self.pseudo[i] for i in self.parts[p]]
        handle = ex.start(pseudo, [1.0] * len(pseudo), self.syncs[p])
        self._record(ex)
        self.syncs[p] += 1
        self.pending[p] = _Sync(step + self.tau, handle=handle)

    def _record(self, ex) -> None:
        self.stats.record((self.world - 1) * self._payload, (self.world - 1) * self._payload,
                          ex.stats.last_seconds, 1)

    def _restart(self, part: list[int], alpha: float) -> None:
        super()._restart(part, alpha)
        for i in part:
            if self.keep:  # this replica's own unsent progress stays in its parameters
                self._locals[i].sub_(self._resid[i].to(self._locals[i].dtype))
            self._start[i].copy_(self._locals[i])


REPLICATORS.setdefault("diloco-residual", ResidualDiLoCo)
