"""Replicas of different speeds in the app (issue 55): ``flexdemo train`` with a DiLoCo pace
(the run in syncs) or balanced batches, ``train.slowdown`` (an emulated slower rank), and
``flexdemo bench --preset stragglers``'s options and arithmetic.

The trainer runs on real gloo processes on 127.0.0.1 (``run_world``); what is asserted is
counted (steps, syncs, batch sizes, bits), never seconds."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from dist_util import run_world

from flexdemo import Pace
from flexdemo.app.bench.run import PRESETS, STRATEGIES, BenchError, bench_options, run_config
from flexdemo.app.bench.stragglers import (
    comparison,
    goodput,
    partner,
    replica_speeds,
    run_figures,
    straggler_lines,
    straggler_table,
    time_to_loss,
    value_at,
)
from flexdemo.app.cli import main
from flexdemo.app.config.checks import config_from_dict, validate
from flexdemo.app.config.files import load_config
from flexdemo.app.config.schema import ConfigError
from flexdemo.app.schedule import lr_at
from flexdemo.app.train.speeds import PacedRun, Slowdown, crossed, schedule_step

ROOT = Path(__file__).parent.parent
GPT = str(ROOT / "configs" / "gpt.toml")
QUICK = ["task.model=tiny", "task.corpus_bytes=200000", "train.batch=4", "train.warmup=2",
         "train.eval_batches=1", "train.tensorboard=false", "train.progress=false",
         "train.threads=0", "train.log_every=100"]
# DiLoCo with plain averaging and AdamW: the cheapest DiLoCo step, H=4
PACED = ["strategy.replicator=diloco-avg", "strategy.optimizer=adamw", "strategy.lr=1e-3"]


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _trainer_worker(rank: int, world: int, overrides: list[str]) -> dict:
    """A rank of ``run_world``: train, and return the summary, the lines said and the
    parameters (with the learning rate of the last step)."""
    from flexdemo.app.train.trainer import Trainer

    lines: list[str] = []
    trainer = Trainer(load_config(GPT, overrides), echo=lines.append)
    summary = trainer.run()
    params = [p.detach().clone() for p in trainer.model.parameters()]
    return {"summary": summary, "lines": lines, "params": params,
            "lr": trainer.opt.param_groups[0]["lr"]}


# ---------------------------------------------------------------------- a paced run
def _steps_of(changes: list, inner_steps: int, syncs: int, world: int) -> list[int]:
    """Each replica's steps over ``syncs`` periods: H in the first, then the counts of the
    last change made at an earlier sync (a change at sync j is in force from period j + 1)."""
    counts, steps, made = [inner_steps] * world, [0] * world, dict(
        (j, c) for j, c in changes)
    for period in range(1, syncs + 1):
        steps = [a + b for a, b in zip(steps, counts)]
        counts = made.get(period, counts)
    return steps


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["fixed", "adaptive"])
def test_paced_run_with_a_slowed_rank_ends_at_the_same_sync_on_every_rank(tmp_path, mode):
    """Three replicas, rank 2 slowed 3x, a measured pace at H=4, train.steps=10 (rounded up
    to 3 syncs): every rank stops after sync 3; each rank's steps are H in the first period
    and then the counts in force (fixed: measured at sync 1; adaptive: changed at syncs past
    the tolerance); the replicas end identical; evaluations at the syncs only, the lines rank
    0's own steps."""
    out = tmp_path / "run"
    results = run_world(_trainer_worker, 3, [
        *QUICK, *PACED, "mesh.replicate=3", "train.steps=10", "train.eval_every=4",
        f"strategy.replicator_kwargs={{inner_steps=4, pace=\"{mode}\"}}",
        "train.slowdown=3.0", "train.slow_ranks=[2]", f"train.out={out}"])
    s = results[0]["summary"]
    counts, changes = s["pace"]["counts"], s["pace"]["changes"]
    assert s["pace"] == {"inner_steps": 4, "counts": counts, "weights": "steps", "syncs": 3,
                         "syncs_total": 3, "changes": changes}
    # about H for the fastest (at most 2H: step_counts), the fewest steps for the slowed rank
    assert changes and changes[-1][1] == counts and max(counts) <= 2 * 4
    assert counts[2] == min(counts) >= 1
    if mode == "fixed":
        assert changes == [[1, counts]]  # measured once, at the first sync
    steps = _steps_of(changes, 4, 3, 3)
    assert s["per_rank"]["steps"] == steps and s["steps"] == 12 and s["steps_total"] == 12
    assert s["per_rank"]["tokens"] == [n * 4 * 64 for n in steps]  # batch 4 x 64 tokens
    assert all(r["summary"]["per_rank"] == s["per_rank"] for r in results)  # same everywhere
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], r["params"]))
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(1, steps[0] + 1))
    # an evaluation at each sync, none between
    assert [r["step"] for r in rows if "val_loss" in r] == [
        _steps_of(changes, 4, j, 3)[0] for j in (1, 2, 3)]
    assert [r["sync"] for r in rows if "val_loss" in r] == [1, 2, 3]
    assert rows[-1]["progress"] == 12 and rows[-1]["job_tokens_total"] == sum(
        s["per_rank"]["tokens"])
    said = results[0]["lines"]
    assert any("3 syncs of H=4" in line and "train.steps=10 rounded up" in line
               for line in said), said
    assert any("pace" in line and "steps per rank" in line for line in said)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_given_counts_their_steps_and_a_resume_at_a_sync(tmp_path):
    """pace=[4, 2] (H=4): rank 1 takes 2 steps per period, its learning rate at the last
    step that of the schedule's step 2 x 4 + 1 x 2; a run stopped at a sync (stop_at=5:
    the sync after step 8) and resumed ends as the uninterrupted run, bit for bit. Without
    checkpoints an evaluation is reduced while the next period runs (landed at the next
    sync): the same lines and validation losses as evaluated at once (before a checkpoint)."""
    common = [*QUICK, *PACED, "mesh.replicate=2", "train.steps=12", "train.eval_every=4",
              "train.checkpoint_every=4", "strategy.replicator_kwargs={inner_steps=4, "
              "pace=[4, 2]}"]
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    whole = run_world(_trainer_worker, 2, [*common, f"train.out={ref}"])
    assert whole[0]["summary"]["per_rank"]["steps"] == [12, 6]
    # rank 1's last step: period 2, position 1 of 2: the schedule's step 2 * 4 + 1 * 4 / 2
    assert whole[1]["lr"] == lr_at(10.0, 12, 1e-3, 2, "cosine", 0.1)
    assert whole[0]["lr"] == lr_at(11.0, 12, 1e-3, 2, "cosine", 0.1)
    flight = tmp_path / "flight"
    run_world(_trainer_worker, 2, [*common, "train.checkpoint_every=0", f"train.out={flight}"])
    rows, ref_rows = _metrics(flight), _metrics(ref)
    assert [r["step"] for r in rows if "val_loss" in r] == [4, 8, 12]
    assert [(r["step"], r["loss"], r.get("val_loss")) for r in rows] == [
        (r["step"], r["loss"], r.get("val_loss")) for r in ref_rows]
    first = run_world(_trainer_worker, 2, [*common, "train.stop_at=5", f"train.out={cut}"])
    assert first[0]["summary"]["per_rank"]["steps"] == [8, 4]
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["step_000004",
                                                                       "step_000008"]
    again = run_world(_trainer_worker, 2, [*common, "resume=true", f"train.out={cut}"])
    assert again[0]["summary"]["per_rank"]["steps"] == [12, 6]
    assert again[0]["summary"]["per_rank"]["steps_this_run"] == [4, 2]
    assert [r["loss"] for r in _metrics(cut)] == [r["loss"] for r in _metrics(ref)]
    assert all(torch.equal(a, b) for a, b in zip(again[1]["params"], whole[1]["params"]))


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_an_overlapped_pace_marks_its_syncs_where_applied_and_resumes_bitwise(tmp_path):
    """pace=[6, 3] (H=6) with each sync overlapped (tau=2, keep_overlap): rank 0 applies a
    sync 2 steps after its launch, rank 1 (3 steps a period) after 1; the evaluations come
    where rank 0 applies them (steps 8, 14) and at the run's end, where the last sync is
    applied at once (step 18), and the replicas end identical. A run stopped at sync 2
    (stop_at=7: where it is applied) and resumed ends as the uninterrupted run, bit for
    bit."""
    common = [*QUICK, *PACED, "mesh.replicate=2", "train.steps=18", "train.eval_every=6",
              "train.checkpoint_every=6", "strategy.replicator_kwargs={inner_steps=6, "
              "pace=[6, 3], tau=2, keep_overlap=true}"]
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    whole = run_world(_trainer_worker, 2, [*common, f"train.out={ref}"])
    s = whole[0]["summary"]
    assert s["per_rank"]["steps"] == [18, 9] and s["pace"]["syncs"] == 3
    assert [r["step"] for r in _metrics(ref) if "val_loss" in r] == [8, 14, 18]
    assert all(torch.equal(a, b) for a, b in zip(whole[0]["params"], whole[1]["params"]))
    first = run_world(_trainer_worker, 2, [*common, "train.stop_at=7", f"train.out={cut}"])
    assert first[0]["summary"]["per_rank"]["steps"] == [14, 7]
    again = run_world(_trainer_worker, 2, [*common, "resume=true", f"train.out={cut}"])
    assert again[0]["summary"]["per_rank"]["steps"] == [18, 9]
    assert [r["loss"] for r in _metrics(cut)] == [r["loss"] for r in _metrics(ref)]
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(again[r]["params"], whole[r]["params"]))


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_balanced_batches_give_the_slowed_replica_a_smaller_batch(tmp_path):
    """DeMo weighted by tokens with train.batches="balanced", rank 1 slowed 3x: after the
    measured steps the batches share 2 x 8 samples by speed, the slowed rank's smaller;
    every rank counts its own tokens; the replicas stay identical."""
    out = tmp_path / "run"
    results = run_world(_trainer_worker, 2, [
        *QUICK, "strategy.replicator=demo", "strategy.optimizer=sgd", "strategy.lr=1e-3",
        "strategy.replicator_kwargs={topk=16, weights=\"tokens\"}", "mesh.replicate=2",
        "train.batch=8", "train.batches=\"balanced\"", "train.steps=9", "train.eval_every=0",
        "train.slowdown=3.0", "train.slow_ranks=[1]", f"train.out={out}"])
    per = results[0]["summary"]["per_rank"]
    fast, slow = per["batch"]
    assert fast + slow == 16 and slow < fast
    # 6 steps at 8 (the first and the 5 measured), 3 at the balanced sizes
    assert per["tokens"] == [(6 * 8 + 3 * b) * 64 for b in per["batch"]]
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"]))
    assert any(f"balanced batches from step 7: [{fast}, {slow}]" in line
               for line in results[0]["lines"])
    assert [r["batch"] for r in _metrics(out)] == [8] * 6 + [fast] * 3


