"""The quality benchmark (benchmarks/quality.py) end to end in a tiny configuration, and its
best-lr selection and ratios on hand-made runs."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def quality():
    path = ROOT / "benchmarks" / "quality.py"
    spec = importlib.util.spec_from_file_location("quality", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["quality"] = module  # its dataclasses look their module up by name
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("quality", None)


def _run(strategy: str, lr: float, seed: int, final: float, replicas: int = 2) -> dict:
    return {"replicas": replicas, "strategy": strategy, "lr": lr, "seed": seed,
            "final_val": final, "curve": [[5, final + 1.0], [10, final]], "seconds": 1.0,
            "bytes_per_param_step": 4.0, "tokens_per_replica": 100}


def test_best_lr_is_the_lowest_mean_and_ratios_are_against_best_adamw(quality):
    runs = [_run("adamw", 1e-3, 0, 2.0), _run("adamw", 1e-3, 1, 2.2),      # mean 2.1
            _run("adamw", 3e-3, 0, 1.9), _run("adamw", 3e-3, 1, 2.1),      # mean 2.0: best
            _run("demo", 1e-3, 0, 2.5), _run("demo", 1e-3, 1, 2.3),        # mean 2.4: best
            _run("demo", 3e-3, 0, 1.0), _run("demo", 3e-3, 1, math.nan),   # diverged seed
            _run("no-sync", 1e-3, 0, 2.6), _run("no-sync", 1e-3, 1, 2.6),
            _run("adamw", 1e-3, 0, 3.0, replicas=4)]
    rows = {(r["replicas"], r["strategy"], r["lr"]): r for r in quality.summarize(runs)}
    assert rows[(2, "adamw", 3e-3)]["best_lr"] and not rows[(2, "adamw", 1e-3)]["best_lr"]
    assert rows[(2, "demo", 1e-3)]["best_lr"] and not rows[(2, "demo", 3e-3)]["best_lr"]
    assert rows[(2, "demo", 3e-3)]["val_mean"] == math.inf
    assert rows[(2, "adamw", 1e-3)]["val_mean"] == pytest.approx(2.1)
    assert rows[(2, "adamw", 1e-3)]["val_std"] == pytest.approx(0.1)
    assert rows[(2, "adamw", 3e-3)]["vs_adamw"] == pytest.approx(1.0)
    assert rows[(2, "demo", 1e-3)]["vs_adamw"] == pytest.approx(2.4 / 2.0)
    assert rows[(2, "demo", 1e-3)]["vs_no_sync"] == pytest.approx(2.4 / 2.6)
    assert rows[(2, "adamw", 3e-3)]["lr_at_grid_edge"]
    # 4 replicas compare against their own AdamW; no no-sync there
    assert rows[(4, "adamw", 1e-3)]["vs_adamw"] == pytest.approx(1.0)
    assert rows[(4, "adamw", 1e-3)]["vs_no_sync"] is None
    curves = quality.best_curves(runs, list(rows.values()))
    assert curves[(2, "adamw")] == [[5, pytest.approx(3.0), 2.9, 3.1],
                                    [10, pytest.approx(2.0), 1.9, 2.1]]


def test_benchmark_runs_end_to_end_and_writes_json_csv_plot(quality, tmp_path, capsys):
    out = tmp_path / "q"
    result = quality.main(["--quick", "--model", "tiny", "--steps", "6", "--batch", "2",
                           "--eval-every", "3", "--eval-batches", "2", "--seeds", "1",
                           "--corpus-bytes", "200000", "--strategies", "adamw,no-sync",
                           "--lr-grid", "1,3", "--threads", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "adamw" in printed and "no-sync" in printed and "vs adamw" in printed

    data = json.loads((out / "quality.json").read_text())
    assert data["summary"] == json.loads(json.dumps(result["summary"]))
    runs = data["runs"]
    assert len(runs) == 4 and {r["strategy"] for r in runs} == {"adamw", "no-sync"}
    for r in runs:
        assert [p[0] for p in r["curve"]] == [3, 6]
        assert all(math.isfinite(p[1]) and 0.0 < p[1] < 10.0 for p in r["curve"])
        assert r["final_val"] == r["curve"][-1][1]
        assert r["tokens_per_replica"] == 6 * 2 * 64
    # full sync keeps the replicas bitwise identical and sends 4 bytes (fp32) per parameter
    # and step; no sync sends nothing and the replicas drift apart
    for r in runs:
        if r["strategy"] == "adamw":
            assert r["identical"] and r["bytes_per_param_step"] == pytest.approx(4.0, rel=1e-3)
        else:
            assert not r["identical"] and r["bytes_per_param_step"] == 0.0

    with open(out / "quality.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4
    for name in ("adamw", "no-sync"):
        mine = [r for r in rows if r["strategy"] == name]
        best = [r for r in mine if r["best_lr"] == "True"]
        assert len(best) == 1
        assert float(best[0]["val_mean"]) == min(float(r["val_mean"]) for r in mine)
    adamw_best = min(float(r["val_mean"]) for r in rows if r["strategy"] == "adamw")
    for r in rows:
        assert float(r["vs_adamw"]) == pytest.approx(float(r["val_mean"]) / adamw_best)
    assert (out / "quality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data["best_curves"]) == 2


def test_unknown_strategy_is_one_clear_line(quality, capsys):
    with pytest.raises(SystemExit):
        quality.parse_args(["--quick", "--strategies", "adamw,demoo"])
    err = capsys.readouterr().err
    assert "unknown strategy ['demoo']" in err and "choose from" in err


BASE = {"model": "tiny", "steps": 10, "batch": 2, "schedule": "cosine", "warmup": 0.05,
        "min_lr": 0.1, "data": "random", "eval_every": 5, "eval_batches": 2,
        "corpus_bytes": 1000}


def test_merge_adds_stored_runs_and_refuses_other_settings(quality, tmp_path, capsys):
    here = [{**BASE, **_run("adamw", 1e-3, 0, 2.0)}]
    stored = [{**BASE, **_run("adamw", 1e-3, 0, 9.0)}, {**BASE, **_run("adamw", 3e-3, 0, 1.5)}]
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"runs": stored}))
    loaded = quality.load_runs([str(path)])
    quality.check_same(loaded, BASE)
    runs = quality.merged(here, loaded)
    assert sorted((r["lr"], r["final_val"]) for r in runs) == [(1e-3, 2.0), (3e-3, 1.5)]
    path.write_text(json.dumps({"runs": [{**stored[1], "steps": 20}]}))
    with pytest.raises(SystemExit) as e:
        quality.check_same(quality.load_runs([str(path)]), BASE)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert "differ in steps (20 there, 10 here)" in err


def test_ns_dtype_reaches_every_muon_strategy_and_guards_merges(quality, tmp_path, capsys):
    """--ns-dtype fp32: the Muon runs step with fp32 Newton-Schulz (near the bf16 run, not
    its bits); runs of the other precision, or of a version without the setting (bf16), merge
    only where they match."""
    args = ["--quick", "--model", "tiny", "--steps", "2", "--batch", "2", "--eval-every", "2",
            "--eval-batches", "1", "--seeds", "1", "--corpus-bytes", "200000", "--strategies",
            "muon", "--lrs", "0.01", "--threads", "1"]
    (bf16,) = quality.configurations(quality.parse_args(args))
    (fp32,) = quality.configurations(quality.parse_args([*args, "--ns-dtype", "fp32"]))
    assert (bf16["ns_dtype"], fp32["ns_dtype"]) == ("bf16", "fp32")
    a, b = quality.run_one(bf16), quality.run_one(fp32)
    assert a["final_val"] != b["final_val"]
    assert a["final_val"] == pytest.approx(b["final_val"], rel=0.01)
    old = {**BASE, **_run("muon", 1e-2, 0, 2.0)}  # no ns_dtype: written before the setting
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"runs": [old, {**old, "seed": 1, "ns_dtype": "bf16"}]}))
    quality.check_same(quality.load_runs([str(path)]), BASE)
    with pytest.raises(SystemExit):
        quality.check_same(quality.load_runs([str(path)]), {**BASE, "ns_dtype": "fp32"})
    assert "differ in ns_dtype (bf16 there, fp32 here)" in capsys.readouterr().err


@pytest.mark.parametrize("text, says", [("{", "not JSON"), ("[1]", "no 'runs' list"),
                                        ('{"runs": [{"lr": 1}]}', "run 0 lacks replicas")])
def test_unreadable_merge_file_is_one_line(quality, tmp_path, capsys, text, says):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(SystemExit) as e:
        quality.main(["--quick", "--merge", str(path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and says in err
    assert not (tmp_path / "out").exists()


def _fake_run(cfg: dict) -> dict:
    return {**cfg, "params": 1, "curve": [[cfg["steps"], 2.0]], "final_val": 2.0,
            "diverged": False, "identical": True, "seconds": 0.0, "tokens_per_replica": 1,
            "bytes_per_param_step": 4.0}


QUICK_ARGS = ["--quick", "--seeds", "1", "--strategies", "adamw", "--model", "tiny",
              "--batch", "2", "--eval-every", "5", "--eval-batches", "2",
              "--corpus-bytes", "1000", "--threads", "1"]


def test_merge_of_other_settings_is_refused_before_running(quality, tmp_path, capsys,
                                                           monkeypatch):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"runs": [{**BASE, **_run("adamw", 3e-3, 0, 1.5)}]}))
    ran = []
    monkeypatch.setattr(quality, "run_one", lambda cfg: ran.append(cfg) or _fake_run(cfg))
    with pytest.raises(SystemExit) as e:
        quality.main([*QUICK_ARGS, "--steps", "11", "--lrs", "1e-3", "--merge", str(path),
                      "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "differ in steps" in err
    assert not ran and not (tmp_path / "out").exists()


def test_finished_runs_are_written_when_a_later_step_fails(quality, tmp_path, capsys,
                                                           monkeypatch):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"runs": [{**BASE, **_run("adamw", 3e-3, 0, 1.5)}]}))
    monkeypatch.setattr(quality, "run_one", _fake_run)

    def broken(runs):
        raise RuntimeError("summary broke")
    monkeypatch.setattr(quality, "summarize", broken)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="summary broke"):
        quality.main([*QUICK_ARGS, "--steps", "10", "--lrs", "1e-3,1e-2", "--merge", str(path),
                      "--out", str(out)])
    runs = json.loads((out / "quality.json").read_text())["runs"]
    assert sorted(r["lr"] for r in runs) == [1e-3, 3e-3, 1e-2]

    # a run that fails mid-grid keeps the ones finished before it
    def second_fails(cfg):
        if cfg["lr"] == 1e-2:
            raise RuntimeError("run broke")
        return _fake_run(cfg)
    monkeypatch.setattr(quality, "run_one", second_fails)
    out2 = tmp_path / "out2"
    with pytest.raises(RuntimeError, match="run broke"):
        quality.main([*QUICK_ARGS, "--steps", "10", "--lrs", "1e-3,1e-2", "--out", str(out2)])
    assert [r["lr"] for r in json.loads((out2 / "quality.json").read_text())["runs"]] == [1e-3]
    assert "stopped after 1 of 2 runs" in capsys.readouterr().err


def test_budget_keeps_the_runs_finished_in_time(quality, tmp_path, capsys, monkeypatch):
    """--budget-s: no run starts after the deadline; each finished run is on disk at once."""
    clock = [0.0]
    monkeypatch.setattr(quality.time, "perf_counter", lambda: clock[0])
    seen_on_disk = []

    def ten_seconds(cfg):  # each run takes 10 s of the fake clock
        path = tmp_path / "out" / "quality.json"
        seen_on_disk.append(len(json.loads(path.read_text())["runs"]) if path.exists() else 0)
        clock[0] += 10.0
        return _fake_run(cfg)
    monkeypatch.setattr(quality, "run_one", ten_seconds)
    result = quality.main([*QUICK_ARGS, "--steps", "10", "--lrs", "1e-3,2e-3,4e-3,8e-3",
                           "--budget-s", "15", "--out", str(tmp_path / "out")])
    assert [r["lr"] for r in result["runs"]] == [1e-3, 2e-3]  # the third would start at 20 s
    assert seen_on_disk == [0, 1]  # the first run was written before the second began
    assert "2 of 4 runs did not finish in time" in capsys.readouterr().out


@pytest.mark.parametrize("budget", ["0", "-3", "nan"])
def test_bad_budget_is_one_line(quality, capsys, budget):
    with pytest.raises(SystemExit) as e:
        quality.main([*QUICK_ARGS, "--budget-s", budget])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--budget-s" in err


@pytest.mark.parametrize("device, says", [("cuda", "--device cuda: "), ("gpu", "invalid choice")])
def test_device_is_checked_up_front(quality, capsys, monkeypatch, device, says):
    monkeypatch.setattr(quality.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        quality.parse_args(["--quick", "--device", device])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and says in err


def test_merge_only_writes_the_merged_table_without_running(quality, tmp_path, capsys):
    one = [{**BASE, **_run("adamw", 1e-3, s, 2.0 + s)} for s in (0, 1)]
    two = [{**BASE, **_run("demo", 3e-4, s, 2.5)} for s in (0, 1)]
    paths = []
    for name, runs in (("a.json", one), ("b.json", two)):
        (tmp_path / name).write_text(json.dumps({"runs": runs}))
        paths += ["--merge", str(tmp_path / name)]
    out = tmp_path / "all"
    result = quality.main(["--merge-only", *paths, "--out", str(out)])
    rows = {r["strategy"]: r for r in result["summary"]}
    assert rows["adamw"]["val_mean"] == 2.5 and rows["demo"]["vs_adamw"] == 1.0
    assert result["settings"]["steps"] == 10 and result["settings"]["seeds"] == 2
    assert (out / "quality.csv").exists() and (out / "quality.png").exists()
    # the header names what was merged, with the merged runs' settings
    head = capsys.readouterr().out.splitlines()[0]
    assert head.startswith("merging 4 stored runs of 2 file(s), running none: tiny GPT, "
                           "10 steps, batch 2 per replica, replicas [2]")
    for argv in (["--merge-only"], ["--merge-only", "--merge", str(tmp_path / "empty.json")]):
        (tmp_path / "empty.json").write_text(json.dumps({"runs": []}))
        with pytest.raises(SystemExit) as e:
            quality.main([*argv, "--out", str(out)])
        assert e.value.code == 2 and "--merge" in capsys.readouterr().err


def _tiny_cfg(strategy: str) -> dict:
    return {"device": "cpu", "threads": 1, "corpus_bytes": 200_000, "model": "tiny",
            "strategy": strategy, "replicas": 2, "seed": 0, "steps": 4, "batch": 2,
            "lr": 3e-3, "warmup": 0.0, "schedule": "constant", "min_lr": 0.1,
            "eval_every": 4, "eval_batches": 2, "data": "random"}


def test_lookahead_prototype_without_look_ahead_is_plain_demo(quality, monkeypatch):
    """The Nesterov-style prototype hooks private stages of DeMoReplicator: with ``gain=None``
    it must reproduce the plain replicator bit for bit, and with the look-ahead it must send
    other coefficients (a different run), at the same bytes."""
    monkeypatch.setitem(quality.SETTINGS, "lookahead-off", quality.Setting(
        "the prototype selecting from the momentum itself", "demo-lookahead", "sgd", 1e-3,
        {"gain": None}))
    plain = quality.run_one(_tiny_cfg("demo"))
    off = quality.run_one(_tiny_cfg("lookahead-off"))
    nesterov = quality.run_one(_tiny_cfg("demo-nesterov"))
    assert off["curve"] == plain["curve"] and off["identical"]
    assert nesterov["identical"] and nesterov["curve"] != plain["curve"]
    assert nesterov["bytes_per_param_step"] == plain["bytes_per_param_step"]
    with pytest.raises(ValueError, match="runs eagerly"):
        quality.LookaheadDeMo(graphs=True)  # from benchmarks/prototypes.py


def test_overlapped_diloco_settings_run(quality):
    """An overlapped streaming setting builds and trains (an exchange applied ``tau`` steps
    after its launch); over one period of H=20 steps its four fragments together send every
    parameter once in fp32: 4 bytes per parameter, 0.2 per step (and a few header bytes)."""
    cfg = {**_tiny_cfg("diloco-f4-tau1"), "steps": 20, "eval_every": 20}
    run = quality.run_one(cfg)
    assert math.isfinite(run["final_val"])
    assert run["bytes_per_param_step"] == pytest.approx(4.0 / 20, rel=1e-3)  # + a small header


def test_keep_prototype_keeps_the_overlapped_steps(quality, monkeypatch):
    """The eager-style prototype: with ``tau = 0`` it is plain DiLoCo bit for bit; with
    ``tau = 4`` the sync launched after step 20 lands after step 24, where plain DiLoCo
    restarts both replicas from the same global parameters (identical) and the prototype
    keeps each replica's own 4 steps (not identical), at the same bytes."""
    monkeypatch.setitem(quality.SETTINGS, "keep-tau0", quality.Setting(
        "the prototype without overlap", "diloco-keep", "adamw", 1e-3,
        {"inner_steps": 20, "outer_lr": 1.0, "outer_momentum": 0.0}))
    cfg = {**_tiny_cfg("diloco-avg"), "steps": 24, "eval_every": 12}
    plain0 = quality.run_one(cfg)
    keep0 = quality.run_one({**cfg, "strategy": "keep-tau0"})
    assert keep0["curve"] == plain0["curve"]
    plain = quality.run_one({**cfg, "strategy": "diloco-tau4"})
    keep = quality.run_one({**cfg, "strategy": "diloco-tau4-keep"})
    assert plain["identical"] and not keep["identical"]
    assert keep["curve"][0] == plain["curve"][0] and keep["curve"][1] != plain["curve"][1]
    assert keep["bytes_per_param_step"] == plain["bytes_per_param_step"]


