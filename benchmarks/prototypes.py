"""Prototypes of the quality benchmark that did not help, kept so its rows can be run again.

They subclass :class:`~flexdemo.DeMoReplicator` and :class:`~flexdemo.DiLoCoReplicator` and
hook their private stages, which no public interface offers: this file is the one place in
``benchmarks/`` allowed to (``tests/test_benchmark_scripts.py`` holds the others to the
documented modules). Importing it registers ``demo-lookahead``, ``diloco-keep``,
``diloco-residual`` and ``diloco-lowrank`` in :data:`flexdemo.REPLICATORS`, in this process and
in the benchmark's workers.
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


class _FeedbackDiLoCo(DiLoCoReplicator):
    """The frame of the prototypes that compress in the parameters' own layout: every sync
    adds this period's progress to an error-feedback buffer (``resid = decay * resid +
    progress``), sends :meth:`_compress` of it and keeps the rest. The mean of what the
    replicas sent is taken by an fp32 exchange that stands in for the payload: the bytes
    recorded are :meth:`_payload_bytes`, as a gather sends them (``n - 1`` payloads per rank),
    and the stand-in's own are taken back out. With ``keep=False`` every replica restarts from
    the global parameters; with ``keep=True`` it restarts from the global parameters minus its
    own residual, so the progress it has not sent yet stays in its parameters (replicas then
    differ by their residuals). No checkpoints (the residual and the start copy are not
    saved)."""

    def __init__(self, decay: float, keep: bool, **kwargs) -> None:
        super().__init__(exchange="full", **kwargs)
        self.decay, self.keep = decay, keep

    def _compress(self, a: torch.Tensor) -> torch.Tensor:
        """The sent part of ``a``, as the peers decode it."""
        raise NotImplementedError

    def _payload_bytes(self) -> int:
        """The bytes one replica's compressed pseudo-gradient takes on the wire."""
        raise NotImplementedError

    def _setup_state(self) -> None:
        super()._setup_state()
        if self.alpha != 0.0 or self.tau != 0:
            raise ValueError(f"the {type(self).__name__} prototype needs alpha=0 and tau=0")
        self._resid = [torch.zeros_like(g) for g in self.global_params]
        self._start = [g.clone() for g in self.global_params]
        self._payload = self._payload_bytes()

    def _launch(self, p: int, step: int) -> None:
        for i in self.parts[p]:
            a = self._resid[i].mul_(self.decay).add_(self._start[i] - self._locals[i])
            sent = self._compress(a)
            a.sub_(sent)
            self.pseudo[i].copy_(sent)
        ex = self.exchanges[p]
        pseudo = [self.pseudo[i] for i in self.parts[p]]
        handle = ex.start(pseudo, [1.0] * len(pseudo), self.syncs[p])
        self.stats.record((self.world - 1) * self._payload, (self.world - 1) * self._payload,
                          ex.stats.last_seconds, 1)
        self.syncs[p] += 1
        self.pending[p] = _Sync(step + self.tau, handle=handle)

    def _result(self, p: int) -> list[torch.Tensor]:
        ex = self.exchanges[p]
        sent, received = ex.stats.bytes_sent, ex.stats.bytes_received
        try:
            return super()._result(p)
        finally:  # the stand-in's bytes out: the payload's were recorded at launch
            self.stats.record(sent - ex.stats.bytes_sent, received - ex.stats.bytes_received,
                              0.0, 0)

    @staticmethod
    def _rows(a: torch.Tensor, width: int) -> tuple[torch.Tensor, int]:
        """``a``'s entries (fp32) as rows of ``width``, the last one zero-padded, and their
        count."""
        flat = a.reshape(-1)
        n = flat.numel()
        rows = torch.zeros(math.ceil(n / width) * width, device=a.device)
        rows[:n] = flat
        return rows.view(-1, width), n

    def _restart(self, part: list[int], alpha: float, glob=None) -> None:
        super()._restart(part, alpha, glob)
        for i in part:
            if self.keep:  # this replica's own unsent progress stays in its parameters
                self._locals[i].sub_(self._resid[i].to(self._locals[i].dtype))
            self._start[i].copy_(self._locals[i])