# ---------------------------------------------------------------------- the pieces
def test_schedule_step_follows_the_run_not_the_rank():
    """At each sync every replica is at the same step of the schedule; in between the
    slower ones take larger strides."""
    assert schedule_step(0, 0, 4, 4) == 0.0
    assert [schedule_step(2, s, 2, 4) for s in range(2)] == [8.0, 10.0]
    assert [schedule_step(2, s, 4, 4) for s in range(4)] == [8.0, 9.0, 10.0, 11.0]
    assert schedule_step(3, 0, 1, 30) == schedule_step(3, 0, 30, 30) == 90.0
    assert crossed(4, 0, 4) and not crossed(4, 4, 7) and crossed(10, 8, 12)
    assert not crossed(0, 0, 100)
    # a fraction between steps is a rate between theirs
    assert lr_at(0.0, 12, 1.0, 2) < lr_at(0.5, 12, 1.0, 2) < lr_at(1.0, 12, 1.0, 2)


def _paced(counts, rank=0, steps=100, stop_at=0, budget="steps"):
    """A :class:`PacedRun` over a real :class:`Pace` of the given counts (H = 30), bound
    as a replicator binds it."""
    pace = Pace(counts)
    pace.setup(30, len(counts), rank, torch.device("cpu"))
    rep = SimpleNamespace(inner_steps=30, syncs=[0], pace=pace, pending={})
    opt = SimpleNamespace(replicators=[SimpleNamespace(pace=None), rep])
    return PacedRun.of(opt, steps, stop_at, budget), rep


