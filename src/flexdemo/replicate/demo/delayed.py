"""DeMo's delayed mode (``overlap="delayed"``): each step checks and applies the exchange
launched the step before, and launches its own. :class:`InFlight`, owned by the replicator,
holds that exchange and the verdict not yet judged; under fault tolerance a new quorum drops
the exchange in flight (:meth:`InFlight.drop`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

from ...transport import Pending, all_gather
from ..bound import PeerBound, float_bits, from_bits
from .checks import VERDICT_COLUMNS, VerdictToHost, arrived, check_payloads, kept_peers
from .decode import add_back_own
from .layout import Group
from .staging import Staging, StepPlan

__all__ = ["Exchange", "InFlight", "Stages"]

WIDTH = len(VERDICT_COLUMNS)  # a verdict row's columns (a bounded one: norm, factor after)


class Exchange(NamedTuple):
    """An exchange in flight: its step, the payloads (or their exchange, not yet waited
    for), the plan they were encoded with and this replica's row in them."""

    step: int
    payloads: torch.Tensor | Pending
    plan: StepPlan
    row: int


class Stages(Protocol):
    """The owner's stages that :class:`InFlight` calls (a
    :class:`~flexdemo.replicate.DeMoReplicator`), looked up at each call, and its bound on
    each peer's part."""

    bound: PeerBound
    transport: Any

    def encode_payload(self, grads, lrs, step: int, buf: torch.Tensor) -> list:
        """This rank's payload for ``step`` in ``buf`` (error feedback included)."""

    def on_payloads(self, key: tuple, fn: Callable, gathered: torch.Tensor) -> Any:
        """``fn(gathered)``, through a CUDA graph for ``key`` when graphed."""

    def good_peers_of(self, rows: list[list[int]], step: int, code: int) -> list[int]:
        """The good peers of a verdict's ``rows``; raises, or counts bad peers."""

    def write_mean(self, decoded: list, good: list[int] | None, sent_plan: StepPlan,
                   plan: StepPlan, grads, kept=None, factors=None) -> None:
        """The decoded mean of the peers' payloads into ``grads``."""

    def add_to_momentum(self, g: Group, idx: torch.Tensor, pos: torch.Tensor,
                        vals: torch.Tensor, sign: float) -> None:
        """Add ``sign * sent`` to the momentum of group ``g``."""


