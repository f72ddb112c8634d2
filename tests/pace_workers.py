"""Replicas of different speeds (DiLoCo's ``pace=``): the model, training loops and the dense
reference shared by tests/test_pace.py, and the gloo worker its processes run (importable by
the children)."""

from __future__ import annotations

import copy

import torch
from dist_util import alike, outer_sync
from torch import nn

from flexdemo import DeToNATION, DiLoCoReplicator, Pace

LR = 1e-2


class FakeClock:
    """A clock that advances ``seconds`` per reading: a replica that reads it at the start and
    the end of its measured steps looks ``seconds`` slow (no real time is read)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.now = seconds, 0.0

    def __call__(self) -> float:
        self.now += self.seconds
        return self.now


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 6))


#: the model, with the same initial parameters on every replica
model_fn = alike(_net)


def loss_of(model, r: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * r + step)
    x, y = torch.randn(8, 12, generator=g), torch.randn(8, 6, generator=g)
    return nn.functional.mse_loss(model(x), y)


def train(model, opt, r: int, steps: int, tokens: int | None = None) -> None:
    """``steps`` inner steps of replica ``r`` from its optimizer's step count on (its own
    batches), reporting ``tokens`` per step when given."""
    for _ in range(steps):
        loss_of(model, r, opt.steps).backward()
        if tokens is not None:
            opt.count_tokens(tokens)
        opt.step()
        opt.zero_grad()


def params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def weighted_mean(pseudo: list[list[torch.Tensor]], weights: list[float], *,
                  exact: bool) -> list[torch.Tensor]:
    """The replicas' mean of each tensor weighted by ``weights``. ``exact``: with the
    arithmetic of an fp32 all-reduce of inputs scaled by ``c_i = w_i n / W`` (float64, rounded
    to fp32 once; no scaling when the weights are equal), summed in rank order, divided by
    ``n``; else ``sum_i w_i x_i / W`` in float64, rounded once."""
    n, out = len(pseudo), []
    scales = None
    if len(set(weights)) > 1:
        total = sum(weights)
        scales = torch.tensor([w * n / total for w in weights], dtype=torch.float64).float()
    for i in range(len(pseudo[0])):
        if exact:
            acc = pseudo[0][i] if scales is None else pseudo[0][i] * scales[0]
            acc = acc.clone()
            for r in range(1, n):
                acc += pseudo[r][i] if scales is None else pseudo[r][i] * scales[r]
            out.append(acc / n)
        else:
            acc64 = sum(w * p[i].double() for w, p in zip(weights, pseudo))
            out.append((acc64 / sum(weights)).float())
    return out


def _reference_setup(world: int, outer_lr: float, outer_momentum: float):
    """A written-out DiLoCo's replicas (the same initial model), their AdamW inner
    optimizers, the global parameters and the outer SGD (Nesterov where it has momentum)."""
    models = [model_fn() for _ in range(world)]
    inner = [torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.0) for m in models]
    glob = [nn.Parameter(p.detach().clone()) for p in models[0].parameters()]
    outer = torch.optim.SGD(glob, lr=outer_lr, momentum=outer_momentum,
                            nesterov=outer_momentum > 0)
    return models, inner, glob, outer


def dense_reference(counts: list[list[int]], *, outer_lr: float = 0.7,
                    outer_momentum: float = 0.9, tokens: list[int] | None = None,
                    exact: bool = True) -> list[list[torch.Tensor]]:
    """DiLoCo written out for replicas of different speeds: in period ``j`` replica ``r``
    takes ``counts[j][r]`` AdamW steps on its own batches from the global parameters, the
    pseudo-gradients ``global - local`` are averaged weighted by the steps (or by
    ``tokens[r]`` per step), an outer SGD step (Nesterov where it has momentum) moves the
    global parameters and every replica restarts there."""
    world = len(counts[0])
    models, inner, glob, outer = _reference_setup(world, outer_lr, outer_momentum)
    steps = [0] * world
    for period in counts:
        for r, (m, opt) in enumerate(zip(models, inner)):
            for _ in range(period[r]):
                loss_of(m, r, steps[r]).backward()
                opt.step()
                opt.zero_grad()
                steps[r] += 1
        weights = period if tokens is None else [k * t for k, t in zip(period, tokens)]
        with torch.no_grad():
            pseudo = [[g - p for g, p in zip(glob, m.parameters())] for m in models]
            outer_sync(glob, models, weighted_mean(pseudo, weights, exact=exact), outer)
    return [params(m) for m in models]


def overlap_delays(counts: list[list[int]], tau: int, inner_steps: int) -> list[list[int]]:
    """The steps after each sync's launch at which each replica applies it, for given counts:
    ``tau`` of the fastest replica's steps in its own, ``round(tau k / H)`` (at least 1, at
    most ``k - 1``) for a count ``k`` in the period after the launch."""
    return [[min(k - 1, max(1, round(tau * k / inner_steps))) for k in period]
            for period in counts[1:]]


def overlap_reference(counts: list[list[int]], delays: list[list[int]], *,
                      outer_lr: float = 0.7, outer_momentum: float = 0.9
                      ) -> list[list[torch.Tensor]]:
    """DiLoCo with each sync overlapped with the next steps (``keep_overlap``), written out:
    in period ``j`` replica ``r`` takes ``counts[j][r]`` AdamW steps; at its end the
    pseudo-gradients ``global - local`` are taken and each replica remembers where it stood;
    after its first ``delays[j][r]`` steps of the next period (at once after the last period)
    the weighted mean (fp32, in rank order) steps the global parameters, and each replica
    moves to them plus its steps since it stood there."""
    world = len(counts[0])
    models, inner, glob, outer = _reference_setup(world, outer_lr, outer_momentum)
    steps = [0] * world
    pending = None  # (means, anchors) of the sync in flight

    def apply(means, anchors):
        with torch.no_grad():
            for g, avg in zip(glob, means):
                g.grad = avg
            outer.step()
            outer.zero_grad()
            for m, anchor in zip(models, anchors):
                for p, a, g in zip(m.parameters(), anchor, glob):
                    p.sub_(a).add_(g)

    def take(r, n):
        for _ in range(n):
            loss_of(models[r], r, steps[r]).backward()
            inner[r].step()
            inner[r].zero_grad()
            steps[r] += 1

    for j, period in enumerate(counts):
        early = [0] * world if pending is None else delays[j - 1]
        for r in range(world):
            take(r, early[r])
        if pending is not None:
            apply(*pending)
        for r in range(world):
            take(r, period[r] - early[r])
        with torch.no_grad():
            pseudo = [[g - p for g, p in zip(glob, m.parameters())] for m in models]
            anchors = [params(m) for m in models]
        pending = (weighted_mean(pseudo, period, exact=True), anchors)
    apply(*pending)
    return [params(m) for m in models]


# ---------------------------------------------------------------------- gloo
H = 6
SECONDS = [1.0, 1.0, 3.0]  # rank 2 three times slower: counts [6, 6, 2]
PERIODS = 3  # the first measures, two run at the measured counts


def paced_run(rank: int, world: int, group=None, exchange_kwargs: dict | None = None,
              weights: str = "steps", tokens: int | None = None) -> dict:
    """One replica of a fixed-mode run (its speed from :data:`SECONDS` on a fake clock) for
    :data:`PERIODS` periods; its parameters, counts and bytes sent."""
    model = model_fn()
    rep = DiLoCoReplicator(H, pace=Pace(weights=weights, clock=FakeClock(SECONDS[rank])),
                           exchange_kwargs=exchange_kwargs)
    opt = DeToNATION(model.parameters(), rep, base="adamw", lr=LR, group=group)
    train(model, opt, rank, H, tokens)  # the first period: H steps everywhere, measured
    counts = rep.pace.counts
    assert counts is not None, "measured at the first sync"
    train(model, opt, rank, (PERIODS - 1) * counts[rank], tokens)
    return {"params": params(model), "counts": counts, "steps": opt.steps,
            "sent": opt.bytes_sent, "payload": rep.exchange_bytes()}


CASES = {  # name -> (exchange_kwargs, weights, tokens per step of each rank)
    "fp32": (None, "steps", None),
    "int4-scatter-tokens": ({"values": "int4", "block": 16, "reduce": "scatter"}, "tokens",
                            [100, 300, 200]),
}


def gloo_pace_worker(rank: int, world: int) -> dict:
    """Every case of :data:`CASES` on this gloo rank."""
    torch.manual_seed(0)
    out = {}
    for name, (kw, weights, tokens) in CASES.items():
        out[name] = paced_run(rank, world, exchange_kwargs=kw, weights=weights,
                              tokens=None if tokens is None else tokens[rank])
    return out


# ---------------------------------------------------------------------- adaptive mode
ADAPTIVE_H = 10
ADAPTIVE_PERIODS = 6
#: the counts in force in each period of :func:`adaptive_run` (decided at syncs 3 and 5)
ADAPTIVE_COUNTS = [[10, 10, 10]] * 3 + [[9, 8, 3]] * 2 + [[10, 9, 10]]


def adaptive_seconds(rank: int, period: int) -> float:
    """Seconds per step of ``rank`` in ``period`` (from 1): rank 1 is 10% slower throughout
    (a count of 9 of 10: within the bound of 0.15 x 9 steps, so alone it changes nothing), rank 2
    three times slower in periods 3 and 4 (after sync 2, until sync 4), then recovered."""
    if rank == 2 and period in (3, 4):
        return 3.0
    return 1.1 if rank == 1 else 1.0


class VirtualClock:
    """A clock that only the training loop advances (by the replica's seconds per step, as a
    step's forward and backward would take): no real time is read."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def adaptive_run(rank: int, world: int, group=None, *, periods: int = ADAPTIVE_PERIODS,
                 state: tuple | None = None, tolerance: float = 0.15,
                 seconds=adaptive_seconds, mode: str = "adaptive") -> dict:
    """One replica of an adaptive run (H = 10, weights by steps, tolerance 0.15) on a
    :class:`VirtualClock` advanced by ``seconds(rank, period)`` before each step, until
    ``periods`` syncs (from ``state``, a saved ``(model, optimizer)`` state, when given).
    After each sync: the sync's number, the counts in force next and the parameters
    (``mode="timed"``: a timed pace; ``steps_done``: every replica's steps, as gathered)."""
    model = model_fn()
    clock = VirtualClock()
    rep = DiLoCoReplicator(ADAPTIVE_H, pace=Pace(mode, tolerance=tolerance, clock=clock))
    opt = DeToNATION(model.parameters(), rep, base="adamw", lr=LR, group=group)
    if state is not None:
        model.load_state_dict(state[0])
        opt.load_state_dict(state[1])
    pace = rep.pace
    loaded = (pace.counts, pace.synced, list(pace.changes))
    after = []
    while pace.synced < periods:
        clock.now += seconds(rank, pace.synced + 1)  # this step's forward and backward
        loss_of(model, rank, opt.steps).backward()
        opt.step()
        opt.zero_grad()
        if pace.since == 0:  # it just synced
            after.append((pace.synced, list(pace.counts or []), params(model)))
    return {"loaded": loaded, "after": after, "changes": list(pace.changes),
            "steps_done": list(pace.steps_done),
            "params": params(model),
            "steps": opt.steps, "sent": opt.bytes_sent, "payload": rep.exchange_bytes(),
            "state": (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))}