def test_paced_run_length_in_syncs():
    run, rep = _paced([30, 30, 30, 10], rank=3)
    assert run is not None and (run.total, run.last, run.span) == (4, 4, 120)
    assert _paced([30, 30, 30, 10], steps=120, stop_at=31)[0].last == 2  # the sync at/after
    assert PacedRun.of(SimpleNamespace(replicators=[]), 100) is None
    rep.syncs[0], rep.pace.since = 2, 5
    assert run.position() == 75.0 and run.at == 60 and not run.done
    rep.syncs[0] = 4
    assert run.done and "rounded up" in run.note(100) and "rounded" not in run.note(120)


def test_a_run_by_tokens_lasts_until_the_replicas_steps_reach_the_budget():
    """``train.pace_budget = "tokens"``: 240 synchronous steps of 4 replicas are 960 replica
    steps; at counts [30, 30, 30, 10] (100 a period) that is 10 syncs, and the run ends at
    the first sync at or past the budget; a first period of other counts is counted as it
    runs."""
    run, rep = _paced([30, 30, 30, 10], rank=3, steps=240, budget="tokens")
    assert run.budget == 960 and (run.total, run.span) == (10, 240)
    assert "960 steps together" in run.note(240)
    for sync in range(1, 11):  # what each sync does to the pace: its period's steps done
        rep.syncs[0] = sync
        rep.pace.steps_done = [30 * sync] * 3 + [10 * sync]
        assert run.total == 10 and run.done == (sync == 10)
        # the schedule by tokens: the synchronous run's step at the same tokens (25 a sync)
        assert run.position() == 25 * sync
    rep.syncs[0], rep.pace.steps_done, rep.pace.since = 2, [60, 60, 60, 20], 5
    assert run.position() == 50 + 25 * 5 / 10  # half of replica 3's period: half of 25
    run, rep = _paced([30, 30, 30, 10], steps=240, budget="tokens")
    rep.pace._first_period = [30, 30, 30, 15]  # decided after 8 steps (Pace.measure)
    assert run.total == 10  # 105 in the first period, 855 more: 9 periods
    run, rep = _paced([30, 30], steps=240, budget="tokens", stop_at=60)
    assert (run.total, run.last) == (8, 2)


