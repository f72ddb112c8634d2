"""Per-step exchanges weighted by each replica's tokens (issue 55, balanced batches):
``FullReplicator(weights="tokens")`` and ``DeMoReplicator(weights="tokens")``.

Replicas run in threads over an :class:`~flexdemo.transport.InProcessHub`; the fp32
comparisons use an all-reduce that adds in rank order (:class:`pace_workers.RankOrder`) so a
dense reference can add alike: each replica's gradient scaled by ``c_i = w_i n / W`` (float64,
rounded to fp32 once), summed in rank order, divided by ``n``. The quantised exchanges are
compared within their rounding: int8 with a scale per block of 128 values rounds each value by
at most half a step, ``max|x| / 254`` of its block."""

from __future__ import annotations

import pytest
import torch
from dist_util import RankOrder
from pace_workers import LR, loss_of, model_fn, params, weighted_mean
from torch import nn

from flexdemo import DeMoReplicator, DeToNATION, DiLoCoReplicator, FullReplicator
from flexdemo.replicate.weights import weight_factors
from flexdemo.simulate import run_replicas
from flexdemo.transport import InProcessHub

STEPS = 3


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def run_steps(world: int, replicator, tokens: list[float] | None, *, steps: int = STEPS,
              rank_order: bool = True) -> list[tuple[list[torch.Tensor], int]]:
    """Every replica's parameters and bytes sent after ``steps`` steps of ``replicator()``
    (AdamW), replica ``r`` reporting ``tokens[r]`` per step (none when None)."""
    hub = InProcessHub(world, timeout=60)

    def work(r):
        model = model_fn()
        group = RankOrder(hub, r) if rank_order else hub.transport(r)
        opt = DeToNATION(model.parameters(), replicator(), base="adamw", lr=LR, group=group)
        for s in range(steps):
            loss_of(model, r, s).backward()
            if tokens is not None:
                opt.count_tokens(tokens[r])
            opt.step()
            opt.zero_grad()
        return params(model), opt.bytes_sent

    return run_replicas(hub, work)


def dense_steps(world: int, tokens: list[float], steps: int = STEPS) -> list[torch.Tensor]:
    """Data parallelism written out: at each step every replica's gradient at the shared
    parameters, their mean weighted by ``tokens`` (as the fp32 exchange computes it), an
    AdamW step."""
    model = model_fn()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    for s in range(steps):
        grads = []
        for r in range(world):
            model.zero_grad()
            loss_of(model, r, s).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, g in zip(model.parameters(), weighted_mean(grads, tokens, exact=True)):
            p.grad = g
        opt.step()
    return params(model)


def _full_sent_everything_demo(**kw) -> DeMoReplicator:
    """DeMo that sends every value of its momentum, in fp32, with no decay and no sign:
    its mean is the mean of the replicas' gradients."""
    return DeMoReplicator(topk=64, chunk=8, decay=0.0, transform="none", values="fp32",
                          sign=False, scale_by_lr=False, small="separate", chunking="divisor",
                          **kw)


# ---------------------------------------------------------------------- exact means
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["full", "demo-dense"])
def test_weighted_by_tokens_is_the_dense_reference_bitwise(world, kind):
    """Unequal tokens per step (8, 24, 16): every replica ends at the bits of the dense
    reference that weighs each gradient by its tokens; the fp32 full sync, and DeMo sending
    every value (its momentum is then the step's scaled gradient); equal weights differ."""
    tokens = [8, 24, 16][:world]
    build = (lambda: FullReplicator(weights="tokens")) if kind == "full" else (
        lambda: _full_sent_everything_demo(weights="tokens"))
    out = run_steps(world, build, tokens)
    ref = dense_steps(world, tokens)
    for r in range(world):
        assert _equal(out[r][0], ref), (kind, r, [(a - b).abs().max().item()
                                                  for a, b in zip(out[r][0], ref)])
    assert not _equal(ref, dense_steps(world, [1] * world))


