"""N replicas in one process: bitwise equal to N gloo processes, clear errors, no hangs."""

from __future__ import annotations

import time

import pytest
import torch
from dist_util import run_world
from dist_workers import batch
from sim_workers import CASES, STEPS, gloo_worker, loss_fn, model, optimizer, snapshot
from torch import nn

import flexdemo
from flexdemo import DeToNATION, FullReplicator, NonFiniteGradientError
from flexdemo.simulate import SimulatedReplicas, SimulationError
from flexdemo.transport import InProcessTransport, ReplicaAbortedError


def simulated_trace(case: str, world: int) -> list[list[dict]]:
    sim = SimulatedReplicas(model, loss_fn, replicas=world,
                            optimizer_fn=lambda params, group: optimizer(case, params, group))
    trace = []
    for s in range(STEPS):
        sim.step([batch(r, s) for r in range(world)])
        trace.append([snapshot(m, o) for m, o in zip(sim.models, sim.optimizers)])
    return trace


def assert_same_as_gloo(gloo: list[dict], world: int, cases) -> None:
    for case in cases:
        sim = simulated_trace(case, world)
        for s in range(STEPS):
            if case.startswith("full"):  # every step syncs: the gloo ranks are identical
                for r in range(1, world):
                    assert all(torch.equal(a, b) for a, b in zip(
                        gloo[0][case][s]["params"], gloo[r][case][s]["params"])), (case, s, r)
            if case.startswith("diloco") and s % 2 == 1:  # a sync step (H=2)
                for r in range(1, world):
                    assert all(torch.equal(a, b) for a, b in zip(
                        gloo[0][case][s]["params"], gloo[r][case][s]["params"])), (case, s, r)
            for r in range(world):
                want, got = gloo[r][case][s], sim[s][r]
                assert want["sent"] == got["sent"] and want["received"] == got["received"], \
                    (case, s, r, want["sent"], got["sent"])
                for a, b in zip(want["params"], got["params"]):
                    assert torch.equal(a, b), f"{case}: replica {r} differs at step {s}"
        assert sim[-1][0]["sent"] > 0 or case.startswith("diloco")


@pytest.mark.multiprocess
def test_two_replicas_bitwise_equal_to_two_gloo_processes(one_thread):
    cases = list(CASES)
    gloo = run_world(gloo_worker, 2, cases)
    assert_same_as_gloo(gloo, 2, cases)


@pytest.mark.multiprocess
def test_four_replicas_bitwise_equal_to_four_gloo_processes(one_thread):
    # all-reduce (full, striding) sums in gloo's ring order: bitwise equal on 4 ranks too
    cases = ["demo", "full", "striding", "diloco-full", "diloco-int4-scatter",
             "full-int8-scatter", "full-int2-scatter-oef", "diloco-stat1-scatter-oef"]
    gloo = run_world(gloo_worker, 4, cases)
    assert_same_as_gloo(gloo, 4, cases)


def tiny_sim(replicas=2, **kw) -> SimulatedReplicas:
    kw.setdefault("replicator", "demo")
    kw.setdefault("replicator_kwargs", {"topk": 4, "chunk": 8} if kw["replicator"] == "demo"
                  else None)
    return SimulatedReplicas(model, loss_fn, replicas=replicas, lr=0.01, **kw)


def test_replicas_stay_identical_and_count_bytes():
    sim = tiny_sim(replicas=4)
    losses = sim.step([batch(r, 0) for r in range(4)])
    assert len(losses) == 4 and all(torch.isfinite(x) for x in losses)
    assert len({float(x) for x in losses}) == 4  # each replica saw its own batch
    assert sim.identical()
    payload = sim.optimizers[0].replicators[0].payload_bytes()
    assert sim.bytes_sent == [3 * payload] * 4  # all-gather: (n - 1) x payload
    assert all(isinstance(o.replicators[0].group, InProcessTransport) for o in sim.optimizers)
    nosync = tiny_sim(replicas=2, replicator="none")
    nosync.step([batch(r, 0) for r in range(2)])
    assert not nosync.identical() and nosync.bytes_sent == [0, 0]


def test_failing_replica_ends_the_step_with_its_error():
    class Boom(RuntimeError):
        pass

    def opt_fn(params, group):
        opt = DeToNATION(params, [FullReplicator()], lr=0.01, group=group)
        if group.rank == 1:
            def step(closure=None):
                raise Boom("replica 1 broke")
            opt.step = step
        return opt

    # a timeout past the per-test limit: replicas left waiting for replica 1 would hang the
    # test until pytest-timeout fails it; aborted, they end the step at once
    sim = SimulatedReplicas(model, loss_fn, replicas=3, optimizer_fn=opt_fn, timeout=3600)
    with pytest.raises(Boom, match="replica 1 broke") as info:
        sim.step([batch(r, 0) for r in range(3)])
    assert any("simulated replica 1 of 3" in n for n in getattr(info.value, "__notes__", []))


