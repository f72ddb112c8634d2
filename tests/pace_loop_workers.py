"""DiLoCo with a pace under the training loops people write (tests/test_pace_loops.py): one
replica's loop in each order of zero_grad, forward, backward and step, ``count_tokens`` at
several points before the step, a NaN/Inf injected in the middle of a period, the reference
that loop must give, and the gloo worker its processes run (importable by the children)."""

from __future__ import annotations

import torch
from dist_util import outer_sync
from pace_workers import LR, loss_of, model_fn, params, weighted_mean
from torch import nn

from flexdemo import DeToNATION, DiLoCoReplicator, NonFiniteGradientError, Pace

H = 4
COUNTS = [4, 4, 2]  # replica 2 syncs after 2 inner steps, the others after 4
TOKENS = [100, 300, 200]  # tokens per step of each replica (weights="tokens")
PERIODS = 3

#: the loop orders (the names of tests/elastic_workers.py's ORDERS)
ORDERS = {
    "zero-first": "zero_grad, forward, backward, step",
    "forward-zero": "forward, zero_grad, backward, step",
    "zero-last": "forward, backward, step, zero_grad",
}
#: where a step's ``opt.count_tokens(n)`` goes in the loop: first thing in the iteration
#: (before zero_grad under "zero-first"), after the forward pass, after the backward pass
#: (right before the step); "after-step" breaks the documented contract (a step's tokens go in
#: before that step's ``opt.step()``: a test's control)
SPOTS = ("first", "after-forward", "after-backward", "after-step")
#: the loop the pace was first tested with: forward, backward, count_tokens, step, zero_grad
STANDARD = ("zero-last", "after-backward")

#: name -> (what is made non-finite, replica, the step before which it is), each in period 2
#: (sync 2): a gradient of a fast replica in the middle of its 4 steps (steps 4..7), of the
#: slow replica at the first of its 2 steps (steps 2..3) and at its last (the step that syncs),
#: and a parameter of a fast replica (every later gradient of that replica is NaN too, and so
#: is its pseudo-gradient at the sync, under either policy)
FAULTS = {
    "grad-fast-mid": ("grad", 0, 5),
    "grad-slow-mid": ("grad", 2, 2),
    "grad-slow-at-sync": ("grad", 2, 3),
    "param-fast-mid": ("param", 0, 5),
}