@pytest.mark.parametrize("world", [2, 3])
def test_bytes_are_one_float64_per_replica_and_step(world):
    tokens = [8, 24, 16][:world]
    weighted = run_steps(world, lambda: FullReplicator(weights="tokens"), tokens)
    plain = run_steps(world, FullReplicator, None)
    for r in range(world):
        assert weighted[r][1] == plain[r][1] + STEPS * 8 * (world - 1)


# ---------------------------------------------------------------------- today's bits
EXCHANGES = {
    "fp32": dict(),
    "int8": dict(values="int8"),
    "int4-scatter": dict(values="int4", block=16, reduce="scatter"),
}
DEMOS = {
    "demo": dict(),
    "demo-senders": dict(mean="senders", values="fp32", topk=8),
    "demo-scatter": dict(reduce="scatter"),
}


@pytest.mark.parametrize("name", [*EXCHANGES, *DEMOS])
def test_equal_tokens_are_todays_bits(name):
    """Equal reported tokens, and tokens never reported, give factors of exactly 1: the bits
    of the same replicator without weights (3 replicas, ring-order all-reduce)."""
    cls, kw = (FullReplicator, EXCHANGES[name]) if name in EXCHANGES else (
        DeMoReplicator, DEMOS[name])
    plain = run_steps(3, lambda: cls(**kw), None, rank_order=False)
    equal = run_steps(3, lambda: cls(weights="tokens", **kw), [64] * 3, rank_order=False)
    silent = run_steps(3, lambda: cls(weights="tokens", **kw), None, rank_order=False)
    for r in range(3):
        assert _equal(plain[r][0], equal[r][0]) and _equal(plain[r][0], silent[r][0]), (name, r)
        assert equal[r][1] == plain[r][1] + STEPS * 16
    assert not _equal(plain[0][0], params(model_fn()))  # it trained


