"""A DiLoCo pace under fault tolerance (flexdemo.replicate.elastic_pace): quorums at syncs only,
counts from each quorum's own measurements, a joiner's count from its own clock.

The arithmetic and the timed period run on a virtual clock in this process; the runs are real
processes on torchft (tests/elastic_workers.py: a real lighthouse, a real kill), asserting
counted steps and bits, never seconds.
"""

from __future__ import annotations

import pytest
import torch
from test_elastic import (
    Lighthouse,
    _final,
    _no_torchft_noise,
    _ok,
    _same,
    _until_alone,
    _wait,
    _worker,
    procs,  # noqa: F401 - the fixture
)

import flexdemo
from flexdemo.ft.state import check_supported
from flexdemo.replicate.elastic_pace import ElasticPace, elastic_counts
from flexdemo.transport import Transport


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_every_replica_measured_gets_the_adaptive_counts_against_its_own_steps():
    # 10 ms and 30 ms a step, H = 30: the slow one takes 10, the fast ones 30
    counts, target = elastic_counts([0.01, 0.01, 0.03], [30, 30, 30], 30, 0.1)
    assert counts == [30, 30, 10] and target is None
    # within the tolerance of the steps each took: kept, whatever ranks they had before
    counts, target = elastic_counts([0.01, 0.03, 0.0101], [30, 10, 30], 30, 0.1)
    assert counts == [30, 10, 30] and target is None


def test_an_unmeasured_replica_runs_for_the_period_s_time():
    counts, target = elastic_counts([0.01, 0.0, 0.03], [30, 1, 10], 30, 0.1)
    assert counts == [30, None, 10]
    assert target == pytest.approx(0.30)  # the slow one's 10 steps of 30 ms
    assert elastic_counts([0.0, 0.0], [1, 1], 8, 0.1) == ([8, 8], None)  # none measured: H


def _pace(clock: Clock, weights: str = "steps") -> ElasticPace:
    pace = ElasticPace.from_pace(flexdemo.Pace("adaptive", weights=weights, clock=clock))
    pace.setup(6, 1, 0, torch.device("cpu"))
    return pace


def test_a_timed_period_ends_when_the_next_step_would_pass_its_time():
    clock = Clock()
    pace = _pace(clock)
    pace.own, pace.target = None, 1.0  # a joiner's first whole period: 1 s
    pace.start_period()
    ends = []
    for _ in range(8):
        clock.now += 0.2
        assert pace.local_next() or ends  # every step before the decision is local
        ends.append(pace.after_step())
        if ends[-1]:
            break
    # after 4 steps (0.8 s) one more ends at 1.0 s: 0.8 + 1.5 * 0.2 >= 1.0, so the 5th syncs
    assert ends == [False, False, False, False, True]
    assert pace._taken == 5


def test_a_timed_period_lasts_at_most_2h_steps():
    clock = Clock()
    pace = _pace(clock)
    pace.own, pace.target = None, 1e9
    pace.start_period()
    n = 0
    while True:
        clock.now += 0.01
        n += 1
        if pace.after_step():
            break
    assert n == 2 * 6


class _Peers(Transport):
    """This rank (0) and peers whose gathered rows are given (what a quorum would send)."""

    def __init__(self, rows: list[list[float]]) -> None:
        self.rows = rows
        self.size, self.rank = len(rows) + 1, 0

    def global_rank(self, r: int) -> int:
        return r

    def all_reduce_sum_(self, buf, async_op=False):
        raise AssertionError("not used")

    def all_gather_into(self, out, inp, async_op=False):
        n = inp.numel()
        out[:n].copy_(inp)
        for i, row in enumerate(self.rows, 1):
            out[i * n:(i + 1) * n].copy_(torch.tensor(row, dtype=out.dtype))


def _ended_period(clock: Clock, steps: int, seconds: float, weights: str = "steps"
                  ) -> ElasticPace:
    pace = _pace(clock, weights)
    pace.own = steps
    pace.start_period()
    for _ in range(steps):
        clock.now += seconds
        pace.after_step()
    return pace


def test_weights_are_each_replica_s_steps_and_peers_numbers_are_bounded():
    clock = Clock()
    pace = _ended_period(clock, 6, 0.01)  # this replica: 6 steps of 10 ms
    stats = flexdemo.transport.CommStats()
    # a peer of 2 steps of 30 ms; a peer claiming 10^9 steps and an infinite time
    factors = pace.factors(_Peers([[0.03, 2.0, 0.0], [float("inf"), 1e9, 0.0]]), stats)
    # the boastful peer counts 0 steps (weight 0) and unmeasured (a timed period next)
    assert torch.equal(factors, torch.tensor([6 * 3 / 8, 2 * 3 / 8, 0.0]))
    assert pace.own == 6 and pace.target is None  # within the tolerance: kept
    assert pace.changes[-1] == (1, [6, 2, 0])
    assert stats.bytes_sent == 2 * 24  # three float64 numbers to each of 2 peers (ring)