def test_first_seed_shifts_the_seeds_run(quality, capsys):
    args = quality.parse_args(["--quick", "--strategies", "demo", "--lrs", "1e-3",
                               "--seeds", "2", "--first-seed", "3"])
    assert sorted(c["seed"] for c in quality.configurations(args)) == [3, 4]
    with pytest.raises(SystemExit):
        quality.parse_args(["--quick", "--first-seed", "-1"])
    assert "--first-seed must be >= 0" in capsys.readouterr().err


def test_ratios_against_full_sync_muon(quality):
    runs = [_run("adamw", 1e-3, 0, 2.0), _run("muon", 1e-2, 0, 1.6), _run("muon", 3e-2, 0, 1.8),
            _run("muloco-h20-int4", 1e-2, 0, 1.7)]
    rows = {(r["replicas"], r["strategy"], r["lr"]): r for r in quality.summarize(runs)}
    assert rows[(2, "muloco-h20-int4", 1e-2)]["vs_muon"] == pytest.approx(1.7 / 1.6)
    assert rows[(2, "muloco-h20-int4", 1e-2)]["vs_adamw"] == pytest.approx(1.7 / 2.0)
    assert rows[(2, "adamw", 1e-3)]["vs_muon"] == pytest.approx(2.0 / 1.6)
    assert "vs muon" in quality.table(list(rows.values()))