def test_slowdown_is_for_its_ranks_only():
    cpu = torch.device("cpu")
    assert Slowdown.for_rank(1.0, [], 0, cpu) is None
    assert Slowdown.for_rank(3.0, [2], 0, cpu) is None
    assert Slowdown.for_rank(3.0, [2], 2, cpu).factor == 3.0
    assert Slowdown.for_rank(2.0, [], 5, cpu) is not None  # empty: every rank


@pytest.mark.parametrize("overrides, needle", [
    (["train.slowdown=0.5"], "train.slowdown: must be a factor >= 1"),
    (["train.slow_ranks=[1]"], "train.slow_ranks: must be distinct ranks of this job, 0..0"),
    (["train.slow_ranks=[0, 0]"], "distinct ranks"),
    (["train.slow_ranks=3"], "train.slow_ranks: expected an array"),
    (["train.slow_ranks=['a']"], "train.slow_ranks[0]: expected an integer"),
    (["train.batches=fair"], "train.batches: unknown value 'fair'"),
    (["train.batches=balanced", "strategy.replicator=diloco",
      "strategy.replicator_kwargs={pace=\"fixed\"}"], "choose one"),
    (["train.pace_budget=tokens"], "this strategy has none"),
    (["train.pace_budget=bytes"], "train.pace_budget: unknown value 'bytes'"),
    (["fault_tolerance.enabled=true", "fault_tolerance.lighthouse=http://127.0.0.1:29510",
      "strategy.replicator=diloco", "strategy.replicator_kwargs={pace=\"adaptive\"}"],
     "does not run a DiLoCo pace under fault tolerance yet"),
])
def test_bad_speed_settings_are_one_line(overrides, needle):
    with pytest.raises(ConfigError, match=None) as e:
        load_config(GPT, overrides, world_size=1, environ={})
    assert needle in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------- the preset