class ResidualDiLoCo(_FeedbackDiLoCo):
    """A prototype of sparse DiLoCo whose replicas keep their own unsent progress.

    SparseLoCo's compression done in the parameters' own layout (:class:`_FeedbackDiLoCo`):
    the ``topk`` largest of each chunk of ``chunk * chunk`` entries of the error-feedback
    buffer, values through a block codec, 12-bit indices.
    """

    def __init__(self, topk: int = 64, chunk: int = 64, decay: float = 0.95,
                 values: str = "stat2", keep: bool = True, **kwargs) -> None:
        super().__init__(decay, keep, **kwargs)
        self.topk, self.block = topk, chunk * chunk
        self.codec = BlockValueCodec(values)

    def _payload_bytes(self) -> int:
        blocks = sum(math.ceil(p.numel() / self.block) for p in self.global_params)
        return (32 + math.ceil(blocks * self.topk * 12 / 8)
                + self.codec.nbytes(blocks, self.topk))

    def _compress(self, a: torch.Tensor) -> torch.Tensor:
        rows, n = self._rows(a, self.block)
        k = min(self.topk, self.block)
        idx = rows.abs().topk(k, dim=1).indices
        vals = rows.gather(1, idx)
        buf = torch.zeros(self.codec.nbytes(*vals.shape), dtype=torch.uint8, device=a.device)
        sent = torch.zeros_like(rows).scatter_(1, idx, self.codec.encode(vals, buf))
        return sent.view(-1)[:n].view_as(a)


REPLICATORS.setdefault("diloco-residual", ResidualDiLoCo)


class LowRankDiLoCo(_FeedbackDiLoCo):
    """A prototype of DiLoCo whose pseudo-gradients travel as low-rank factors
    (:class:`_FeedbackDiLoCo`): each matrix (a tensor of two or more dimensions, its first
    against the rest) sends the best rank-``approx_rank`` approximation of its error-feedback
    buffer as two bf16 factors, ``approx_rank * (m + n)`` values; every other tensor (biases,
    norms) sends its buffer densely with ``vectors`` values (a statistical codebook per block
    of 256). By default the replicas restart from the global parameters (``keep=False``).
    """

    def __init__(self, approx_rank: int = 1, decay: float = 0.95, vectors: str = "stat2",
                 keep: bool = False, **kwargs) -> None:
        super().__init__(decay, keep, **kwargs)
        self.approx_rank = approx_rank
        self.codec = BlockValueCodec(vectors)

    def _low_rank(self, shape) -> bool:
        return len(shape) >= 2 and min(shape[0], math.prod(shape[1:])) > 2 * self.approx_rank

    def _payload_bytes(self) -> int:
        payload = 32
        for g in self.global_params:
            if self._low_rank(g.shape):
                payload += 2 * self.approx_rank * (g.shape[0] + g[0].numel())
            else:
                payload += self.codec.nbytes(math.ceil(g.numel() / 256), 256)
        return payload

    def _compress(self, a: torch.Tensor) -> torch.Tensor:
        if self._low_rank(a.shape):
            m = a.reshape(a.shape[0], -1).float()
            u, s, vh = torch.linalg.svd(m, full_matrices=False)
            root = s[:self.approx_rank].sqrt()
            left = (u[:, :self.approx_rank] * root).bfloat16().float()
            right = (root[:, None] * vh[:self.approx_rank]).bfloat16().float()
            return (left @ right).view_as(a).to(a.dtype)
        rows, n = self._rows(a, 256)
        buf = torch.zeros(self.codec.nbytes(*rows.shape), dtype=torch.uint8, device=a.device)
        return self.codec.encode(rows, buf).reshape(-1)[:n].view_as(a).to(a.dtype)


REPLICATORS.setdefault("diloco-lowrank", LowRankDiLoCo)