@pytest.mark.parametrize("strategy", ["muloco-h20-f4-int4", "demo-ortho-k64", "demo-muon"])
def test_muon_family_settings_run(quality, strategy):
    """Muon-family settings build and train with optimizer "muon" (Muon on the hidden
    matrices); the orthogonalised DeMo sends topk values as int2, like DeMo."""
    run = quality.run_one(_tiny_cfg(strategy))
    assert math.isfinite(run["final_val"]) and run["identical"] in (True, False)
    setting = quality.SETTINGS[strategy]
    assert setting.optimizer == "muon"
    if setting.replicator == "demo":
        assert run["identical"]  # the decoded mean is the same on every replica
        assert 0 < run["bytes_per_param_step"] < 0.05


def test_each_row_against_full_sync_with_its_own_inner_optimizer_and_the_best(quality,
                                                                              tmp_path):
    runs = [_run("adamw", 1e-3, 0, 2.0), _run("adamw-b95-wd", 1e-3, 0, 1.9),
            _run("muon", 1e-2, 0, 1.6), _run("muon-wd", 1e-2, 0, 1.5),
            _run("sparseloco", 1e-2, 0, 1.65), _run("muloco-adamw", 1e-3, 0, 2.09)]
    runs[4]["received_per_param_step"] = 0.001
    rows = {r["strategy"]: r for r in quality.summarize(runs)}
    # Muon inner steps: against the best full-sync Muon (muon-wd); AdamW's against AdamW's
    assert rows["sparseloco"]["vs_same"] == pytest.approx(1.65 / 1.5)
    assert rows["sparseloco"]["ref_same"] == "muon-wd"
    assert rows["muloco-adamw"]["vs_same"] == pytest.approx(2.09 / 1.9)
    assert rows["muloco-adamw"]["ref_same"] == "adamw-b95-wd"
    assert rows["muloco-adamw"]["vs_best_full"] == pytest.approx(2.09 / 1.5)
    assert rows["sparseloco"]["received_per_param_step"] == pytest.approx(0.001)
    printed = quality.table(list(rows.values()))
    assert "vs same" in printed and "recv B/p/s" in printed
    quality.frontier_plot(list(rows.values()), tmp_path / "f.png", "t")
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_long_mode_is_the_mini_gpt_at_5000_steps_on_2_4_and_8_replicas(quality, capsys):
    args = quality.parse_args(["--long", "--strategies", "muon,sparseloco"])
    assert (args.model, args.steps, args.replicas) == ("mini", 5000, [2, 4, 8])
    with pytest.raises(SystemExit):
        quality.parse_args(["--long", "--quick"])
    assert "choose one" in capsys.readouterr().err