# ---------------------------------------------------------------------- the pull
class _Linear(nn.Module):
    """One 64 x 64 matrix whose loss ``(P * G).sum()`` has the gradient ``G``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(64, 64))


_V = torch.randn(64, 64, generator=torch.Generator().manual_seed(5))


def _pulled_mean(replicator, tokens: list[int]) -> torch.Tensor:
    """The exchanged mean of one step of 2 replicas with gradients ``+V`` and ``-V``,
    weighted by ``tokens`` (SGD at lr 1 from zero: the parameters are minus the mean)."""
    hub = InProcessHub(2, timeout=60)

    def work(r):
        model = _Linear()
        opt = DeToNATION(model.parameters(), replicator(), base="sgd", lr=1.0,
                         group=hub.transport(r))
        (model.weight * (_V if r == 0 else -_V)).sum().backward()
        opt.count_tokens(tokens[r])
        opt.step()
        return model.weight.detach().clone()

    out = run_replicas(hub, work)
    assert torch.equal(out[0], out[1])
    return -out[0]


@pytest.mark.parametrize("name", [*EXCHANGES, "demo", "demo-senders"])
def test_tokens_pull_the_mean_toward_the_heavier_replica(name):
    """Gradients ``+V`` and ``-V`` with tokens 3 : 1: the weighted mean is ``V / 2`` (fp32 to
    rounding, int8 within half a step of its blocks' scale), with 1 : 3 ``-V / 2``, with
    1 : 1 zero; DeMo (top-k of a momentum, signed) keeps the direction, measured as the
    projection on ``V`` of what it applies."""
    if name in EXCHANGES:
        build = lambda: FullReplicator(weights="tokens", **EXCHANGES[name])  # noqa: E731
    else:
        build = lambda: DeMoReplicator(weights="tokens", **DEMOS[name])  # noqa: E731
    proj = {}
    for label, tokens in (("first", [3, 1]), ("equal", [1, 1]), ("second", [1, 3])):
        mean = _pulled_mean(build, tokens)
        proj[label] = float((mean * _V).sum() / (_V * _V).sum())
        want = {"first": 0.5, "equal": 0.0, "second": -0.5}[label] * _V
        if name == "fp32":
            torch.testing.assert_close(mean, want, rtol=0, atol=1e-6)
        elif name in EXCHANGES:  # each replica's part rounded by half a step of its block
            step = 1.5 * _V.abs().max() / (254 if name == "int8" else 14)
            torch.testing.assert_close(mean, want, rtol=0, atol=float(step))
    assert proj["first"] > 0 > proj["second"], (name, proj)
    assert abs(proj["equal"]) < 0.5 * proj["first"], (name, proj)


def test_a_replica_that_reports_no_tokens_weighs_nothing():
    """Tokens [5, 0]: the mean is the first replica's gradient (``2 g / 2``, exact)."""
    mean = _pulled_mean(lambda: FullReplicator(weights="tokens"), [5, 0])
    assert torch.equal(mean, _V)


def test_weight_factors():
    f64 = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731
    ones = torch.ones(3, dtype=torch.float64)
    assert torch.equal(weight_factors(f64([7, 7, 7]), ones), torch.ones(3))
    assert torch.equal(weight_factors(f64([0, 0, 0]), ones), torch.ones(3))
    assert torch.equal(weight_factors(f64([1, 2, 3]), ones),
                       torch.tensor([0.5, 1.0, 1.5]))
    assert torch.equal(weight_factors(f64([0, 0]), f64([4, 2])),
                       f64([4 * 2 / 6, 2 * 2 / 6]).float())


# ---------------------------------------------------------------------- settings
def test_weights_settings_are_checked():
    with pytest.raises(ValueError, match="weights must be one of"):
        FullReplicator(weights="bytes")
    with pytest.raises(ValueError, match="weights must be one of"):
        DeMoReplicator(weights="steps")
    with pytest.raises(ValueError, match="senders' mean"):
        DeMoReplicator(weights="tokens", mean="senders", reduce="scatter")
    with pytest.raises(ValueError, match="senders' mean"):
        DeMoReplicator(weights="tokens", mean="senders", overlap="delayed")
    with pytest.raises(ValueError, match="pace=Pace"):
        DiLoCoReplicator(4, exchange=FullReplicator(weights="tokens"))
    with pytest.raises(ValueError, match="pace=Pace"):
        DiLoCoReplicator(4, exchange="demo", exchange_kwargs={"weights": "tokens"})
    assert "weights='tokens'" in repr(FullReplicator(weights="tokens"))
    assert "weights='tokens'" in repr(DeMoReplicator(weights="tokens"))
    assert "weights" not in repr(FullReplicator())
    hub = InProcessHub(1, timeout=10)
    rep = FullReplicator(weights="tokens")
    DeToNATION(model_fn().parameters(), rep, group=hub.transport(0))
    problem = rep.fault_tolerance_problem()
    assert problem is not None and "weights='tokens'" in problem
    assert FullReplicator().fault_tolerance_problem() is None


def test_a_skipped_step_drops_its_tokens():
    """A step the schedule skips runs locally: its tokens are not carried to the next
    exchange (equal reports there: today's bits)."""
    plain = run_steps(2, lambda: FullReplicator(replicate_every=2), None, steps=4)
    hub = InProcessHub(2, timeout=60)

    def work(r):
        model = model_fn()
        opt = DeToNATION(model.parameters(), FullReplicator(weights="tokens", replicate_every=2),
                         base="adamw", lr=LR, group=RankOrder(hub, r))
        for s in range(4):
            loss_of(model, r, s).backward()
            opt.count_tokens([100, 1][r] if s % 2 else 10)  # unequal on the skipped steps
            opt.step()
            opt.zero_grad()
        return params(model)

    out = run_replicas(hub, work)
    for r in range(2):
        assert _equal(out[r], plain[r][0]), r


# ---------------------------------------------------------------------- balanced batches
def test_balanced_batches():
    """Sizes in proportion to speed, summing to the global batch, each at least 1; the
    largest remainders (ties to the lower rank); checked arguments."""
    from flexdemo import balanced_batches

    assert balanced_batches([0.01, 0.01, 0.03], 56) == [24, 24, 8]
    assert balanced_batches([1.0, 1.0, 1.0], 10) == [4, 3, 3]  # a tie: the lower rank
    assert balanced_batches([1.0, 1000.0], 2) == [1, 1]  # at least one each
    assert balanced_batches([1.0, 1000.0, 1000.0], 4) == [2, 1, 1]
    assert balanced_batches([2.0, 1.0], 3) == [1, 2]
    for secs, batch in (([0.3, 0.1, 0.7, 0.2], 1000), ([1e-3, 5e-3], 7), ([1.0] * 5, 5)):
        sizes = balanced_batches(secs, batch)
        assert sum(sizes) == batch and min(sizes) >= 1
        quotas = [batch / s / sum(1 / t for t in secs) for s in secs]
        assert all(abs(k - q) < 1 for k, q in zip(sizes, quotas)), (sizes, quotas)
    with pytest.raises(ValueError, match="seconds per sample"):
        balanced_batches([1.0, 0.0], 8)
    with pytest.raises(ValueError, match="at least one sample per replica"):
        balanced_batches([1.0, 1.0, 1.0], 2)


def test_measured_batches_are_the_same_on_every_rank():
    from flexdemo import measured_batches

    hub = InProcessHub(3, timeout=30)
    out = run_replicas(hub, lambda r: measured_batches([0.01, 0.01, 0.03][r], 56,
                                                       hub.transport(r)))
    assert out == [[24, 24, 8]] * 3


def test_balanced_batches_weighted_by_tokens_are_the_global_batch():
    """One global batch of 56 split [24, 24, 8] across 3 replicas (the third 3x slower), each
    the mean loss of its own part, weighted by its rows: one SGD step is the step on the whole
    batch's mean loss (to fp32 rounding), where the plain mean of the three is not."""
    from flexdemo import balanced_batches

    sizes = balanced_batches([0.01, 0.01, 0.03], 56)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(56, 12, generator=g), torch.randn(56, 6, generator=g)
    parts = list(zip(x.split(sizes), y.split(sizes)))

    def run(weights):
        hub = InProcessHub(3, timeout=60)

        def work(r):
            model = model_fn()
            opt = DeToNATION(model.parameters(), FullReplicator(weights=weights), base="sgd",
                             lr=1.0, group=hub.transport(r))
            nn.functional.mse_loss(model(parts[r][0]), parts[r][1]).backward()
            opt.count_tokens(sizes[r])
            opt.step()
            return params(model)
        return run_replicas(hub, work)[0]

    whole = model_fn()
    torch.optim.SGD(whole.parameters(), lr=1.0).zero_grad()
    nn.functional.mse_loss(whole(x), y).backward()
    want = [p.detach() - p.grad for p in whole.parameters()]
    for a, b in zip(run("tokens"), want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(run("equal"), want))


@pytest.mark.multiprocess
def test_the_docs_loop_runs_on_two_processes(tmp_path):
    """docs/stragglers.md's own loop, as written, on 2 ranks (torchrun's variables): both
    measure, get the same sizes summing to the global batch, and take 8 steps."""
    import re

    from dist_util import run_as_torchrun
    from test_docs import ROOT, snippets


    found = [s for s in snippets(ROOT / "docs" / "stragglers.md") if s.mode == "torchrun"]
    assert len(found) == 1
    script = tmp_path / "balanced.py"
    script.write_text(found[0].code)
    outs = run_as_torchrun(script, 2, tmp_path)
    for out in outs:
        assert re.search(r"^48 8 \d+$", out, re.M), out