class InFlight:
    """The delayed mode's exchange in flight and the verdict deferred a step.

    Its owner (:class:`Stages`) hands over its send buffers (two: a step's buffer is not
    touched until the step after next), its groups, codec and staging plans
    (:class:`~.staging.Staging`). A step calls :meth:`receive`, then :meth:`send`, then
    :meth:`apply`."""

    def __init__(self, owner: Stages, buffers: list[torch.Tensor], groups: list[Group], codec,
                 plans: Staging) -> None:
        self.owner = owner
        self.buffers, self.groups, self.codec, self.plans = buffers, groups, codec, plans
        self.sent: Exchange | None = None
        # the step a landing payload must carry (a device scalar the checks' graph reads)
        self.device = buffers[0].device
        self.expected_step = torch.zeros((), dtype=torch.int64, device=self.device)
        self._to_host = VerdictToHost()
        self.verdict: tuple | None = None  # (step, presence code, host rows, CUDA event)

    # ------------------------------------------------------------------ a step
    def judge(self) -> None:
        """Judge the verdict deferred by the step before (its payloads' update was already
        applied, bad ones left out on the device): raise, or count and warn."""
        pending, self.verdict = self.verdict, None
        if pending is not None:
            step, code, host = arrived(pending)
            rows = host.tolist()
            self.owner.good_peers_of([r[:WIDTH] for r in rows], step, code)
            bound = self.owner.bound
            if rows and len(rows[0]) > WIDTH:  # the clips it applied on the device
                norms, factors = (from_bits([r[c] for r in rows]) for c in (WIDTH, WIDTH + 1))
                bound.report(norms, factors, len(rows), step=step,
                             transport=self.owner.transport)

    def receive(self):
        """Judge the verdict deferred by the step before, then wait for the exchange in
        flight (launched the step before) and check it on the device, deferring its verdict;
        ``(decoded, (keep, count), plan it was encoded with)``, or None when there is none.
        No read of the device."""
        self.judge()
        previous, self.sent = self.sent, None
        if previous is None:
            return None
        prev_step, handle, prev_plan, row = previous
        gathered = handle.wait() if isinstance(handle, Pending) else handle
        self.expected_step.fill_(prev_step)
        verdict, decoded, keep, count, factors = self.owner.on_payloads(
            ("check-kept", prev_plan.key), lambda x: self._check_and_keep(x, prev_plan, row),
            gathered)
        self.verdict = self._to_host.start(verdict, prev_step, prev_plan.code)
        return decoded, (keep, count), prev_plan, factors

    def _check_and_keep(self, gathered: torch.Tensor, plan: StepPlan, row: int):
        """The verdict, the decoded payloads, the peers kept in the mean (``keep``,
        ``count``) and, with a bound on each peer's part, every peer's factor (else None),
        all decided on the device; the verdict then carries each peer's norm and factor (two
        more columns, fp64 bits) for the host to report a clip a step later."""
        bound = self.owner.bound
        if not bound.on or gathered.shape[0] < 2:
            verdict, decoded = check_payloads(gathered, self.groups, self.codec, plan)
            keep, count = kept_peers(verdict, self.expected_step, plan.code)
            return verdict, decoded, keep, count, None
        verdict, decoded, norms = check_payloads(gathered, self.groups, self.codec, plan,
                                                 norms=True)
        keep, count = kept_peers(verdict, self.expected_step, plan.code)
        factors = bound.factors_on_device(norms, row, keep)
        verdict = torch.cat([verdict, float_bits(norms).view(-1, 1),
                             float_bits(factors).view(-1, 1)], 1)
        return verdict, decoded, keep, count, factors

    def send(self, grads, lrs, step: int, plan: StepPlan, transport, stats, rank: int) -> None:
        """Encode ``grads`` and start their exchange over ``transport`` (applied next step)."""
        buf = self.buffers[step % 2]
        self.owner.encode_payload(grads, lrs, step, buf)
        self.sent = Exchange(step, all_gather(buf, transport, stats, async_op=True), plan, rank)

    def apply(self, received, plan: StepPlan, grads) -> None:
        """The decoded mean of what :meth:`receive` returned into ``grads`` (zeros when
        nothing was in flight)."""
        if received is None:
            torch._foreach_zero_([g for g in grads if g is not None])
            return
        decoded, kept, sent_plan, factors = received
        self.owner.write_mean(decoded, None, sent_plan, plan, grads, kept, factors)

    def hand_verdict_to(self, other: InFlight) -> None:
        """``other`` judges this one's deferred verdict at its next step (a phase switch)."""
        other.verdict, self.verdict = self.verdict, None

    # ------------------------------------------------------------------ fault tolerance
    def drop(self) -> None:
        """Drop the exchange in flight, never applied, and add this replica's
        own payload back to its momentum (what error feedback subtracted), as if it had not
        been sent. Its own payload is its row of the payloads if they arrived, else its send
        buffer (not touched until the step after next). The peers' exchange is not waited
        for: a peer may be gone."""
        if self.sent is None:
            return
        step, handle, plan, row = self.sent
        self.sent = None
        own = handle[row] if isinstance(handle, torch.Tensor) else self.buffers[step % 2]
        add_back_own(self.owner.add_to_momentum, self.groups, self.codec, own, plan)

    # ------------------------------------------------------------------ state
    def clear(self) -> None:
        """Nothing in flight and no verdict deferred (the replica's state from zero)."""
        self.sent = self.verdict = None

    def held(self) -> list[torch.Tensor]:
        """The payloads in flight where they arrived (no copy), else nothing."""
        sent = self.sent
        return [sent.payloads] if sent is not None and isinstance(sent.payloads,
                                                                  torch.Tensor) else []

    def save(self, sd: dict, copy: bool = True) -> dict:
        """``sd`` with the exchange in flight (waited for: its payloads) and the verdict not
        yet judged, so a resumed run has the bits of an uninterrupted one (copied, or the
        live tensors when not ``copy``)."""
        if self.sent is not None:
            step, handle, plan, row = self.sent
            gathered = handle.wait() if isinstance(handle, Pending) else handle
            self.sent = Exchange(step, gathered, plan, row)
            present = plan.key[0]
            sd["inflight"] = {"step": step, "gathered": gathered.clone() if copy else gathered,
                              "code": plan.code,
                              "present": list(present), "row": row}
        if self.verdict is not None:  # a verdict not yet judged: judged after a resume
            step, code, host = arrived(self.verdict)
            sd["verdict"] = {"step": step, "code": code, "rows": host.clone() if copy else host}
        return sd

    def load(self, sd: dict[str, Any], nparams: int, rank: int) -> None:
        """The exchange in flight and the deferred verdict from ``sd`` (:meth:`save`), for a
        replica of ``nparams`` parameters (its row: ``rank`` where ``sd`` does not say)."""
        verdict = sd.get("verdict")
        self.verdict = None
        if verdict is not None:
            rows = verdict["rows"].to("cpu", torch.int64)
            rows._flexdemo_host_copy = True
            self.verdict = (int(verdict["step"]), int(verdict["code"]), rows, None)
        inflight = sd.get("inflight")
        self.sent = None
        if inflight is not None:
            present = tuple(bool(p) for p in inflight.get("present", [True] * nparams))
            self.sent = Exchange(int(inflight["step"]), inflight["gathered"].to(self.device),
                                 self.plans.plan(present, None), int(inflight.get("row", rank)))