def test_equal_steps_scale_nothing_and_tokens_weigh_when_reported():
    clock = Clock()
    pace = _ended_period(clock, 6, 0.01)
    assert pace.factors(_Peers([[0.01, 6.0, 0.0]]), flexdemo.transport.CommStats()) is None
    pace = _ended_period(clock, 6, 0.01, weights="tokens")
    pace.count_tokens(300)
    factors = pace.factors(_Peers([[0.01, 6.0, 100.0]]), flexdemo.transport.CommStats())
    assert torch.equal(factors, torch.tensor([1.5, 0.5]))


def test_a_joiner_healed_at_a_sync_syncs_at_its_first_step_unmeasured():
    clock = Clock()
    peer = _pace(clock)
    peer.start_period()
    for _ in range(5):  # the peer at its sync's quorum: 5 of its 6 steps taken
        clock.now += 0.01
        peer.after_step()
    joiner = _pace(clock)
    joiner.load_state_dict(peer.state_dict())
    joiner.joined()
    assert not joiner.local_next()  # its next step is the peers' sync
    clock.now += 0.5
    assert joiner.after_step() is True
    factors = joiner.factors(_Peers([[0.01, 6.0, 0.0]]), flexdemo.transport.CommStats())
    assert torch.equal(factors, torch.tensor([2 / 7, 12 / 7]))  # its own 1 step against 6
    assert joiner.own is None and joiner.target == pytest.approx(0.06)  # timed: the period


def test_a_replica_healed_at_the_first_step_runs_the_first_period():
    clock = Clock()
    peer, joiner = _pace(clock), _pace(clock)
    joiner.load_state_dict(peer.state_dict())  # torchft's first quorum heals all but one
    joiner.joined()
    ends = []
    for _ in range(6):
        clock.now += 0.01
        ends.append(joiner.after_step())
    assert ends == [False] * 5 + [True] and joiner._taken == 6 and joiner._timed == 4


def test_a_timed_elastic_pace_times_every_period():
    clock = Clock()
    pace = ElasticPace.from_pace(flexdemo.Pace("timed", clock=clock))
    pace.setup(6, 1, 0, torch.device("cpu"))
    pace.start_period()
    for _ in range(6):
        clock.now += 0.01
        pace.after_step()
    pace.factors(_Peers([[0.03, 2.0, 0.0]]), flexdemo.transport.CommStats())
    assert pace.own is None and pace.target == pytest.approx(0.06)  # 6 steps of 10 ms


def test_under_fault_tolerance_a_pace_must_be_adaptive():
    for spec in ([3, 3], "fixed"):
        rep = flexdemo.DiLoCoReplicator(3, pace=spec)
        with pytest.raises(ValueError, match="pace='adaptive'"):
            check_supported(rep)
    rep = flexdemo.DiLoCoReplicator(3, pace="adaptive")
    check_supported(rep)
    rep.enter_fault_tolerance()
    assert isinstance(rep.pace, ElasticPace)


def _pair(started: list, tmp, url: str, fast: tuple[str, str], slow: tuple[str, str],
          *common: str, fast_args: tuple[str, ...] = ()) -> None:
    """A fast group (10 ms a step) and a slow one (40 ms), ``(replica id, out)`` each, both
    run to the end and exit 0."""
    a = _worker(started, tmp, url, *fast, *common, "--delay", "0.01", *fast_args)
    b = _worker(started, tmp, url, *slow, *common, "--delay", "0.04")
    _ok(a, tmp, fast[1])
    _ok(b, tmp, slow[1])


