"""DeMo's delayed mode (``overlap="delayed"``): each step checks and applies the exchange
launched the step before, and launches its own. Under fault tolerance a new quorum drops the
exchange in flight (:func:`return_inflight`)."""

from __future__ import annotations

from typing import Any

import torch

from ...transport import Pending, all_gather
from .checks import arrived, check_payloads, kept_peers
from .layout import block_positions
from .staging import StepPlan

# a DeMoReplicator (not imported: the replicator imports this module)
DeMo = Any


def judge_deferred_verdict(rep: DeMo) -> None:
    """Judge the verdict deferred by the step before (its payloads' update was already
    applied, bad ones left out on the device): raise, or count and warn."""
    pending, rep._pending = rep._pending, None
    if pending is not None:
        step, code, host = arrived(pending)
        rep._good_peers(host.tolist(), step, code)


def receive_inflight(rep: DeMo):
    """Judge the verdict deferred by the step before, then wait for the exchange in
    flight (launched the step before) and check it on the device, deferring its verdict;
    ``(decoded, (keep, count), plan it was encoded with)``, or None when there is none.
    No read of the device."""
    judge_deferred_verdict(rep)
    previous, rep._inflight = rep._inflight, None
    if previous is None:
        return None
    prev_step, handle, prev_plan, _ = previous
    gathered = handle.wait() if isinstance(handle, Pending) else handle
    rep._expected_step.fill_(prev_step)
    verdict, decoded, keep, count = rep._on_payloads(
        ("check-kept", prev_plan.key), lambda x: check_and_keep(rep, x, prev_plan), gathered)
    rep._pending = rep._verdict_to_host.start(verdict, prev_step, prev_plan.code)
    return decoded, (keep, count), prev_plan


def check_and_keep(rep: DeMo, gathered: torch.Tensor, plan: StepPlan):
    """The verdict, the decoded payloads and the peers kept in the mean (``keep``,
    ``count``), all decided on the device."""
    verdict, decoded = check_payloads(gathered, rep.groups, rep.codec, plan)
    keep, count = kept_peers(verdict, rep._expected_step, plan.code)
    return verdict, decoded, keep, count


def encode_and_send(rep: DeMo, grads, lrs, step: int, plan: StepPlan) -> None:
    """Encode ``grads`` and start their exchange (applied next step)."""
    buf = rep._buckets[step % 2]
    rep._encode_payload(grads, lrs, step, buf)
    rep._inflight = (step, all_gather(buf, rep.transport, rep.stats, async_op=True), plan,
                     rep.rank)


def apply_received(rep: DeMo, received, plan: StepPlan, grads) -> None:
    """The decoded mean of what :func:`receive_inflight` returned into ``grads`` (zeros
    when nothing was in flight)."""
    if received is None:
        torch._foreach_zero_([g for g in grads if g is not None])
        return
    decoded, kept, sent_plan = received
    rep._write_mean(decoded, None, sent_plan, plan, grads, kept)


def return_inflight(rep: DeMo) -> None:
    """Drop the exchange in flight, never applied, and add this replica's
    own payload back to its momentum (what error feedback subtracted), as if it had not
    been sent. Its own payload is its row of the payloads if they arrived, else its send
    buffer (not touched until the step after next). The peers' exchange is not waited
    for: a peer may be gone."""
    if rep._inflight is None:
        return
    step, handle, plan, row = rep._inflight
    rep._inflight = None
    own = handle[row] if isinstance(handle, torch.Tensor) else rep._buckets[step % 2]
    _, decoded = check_payloads(own.unsqueeze(0), rep.groups, rep.codec, plan)
    for g, sent in zip(rep.groups, decoded):
        if sent is not None:
            idx, vals = sent[0][0], sent[1][0]
            rep._add_to_momentum(g, idx, block_positions(g.coef.shape, idx), vals, sign=1.0)