def test_stragglers_preset_options_and_configs():
    o = bench_options(preset="stragglers")
    assert (o.nodes, o.ranks_per_node, o.slow_factor, o.slow_node) == (4, 1, 3.0, 3)
    assert o.strategies == list(PRESETS["stragglers"]["strategies"])
    assert {partner(n) for n in o.strategies} == {None, "muloco-int4", "muloco", "flexdemo"}
    assert o.bandwidths == ["100mbit"] and o.steps % 30 == 0  # whole periods of H=30
    for name in o.strategies:
        cfg = validate(config_from_dict(run_config(o, name, "x")), 4)
        assert cfg.train.slowdown == 3.0 and cfg.train.slow_ranks == [3]
        assert cfg.train.batches == ("balanced" if name.endswith("-balanced") else "equal")
    paced = run_config(o, "muloco-int4-paced", "x")
    assert paced["strategy"]["replicator_kwargs"] == {"pace": "fixed"}
    assert paced["train"]["pace_budget"] == "tokens"  # the synchronous run's tokens
    assert "pace_budget" not in run_config(o, "muloco-int4", "x")["train"]
    assert STRATEGIES["flexdemo-balanced"].replicator_kwargs["weights"] == "tokens"
    two = bench_options(preset="stragglers", slow_factor=2, slow_node=0, ranks_per_node=2)
    assert run_config(two, "flexdemo", "x")["train"]["slow_ranks"] == [0, 1]
    plain = bench_options(strategies="flexdemo")
    assert plain.slow_factor == 1.0 and "slowdown" not in run_config(plain, "flexdemo",
                                                                      "x")["train"]


@pytest.mark.parametrize("kwargs, needle", [
    ({"slow_factor": 0.5}, "--slow-factor must be a number >= 1"),
    ({"slow_factor": math.nan}, "--slow-factor must be a number >= 1"),
    ({"slow_node": 4}, "--slow-node 4: the sweep has 4 nodes, numbered 0..3"),
    ({"slow_node": -1}, "--slow-node -1"),
])
def test_bad_preset_options(kwargs, needle):
    with pytest.raises(BenchError) as e:
        bench_options(preset="stragglers", **kwargs)
    assert needle in str(e.value)
    with pytest.raises(BenchError, match="give --slow-factor above 1"):
        bench_options(strategies="flexdemo", slow_node=1)
    with pytest.raises(BenchError, match="not for the elastic preset"):
        bench_options(preset="elastic", slow_factor=2.0)


