"""The preset harness (benchmarks/presets.py): its search on hand-made runs (first grids, one
lr beyond an edge that holds the best, a third seed where a gap is under a point), its table,
and that every row runs the library's replicator and optimizer by the names prepare() takes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def presets():
    names = ("quality", "presets")
    for name in names:
        sys.modules.pop(name, None)
    spec = importlib.util.spec_from_file_location("presets", ROOT / "benchmarks" / "presets.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["presets"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        for name in names:
            sys.modules.pop(name, None)


def _run(row: str, lr: float, seed: int, final: float) -> dict:
    return {"replicas": 8, "strategy": row, "lr": lr, "seed": seed, "final_val": final,
            "curve": [[900, final]], "seconds": 1.0, "bytes_per_param_step": 0.01,
            "tokens_per_replica": 100, "tokens_per_param": 22.0}


def _grid(presets, row: str, finals: list[float], seeds=(0, 1)) -> list[dict]:
    return [_run(row, lr, s, f) for lr, f in zip(presets.first_grid(row), finals)
            for s in seeds]


def test_first_grids_then_an_edge_extended_then_a_third_seed(presets):
    rows = ["full/muon", "none/muon", "muloco/muon"]
    need = presets.wanted([], rows, extend=2)
    assert len(need) == 3 * 3 * 2  # three lrs, two seeds each
    assert {lr for r, lr, _ in need if r == "full/muon"} == {0.01, 0.02, 0.04}
    runs = (_grid(presets, "full/muon", [1.50, 1.45, 1.47])         # best inside
            + _grid(presets, "none/muon", [1.90, 1.95, 2.00])        # best at the low edge
            + _grid(presets, "muloco/muon", [1.60, 1.55, 1.58]))     # inside, +6.9%
    need = presets.wanted(runs, rows, extend=2)
    assert sorted(need) == [("none/muon", 0.0025, 0), ("none/muon", 0.0025, 1)]
    runs += [_run("none/muon", 0.0025, s, 1.96) for s in (0, 1)]     # now inside
    assert presets.wanted(runs, rows, extend=2) == []
    # a gap under one point against the same full sync: a third seed at the best lr and its
    # neighbours
    runs = [r for r in runs if r["strategy"] != "muloco/muon"]
    runs += _grid(presets, "muloco/muon", [1.50, 1.455, 1.49])       # +0.3%
    need = presets.wanted(runs, rows, extend=2)
    assert sorted(need) == [("muloco/muon", lr, 2) for lr in (0.005, 0.01, 0.02)]


def test_an_edge_is_extended_at_most_extend_times(presets):
    runs = _grid(presets, "full/adamw", [1.9, 1.8, 1.7])            # best at the high edge
    assert presets.wanted(runs, ["full/adamw"], extend=0) == []
    need = presets.wanted(runs, ["full/adamw"], extend=1)
    assert sorted(need) == [("full/adamw", 0.016, 0), ("full/adamw", 0.016, 1)]
    runs += [_run("full/adamw", 0.016, s, 1.6) for s in (0, 1)]
    assert presets.wanted(runs, ["full/adamw"], extend=1) == []


def test_the_table_states_each_gap_and_marks_an_edge(presets):
    runs = (_grid(presets, "full/muon", [1.50, 1.40, 1.47])
            + _grid(presets, "none/muon", [1.80, 1.75, 1.70])
            + _grid(presets, "muloco/muon", [1.60, 1.54, 1.58]))
    rows = presets.quality.summarize(runs)
    text = presets.markdown(rows, "python benchmarks/presets.py", "2026-12-07")
    line = next(x for x in text.splitlines() if x.startswith("| `muloco/muon`"))
    assert '`prepare(model, "muloco", "muon")`' in line
    assert "+10.0%" in line and "-9.4%" in line  # vs full sync (1.54/1.40), vs no sync
    edge = next(x for x in text.splitlines() if x.startswith("| `none/muon`"))
    assert "0.02 !" in edge


def test_every_row_runs_the_library_preset_it_names(presets):
    from flexdemo.replicate import REPLICATORS
    settings = presets.quality.SETTINGS
    for row in presets.GUESS:
        replicator, optimizer = row.split("/")
        s = settings[row]
        assert s.optimizer == optimizer and s.replicator in REPLICATORS, row
        # a row named by a replicator runs its defaults; a row with settings of its own says
        # them in its name and in its prepare() call
        assert (s.replicator == replicator) == (not s.replicator_kwargs), row
    assert presets.prepare_call("muloco-int4-h150/muon") == (
        'prepare(model, "muloco-int4", "muon", replicator_kwargs={"inner_steps": 150})')
    assert presets.prepare_call("muloco/adamw") == (
        'prepare(model, "muloco", "adamw", weight_decay=0.1, optimizer_kwargs={"betas": '
        '(0.9, 0.95)})')
    tuned = settings["full/adamw"].optimizer_kwargs
    assert tuned == {"weight_decay": 0.1, "base_kwargs": {"betas": (0.9, 0.95)}}
