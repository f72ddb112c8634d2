"""DeMo's mean of the gathered payloads: the check of every peer's payload (one host read,
the peers' norms for the bound included) and the decoded mean written into the gradients.
A part of :class:`~flexdemo.replicate.demo.DeMoReplicator`, kept in a class of its own."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ...compress.blocks import BlockValueCodec
from ..base import Replicator
from ..bound import PeerBound
from .checks import check_payloads, good_peers
from .decode import ScaledPayloads, clip_to_median_norm, decode_mean
from .graphs import StepGraphs
from .layout import BlockLayout, Group
from .staging import Staging, StepPlan

if TYPE_CHECKING:  # the checker reads the replicator's attributes; at run time a plain part
    _Base = Replicator
else:
    _Base = object

__all__ = ["CheckedMean"]


class CheckedMean(_Base):
    """The check and the decoded mean of :class:`~flexdemo.replicate.demo.DeMoReplicator`
    (whose state these methods read: its layout, groups, codec, bound and graphs)."""

    layout: BlockLayout
    groups: list[Group]
    codec: BlockValueCodec
    bound: PeerBound
    sign: bool
    mean: str
    clip: str
    reduce: str
    step_graphs: StepGraphs
    staging_plans: Staging

    @property
    def _graphed(self) -> bool:  # DeMoReplicator's
        raise NotImplementedError

    def on_payloads(self, key: tuple, fn: Callable, gathered: torch.Tensor) -> Any:
        raise NotImplementedError  # DeMoReplicator's

    def scaled_input_problem(self) -> str | None:
        """A mean over the senders weighs inputs scaled per rank in the gathered decode only."""
        if self.mean == "senders" and self.reduce != "gather":
            return (f"mean='senders' weighs the senders with reduce='gather' only (not "
                    f"reduce={self.reduce!r})")
        return None

    def _check_now(self, gathered: torch.Tensor, step: int, plan: StepPlan):
        """Check the gathered payloads and read the verdict; raise or drop bad ones. Returns
        the good peers, the decoded payloads and, where some peer is over the bound
        (:mod:`..bound`: the peers' norms ride in the same read), every peer's factor
        ``(peers,)`` (else None)."""
        keep = self._graphed or not self.memory_first  # else unpacked again to decode
        n = gathered.shape[0]
        bounded = self.bound.on and n > 1
        out = self.on_payloads(
            ("check", plan.key, bounded),
            lambda x: check_payloads(x, self.groups, self.codec, plan, keep, bounded), gathered)
        verdict, decoded = out[0], out[1]
        if not bounded:
            return self.good_peers_of(verdict.tolist(), step, plan.code), decoded, None
        good, factors = self.bound.read_verdict(
            verdict, out[2], lambda rows: self.good_peers_of(rows, step, plan.code), self.rank,
            step=step, transport=self.transport)
        return good, decoded, factors

    def good_peers_of(self, rows: list[list[int]], step: int, code: int) -> list[int]:
        """The good peers of a verdict's ``rows``; raises, or counts and warns, for every bad
        payload (:meth:`bad_peer`)."""
        return good_peers(rows, step, code, name=self.name, group=self.transport,
                          groups=self.groups, bad_peer=self.bad_peer)

    # ------------------------------------------------------------------ decode
    def write_mean(self, decoded: Sequence, good: list[int] | None, sent_plan: StepPlan,
                    plan: StepPlan, grads,
                    kept: tuple[torch.Tensor, torch.Tensor] | None = None,
                    factors: torch.Tensor | None = None) -> None:
        """The decoded mean of the good peers' payloads (encoded with ``sent_plan``) into the
        gradients present now (``plan``): one multi-tensor copy per group. The good peers are
        ``good``, or (delayed mode) ``kept``, decided on the device; ``factors`` (the bound,
        :mod:`..bound`) scale each peer's values first."""
        lay, sign, senders = self.layout, self.sign, self.mean == "senders"
        scales = self.peer_scales if senders else None  # the senders' factors (.pace)
        if factors is not None and kept is None:
            decoded = ScaledPayloads(decoded, factors)
        if self.clip == "median":
            decoded = clip_to_median_norm(decoded, good, kept)
        for gi, g in enumerate(self.groups):
            pieces, views = plan.write[gi]
            if not pieces:
                continue
            if not sent_plan.group_on[gi]:  # nothing was sent for it (delayed mode)
                torch._foreach_zero_([lay.piece(grads, p) for p in pieces])
                continue
            idx, vals = decoded[gi]
            n = idx.shape[0]
            if kept is not None:  # masked on the device, whichever peers are left out
                fn = lambda g=g, idx=idx, vals=vals: decode_mean(  # noqa: E731
                    lay, g, idx, vals if factors is None else vals * factors.view(-1, 1, 1),
                    sign=sign, kept=kept, senders=senders, scales=scales)
                _ = self.step_graphs.run(("decode-kept", sent_plan.key, n, gi), fn) \
                    if self._graphed and scales is None else fn()
                self.staging_plans.write_back(grads, pieces, views)
                continue
            assert good is not None  # given unless the peers were kept on the device
            peer_scales = scales
            if len(good) < n:  # dropped peers (the rare path)
                keep = torch.tensor(good, dtype=torch.int64, device=idx.device)
                idx, vals = idx.index_select(0, keep), vals.index_select(0, keep)
                if scales is not None:
                    peer_scales = scales.index_select(0, keep)
            if self._graphed and len(good) == n and factors is None and scales is None:
                # a graph per group: shared workspace
                self.step_graphs.run(("decode", sent_plan.key, n, gi),
                                     lambda g=g, idx=idx, vals=vals: decode_mean(
                                         lay, g, idx, vals, sign=sign, senders=senders))
            else:  # mean, inverse DCT, sign
                decode_mean(lay, g, idx, vals, sign=sign, senders=senders, scales=peer_scales)
            self.staging_plans.write_back(grads, pieces, views)  # into the gradients