def gloo_adaptive_worker(rank: int, world: int) -> dict:
    """:func:`adaptive_run` on this gloo rank."""
    torch.manual_seed(0)
    out = adaptive_run(rank, world)
    del out["state"]
    return out


# ---------------------------------------------------------------------- sharded replicas
#: seconds per step of each rank of 2 replicas x 2 shards (ranks 2r, 2r + 1: replica r): only
#: replica 1's second shard is slow, which its replicate group ({1, 3}) sees and the other
#: ({0, 2}) does not
SHARD_SECONDS = [1.0, 1.0, 1.0, 3.0]
SHARD_TOKENS = [10, 30, 20, 20]


def sharded_pace_worker(rank: int, world: int) -> dict:
    """A replica spread over two ranks (as FSDP shards it; here each rank's own small model
    stands for its shard): every rank of the job must reach the same counts and the same
    weight factors, or the ranks of one replica sync at different steps. One measured period
    of H = 6, then two periods at the counts measured, weighted by reported tokens."""
    import torch.distributed as dist

    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[rank % 2]  # the ranks holding the same shard of each replica
    model = model_fn()
    rep = DiLoCoReplicator(6, pace=Pace(weights="tokens", clock=FakeClock(SHARD_SECONDS[rank])),
                           group=group)
    opt = DeToNATION(model.parameters(), rep, base="adamw", lr=LR, group=group)
    factors = []
    step = 0
    while rep.syncs[0] < 3:
        loss_of(model, rank, step).backward()
        opt.count_tokens(SHARD_TOKENS[rank])
        synced = rep.syncs[0]
        opt.step()
        opt.zero_grad()
        step += 1
        if rep.syncs[0] != synced:
            exchange = rep.exchanges[0]
            scales = exchange.peer_scales
            factors.append(None if scales is None else scales.tolist())
    return {"counts": rep.pace.counts, "steps": opt.steps, "factors": factors}


