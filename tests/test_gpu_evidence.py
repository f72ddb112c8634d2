"""benchmarks/gpu_evidence.py, the first command on a lent GPU, kept working on the CPU: its
``--smoke`` run writes every table, the JSON and the plots, and a spent budget stops it cleanly."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_util import run_python

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_evidence.py"
STRATEGIES = ["adamw", "muon", "demo", "demo-delayed", "demo-1group", "demo-muon", "muloco",
              "sparseloco"]
QUALITY = ["adamw", "muon", "muloco", "demo-muon"]


def _run(out: Path, *extra: str, timeout: float = 150) -> subprocess.CompletedProcess:
    """The script as a GPU user runs it: ``PYTHONPATH=src`` from the repository root (forked
    from the preloaded fork server, dist_util.run_python)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""}
    return run_python([str(SCRIPT), "--smoke", "--out", str(out), *extra], cwd=ROOT, env=env,
                      timeout=timeout)


@pytest.mark.multiprocess
def test_smoke_writes_every_table_json_and_plot(tmp_path):
    # a budget a loaded machine cannot spend (the smoke run's own 40 s is a time box: it took
    # 15-45 s here, and its cuts are tested below)
    proc = _run(tmp_path, "--budget-s", "250", timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "evidence.json").read_text())
    assert data["device"] == "cpu" and data["smoke"] and data["budget_s"] == 250

    step = data["step_cost"]
    assert step["complete"] and step["cells_done"] == step["cells_planned"] == 2 * len(STRATEGIES)
    assert list(step["strategies"]) == STRATEGIES
    for layout in ("whole", "1/8 rows"):
        rows = {r["strategy"]: r for r in step["rows"] if r["layout"] == layout}
        assert list(rows) == STRATEGIES, layout
        for r in rows.values():
            assert "error" not in r and r["ms_median"] > 0 and r["pct_fwd_bwd"] > 0, r
            assert r["steps_timed"] == r["steps_planned"], r
            assert "peak_P" not in r  # no allocator figures on the CPU
            assert r["state_P"] >= 0 and r["workspace_P"] >= 0  # exact counts everywhere
    shards = {r["strategy"]: r for r in step["rows"] if r["layout"] == "1/8 rows"}
    whole = {r["strategy"]: r for r in step["rows"] if r["layout"] == "whole"}
    assert all(shards[k]["local_params"] < whole[k]["local_params"] for k in STRATEGIES)
    assert abs(whole["adamw"]["state_P"] - 2.0) < 0.01  # AdamW's two moments, counted exactly
    for key in ("muloco", "sparseloco"):  # DiLoCo: timed over a sync interval, one sync in it
        assert whole[key]["sync_every"] == 30 and whole[key]["mean_has_sync"]
    assert step["models"][0]["fwd_bwd_ms"] > 0 and step["models"][0]["fwd_bwd_peak_P"] is None

    table = (tmp_path / "step_cost.md").read_text()
    assert "One process is one replica" in table
    for key in STRATEGIES:
        line = next(x for x in table.splitlines() if x.startswith(f"| {key} (`"))
        ms = float(line.split("|")[2])
        assert ms > 0, line
        assert "not reached" not in line and "error" not in line, line
    memory = (tmp_path / "memory.md").read_text()
    assert memory.count("n/a (CPU)") == 4 * len(STRATEGIES)

    q = data["quality"]
    assert [r["strategy"] for r in q["rows"]] == QUALITY and q["replicas"] == 2
    for r in q["rows"]:
        assert r["stopped"] == "done" and r["steps_reached"] == r["steps_planned"] == 10, r
        assert math.isfinite(r["final_val"]) and r["final_val"] < r["curve"][0][1], r
        assert [s for s, _ in r["curve"]] == [0, 5, 10] and r["lr"] > 0 and r["lr_source"]
    sent = {r["strategy"]: r["bytes_per_param_step"] for r in q["rows"]}
    assert sent["adamw"] == pytest.approx(4.0, rel=1e-3) and 0 < sent["demo-muon"] < 0.1
    quality_md = (tmp_path / "quality.md").read_text()
    assert all(f"| {k} | `" in quality_md for k in QUALITY)

    for name in ("step_cost.md", "memory.md", "quality.md"):  # printed too
        assert (tmp_path / name).read_text().splitlines()[0] in proc.stdout
    if importlib.util.find_spec("matplotlib"):
        assert sorted(data["plots"]) == ["quality_loss.png", "step_cost.png"]
        assert all((tmp_path / p).stat().st_size > 1000 for p in data["plots"])
    cells = 2 * len(STRATEGIES)
    assert f"{cells} of {cells} cells" in proc.stdout and "0 error(s)" in proc.stdout


@pytest.mark.multiprocess
def test_a_spent_budget_stops_every_part_cleanly(tmp_path):
    """A budget spent by the start-up (a microsecond: a process forked with torch imported
    reached the first model within 0.5 s): nothing is timed or trained, every part says so,
    and the run still writes its tables and JSON and exits 0."""
    proc = _run(tmp_path, "--budget-s", "1e-6", timeout=90)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "evidence.json").read_text())
    assert data["step_cost"]["cells_done"] == 0 and not data["step_cost"]["complete"]
    assert [r["stopped"] for r in data["quality"]["rows"]] == ["not reached"] * len(QUALITY)
    assert "tiny: not reached" in (tmp_path / "step_cost.md").read_text()
    assert "not reached" in (tmp_path / "quality.md").read_text()
    assert "cut short" in proc.stdout


def test_cuda_without_a_gpu_is_one_line(capsys, monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_evidence", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_evidence", module)  # its dataclasses look it up
    spec.loader.exec_module(module)
    monkeypatch.setattr(module.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        module.main(["--device", "cuda", "--out", str(tmp_path / "o")])
    assert e.value.code == 2 and "no CUDA device is available" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