def _steps_per_period(tmp, out: str) -> list[int]:
    """The steps between this group's syncs (from its progress: a sync's line has local 0)."""
    rows = [line.split() for line in (tmp / out / "progress0").read_text().splitlines()]
    periods, n = [], 0
    for row in rows:
        n += 1
        if row[6] == "0":  # a step in a quorum: the first step, or a sync
            periods.append(n)
            n = 0
    return periods


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("order", ["zero-first", "forward-zero", "zero-last", "none"])
def test_a_slow_group_takes_fewer_steps_and_both_end_identical(tmp_path, procs,  # noqa: F811
                                                               order):
    """A sleeps 10 ms a step, B 40 ms, DiLoCo H=6 with pace='adaptive', 6 syncs, in each loop
    order. Quorums form only at the first step and the syncs; after the first period B takes
    fewer steps than A; both end with the same global copy and parameters, bit for bit."""
    lh = Lighthouse(1, tmp_path / "lighthouse.log")
    try:
        _pair(procs, tmp_path, lh.url, ("A", "A"), ("B", "B"), "--replicator", "diloco-paced",
              "--syncs", "6", "--min-replicas", "2", "--timeout", "30", "--order", order)
    finally:
        lh.stop()
    pa, pb = _steps_per_period(tmp_path, "A"), _steps_per_period(tmp_path, "B")
    assert len(pa) == len(pb) == 1 + 6  # the first step's quorum and 6 syncs, nothing else
    assert pa[0] + pa[1] == pb[0] + pb[1] == 6  # the first period: H on both (its first
    # step had a quorum)
    assert all(kb < ka for ka, kb in zip(pa[2:], pb[2:])), (pa, pb)
    fa, fb = _final(tmp_path, "A"), _final(tmp_path, "B")
    assert _same(fa["global"], fb["global"]) and _same(fa["params"], fb["params"])
    assert fa["synced"] == fb["synced"] == 6
    for name in ("A", "B"):
        _no_torchft_noise((tmp_path / f"{name}.log").read_text())


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("die_at", [5, 10])
def test_a_killed_group_leaves_and_a_joiner_gets_its_count_from_its_clock(tmp_path,
                                                                           procs,  # noqa: F811
                                                                           die_at):
    """A (10 ms a step) and B1 (40 ms) run paced; B1 is killed (SIGKILL) in its step
    ``die_at``: 5, in the quorum of the first sync (A's sync fails there, is undone and taken
    again alone), or 10, an inner step after a few syncs (A finds it missing at its next
    sync's quorum); A goes on alone; B2 (40 ms) starts afresh, heals into A's next sync (its
    first step: a sync of both), runs its next period on its own clock, then is measured and
    counted: fewer steps than A's. Both end at sync 12 with the same bits."""
    lh = Lighthouse(1, tmp_path / "lighthouse.log")
    try:
        common = ["--replicator", "diloco-paced", "--syncs", "12", "--timeout", "30"]
        ready_a, ready_b1, ready_b2 = (tmp_path / f"{n}-ready" for n in ("a", "b1", "b2"))
        a = _worker(procs, tmp_path, lh.url, "A", "A", *common, "--delay", "0.01",
                    "--ready-file", str(ready_a), "--hold", f"0:{ready_b1}")
        b1 = _worker(procs, tmp_path, lh.url, "B", "B1", *common, "--delay", "0.04",
                     "--ready-file", str(ready_b1), "--hold", f"0:{ready_a}",
                     "--die-at", str(die_at))
        assert _wait(b1, tmp_path, "B1") == -9
        _until_alone(tmp_path, "A")
        b2 = _worker(procs, tmp_path, lh.url, "B", "B2", *common, "--delay", "0.04")
        _ok(a, tmp_path, "A")
        _ok(b2, tmp_path, "B2")
    finally:
        lh.stop()
    rows = [line.split() for line in (tmp_path / "B2" / "progress0").read_text().splitlines()]
    assert rows[0][6] == "0" and rows[0][1] == "2" and rows[0][2] == "1"  # healed into a sync
    pa, pb = _steps_per_period(tmp_path, "A"), _steps_per_period(tmp_path, "B2")
    assert pb[0] == 1 and len(pb) >= 3  # its sync, its timed period, and measured ones
    assert pb[-1] < pa[-1], (pa, pb)
    fa, fb = _final(tmp_path, "A"), _final(tmp_path, "B2")
    assert _same(fa["global"], fb["global"]) and _same(fa["params"], fb["params"])
    for name in ("A", "B2"):
        _no_torchft_noise((tmp_path / f"{name}.log").read_text())


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_paced_group_resumes_from_its_checkpoint_and_a_new_group_heals_from_it(
        tmp_path, procs):  # noqa: F811
    """A (10 ms a step) and B (40 ms) run paced to sync 4, A saves a checkpoint; A resumes
    from it beside a new slow group C: C heals from A (the later sync), both reach sync 8
    with the same bits, and A's steps go on from the saved ones."""
    lh = Lighthouse(1, tmp_path / "lighthouse.log")
    saved = tmp_path / "ckpt-A"
    try:
        common = ["--replicator", "diloco-paced", "--min-replicas", "2", "--timeout", "30"]
        _pair(procs, tmp_path, lh.url, ("A", "A"), ("B", "B"), *common, "--syncs", "4",
              fast_args=("--save", str(saved)))
        _pair(procs, tmp_path, lh.url, ("A", "A2"), ("C", "C"), *common, "--syncs", "8",
              fast_args=("--resume", str(saved)))
    finally:
        lh.stop()
    first = (tmp_path / "A2" / "progress0").read_text().split()
    assert int(first[0]) == _final(tmp_path, "A")["step"]  # where the checkpoint stood
    fa, fc = _final(tmp_path, "A2"), _final(tmp_path, "C")
    assert fa["synced"] == fc["synced"] == 8
    assert _same(fa["global"], fc["global"]) and _same(fa["params"], fc["params"])
    pa, pc = _steps_per_period(tmp_path, "A2"), _steps_per_period(tmp_path, "C")
    assert pc[-1] < pa[-1], (pa, pc)  # C measured and counted as the slower
