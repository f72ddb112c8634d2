"""``"auto"``: the choice for given measurements, the bounded probe on real ranks, a probe that
times out, a single replica, a quorum that changes size, and resume across the decision."""

from __future__ import annotations

import copy
import json
import threading
import time
from pathlib import Path

import pytest
import torch
from auto_workers import prepare_worker, resume_worker, timeout_worker
from dist_util import run_world
from torch import nn

import flexdemo
from flexdemo.auto import (
    FALLBACK_LINK,
    PROBE_BYTES,
    AutoReplicator,
    Link,
    choose,
    load_ranking,
    parse_link,
    probe_link,
    size_candidate,
)
from flexdemo.transport import Transport

RANKED = load_ranking()

SHAPES = {  # local parameter shapes of three models
    "0.8M": [torch.Size([256, 256])] * 12 + [torch.Size([256])] * 12,
    "85M": [torch.Size([768, 768])] * 48 + [torch.Size([3072, 768]), torch.Size([768, 3072])] * 12
    + [torch.Size([768])] * 24,
    "3 tensors": [torch.Size([512, 512]), torch.Size([512]), torch.Size([10, 512])],
}

# bandwidth, latency, replicas, compute (s/step), model, budget -> the pick
CASES = [
    ("10gbit", "0.05ms", 2, 0.25, "0.8M", 0.05, "full"),  # a fast link: full sync
    ("100gbit", "0.01ms", 2, 1.0, "85M", 0.05, "full"),
    ("10gbit", "0.05ms", 2, 0.25, "85M", 0.05, "diloco-h20-int4"),  # 85M does not fit fully
    ("1gbit", "0.2ms", 2, 0.25, "85M", 0.05, "streaming-h20-int4"),  # tau=1 hides the sync
    ("1gbit", "0.2ms", 2, 1.0, "85M", 0.05, "diloco-h20-int4"),  # a slower step hides it all
    ("1gbit", "0.2ms", 2, 0.25, "85M", 0.2, "diloco-h20-int4"),  # a larger budget
    ("100mbit", "1ms", 2, 0.25, "85M", 0.05, "muloco-int4-streaming"),
    ("100mbit", "1ms", 8, 0.05, "0.8M", 0.05, "streaming-h20-int4"),
    ("10mbit", "50ms", 8, 0.1, "85M", 0.05, "sparseloco-dct"),  # nothing fits: the least exposed
    ("100mbit", "10ms", 4, 0.01, "3 tensors", 0.05, "sparseloco-dct"),  # too few tensors to stream
]


@pytest.mark.parametrize("bw,lat,n,compute,model,budget,pick", CASES)
def test_choice_for_given_measurements(bw, lat, n, compute, model, budget, pick):
    sizings = [size_candidate(c, SHAPES[model], n) for c in RANKED]
    d = choose(RANKED, sizings, parse_link(f"{bw},{lat}"), compute, n, budget)
    assert d.name == pick, d.line()
    line = d.line()
    assert line.startswith("auto: ") and f"between {n} replicas" in line and "\n" not in line
    assert f"-> {d.label} (" in line and "MB/step, exposed comm" in line
    assert ("nothing fits" in line) == (d.exposed_share > budget)
    better = [c for c in d.considered[: [c[0] for c in d.considered].index(pick)]]
    if d.exposed_share <= budget:  # every better-ranked candidate is over the budget
        assert all(share > budget for _, _, share in better)


def test_sizes_are_the_replicators_own():
    """The bytes of a candidate are its replicator's exchange_bytes() on the model, as set up
    for training (here: 2 simulated replicas)."""
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    shapes = [p.shape for p in model.parameters()]
    for c in RANKED:
        if c.name in ("muloco-int4-streaming",):
            continue  # 4 tensors: too few for 5 fragments
        sim = flexdemo.SimulatedReplicas(model, lambda m, b: m(b).sum(), replicas=2,
                                         replicator=c.replicator, optimizer="adamw",
                                         replicator_kwargs=copy.deepcopy(c.replicator_kwargs)
                                         or None)
        rep = sim.optimizers[0].replicators[0]
        s = size_candidate(c, shapes, 2)
        assert s is not None and sum(s.syncs) == rep.exchange_bytes(), c.name
        assert s.period == getattr(rep, "inner_steps", 1)
    assert size_candidate(RANKED[4], shapes, 2) is None  # fragments=5 > 4 tensors


