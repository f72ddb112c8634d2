"""DeMo's sparse mean over one shared index set (DeMoReplicator(reduce="shared")): the exact
mean at the shared indices against a dense reference, error feedback that keeps exactly what
was not sent, bytes sent and received exact and flat in the group size, one outcome on every
replica for bad input (with the reduce-scatter's cases, in test_demo_scatter.py), identical
replicas on gloo ranks and a bitwise resume."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from dist_util import run_world
from frontier_util import batch, loss_fn, tiny_model
from sparse_exchange_util import EXACT, MIXED, PLAIN, K, blocks, grads_of, unblocks
from sparse_exchange_util import exchange as exchange_by

from flexdemo import SimulatedReplicas
from flexdemo.replicate import DeMoReplicator

CHUNKS = [(8, 8), (8, 8), (4, 8), (6, 8)]  # EXACT's blocks


def exchange(world: int, shapes=EXACT, before=None, reduce: str = "shared", **kw) -> list:
    """:func:`sparse_exchange_util.exchange`, over the shared index set unless ``reduce``
    says."""
    return exchange_by(world, shapes, before, reduce=reduce, **kw)


def shared_mask(world: int, i: int) -> torch.Tensor:
    """Tensor ``i``'s shared set as a ``(blocks, entries)`` mask: the union of every
    replica's top ``ceil(K / world)`` per block."""
    cr, cc = CHUNKS[i]
    mask = torch.zeros_like(blocks(grads_of(0, EXACT)[i], cr, cc), dtype=torch.bool)
    for r in range(world):
        b = blocks(grads_of(r, EXACT)[i], cr, cc)
        mask.scatter_(1, b.abs().topk(math.ceil(K / world), dim=1).indices, True)
    return mask


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_mean_at_the_shared_indices_is_exact_against_a_dense_reference(world):
    out = exchange(world, **PLAIN)
    overlap = False
    for i, shape in enumerate(EXACT):
        cr, cc = CHUNKS[i]
        mask = shared_mask(world, i)
        overlap |= bool((mask.sum(1) < world * math.ceil(K / world)).any())
        total = blocks(grads_of(0, EXACT)[i], cr, cc)
        for r in range(1, world):  # rank order, as the owners sum
            total = total + blocks(grads_of(r, EXACT)[i], cr, cc)
        want = unblocks(torch.where(mask, total / world, 0.0), shape, cr, cc)
        for r in range(world):
            assert torch.equal(out[r][0][i], want), (world, i, r)
    assert overlap  # some replicas picked the same coefficient: it counts once


def test_shared_slots_that_are_not_k_take_the_sparse_decode_at_3_replicas():
    """At 3 replicas the shared set has 3 x ceil(5 / 3) = 6 slots per block, not k = 5; with
    16 x 16 blocks that few slots are decoded sparsely, whose scratch was sized for k (a shape
    error on every replica); the mean is exact against a dense reference."""
    shapes, c = [torch.Size((32, 32)), torch.Size((16, 48))], 16
    out = exchange(3, shapes, **{**PLAIN, "chunk": c})
    for i, shape in enumerate(shapes):
        picks = [blocks(grads_of(r, shapes)[i], c, c) for r in range(3)]
        mask = torch.zeros_like(picks[0], dtype=torch.bool)
        for b in picks:
            mask.scatter_(1, b.abs().topk(2, dim=1).indices, True)
        want = unblocks(torch.where(mask, (picks[0] + picks[1] + picks[2]) / 3, 0.0), shape, c, c)
        for r in range(3):
            assert not isinstance(out[r][0], Exception), out[r][0]
            assert torch.equal(out[r][0][i], want), (i, r)


