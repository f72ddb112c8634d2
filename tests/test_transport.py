"""The transport: process-group and in-process collectives, gloo's summation order, accounting."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_util import run_world

from flexdemo.simulate import SimulationError, run_replicas
from flexdemo.transport import (
    CommStats,
    InProcessHub,
    Pending,
    ProcessGroupTransport,
    all_gather,
    all_gather_bytes,
    all_reduce_bytes,
    all_reduce_sum,
    gather_into,
    global_rank,
    group_rank,
    group_ranks,
    group_size,
    ring_sum_,
    transport_for,
)

# sizes around gloo's segment rounding; BIG fp32 (16 MB) needs more than 2n segments of at most
# 1 MiB, which moves the chunk boundaries
SIZES = [1, 3, 7, 8, 13, 1000, 65_541]
BIG = 4_000_037
DTYPES = [torch.float32, torch.bfloat16]


def data(rank: int, n: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    # mixed magnitudes: different summation orders give different bits
    return (torch.randn(n, generator=g) * torch.exp(4 * torch.randn(n, generator=g))).to(dtype)


def gloo_sums(rank: int, world: int) -> dict:
    out = {}
    cases = [(dtype, n) for dtype in DTYPES for n in SIZES] + [(torch.float32, BIG)]
    for dtype, n in cases:
        t = data(rank, n, dtype)
        dist.all_reduce(t)
        out[dtype, n] = t
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [3, 4])
def test_ring_sum_matches_gloo_all_reduce_bitwise(world):
    res = run_world(gloo_sums, world)
    plain_differs = False
    for (dtype, n), want in res[0].items():
        parts = [data(r, n, dtype) for r in range(world)]
        assert torch.equal(ring_sum_(torch.empty_like(want), parts), want), (dtype, n)
        plain = parts[0].clone()
        for p in parts[1:]:
            plain += p
        plain_differs |= not torch.equal(plain, want)
    assert plain_differs  # the order matters: a rank-order sum is not gloo's


def test_in_process_collectives_results_and_bytes():
    hub = InProcessHub(3, timeout=30)
    stats = [CommStats() for _ in range(3)]

    def work(r):
        g = hub.transport(r)
        x = torch.arange(5, dtype=torch.float32) + 10 * r
        gathered = all_gather(x, g, stats[r])
        pend = all_gather(x.to(torch.uint8), g, stats[r], async_op=True)
        s = all_reduce_sum(x.clone(), g, stats[r])
        pend_sum = all_reduce_sum(x.clone(), g, stats[r], async_op=True)
        out = torch.empty(3, 2, dtype=torch.int64)
        gather_into(out, torch.tensor([r, -r]), g)
        assert isinstance(pend, Pending) and isinstance(pend_sum, Pending)
        return gathered, pend.wait(), s, pend_sum.wait(), out, (group_size(g), group_rank(g),
                                                                global_rank(g, 2), group_ranks(g))

    for r, (gathered, gathered8, s, s2, out, names) in enumerate(run_replicas(hub, work)):
        want = torch.stack([torch.arange(5.0) + 10 * q for q in range(3)])
        assert torch.equal(gathered, want) and torch.equal(gathered8, want.to(torch.uint8))
        assert torch.equal(s, want.sum(0)) and torch.equal(s2, want.sum(0))
        assert out.tolist() == [[0, 0], [1, -1], [2, -2]]
        assert names == (3, r, 2, [0, 1, 2])
        # the ring formulas, as over a process group: 2 all-gathers, 2 all-reduces
        want_bytes = (all_gather_bytes(20, 3) + all_gather_bytes(5, 3)
                      + 2 * all_reduce_bytes(5, 4, 3))
        assert stats[r].bytes_sent == stats[r].bytes_received == want_bytes
        assert stats[r].collectives == 4


def test_one_replica_and_no_process_group_move_nothing(monkeypatch):
    # other tests may leave a default group behind in this process: act as if there were none
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    tr = transport_for(None)
    assert isinstance(tr, ProcessGroupTransport) and (tr.size, tr.rank) == (1, 0)
    assert group_size(None) == 1 and group_ranks(None) == [0]
    st = CommStats()
    x = torch.ones(4)
    assert all_gather(x, None, st).shape == (1, 4) and all_reduce_sum(x, None, st) is x
    hub = InProcessHub(1)
    g = hub.transport(0)
    assert all_gather(x, g, st).shape == (1, 4) and st.bytes_sent == 0 and st.collectives == 0


def test_replica_that_leaves_early_fails_the_others_at_once():
    hub = InProcessHub(2, timeout=60)

    def work(r):
        st = CommStats()
        for _ in range(1 + r):  # replica 1 runs one collective more than replica 0
            all_reduce_sum(torch.ones(3), hub.transport(r), st)

    with pytest.raises(SimulationError, match=r"replica\(s\) \[0\] finished their step"):
        run_replicas(hub, work)
    assert run_replicas(hub, lambda r: r) == [0, 1]  # the hub is reset for the next run


def test_hub_and_transport_arguments():
    with pytest.raises(ValueError, match="integer >= 1"):
        InProcessHub(0)
    with pytest.raises(ValueError, match="timeout"):
        InProcessHub(2, timeout=0)
    with pytest.raises(ValueError, match="outside"):
        InProcessHub(2).transport(2)
