"""The byte frontier's pieces: the mean of each coordinate over the replicas that sent it,
peers clipped to the median norm, error feedback, and the named presets (identical replicas,
bitwise resume; the exact bytes of our variants "muloco-int4" and "sparseloco-dct" at 2, 4 and 8
replicas; the papers' presets against their references: tests/test_parity.py)."""

from __future__ import annotations

import math

import pytest
import torch
from frontier_util import batch, loss_fn, tiny_model

from flexdemo import SimulatedReplicas
from flexdemo.compress.quant import ValueCodec
from flexdemo.replicate import (
    FRONTIER,
    DeMoReplicator,
    DiLoCoReplicator,
    FullReplicator,
    NonFiniteGradientError,
    make_replicator,
)
from flexdemo.simulate import run_replicas
from flexdemo.transport import InProcessHub

CHUNK, K = 8, 5
SHAPES = [torch.Size([16, 16]), torch.Size([8, 24])]  # 4 and 3 blocks of 8 x 8, no padding


def grads_of(r: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7 + r)
    return [torch.randn(s, generator=g) * scale for s in SHAPES]


def blocks(t: torch.Tensor) -> torch.Tensor:
    """``t`` as its 8 x 8 blocks, ``(blocks, 64)``, row-major over the block grid."""
    r, c = t.shape
    return t.reshape(r // CHUNK, CHUNK, c // CHUNK, CHUNK).permute(0, 2, 1, 3).reshape(-1, 64)


def unblocks(b: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    r, c = shape
    return b.reshape(r // CHUNK, c // CHUNK, CHUNK, CHUNK).permute(0, 2, 1, 3).reshape(r, c)


def sparse_topk(t: torch.Tensor) -> torch.Tensor:
    """The top-K entries of every block of ``t`` by magnitude, the rest zero."""
    b = blocks(t)
    keep = torch.zeros_like(b).scatter_(1, b.abs().topk(K, dim=1).indices, 1.0)
    return unblocks(b * keep, t.shape)


def exchange(world: int, scale=lambda r: 1.0, **kw) -> list[list[torch.Tensor]]:
    """One DeMo exchange (plain top-K per block, fp32 values, momentum decay 0: the input
    itself is selected) of ``grads_of(r)`` over ``world`` in-process replicas."""
    hub = InProcessHub(world, timeout=30)

    def work(r):
        rep = DeMoReplicator(topk=K, chunk=CHUNK, decay=0.0, sign=False, scale_by_lr=False,
                             values="fp32", transform="none", **kw)
        rep.setup(SHAPES, torch.device("cpu"), hub.transport(r))
        return rep(grads_of(r, scale(r)), [1.0] * len(SHAPES), 0)

    return run_replicas(hub, work)


@pytest.mark.parametrize("mean", ["senders", "replicas"])
def test_the_mean_is_exact_against_a_dense_reference(mean):
    world = 3
    out = exchange(world, mean=mean)
    for i in range(len(SHAPES)):
        sent = [sparse_topk(grads_of(r)[i]) for r in range(world)]
        total = sent[0] + sent[1] + sent[2]  # rank order, as every replica sums
        if mean == "senders":
            count = sum((s != 0).float() for s in sent)
            want = total / count.clamp(min=1.0)
            assert (count == 2).any() and (count == 1).any()  # overlapping and lone senders
        else:
            want = total / world
        for r in range(world):
            assert torch.equal(out[r][i], want), (mean, i, r)


def test_peers_above_the_median_norm_are_clipped_to_it():
    world, big = 3, 2  # replica 2 sends ten times the others' norm
    out = exchange(world, scale=lambda r: 10.0 if r == big else 1.0, mean="senders",
                   clip="median")
    sent = [[sparse_topk(g) for g in grads_of(r, 10.0 if r == big else 1.0)]
            for r in range(world)]
    norms = torch.stack([torch.cat([s.reshape(-1) for s in peer]).norm() for peer in sent])
    median = norms.sort().values[1]
    for i in range(len(SHAPES)):
        clipped = [sent[r][i] * (median / norms[r] if norms[r] > median else 1.0)
                   for r in range(world)]
        count = sum((s != 0).float() for s in clipped)
        want = (clipped[0] + clipped[1] + clipped[2]) / count.clamp(min=1.0)
        for r in range(world):
            torch.testing.assert_close(out[r][i], want, rtol=1e-5, atol=1e-6)
        assert torch.equal(out[0][i], out[1][i]) and torch.equal(out[0][i], out[2][i])
    # (10x the median is over the default bound on each peer's part, 8x: off here)
    unclipped = exchange(world, scale=lambda r: 10.0 if r == big else 1.0, mean="senders",
                         peer_bound=None)
    assert unclipped[0][0].abs().max() > 2 * out[0][0].abs().max()


@pytest.mark.parametrize("values", ["fp32", "int2", "stat2", "stat3", "stat1"])
def test_error_feedback_keeps_what_was_not_sent(values):
    """A group of one decodes its own payload: the update plus the error-feedback buffer
    is the input, and everything not selected stays in the buffer exactly."""
    rep = DeMoReplicator(topk=K, chunk=CHUNK, decay=1.0, sign=False, scale_by_lr=False,
                         values=values, transform="none", mean="senders")
    rep.setup(SHAPES, torch.device("cpu"), None)
    g = grads_of(0)
    out = rep([t.clone() for t in g], [1.0] * len(SHAPES), 0)
    residual = [unblocks(d.reshape(-1, 64), s) for d, s in zip(rep.delta, SHAPES)]
    for i in range(len(SHAPES)):
        picked = sparse_topk(g[i]) != 0
        assert torch.equal(residual[i][~picked], g[i][~picked])  # not sent: kept exactly
        assert torch.equal(out[i][~picked], torch.zeros_like(out[i][~picked]))
        torch.testing.assert_close(out[i] + residual[i], g[i], rtol=0, atol=1e-6)
        if values != "fp32":  # lossy values: the rounding error stays in the buffer
            assert residual[i][picked].abs().max() > 0


def sim_of(preset: str, replicas: int, seed: int = 0, **kw) -> SimulatedReplicas:
    torch.manual_seed(seed)
    return SimulatedReplicas(tiny_model, loss_fn, replicas=replicas, replicator=preset,
                             optimizer="adamw", lr=1e-2, seed=seed,
                             replicator_kwargs={"inner_steps": 3, **kw})


def test_presets_are_diloco_with_their_documented_settings():
    """The papers' names (tests/test_parity.py checks their updates) and our variants."""
    muloco, sparse = make_replicator("muloco"), make_replicator("sparseloco")
    assert isinstance(muloco, DiLoCoReplicator) and isinstance(sparse, DiLoCoReplicator)
    assert (muloco.inner_steps, muloco.outer_lr, muloco.outer_momentum) == (30, 0.7, 0.6)
    ex = muloco.exchange
    assert (ex.values, ex.reduce, ex.error_feedback) == ("stat2-tensor", "gather", 0.9)
    ex = sparse.exchange
    assert (sparse.inner_steps, sparse.outer_lr, sparse.outer_momentum) == (30, 1.0, 0.0)
    assert (ex.topk, ex.chunk, ex.chunking, ex.small, ex.values, ex.decay, ex.transform,
            ex.mean) == (64, 64, "divisor", "separate", "stat2-tensor", 0.95, "none",
                         "senders")
    int4, dct = make_replicator("muloco-int4"), make_replicator("sparseloco-dct")
    assert (int4.inner_steps, int4.outer_lr, int4.outer_momentum) == (30, 0.7, 0.6)
    assert (int4.exchange.values, int4.exchange.reduce, int4.exchange.error_feedback) == (
        "int4", "scatter", None)
    ex = dct.exchange
    assert (dct.inner_steps, dct.outer_lr, dct.outer_momentum) == (30, 1.0, 0.0)
    assert (ex.topk, ex.chunk, ex.chunking, ex.values, ex.decay, ex.transform, ex.mean) == (
        64, 64, "near", "stat2", 0.95, "dct", "replicas")
    avg = make_replicator("diloco-avg")
    assert (avg.inner_steps, avg.outer_lr, avg.outer_momentum) == (100, 1.0, 0.0)
    # settings given with the name override, exchange settings merge into the preset's
    other = make_replicator("sparseloco", inner_steps=10, exchange_kwargs={"topk": 128})
    assert other.inner_steps == 10 and other.exchange.topk == 128
    assert other.exchange.values == "stat2-tensor"
    assert FRONTIER["sparseloco"]["exchange_kwargs"]["topk"] == 64  # the table is unchanged
    with pytest.raises(ValueError, match="no setting 'topk'"):
        make_replicator("sparseloco", topk=3)
    with pytest.raises(ValueError, match="one codebook per tensor"):
        make_replicator("muloco", exchange_kwargs={"reduce": "scatter"})


EF2 = {"exchange_kwargs": {"values": "int2", "error_feedback": 0.9,
                           "owner_error_feedback": True}}
EF1 = {"exchange_kwargs": {"values": "stat1", "block": 16, "error_feedback": 0.9}}
OWNER = {"exchange_kwargs": {"values": "int4", "block": 16, "owner_error_feedback": 0.7}}


@pytest.mark.parametrize("preset,kw", [("muloco", {}), ("sparseloco", {}), ("muloco-int4", {}),
                                       ("sparseloco-dct", {}), ("muloco-int4", EF2),
                                       ("muloco-int4", EF1), ("muloco-int4", OWNER)])
def test_presets_keep_replicas_identical_and_resume_bitwise(preset, kw, tmp_path):
    def run(sim, steps):
        for s in steps:
            sim.step([batch(r, s) for r in range(3)])

    a = sim_of(preset, 3, **kw)
    run(a, range(3))
    assert a.identical()  # every replica restarts from the same global parameters
    run(a, range(3, 4))
    assert not a.identical()  # inner steps are local
    torch.save(a.state_dict(), tmp_path / "sim.pt")
    run(a, range(4, 9))
    assert a.identical()
    b = sim_of(preset, 3, seed=5, **kw)
    b.load_state_dict(torch.load(tmp_path / "sim.pt", weights_only=False))
    run(b, range(4, 9))
    for ma, mb in zip(a.models, b.models):
        assert all(torch.equal(p, q) for p, q in zip(ma.parameters(), mb.parameters()))
    assert a.bytes_sent == b.bytes_sent and a.bytes_received == b.bytes_received
    if kw in (EF2, OWNER):  # the owners' residuals (owner error feedback) came back too
        for oa, ob in zip(a.optimizers, b.optimizers):
            ra, rb = oa.replicators[0].exchanges[0], ob.replicators[0].exchanges[0]
            assert ra.owner_residual.abs().max() > 0
            assert torch.equal(ra.owner_residual, rb.owner_residual)


@pytest.mark.parametrize("preset", ["muloco-int4", "sparseloco-dct"])
def test_bytes_sent_and_received_are_exact_at_2_4_and_8_replicas(preset):
    """Our variants' wire formats (the papers' presets: tests/test_parity.py)."""
    per_sync = {}
    for n in (2, 4, 8):
        sim = sim_of(preset, n)
        for s in range(6):  # two syncs
            sim.step([batch(r, s) for r in range(n)])
        reps = [o.replicators[0] for o in sim.optimizers]
        one = reps[0].exchange_bytes()  # one period: every fragment synced once
        assert all(r.exchange_bytes() == one for r in reps)
        assert sim.bytes_sent == [2 * one] * n and sim.bytes_received == [2 * one] * n
        ex = reps[0].exchanges[0]
        if preset == "sparseloco-dct":  # an all-gather: n - 1 payloads of the exact size
            assert one == (n - 1) * ex.payload_bytes()
            assert ex.payload_bytes() == sparse_payload_bytes(ex)
        per_sync[n] = one
    if preset == "muloco-int4":  # reduce-scatter: at most two payloads whatever the group size
        assert per_sync[8] <= 2 * per_sync[2] * 1.1
    else:  # a gather grows as n - 1 (issue: a flat path for sparse exchanges)
        assert per_sync[8] == 7 * per_sync[2]


def sparse_payload_bytes(ex: DeMoReplicator) -> int:
    """The sparseloco-dct wire format by hand: a 32-byte header, then per group of blocks
    12-bit indices (64 x 64 blocks; fewer bits for smaller ones) and 2-bit codes of its values
    with a bf16 codebook of 4 bin means per block, each segment 8-byte aligned."""
    def aligned(x):
        return x + -x % 8

    body = 0
    for g in ex.groups:
        bits = (g.block_numel - 1).bit_length()
        assert bits == (12 if g.block_numel == 4096 else bits)
        body += aligned(-(-g.blocks * g.k * bits // 8))
        body += aligned(2 * 4 * g.blocks + -(-g.blocks * g.k * 2 // 8))
    return 32 + body


def full_exchange(world: int, before=None, **kw) -> list:
    """Two exchanges of ``grads_of(r)`` (the second scaled by 0.5) on ``world`` in-process
    replicas with a quantised FullReplicator; per replica its outputs (or the error it
    raised) and the replicator."""
    hub = InProcessHub(world, timeout=30)

    def work(r):
        rep = FullReplicator(**kw)
        rep.setup(SHAPES, torch.device("cpu"), hub.transport(r))
        outs = []
        for step in range(2):
            grads = [g * (1.0 - 0.5 * step) for g in grads_of(r)]
            if before is not None:
                before(r, step, grads)
            try:
                outs.append(rep(grads, [1.0] * len(SHAPES), step))
            except NonFiniteGradientError as e:
                outs.append(e)
        return outs, rep

    return run_replicas(hub, work)


@pytest.mark.parametrize("values", ["int2", "stat1"])
@pytest.mark.parametrize("reduce", ["gather", "scatter"])
def test_dense_error_feedback_sends_the_residual_and_keeps_the_rest(reduce, values):
    decay, world = 0.9, 3
    hub_out = full_exchange(world, values=values, block=16, reduce=reduce,
                            error_feedback=decay)
    plain = full_exchange(world, values=values, block=16, reduce=reduce)
    flat = [[torch.cat([t.reshape(-1) for t in o]) for o in outs] for outs, _ in hub_out]
    for r in range(1, world):  # bitwise one mean on every replica, at every step
        assert all(torch.equal(a, b) for a, b in zip(flat[0], flat[r]))
    x = [torch.cat([g.reshape(-1) for g in grads_of(r)]) for r in range(world)]
    codec = ValueCodec(values, 16)
    for r, (_, rep) in enumerate(hub_out):
        # step 0 sends Q(x); step 1 sends Q(decay * (x - Q(x)) + x / 2): the residual is what
        # the encoding lost, carried over
        e0 = x[r] - codec_round(codec, x[r], reduce, world)
        acc = decay * e0 + 0.5 * x[r]
        want = acc - codec_round(codec, acc, reduce, world)
        torch.testing.assert_close(rep.residual, want, rtol=0, atol=1e-5)
    # the second step's mean differs from the one without error feedback: the residual went in
    plain_flat = torch.cat([t.reshape(-1) for t in plain[0][0][1]])
    assert not torch.equal(flat[0][1], plain_flat)
    err_ef = (flat[0][0] + flat[0][1] - 1.5 * torch.stack(x).mean(0)).norm()
    err_plain = (torch.cat([t.reshape(-1) for t in plain[0][0][0]]) + plain_flat
                 - 1.5 * torch.stack(x).mean(0)).norm()
    assert err_ef < err_plain  # over two steps, error feedback tracks the sum better


def codec_round(codec, values: torch.Tensor, reduce: str, world: int) -> torch.Tensor:
    """``values`` through the first encoding of the exchange (chunked as the owners cut it
    under reduce-scatter)."""
    if reduce == "gather":
        buf = torch.zeros(codec.nbytes(values.numel()), dtype=torch.uint8)
        codec.encode(values, buf)
        return codec.decode(buf, values.numel())
    chunk = math.ceil(math.ceil(values.numel() / world) / codec.block) * codec.block
    padded = torch.zeros(world * chunk)
    padded[: values.numel()] = values
    out = []
    for c in range(world):
        buf = torch.zeros(codec.nbytes(chunk), dtype=torch.uint8)
        codec.encode(padded[c * chunk:(c + 1) * chunk], buf)
        out.append(codec.decode(buf, chunk))
    return torch.cat(out)[: values.numel()]


def test_a_failed_step_leaves_the_residual_holding_its_input():
    """Step 1 fails on every replica (a NaN on rank 1): each adds back what it sent, so a
    good rank's residual holds its step's input on top of the decayed residual, and the bad
    rank's residual is as before the step (its input is not taken in)."""
    decay, world = 0.5, 2

    def nan_at_step_1_on_rank_1(r, step, grads):
        if r == 1 and step == 1:
            grads[0][0, 0] = float("nan")

    out = full_exchange(world, before=nan_at_step_1_on_rank_1, values="int4", block=16,
                        error_feedback=decay)
    codec = ValueCodec("int4", 16)
    for r, (outs, rep) in enumerate(out):
        assert isinstance(outs[1], NonFiniteGradientError) and outs[1].ranks == [1]
        x = torch.cat([g.reshape(-1) for g in grads_of(r)])
        e0 = x - codec_round(codec, x, "gather", world)
        want = decay * e0 + 0.5 * x if r == 0 else e0
        torch.testing.assert_close(rep.residual, want, rtol=0, atol=1e-6)


KEEP_FULL = {"exchange": "full", "keep_unsent": True,
             "exchange_kwargs": {"values": "int4", "block": 16, "error_feedback": 0.9}}
KEEP_SPARSE = {"exchange": "topk", "keep_unsent": True,
               "exchange_kwargs": {"topk": 8, "chunk": 8, "values": "stat2", "decay": 0.95}}


def keep_sim(replicas: int, kw: dict, seed: int = 0) -> SimulatedReplicas:
    torch.manual_seed(seed)
    return SimulatedReplicas(tiny_model, loss_fn, replicas=replicas, replicator="diloco",
                             optimizer="adamw", lr=1e-2, seed=seed,
                             replicator_kwargs={"inner_steps": 3, **kw})


@pytest.mark.parametrize("kw", [KEEP_FULL, KEEP_SPARSE], ids=["int4-ef", "topk-stat2"])
def test_kept_progress_is_the_residual_the_exchange_has_not_sent(kw):
    sim = keep_sim(3, kw)
    plain = keep_sim(3, {**kw, "keep_unsent": False})
    for s in range(6):  # two syncs
        sim.step([batch(r, s) for r in range(3)])
        plain.step([batch(r, s) for r in range(3)])
    assert plain.identical() and not sim.identical()  # replicas differ by their residuals
    for model, opt in zip(sim.models, sim.optimizers):
        rep = opt.replicators[0]
        for p, g, e in zip(model.parameters(), rep.global_params, rep.residual):
            assert torch.equal(p.detach(), g - e)  # the global parameters minus its residual
            assert e.abs().max() > 0
        if kw is KEEP_FULL:  # the same residual as the exchange's own error feedback
            flat = torch.cat([e.reshape(-1) for e in rep.residual])
            torch.testing.assert_close(flat, rep.exchanges[0].residual, rtol=0, atol=1e-6)
    # the global parameters are the same on every replica, and what plain DiLoCo reaches
    # differs (the kept progress changes what the replicas send next)
    globals_ = [o.replicators[0].global_params for o in sim.optimizers]
    assert all(torch.equal(a, b) for g in globals_[1:] for a, b in zip(globals_[0], g))


def test_kept_progress_resumes_bitwise(tmp_path):
    kw = {**KEEP_SPARSE, "exchange": "demo"}
    a = keep_sim(2, kw)
    for s in range(4):
        a.step([batch(r, s) for r in range(2)])
    torch.save(a.state_dict(), tmp_path / "sim.pt")
    for s in range(4, 9):
        a.step([batch(r, s) for r in range(2)])
    b = keep_sim(2, kw, seed=3)
    b.load_state_dict(torch.load(tmp_path / "sim.pt", weights_only=False))
    for s in range(4, 9):
        b.step([batch(r, s) for r in range(2)])
    for ma, mb in zip(a.models, b.models):
        assert all(torch.equal(p, q) for p, q in zip(ma.parameters(), mb.parameters()))


@pytest.mark.parametrize("kw,says", [
    ({"tau": 1}, "tau=0 and alpha=0"),
    ({"alpha": 0.5}, "tau=0 and alpha=0"),
    ({"exchange": "full"}, "can tell what it sent"),
    ({"exchange": "demo", "exchange_kwargs": {"overlap": "delayed"}}, "can tell what it sent"),
])
def test_keep_unsent_refuses_what_it_cannot_keep(kw, says):
    with pytest.raises(ValueError, match=says):
        DiLoCoReplicator(inner_steps=4, keep_unsent=True, **kw)
    rep = DiLoCoReplicator(inner_steps=4, **KEEP_SPARSE)
    assert "keep_unsent" in rep.fault_tolerance_problem()