def test_nonfinite_gradient_raises_on_every_replica_together():
    sim = tiny_sim(replicas=2)
    sim.step([batch(r, 0) for r in range(2)])
    sim.backward([batch(r, 1) for r in range(2)])
    sim.models[1].out.weight.grad[0, 0] = float("nan")
    errors = []

    def step(r):
        try:
            sim.optimizers[r].step()
        except NonFiniteGradientError as e:
            errors.append((r, e.ranks))
        sim.optimizers[r].zero_grad()

    sim.run(step)
    assert sorted(errors) == [(0, [1]), (1, [1])]
    sim.step([batch(r, 2) for r in range(2)])  # training goes on
    assert sim.identical()


def test_a_raised_step_leaves_fresh_gradients_for_the_next():
    sim = tiny_sim(replicas=2)
    sim.backward([batch(r, 0) for r in range(2)])
    sim.models[1].out.weight.grad[0, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError, match=r"rank\(s\) \[1\]"):
        sim.optimizer_step()
    assert all(p.grad is None for m in sim.models for p in m.parameters())
    sim.step([batch(r, 1) for r in range(2)])  # finite data trains on
    assert sim.identical()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_one_clear_error():
    with pytest.raises(ValueError, match="CUDA is not available here"):
        SimulatedReplicas(model, loss_fn, replicas=2, device="cuda")


def test_stuck_replica_times_out_with_a_clear_error():
    sim = tiny_sim(replicas=2, timeout=0.5)
    orig = sim.optimizers[0].step

    def slow(closure=None):
        time.sleep(1.5)
        return orig(closure)

    sim.optimizers[0].step = slow
    with pytest.raises(SimulationError, match="replica 1 waited 0.5 s"):
        sim.step([batch(r, 0) for r in range(2)])


def test_replicas_built_differently_fail_at_construction():
    def opt_fn(params, group):
        reps = ["demo"] if group.rank == 0 else ["full"]
        return DeToNATION(params, reps, lr=0.01, group=group)

    with pytest.raises(ValueError, match=r"ranks \[1\] built another optimizer"):
        SimulatedReplicas(model, loss_fn, replicas=2, optimizer_fn=opt_fn, timeout=30)


def test_replicas_running_different_collectives_fail_clearly():
    def opt_fn(params, group):  # built alike, then replica 1 exchanges every other step only
        opt = DeToNATION(params, ["full"], lr=0.01, group=group)
        opt.replicators[0].replicate_every = 1 + group.rank
        return opt

    sim = SimulatedReplicas(model, loss_fn, replicas=2, optimizer_fn=opt_fn, timeout=30)
    sim.step([batch(r, 0) for r in range(2)])
    with pytest.raises(SimulationError, match="different (sequences of )?collectives") as info:
        for step in (1, 2):
            sim.step([batch(r, step) for r in range(2)])
    assert isinstance(info.value.__cause__, ReplicaAbortedError)


def test_bad_arguments():
    with pytest.raises(ValueError, match="one batch per replica"):
        tiny_sim(replicas=2).step([batch(0, 0)])
    with pytest.raises(ValueError, match="integer >= 1"):
        SimulatedReplicas(model, loss_fn, replicas=0)
    with pytest.raises(ValueError, match="without group="):
        SimulatedReplicas(model, loss_fn, replicas=2,
                          replicator=FullReplicator(group=object()))
    with pytest.raises(TypeError, match="nn.Module"):
        SimulatedReplicas(lambda: 3, loss_fn, replicas=2)


def test_instances_are_copied_per_replica_and_dropout_streams_per_replica():
    drop = nn.Sequential(nn.Linear(12, 32), nn.Dropout(0.5), nn.Linear(32, 6))
    sim = SimulatedReplicas(drop, loss_fn, replicas=2, replicator=FullReplicator(), seed=5)
    reps = [o.replicators[0] for o in sim.optimizers]
    assert reps[0] is not reps[1] and reps[0].group is not reps[1].group
    x = torch.ones(4, 12)
    masks = []
    for r in range(2):
        with sim.replica_rng(r):
            masks.append(torch.rand(3))
    torch.manual_seed(5)
    want0 = torch.rand(3)
    torch.manual_seed(6)
    want1 = torch.rand(3)
    assert torch.equal(masks[0], want0) and torch.equal(masks[1], want1)
    sim.step([(x, torch.zeros(4, 6))] * 2)
    assert sim.identical()


def test_drop_in_demo_over_the_simulated_group():
    sim = SimulatedReplicas(
        model, loss_fn, replicas=2,
        optimizer_fn=lambda params, group: flexdemo.DeMo(
            params, lr=1e-3, compression_topk=4, compression_chunk=8, process_group=group))
    for s in range(3):
        sim.step([batch(r, s) for r in range(2)])
    assert sim.identical() and sim.bytes_sent[0] > 0