def test_low_rank_prototype_sends_rank_r_and_counts_its_factors(quality):
    """The low-rank prototype (benchmarks/prototypes.py): after one sync of plain averaging
    (outer lr 1.0) the global copy of every matrix moved by the mean of two rank-1 matrices
    (rank 2 at most), every replica restarted from it, what was not sent stays in the error
    feedback (sent + kept = the period's progress), and the bytes counted are the factors' and
    codes' a gather sends, not the fp32 stand-in exchange's."""
    from flexdemo import SimulatedReplicas
    from flexdemo.app.tasks import GPT, gpt_config

    cfg = gpt_config("tiny")
    torch.manual_seed(0)
    sim = SimulatedReplicas(lambda: GPT(cfg), lambda m, b: m(*b), replicas=2,
                            replicator="diloco-lowrank", optimizer="adamw", lr=3e-3,
                            replicator_kwargs={"inner_steps": 4, "approx_rank": 1,
                                               "outer_lr": 1.0, "outer_momentum": 0.0})
    reps = [o.replicators[0] for o in sim.optimizers]
    start = [g.clone() for g in reps[0].global_params]
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randint(0, 256, (2, 2, cfg.seq_len + 1), generator=gen)
        sim.step([(x[r, :, :-1], x[r, :, 1:]) for r in range(2)])
    assert sim.identical()
    moved = [s - g for s, g in zip(start, reps[0].global_params)]
    matrices = [m for m in moved if m.ndim == 2 and min(m.shape) > 2]
    assert matrices and all(torch.linalg.matrix_rank(m.double(), rtol=1e-5) <= 2
                            for m in matrices)
    assert any(torch.linalg.matrix_rank(m.double(), rtol=1e-5) == 2 for m in matrices)
    assert all(float(r.norm()) > 0 for r in reps[0]._resid)
    payload = reps[0]._payload
    params = sum(p.numel() for p in sim.models[0].parameters())
    assert payload < 0.1 * 4 * params
    assert sim.bytes_sent == [payload, payload] and sim.bytes_received == [payload, payload]