@pytest.mark.parametrize("values", ["fp32", "stat2", "int2"])
def test_error_feedback_keeps_exactly_what_was_not_sent(values):
    """Each replica's buffer loses exactly its own values at the shared indices, as decoded
    (what ``sent_into`` reports); everything else stays in it bit for bit."""
    world = 2
    out = exchange(world, **{**PLAIN, "decay": 1.0, "values": values})
    for r, (_, rep) in enumerate(out):
        sent = [torch.zeros(s) for s in EXACT]
        rep.sent_into(sent)
        for i, shape in enumerate(EXACT):
            cr, cc = CHUNKS[i]
            g = grads_of(r, EXACT)[i]
            picked = unblocks(shared_mask(world, i), shape, cr, cc)
            residual = unblocks(rep.delta[i].reshape(-1, cr * cc), shape, cr, cc)
            assert torch.equal(residual[~picked], g[~picked])  # not sent: kept exactly
            assert torch.equal(sent[i][~picked], torch.zeros_like(g[~picked]))
            torch.testing.assert_close(residual + sent[i], g, rtol=0, atol=1e-6)
            if values != "fp32":  # lossy values: the rounding error stays in the buffer
                assert residual[picked].abs().max() > 0
            else:
                assert torch.equal(residual[picked], torch.zeros_like(g[picked]))


@pytest.mark.parametrize("world", [2, 3])
def test_every_replica_gets_bitwise_the_same_update_with_mixed_tensors(world):
    out = exchange(world, shapes=MIXED, **{**PLAIN, "values": "stat2", "decay": 0.9,
                                           "transform": "dct"})
    for r in range(1, world):
        assert all(torch.equal(a, b) for a, b in zip(out[0][0], out[r][0]))
    assert any(t.abs().sum() > 0 for t in out[0][0])