class CorruptingTransport(InProcessTransport):
    """Replica 1 of the hub, whose all-gathered payloads arrive with a broken header."""

    def all_gather_into(self, out, inp, async_op=False):
        if inp.dtype == torch.uint8:  # DeMo's payloads (not the set-up's shape check)
            inp = inp.clone()
            inp[:8] = 0xFF  # the magic number
        return super().all_gather_into(out, inp, async_op)


def test_corrupt_payload_is_named_on_every_replica(monkeypatch):
    from flexdemo.replicate import CorruptPayloadError

    # DeMo names the peer through torch.distributed whenever a default group exists (another
    # test may leave one behind); with flexdemo.transport.global_rank it needs none
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)

    def opt_fn(params, group):
        if group.rank == 1:
            group = CorruptingTransport(group.hub, 1)
        return DeToNATION(params, [flexdemo.DeMoReplicator(topk=4, chunk=8)], lr=0.01,
                          group=group)

    sim = SimulatedReplicas(model, loss_fn, replicas=2, optimizer_fn=opt_fn)
    sim.backward([batch(r, 0) for r in range(2)])
    errors = {}

    def step(r):
        try:
            sim.optimizers[r].step()
        except CorruptPayloadError as e:
            errors[r] = str(e)

    sim.run(step)
    assert sorted(errors) == [0, 1]
    assert all("corrupt payload from rank 1" in e for e in errors.values())


def test_state_dict_round_trip_resumes_bitwise(tmp_path):
    def run(sim, steps):
        for s in steps:
            sim.step([batch(r, s) for r in range(3)])

    a = tiny_sim(replicas=3, seed=1)
    run(a, range(2))
    torch.save(a.state_dict(), tmp_path / "sim.pt")
    run(a, range(2, 4))
    b = tiny_sim(replicas=3, seed=7)
    b.load_state_dict(torch.load(tmp_path / "sim.pt", weights_only=False))
    run(b, range(2, 4))
    for ma, mb in zip(a.models, b.models):
        assert all(torch.equal(p, q) for p, q in zip(ma.parameters(), mb.parameters()))
    assert a.bytes_sent == b.bytes_sent
    with pytest.raises(ValueError, match="replicas=3"):
        tiny_sim(replicas=2).load_state_dict(a.state_dict())


def test_cli_simulate_trains_replicas_of_the_gpt(capsys, tmp_path):
    import json

    from flexdemo.app.cli import main

    out = tmp_path / "sim.json"
    assert main(["simulate", "--replicas", "2", "--steps", "3", "--log-every", "3", "--batch",
                 "2", "--corpus-bytes", "40000", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "sent/replica/step" in text and "replicas identical: True" in text
    assert "step     3/3 (100%)" in text and "eta 0s" in text  # progress of a long run
    summary = json.loads(out.read_text())
    assert summary["replicas_identical"] is True
    assert len(set(summary["val_loss_per_replica"])) == 1
    assert summary["bytes_sent_per_replica"][0] > 0
    assert summary["strategy"]["replicator"] == "demo"
    # --seed fixes the initial weights too: the same command gives the same run
    again = tmp_path / "again.json"
    assert main(["simulate", "--replicas", "2", "--steps", "3", "--log-every", "3", "--batch",
                 "2", "--corpus-bytes", "40000", "--out", str(again)]) == 0
    assert json.loads(again.read_text())["val_loss"] == summary["val_loss"]


def test_cli_simulate_rejects_bad_input_in_one_line(capsys):
    from flexdemo.app.cli import main

    for argv, needle in ((["--strategy", "nope"], "unknown strategy 'nope'"),
                         (["--warmup", "5", "--steps", "5"], "--warmup must be"),
                         (["--lr", "-1"], "--lr must be > 0")):
        assert main(["simulate", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith("flexdemo simulate: error: ") and needle in err, err


def test_train_loop_sets_the_lr_calls_back_and_stops():
    """SimulatedReplicas.train: the loop of `flexdemo simulate` and the quality benchmark."""
    sim = tiny_sim(replicas=2)
    seen = []

    def on_step(done, losses):
        seen.append((done, len(losses), sim.optimizers[1].param_groups[0]["lr"]))
        return done == 3

    taken = sim.train(5, lambda step: [batch(r, step) for r in range(2)],
                      lambda step: 0.1 * (step + 1), on_step)
    assert taken == 3 and [(d, n) for d, n, _ in seen] == [(1, 2), (2, 2), (3, 2)]
    assert [lr for *_, lr in seen] == pytest.approx([0.1, 0.2, 0.3])
    assert sim.identical() and sim.bytes_sent[0] > 0