@pytest.mark.parametrize("argv, needle", [
    (["--slow-node", "9"], "--slow-node 9"),
    (["--slow-factor", "0.2"], "--slow-factor must be a number >= 1"),
])
def test_bad_preset_options_on_the_command_line_are_one_line(capsys, argv, needle):
    assert main(["bench", "--preset", "stragglers", "--unshaped", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("flexdemo bench: error: ") and needle in err


# ---------------------------------------------------------------------- the arithmetic
def _run(name: str, val: list[float], seconds: list[float], tokens: list[int],
         per: dict) -> dict:
    return {"strategy": name, "bandwidth": "100mbit", "status": "ok", "val_loss": val[-1],
            "per_rank": per, "curve": {"val_loss": val, "val_seconds": seconds,
                                       "val_tokens": tokens}}


def _sync_and_paced() -> tuple[dict, dict]:
    """Four replicas of 100 tokens per step, one 3x slower (its compute 0.3 s per step, the
    others' 0.1 s: speeds 1000, 1000, 1000, 333.3 tokens/s). Synchronous: 40 steps each in
    12 s (the slow one's pace). Paced: 30 steps on the fast, 10 on the slow, in 3.2 s."""
    sync = _run("muloco-int4", [3.0, 2.6, 2.4], [4.0, 8.0, 12.0], [4000, 8000, 16000], {
        "steps_this_run": [40] * 4, "tokens": [4000] * 4,
        "compute_seconds": [0.1, 0.1, 0.1, 0.3], "train_seconds": [12.0, 12.0, 12.0, 12.0]})
    paced = _run("muloco-int4-paced", [2.9, 2.5], [1.6, 3.2], [5000, 10000], {
        "steps_this_run": [30, 30, 30, 10], "tokens": [3000, 3000, 3000, 1000],
        "compute_seconds": [0.1, 0.1, 0.1, 0.3], "train_seconds": [3.2, 3.1, 3.2, 3.0]})
    return sync, paced


def test_goodput_time_to_loss_and_equal_tokens_on_hand_made_curves():
    sync, paced = _sync_and_paced()
    assert replica_speeds(sync) == pytest.approx([1000, 1000, 1000, 1000 / 3])
    # the job: 16000 tokens in 12 s over 3333.3 tokens/s of replicas: 0.4
    assert goodput(sync) == pytest.approx(16000 / 12 / (10000 / 3))
    assert goodput(sync) == pytest.approx(0.4)
    assert goodput(paced) == pytest.approx(10000 / 3.2 / (10000 / 3))
    f = run_figures(paced)
    assert (f["tokens"], f["job_seconds"]) == (10000, 3.2)
    assert f["tokens_per_second"] == pytest.approx(3125)
    # the first evaluation at or below the target, interpolated from the one before
    assert time_to_loss([1.0, 2.0, 3.0], [3.0, 2.5, 2.0], 2.75) == pytest.approx(1.5)
    assert time_to_loss([1.0, 2.0], [2.0, 1.0], 2.5) == 1.0  # there at the first
    assert time_to_loss([1.0, 2.0], [3.0, 2.8], 2.5) is None
    assert value_at([10, 20, 30], [3.0, 2.0, 1.5], 25) == pytest.approx(1.75)
    assert value_at([10, 20], [3.0, 2.0], 20) == 2.0
    assert value_at([10, 20], [3.0, 2.0], 5) is None and value_at([], [], 1) is None
    c = comparison(paced, sync)
    assert c["target"] == 2.4 and c["reference_time_to_target"] == pytest.approx(12.0)
    assert c["time_to_target"] is None  # the paced run ended at 2.5
    assert c["own_final"] == 2.5 and c["time_to_own_final"] == 3.2
    assert c["reference_time_to_own_final"] == pytest.approx(10.0)
    # equal tokens: the paced run's 10000, the sync curve between 8000 (2.6) and 16000 (2.4)
    assert c["equal_tokens"] == 10000
    assert c["val_loss_at_equal_tokens"] == pytest.approx(2.5)
    assert c["reference_val_loss_at_equal_tokens"] == pytest.approx(2.55)
    better = _run("muloco-int4-paced", [2.9, 2.3], [1.6, 3.2], [5000, 10000],
                  paced["per_rank"])
    c = comparison(better, sync)
    assert c["time_to_target"] == pytest.approx(1.6 + 1.6 * 0.5 / 0.6)
    assert c["own_final"] is None and c["time_to_own_final"] is None


def test_straggler_report_lines_and_table():
    sync, paced = _sync_and_paced()
    failed = {"strategy": "flexdemo-balanced", "bandwidth": "100mbit", "status": "failed",
              "curve": {}}
    lines = straggler_lines([sync, paced, failed], "node 3 slowed 3x")
    assert lines[0] == "muloco-int4-paced vs muloco-int4 @ 100mbit (node 3 slowed 3x):"
    assert lines[1].startswith("  goodput:          0.94 vs 0.40")
    assert lines[2].startswith("  time to 2.4000:  not reached (final 2.5000) vs 12.0 s")
    # the paced run's own final, 2.5, which the sync curve reaches between 8 s and 12 s
    assert lines[3] == ("  time to 2.5000:  3.2 s vs 10.0 s (3.12x sooner) (muloco-int4-paced's "
                        "final validation loss)")
    assert lines[4] == "  at equal tokens:  val loss 2.5000 vs 2.5500 (-2.0%) at 10,000 tokens"
    assert len(lines) == 5  # the failed run has nothing to compare
    table = straggler_table([sync, paced, failed]).splitlines()
    assert table[0].split()[:3] == ["strategy", "link", "val"]
    assert table[3].split()[:7] == ["muloco-int4-paced", "100mbit", "2.5000", "10000", "3.2",
                                    "3125", "0.94"]
    assert table[4].endswith("failed")