def loop_run(rank: int, group, order: str, *, spot: str = "after-backward",
             weights: str = "tokens", nonfinite: str = "raise", fault: str | None = None,
             periods: int = PERIODS, tau: int = 0) -> dict:
    """Replica ``rank`` of DiLoCo (AdamW inner steps, H = 4, ``Pace(COUNTS)``) in loop
    ``order`` until ``periods`` syncs, its own batches (:func:`pace_workers.loss_of`), reporting
    :data:`TOKENS` per step at ``spot``; ``fault`` (of :data:`FAULTS`) injected on its replica.
    A ``NonFiniteGradientError`` from ``opt.step()`` is caught there (the rest of the iteration
    runs: ``zero-last`` still zeroes the gradients) and the loop goes on.

    Returns, per sync (in order): the sync's number, the step it came after on this replica,
    the ranks named by the error it raised (None: it raised none), whether the global
    parameters moved (an outer step was taken) and the parameters after it; and at the end
    the parameters, the steps, the skipped steps and the non-finite errors raised outside a
    sync (none expected). ``tau > 0``: each sync overlapped (``keep_overlap``) and applied
    after its delay (a fault it carries raises there, a stray step), the last settled at the
    end; ``global``: the global parameters then."""
    model = model_fn()
    rep = DiLoCoReplicator(H, pace=Pace(COUNTS, weights=weights), tau=tau,
                           keep_overlap=tau > 0)
    opt = DeToNATION(model.parameters(), rep, base="adamw", lr=LR, group=group,
                     nonfinite=nonfinite)
    kind, bad_rank, bad_step = FAULTS[fault] if fault is not None else (None, -1, -1)
    syncs: list[dict] = []
    stray: list[tuple[int, list[int] | None]] = []
    while rep.syncs[0] < periods:
        step, synced = opt.steps, rep.syncs[0]
        before = [g.clone() for g in rep.global_params]
        if spot == "first":
            opt.count_tokens(TOKENS[rank])
        if order == "zero-first":
            opt.zero_grad()
        if kind == "param" and (rank, step) == (bad_rank, bad_step):
            with torch.no_grad():
                model[0].weight[0, 0] = float("nan")
        loss = loss_of(model, rank, step)  # the forward pass
        if kind == "grad" and (rank, step) == (bad_rank, bad_step):
            loss = loss + model[2].bias.sum() * float("nan")  # a NaN gradient for one tensor
        if spot == "after-forward":
            opt.count_tokens(TOKENS[rank])
        if order == "forward-zero":
            opt.zero_grad()
        loss.backward()
        if spot == "after-backward":
            opt.count_tokens(TOKENS[rank])
        raised: list[int] | None = None
        try:
            opt.step()
        except NonFiniteGradientError as e:
            raised = list(e.ranks or [])
        if spot == "after-step":
            opt.count_tokens(TOKENS[rank])
        if order == "zero-last":
            opt.zero_grad()
        if rep.syncs[0] != synced:
            moved = any(not torch.equal(a, b) for a, b in zip(before, rep.global_params))
            syncs.append({"sync": rep.syncs[0], "step": step, "raised": raised,
                          "moved": moved, "params": params(model)})
        elif raised is not None:
            stray.append((step, raised))
    rep.settle()  # (tau > 0: the last sync, in flight)
    return {"syncs": syncs, "params": params(model), "steps": opt.steps,
            "skipped": opt.skipped_steps, "stray": stray,
            "global": [g.clone() for g in rep.global_params]}


def reference(counts: list[int], periods: int, weights: list[list[float]], *,
              skip: set[tuple[int, int]] = frozenset(), dropped: set[int] = frozenset()
              ) -> list[list[torch.Tensor]]:
    """:func:`pace_workers.dense_reference` (its exact arithmetic: the fp32 all-reduce of the
    inputs scaled by ``w_i n / W``, summed in rank order) with the weights of each period given
    (``weights[j][r]``), the inner steps ``(replica, step)`` in ``skip`` not taken (no AdamW
    update, its state untouched; the step still counts), and the periods in ``dropped`` (from
    0) ending with no outer step: every replica restarts from the global parameters as they
    were."""
    world = len(counts)
    models = [model_fn() for _ in range(world)]
    inner = [torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.0) for m in models]
    glob = [nn.Parameter(p.detach().clone()) for p in models[0].parameters()]
    outer = torch.optim.SGD(glob, lr=0.7, momentum=0.9, nesterov=True)
    steps = [0] * world
    for j in range(periods):
        for r, (m, opt) in enumerate(zip(models, inner)):
            for _ in range(counts[r]):
                if (r, steps[r]) not in skip:
                    loss_of(m, r, steps[r]).backward()
                    opt.step()
                    opt.zero_grad()
                steps[r] += 1
        means = None
        if j not in dropped:
            with torch.no_grad():
                pseudo = [[g - p for g, p in zip(glob, m.parameters())] for m in models]
                means = weighted_mean(pseudo, weights[j], exact=True)
        outer_sync(glob, models, means, outer)
    return [params(m) for m in models]


def gloo_loop_worker(rank: int, world: int, fault: str) -> dict:
    """:func:`loop_run` with ``fault`` under each policy in every loop order, one after the
    other, on this gloo rank (the world's default group): ``{(nonfinite, order): result}``."""
    torch.manual_seed(0)
    return {(nonfinite, order): loop_run(rank, None, order, fault=fault, nonfinite=nonfinite)
            for nonfinite in ("raise", "skip") for order in ORDERS}