def timed_sharded_worker(rank: int, world: int, mode: str = "timed") -> str:
    """A timed (or filling) pace over replicate groups of one rank each in a job of ``world``
    ranks (each replica sharded over every rank): refused at set-up, in one line."""
    groups = [torch.distributed.new_group([r]) for r in range(world)]
    model = model_fn()
    try:
        DeToNATION(model.parameters(), DiLoCoReplicator(4, pace=Pace(mode)),
                   base="adamw", lr=LR, group=groups[rank])
    except ValueError as e:
        return str(e)
    return "accepted"


# ---------------------------------------------------------------------- fill mode
FILL_H = 10
#: real seconds each rank sleeps per step (rank 2 three times slower), and the same figures
#: on the virtual clock of the first measurement (a deterministic first decision: counts
#: [9, 9, 3], the first period's [10, 10, 6])
FILL_SLEEP = [0.01, 0.01, 0.03]


def fill_worker(rank: int, world: int, periods: int = 4, tau: int = 0) -> dict:
    """One replica of a filling pace (H = 10) on gloo: each step sleeps its
    :data:`FILL_SLEEP` (real time: the faster replicas fill the slowest one's period with as
    many steps as fit) and advances the virtual clock that the first ``measure`` steps read.
    After each sync: the counts in force next, every replica's steps so far (gathered) and
    the parameters (``tau > 0``, each sync overlapped: the global ones once it is applied;
    the last applied at once, :meth:`~flexdemo.DiLoCoReplicator.settle`)."""
    import time

    model = model_fn()
    clock = VirtualClock()
    rep = DiLoCoReplicator(FILL_H, pace=Pace("fill", clock=clock), tau=tau,
                           keep_overlap=tau > 0)
    opt = DeToNATION(model.parameters(), rep, base="adamw", lr=LR)
    pace = rep.pace
    after, in_force, applied, delays = [], [], [], []
    while pace.synced < periods:
        period = pace.period  # the counts the period runs at (the first: decided early)
        clock.now += FILL_SLEEP[rank] * 100
        time.sleep(FILL_SLEEP[rank])
        loss_of(model, rank, opt.steps).backward()
        in_flight = bool(rep.pending)
        opt.step()
        opt.zero_grad()
        if pace.since == 0:  # it just synced (launched the sync)
            after.append((list(pace.counts or []), list(pace.steps_done), params(model)))
            in_force.append(period)
            delays.append(pace.delay)
        if in_flight and not rep.pending:  # applied now
            applied.append((pace.since, [g.clone() for g in rep.global_params]))
    rep.settle()
    return {"after": after, "in_force": in_force, "steps": opt.steps, "params": params(model),
            "sent": opt.bytes_sent, "payload": rep.exchange_bytes(), "binding": pace.binding(),
            "applied": applied, "delays": delays,
            "global": [g.clone() for g in rep.global_params]}