def test_ranking_file_names_its_sources():
    data = json.loads(Path(flexdemo.auto.RANKING_FILE).read_text())
    names = [e["name"] for e in data["entries"]]
    assert len(set(names)) == len(names) and names[0] == "full"
    assert {"muloco-int4", "sparseloco-dct"} <= {e["replicator"] for e in data["entries"]}
    gaps = [e["gap"] for e in data["entries"]]
    assert gaps == sorted(gaps)
    for e in data["entries"][1:]:
        p = e["provenance"]
        assert p["table"] and p["model"] and p["steps"] > 0 and p["seeds"] > 0 and p["how"]
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert 'flexdemo = ["auto/*.json"]' in pyproject  # shipped with the package


def test_parse_link():
    assert parse_link("100mbit,1ms").bandwidth == pytest.approx(12.5e6)
    assert parse_link("1gbit,200us").latency == pytest.approx(2e-4)
    assert parse_link("12MB").latency == pytest.approx(1e-3)
    with pytest.raises(ValueError, match="write a rate and a latency"):
        parse_link("fast")


def loss(m, b):
    x, y = b
    return nn.functional.mse_loss(m(x), y)


def tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def batches(step, n=2):
    g = torch.Generator().manual_seed(step)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def simulate(steps, start=0, sim=None, **kwargs):
    kwargs.setdefault("verbose", False)
    sim = sim or flexdemo.SimulatedReplicas(tiny, loss, replicas=2, replicator="auto",
                                            optimizer="adamw", lr=1e-2, seed=0,
                                            replicator_kwargs=kwargs)
    for step in range(start, start + steps):
        sim.step(batches(step))
    return sim


@pytest.mark.parametrize("link,pick", [("100gbit,0.001ms", "full"),
                                       ("1mbit,100ms", "diloco-h20-int4")])
def test_warmup_then_decision_keeps_replicas_identical(link, pick):
    """Local warm-up steps, the decision at step 4, then the choice: full sync gives every
    replica the first one's parameters and AdamW state first; DiLoCo takes the warm-up as its
    first inner steps. After 20 steps (DiLoCo's first sync) the replicas are bitwise equal."""
    sim = simulate(20, link=link, candidates=["full", "diloco-h20-int4"])
    autos = [o.replicators[0] for o in sim.optimizers]
    assert {a.decision.name for a in autos} == {pick}
    assert autos[0].decision.step == 4 and autos[0].decision.compute_seconds > 0
    assert sim.identical()
    assert len(autos[0].lines) == 1 and "(given)" in autos[0].lines[0]
    stats = sim.optimizers[0].last_step_stats()  # what it runs, and its decisions
    assert stats["auto_choice"] == autos[0].decision.label
    assert [h["event"] for h in stats["auto_history"]] == ["decision"]


def test_compute_given_decides_before_step_0(capsys):
    sim = simulate(2, link="1gbit,0.2ms", compute_seconds=0.25, verbose=True)
    a = sim.optimizers[0].replicators[0]
    assert a.decision.step == 0 and a.decision.compute_seconds == 0.25
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [a.decision.line()]  # one line for all replicas


def test_resume_across_the_decision_is_bitwise():
    """Snapshots during the warm-up (step 2) and after the decision (step 9), loaded into
    fresh simulations: the same bits at step 26 as the run that never stopped."""
    kw = dict(link="1mbit,100ms", candidates=["diloco-h20-int4"])
    straight, saved = None, {}
    for start, stop in ((0, 2), (2, 9), (9, 26)):
        straight = simulate(stop - start, start=start, sim=straight, **kw)
        saved[stop] = copy.deepcopy(straight.state_dict())
    for save_at in (2, 9):
        fresh = flexdemo.SimulatedReplicas(tiny, loss, replicas=2, replicator="auto",
                                           optimizer="adamw", lr=1e-2, seed=0,
                                           replicator_kwargs={**kw, "verbose": False})
        fresh.load_state_dict(saved[save_at])
        resumed = simulate(26 - save_at, start=save_at, sim=fresh)
        for a, b in zip(straight.models[0].parameters(), resumed.models[0].parameters()):
            assert torch.equal(a, b), save_at
        a = resumed.optimizers[0].replicators[0]
        assert a.decision.name == "diloco-h20-int4"
        assert (save_at > 4) == a.lines[0].endswith("(resumed)")