def shared_bytes(ex: DeMoReplicator, n: int) -> tuple[int, int]:
    """The sparseloco preset's shared-index exchange by hand: its wire bytes per exchange and
    the bytes one rank sends (and receives) in it."""
    def aligned(x):
        return x + -x % 8

    def stat2(blocks, k):  # a bf16 codebook of 4 bin means per block, 2-bit codes
        return 8 * blocks + -(-blocks * k * 2 // 8)

    idx, part, reply = 32, 0, 8 * n  # a header; the values; a verdict word per sender
    for g in ex.groups:
        bits = (g.block_numel - 1).bit_length()
        share, per = -(-g.k // n), -(-g.blocks // n)
        idx += aligned(-(-g.blocks * share * bits // 8))
        part += aligned(stat2(per, n * share))
        reply += aligned(stat2(per, n * share))
    return idx + n * part + reply, (n - 1) * (idx + part + reply)


def sim_of(replicas: int, seed: int = 0, **kw) -> SimulatedReplicas:
    torch.manual_seed(seed)
    return SimulatedReplicas(tiny_model, loss_fn, replicas=replicas, replicator="sparseloco-dct",
                             optimizer="adamw", lr=1e-2, seed=seed,
                             replicator_kwargs={"inner_steps": 3, **kw,
                                                "exchange_kwargs": {"reduce": "shared"}})


def test_bytes_sent_and_received_are_exact_at_2_and_4_replicas_and_flat():
    per_sync = {}
    for n in (2, 4):
        sim = sim_of(n)
        for s in range(6):  # two syncs
            sim.step([batch(r, s) for r in range(n)])
        reps = [o.replicators[0] for o in sim.optimizers]
        ex = reps[0].exchanges[0]
        payload, one = shared_bytes(ex, n)
        assert ex.payload_bytes() == payload
        assert all(r.exchange_bytes() == one for r in reps)
        assert sim.bytes_sent == [2 * one] * n and sim.bytes_received == [2 * one] * n
        per_sync[n] = one
    assert per_sync[4] < 3 * per_sync[2]  # three blocks: the headers and verdicts weigh
    gathered = DeMoReplicator(topk=64, chunk=64, values="stat2")
    gathered.setup([torch.Size([4096, 64])], torch.device("cpu"), None)
    big = DeMoReplicator(topk=64, chunk=64, values="stat2", reduce="shared")
    big.setup([torch.Size([4096, 64])], torch.device("cpu"), None)
    one = {n: shared_bytes(big, n)[1] for n in (2, 8)}  # 64 blocks: the model's scale
    assert one[8] <= 2 * one[2] and one[2] < gathered.payload_bytes()


def test_diloco_through_it_keeps_replicas_identical_and_resumes_bitwise(tmp_path):
    def run(s, steps):
        for t in steps:
            s.step([batch(r, t) for r in range(3)])

    a = sim_of(3)
    run(a, range(3))
    assert a.identical()
    run(a, range(3, 4))
    assert not a.identical()
    torch.save(a.state_dict(), tmp_path / "sim.pt")
    run(a, range(4, 9))
    assert a.identical()
    b = sim_of(3, seed=5)
    b.load_state_dict(torch.load(tmp_path / "sim.pt", weights_only=False))
    run(b, range(4, 9))
    for ma, mb in zip(a.models, b.models):
        assert all(torch.equal(p, q) for p, q in zip(ma.parameters(), mb.parameters()))
    assert a.bytes_sent == b.bytes_sent and a.bytes_received == b.bytes_received


def test_replicas_that_keep_their_unsent_progress_resume_bitwise(tmp_path):
    def run(s, steps):
        for t in steps:
            s.step([batch(r, t) for r in range(2)])

    a = sim_of(2, keep_unsent=True)
    run(a, range(4))
    torch.save(a.state_dict(), tmp_path / "sim.pt")
    run(a, range(4, 9))
    reps = [o.replicators[0] for o in a.optimizers]
    assert all(torch.equal(x, y) for x, y in zip(reps[0].global_params, reps[1].global_params))
    assert any(t.abs().sum() > 0 for t in reps[0].residual)
    b = sim_of(2, seed=5, keep_unsent=True)
    b.load_state_dict(torch.load(tmp_path / "sim.pt", weights_only=False))
    run(b, range(4, 9))
    for ma, mb in zip(a.models, b.models):
        assert all(torch.equal(p, q) for p, q in zip(ma.parameters(), mb.parameters()))


@pytest.mark.parametrize("kwargs, words", [
    ({"overlap": "delayed"}, "overlap='none'"),
    ({"bucket": False}, "needs bucket=True"),
    ({"on_bad_peer": "drop"}, "on_bad_peer='raise'"),
    ({"clip": "median"}, "clip='none'"),
    ({"mean": "senders"}, "mean='replicas'"),
])
def test_settings_that_cannot_share_are_refused_in_one_line(kwargs, words):
    with pytest.raises(ValueError, match=words) as e:
        DeMoReplicator(reduce="shared", **kwargs)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="'shared'"):
        DeMoReplicator(reduce="ring")
    assert "reduce='shared'" in repr(DeMoReplicator(reduce="shared"))


def gloo_worker(rank: int, world: int, reduce: str = "shared") -> dict:
    """The sparseloco preset over the shared index set on gloo ranks: the parameters after
    every sync, and a twin resumed from a checkpoint taken between syncs."""
    import flexdemo

    kw = {"inner_steps": 3, "exchange_kwargs": {"reduce": reduce}}

    def make():
        torch.manual_seed(0)
        return flexdemo.prepare(tiny_model(), "sparseloco-dct", optimizer="adamw", lr=1e-2,
                                replicate=world, shard=1, replicator_kwargs=kw)

    model, opt = make()
    synced, state = [], None
    for s in range(9):
        loss_fn(model, batch(rank, s)).backward()
        opt.step()
        opt.zero_grad()
        if s == 3:
            state = copy.deepcopy((opt.state_dict(), model.state_dict()))
        if s % 3 == 2:
            synced.append([p.detach().clone() for p in model.parameters()])
    twin, topt = make()
    twin.load_state_dict(state[1])
    topt.load_state_dict(state[0])
    for s in range(4, 9):
        loss_fn(twin, batch(rank, s)).backward()
        topt.step()
        topt.zero_grad()
    rep = opt.replicators[0]
    return {"synced": synced, "resumed": [p.detach().clone() for p in twin.parameters()],
            "final": [p.detach().clone() for p in model.parameters()],
            "sent": rep.stats.bytes_sent, "received": rep.stats.bytes_received,
            "bytes": rep.exchange_bytes()}


@pytest.mark.multiprocess
def test_gloo_ranks_end_every_sync_bitwise_identical_and_resume_bitwise():
    a, b = run_world(gloo_worker, 2)
    for x, y in zip(a["synced"], b["synced"]):
        assert all(torch.equal(p, q) for p, q in zip(x, y))
    for res in (a, b):
        assert all(torch.equal(p, q) for p, q in zip(res["final"], res["resumed"]))
        assert res["sent"] == res["received"] == 3 * res["bytes"]
    assert not all(torch.equal(p, q) for p, q in zip(a["synced"][0], a["synced"][1]))