def test_single_replica_sends_nothing(capsys):
    sim = flexdemo.SimulatedReplicas(tiny, loss, replicas=1, replicator="auto",
                                     optimizer="adamw", lr=1e-2)
    sim.step(batches(0, 1))
    a = sim.optimizers[0].replicators[0]
    assert a.decision.replicator == "none" and a.decision.replicas == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["auto: a single replica, nothing to send -> none (no replication) "
                   "(nothing to send)"]


class Quorum(Transport):
    """A group whose size a test changes (a fault-tolerant quorum); this rank is alone on it,
    so a gather repeats its own row."""

    def __init__(self, size: int) -> None:
        self.size, self.rank = size, 0

    def global_rank(self, r):
        return r

    def all_reduce_sum_(self, buf, async_op=False):
        buf.mul_(self.size)

    def all_gather_into(self, out, inp, async_op=False):
        out.view(self.size, -1).copy_(inp.reshape(1, -1))


def test_quorum_that_changes_size_keeps_the_choice_in_one_line():
    quorum = Quorum(4)
    auto = AutoReplicator(link="100mbit,1ms", compute_seconds=0.25, verbose=False)
    params = [torch.zeros(256, 256) for _ in range(8)]
    auto.setup([p.shape for p in params], torch.device("cpu"), quorum, params=params)
    assert auto.probed is not None and auto.probed.source == "given"  # no probe here
    name = auto.decision.name
    quorum.size = 3
    auto.rebind()
    assert auto.decision.name == name and len(auto.lines) == 2
    assert auto.lines[1].startswith(f"auto: 3 replicas now (was 4); {auto.decision.label} stays")
    assert auto.history[-1]["event"] == "resize"


def test_no_probe_without_a_process_group_uses_the_fallback():
    auto = AutoReplicator(compute_seconds=0.1, verbose=False)
    params = [torch.zeros(64, 64) for _ in range(4)]
    auto.setup([p.shape for p in params], torch.device("cpu"), Quorum(2), params=params)
    assert auto.decision.link == FALLBACK_LINK and auto.decision.replicas == 2
    assert "assuming 10 Mbit/s, 50 ms (no probe over this group" in auto.lines[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("world,shard,candidates", [
    (2, 1, ["full", "diloco-h20-int4"]),  # whichever the measurements choose
    (4, 2, ["full"]),  # FSDP shards: replica 0's parameters and AdamW state after the warm-up
], ids=["2x1", "2x2-full"])
def test_prepare_auto_on_gloo_ranks(world, shard, candidates):
    """The probe on real gloo ranks finishes without timing out; every rank (every shard of every
    replica) takes the same decision after the warm-up, and the replicas of each shard end
    bitwise equal (full sync: every step; DiLoCo H=20: after its first sync, step 19)."""
    res = run_world(prepare_worker, world, candidates, 20, shard, timeout=120)
    probes = [Link(**r["probe"]) for r in res]
    assert all(p.source == "probe" and not p.timed_out for p in probes)
    assert all(r["decision"] == res[0]["decision"] for r in res)
    assert all(r["history"] == res[0]["history"] for r in res)  # retunes too, if any
    assert res[0]["history"][0]["step"] == 4 and res[0]["decision"]["replicas"] == 2
    for r in range(shard):  # ranks r and r + shard hold the same shard
        for a, b in zip(res[r]["params"], res[r + shard]["params"]):
            assert torch.equal(a, b)


@pytest.mark.multiprocess
def test_checkpoint_across_the_decision_resumes_bitwise_on_gloo_ranks(tmp_path):
    """flexdemo's checkpoints (DCP) on 2 gloo ranks: saved during the warm-up (step 2) or after
    the decision (step 9), loaded by a fresh prepare(model, "auto"): the same bits at step 24
    as a run without a stop; a load after the decision takes it over (one line, resumed)."""
    res = run_world(resume_worker, 2, str(tmp_path), [2, 9], 24, timeout=200)
    for r in res:
        assert r[2]["same"] and r[9]["same"]
        assert not r[2]["lines"][0].endswith("(resumed)")
        assert r[9]["lines"] == [r[9]["lines"][0]] and r[9]["lines"][0].endswith("(resumed)")


@pytest.mark.multiprocess
def test_probe_that_times_out_falls_back_on_both_ranks():
    """Rank 1 reaches the probe 3 s late: rank 0's probe gives up at its 1 s bound, before the
    late peer arrives (not a timing claim: the peer is 2 s later than the bound); both ranks
    agree on the fallback link, say so in one line, and train on."""
    res = run_world(timeout_worker, 2, 3.0, timeout=120)
    assert res[0]["probe"]["timed_out"] and res[0]["probe_wall"] < 3.0
    assert res[0]["decision"] == res[1]["decision"]
    d = res[0]["decision"]
    assert d["link"]["source"] == "fallback"
    assert res[0]["lines"] == res[1]["lines"] and len(res[0]["lines"]) == 1
    assert "assuming 10 Mbit/s, 50 ms (probe timed out after 1 s)" in res[0]["lines"][0]


class RatedLink:
    """A two-member group whose collectives take their bytes' time at ``rate`` bytes/s (a sleep;
    None: no wait), noting each buffer's bytes: the probe's choices, not a real peer."""

    size, rank = 2, 0

    def __init__(self, rate: float | None) -> None:
        self.rate, self.issued = rate, []

    def all_reduce_sum_(self, buf, async_op=False):
        nbytes = buf.numel() * buf.element_size()
        self.issued.append(nbytes)
        if self.rate:
            time.sleep(nbytes / self.rate)  # each member sends its whole buffer at n = 2


@pytest.mark.parametrize("rate", [None, 1.25e6], ids=["fast", "10mbit"])
def test_the_probe_ends_with_the_largest_buffer_that_fits(rate):
    """After each buffer the members vote on the next: at 10 Mbit/s the 4 MiB one (3.4 s) would
    not fit the 2 s bound after the 1 MiB one, so it is never issued (nothing is left to finish
    in the background but the last vote); on a fast link every buffer runs."""
    link = RatedLink(rate)
    measured, inflight = probe_link(link, 2.0)
    big = [b for b in link.issued if b > 4 << 10]
    assert not measured.timed_out and measured.source == "probe"
    if rate is None:
        assert big == [b for b in PROBE_BYTES if b > 64] and not inflight
    else:
        assert max(big) <= 1 << 20 and len(inflight) == 1  # the vote to stop
        assert 0.5 * rate < measured.bandwidth <= rate


class VirtualClock:
    """``time`` for the modules that time a step and its exchanges, with a ``perf_counter``
    that reads each replica's own virtual seconds (its thread's name, ``flexdemo-replica-R``,
    is the same every step): only the link's waits and a fixed compute per step move it, so a
    loaded machine's scheduling delays cannot look like a slow link (they once made the fast
    phase measure a link 200x slower, and the retune came a check early)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def perf_counter(self) -> float:
        return self.seconds.get(threading.current_thread().name, 0.0)

    def advance(self, seconds: float, name: str | None = None) -> None:
        name = name or threading.current_thread().name
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def __getattr__(self, name):  # everything else is the real clock
        return getattr(time, name)


class SlowLink(Transport):
    """The simulation's group behind a link that can turn slow: after every collective each
    replica waits for its bytes at ``state["rate"]`` bytes/s (None: no wait) on its virtual
    clock ``state["clock"]``."""

    def __init__(self, inner: Transport, state: dict) -> None:
        self.inner, self.state, self.size, self.rank = inner, state, inner.size, inner.rank

    def global_rank(self, r):
        return self.inner.global_rank(r)

    def _wait(self, nbytes: float) -> None:
        if self.state["rate"]:
            self.state["clock"].advance(nbytes / self.state["rate"])

    def all_reduce_sum_(self, buf, async_op=False):
        out = self.inner.all_reduce_sum_(buf, async_op)
        self._wait((self.size - 1) / self.size * 2 * buf.numel() * buf.element_size())
        return out

    def all_gather_into(self, out, inp, async_op=False):
        work = self.inner.all_gather_into(out, inp, async_op)
        self._wait((self.size - 1) * inp.numel() * inp.element_size())
        return work

    def all_to_all_equal_(self, out, inp, async_op=False):
        work = self.inner.all_to_all_equal_(out, inp, async_op)
        self._wait((self.size - 1) / self.size * inp.numel() * inp.element_size())
        return work

    def __deepcopy__(self, memo):
        return self


def slow_sim(state: dict) -> flexdemo.SimulatedReplicas:
    def build(params, group):
        auto = AutoReplicator(link="1gbit,0.1ms", retune=True, verbose=False,
                              candidates=["full", "diloco-h20-int4"], compute_seconds=0.05)
        return flexdemo.DeToNATION(params, auto, base="adamw", lr=1e-2,
                                   group=SlowLink(group, state))
    return flexdemo.SimulatedReplicas(tiny, loss, replicas=2, optimizer_fn=build, seed=0)


@pytest.fixture
def link_state(monkeypatch) -> dict:
    """The slow link's state: its rate (None until it turns slow) and the virtual clock that
    times the steps and exchanges (patched into the modules that read the time)."""
    state: dict = {"rate": None, "clock": VirtualClock()}
    for module in (flexdemo.transport.core, flexdemo.auto.replicator):
        monkeypatch.setattr(module, "time", state["clock"])
    return state


def run_slow(sim, state, start, stop, slow_from=10, rate=1e5):
    for step in range(start, stop):
        state["rate"] = rate if step >= slow_from else None  # 1e5: ~30 ms per all-reduce
        for r in range(len(sim.models)):  # 50 ms of compute a step
            state["clock"].advance(0.05, f"flexdemo-replica-{r}")
        sim.step(batches(step))
    return sim


def test_retune_when_the_link_drops_switches_every_replica_at_one_step(link_state):
    """Full sync on a fast link; from step 10 the link is ~1000x slower: the checks at steps
    19 and 29 see it, and at step 29 every replica switches to DiLoCo at once (one line);
    its first sync (step 39) leaves them bitwise equal. A checkpoint taken before the switch
    (step 25, the window and the strike kept) or after it (step 35) resumes bitwise. The
    step and its exchanges are timed on a virtual clock (:class:`VirtualClock`)."""
    state = link_state
    straight, saved = slow_sim(state), {}
    for start, stop in ((0, 25), (25, 35), (35, 40)):
        run_slow(straight, state, start, stop)
        saved[stop] = copy.deepcopy(straight.state_dict())
    assert straight.identical()  # DiLoCo's first sync after the switch: step 39
    autos = [o.replicators[0] for o in straight.optimizers]
    for a in autos:
        assert [(h["event"], h["step"], h["name"]) for h in a.history] == [
            ("decision", 0, "full"), ("retune", 29, "diloco-h20-int4")]
        assert a.history[1]["link"]["source"] == "in-band"
        assert [c["step"] for c in a.retune_seconds] == [29]  # its own cost, for the bench
        assert a.retune_seconds[0]["seconds"] > 0
    assert "ms]" in autos[0].lines[1] and "[took " in autos[0].lines[1]
    assert autos[0].lines[1].startswith("auto: retune at step 29 (the link was 1000 Mbit/s, "
                                        "0.1 ms): ")
    for save_at in (25, 35):
        fresh = slow_sim(state)
        fresh.load_state_dict(saved[save_at])
        resumed = run_slow(fresh, state, save_at, 40)
        for a, b in zip(straight.models[1].parameters(), resumed.models[1].parameters()):
            assert torch.equal(a, b), save_at
        assert [h["step"] for h in resumed.optimizers[0].replicators[0].history] == [0, 29]


def test_a_collapsed_link_retunes_at_the_first_check(link_state):
    """A link ~10,000x slower whose waits are most of the step (~300 ms of 350) is a collapse:
    the first check after the drop (step 19) switches, where the ~30 ms waits above, under
    half of the step, take two checks (29); the replicas end bitwise equal."""
    state = link_state
    sim = run_slow(slow_sim(state), state, 0, 40, rate=1e4)
    assert sim.identical()
    for o in sim.optimizers:
        a = o.replicators[0]
        assert [(h["event"], h["step"], h["name"]) for h in a.history] == [
            ("decision", 0, "full"), ("retune", 19, "diloco-h20-int4")]
