"""``flexdemo bench --preset elastic``: options, and a real run in which a node is killed with
SIGKILL and restarted (torchft's lighthouse, gloo, unshaped loopback)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from dist_util import run_python

from flexdemo.app.bench.elastic import (
    analyse,
    pair_lines,
    pair_spread,
    report_lines,
    report_pairs,
)
from flexdemo.app.bench.run import BenchError, bench_options

pytest.importorskip("torchft", reason="the elastic preset runs on torchft (pip install "
                                      "'flexdemo[ft]')")
pytest.importorskip("matplotlib", reason="the elastic preset draws a plot with matplotlib")

PNG = b"\x89PNG\r\n\x1a\n"


def test_elastic_options():
    o = bench_options(preset="elastic")
    assert (o.strategies, o.bandwidths, o.steps) == (["flexdemo"], ["100mbit"], 120)
    assert (o.kill_at, o.restart_at) == (40, 70)
    short = bench_options(preset="elastic", steps=60)  # the defaults scale down to fit
    assert short.kill_at < short.restart_at < 60
    assert bench_options(preset="elastic", kill_at=5, restart_at=9).restart_at == 9
    assert (o.repeat, bench_options(preset="elastic", repeat=5).repeat) == (1, 5)


@pytest.mark.parametrize("kwargs, message", [
    ({"kill_at": 5}, "add --preset elastic"),
    ({"repeat": 3}, "add --preset elastic"),
    ({"preset": "elastic", "strategies": "flexdemo,hsdp-adamw"}, "one strategy at one"),
    ({"preset": "elastic", "strategies": "demo-dp"}, "use --ranks-per-node 1"),
    ({"preset": "elastic", "nodes": 1}, "--nodes 2 or more"),
    ({"preset": "elastic", "kill_at": 50, "restart_at": 50}, "--kill-at < --restart-at"),
])
def test_elastic_bad_options_are_one_line(kwargs, message):
    with pytest.raises(BenchError) as e:
        bench_options(**kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


def _recorded(joiner_from: int) -> tuple[list[dict], dict]:
    """A plain run's metrics and an elastic run's record as the bench reads them: 30 steps,
    node 1 killed at node 0's step 10 and restarted at step 18; its first step is
    ``joiner_from``."""
    plain = [{"step": s, "step_seconds": 0.5, "cpu_seconds": 0.4, "time": 50 + 0.5 * s,
              "loss": 3.0 - s / 30} for s in range(1, 31)]
    t, node0 = 100.0, []
    for s in range(1, 31):
        t += 3.5 if s == 11 else 0.52  # the survivors wait out the heartbeat once
        node0.append({"step": s, "step_seconds": 0.52, "cpu_seconds": 0.42, "time": t,
                      "quorum_seconds": 0.005, "commit_seconds": 0.003,
                      "snapshot_seconds": 0.002, "failed_commits": 0, "loss": 3.0 - s / 30,
                      "replicas": 2 if s <= 10 or s >= joiner_from else 1})
    times = {r["step"]: r["time"] for r in node0}
    joiner = [{"step": s, "step_seconds": 1.5 if s == joiner_from else 0.52,
               "time": times.get(s, t + s), "loss": 3.0 - s / 30}
              for s in range(joiner_from, 31)]
    threads = lambda ft, main: {"python": main, "torchft-manager": ft}  # noqa: E731
    run = {"events": {"kill": {"time": times[10] + 0.1, "survivor_step": 10},
                      "restart": {"time": times[18] + 0.1, "survivor_step": 18},
                      "cpu_from": {"step": 6, "threads": threads(0.1, 5.0)},
                      "cpu_to": {"step": 9, "threads": threads(0.13, 6.2)}},
           "metrics": {"node0": node0, "node1": node0[:10], "node1-restart": joiner},
           "summaries": {"node0": {"val_loss": 2.5}, "node1-restart": {"val_loss": 2.5}}}
    return plain, run


def test_the_figures_of_a_recorded_run():
    """analyse and report_lines on a run's metrics: the overheads over steps 6-9 (before the
    kill), torchft's threads' share, the survivors' and the joiner's times, the ending."""
    o = SimpleNamespace(nodes=2, kill_at=10)
    plain, run = _recorded(joiner_from=24)
    f = analyse(o, plain, run)
    assert f["steps_window"] == [6, 9]
    assert f["overhead"] == pytest.approx(0.04) and f["cpu_overhead"] == pytest.approx(0.05)
    assert f["ft_share_of_step"] == pytest.approx(0.010 / 0.52)
    assert f["ft_threads_cpu_seconds"] == pytest.approx(0.01)
    assert f["ft_threads_share"] == pytest.approx(0.03 / 1.23)
    assert (f["survivors_resume_step"], f["undone_steps"]) == (11, 0)
    assert f["survivors_resume_seconds"] == pytest.approx(3.4)
    assert f["healed"] and f["joiner_first_step"] == 24 and f["joiner_first_step_seconds"] == 1.5
    assert f["replicas_identical"]
    text = "\n".join(report_lines(o, {"val_loss": 2.4}, f))
    assert "fault tolerance costs +4.0% per step (steps 6-9, before the kill)" in text
    assert "it costs +5.0% per step (400 ms -> 420 ms)" in text
    assert "committed step 11 without it 3.4 s later; 0 step(s) undone" in text
    assert "committed step 24 with the survivors" in text and "to the bit" in text
    late = analyse(o, *_recorded(joiner_from=1))  # it began alone: nothing to heal from
    assert not late["healed"]
    assert "raise --steps or lower --restart-at" in "\n".join(report_lines(o, {}, late))


def _pair(plain: float, elastic: float, cpu: float) -> dict:
    return {"plain_step_seconds": plain, "elastic_step_seconds": elastic,
            "overhead": elastic / plain - 1, "cpu_overhead": cpu, "ft_threads_share": 0.03,
            "ft_share_of_step": 0.04}


def test_pairs_report_the_median_and_the_range_of_the_overheads():
    """--repeat: each pair's figures, their median and range; a failed pair is shown and left
    out of the medians."""
    analysed = [{"figures": _pair(0.5, 0.55, 0.02), "failure": None},
                {"figures": {}, "failure": "node 1 exited 1"},
                {"figures": _pair(0.5, 0.49, -0.01), "failure": None},
                {"figures": _pair(0.4, 0.41, 0.01), "failure": None}]
    spread = pair_spread([a["figures"] for a in analysed])
    o = spread["overhead"]
    assert o["pairs"] == 3 and o["min"] == pytest.approx(-0.02) and o["max"] == pytest.approx(0.1)
    assert o["median"] == pytest.approx(0.025)
    assert spread["cpu_overhead"]["median"] == pytest.approx(0.01)
    text = "\n".join(pair_lines(analysed, spread))
    assert "failed: node 1 exited 1" in text and "+2.5% per step at the median" in text
    assert "(-2.0% to +10.0%)" in text and "in CPU time +1.0%" in text


def test_a_failed_first_pair_still_reports_the_next_pair_and_the_table(tmp_path):
    """--repeat whose first elastic run failed: the failure, the first successful pair's
    report and plot, and the pairs' table (the failure a row of it)."""
    o = SimpleNamespace(nodes=2, kill_at=10, ranks_per_node=2, strategies=["demo"],
                        bandwidths=["100mbit"])
    plain, run = _recorded(joiner_from=24)
    figures = analyse(o, plain, run)
    pairs = [({"run_dir": "p1", "val_loss": 2.4}, {"failure": "node 1 exited 1", "out": "e1"}),
             ({"run_dir": "p2", "val_loss": 2.4}, {**run, "failure": None, "out": "e2"})]
    analysed = [{"plain_run_dir": "p1", "elastic_run_dir": "e1", "failure": "node 1 exited 1",
                 "figures": {}},
                {"plain_run_dir": "p2", "elastic_run_dir": "e2", "failure": None,
                 "figures": figures}]
    lines: list[str] = []
    report_pairs(o, tmp_path, pairs, analysed, [[], plain], lines.append)
    text = "\n".join(lines)
    assert "elastic run of pair 1 failed: node 1 exited 1 (logs: e1)" in text
    assert "pair 2, the first whose elastic run succeeded:" in text
    assert "fault tolerance costs +4.0% per step (steps 6-9, before the kill)" in text
    assert "\n1      failed: node 1 exited 1" in text and "+4.0% per step at the median" in text
    assert (tmp_path / "elastic.png").read_bytes().startswith(PNG)
    saved = json.loads((tmp_path / "elastic.json").read_text())
    assert saved["elastic"]["figures"]["overhead"] == pytest.approx(0.04)
    assert [p["failure"] for p in saved["pairs"]] == ["node 1 exited 1", None]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_killed_node_leaves_and_heals_back(tmp_path):
    """The command as a user runs it: the survivors go on alone after the kill, the restarted
    node heals to their step and trains with them, and both end with the same parameters."""
    out = tmp_path / "el"
    # `python -m flexdemo bench ...`, forked from the preloaded fork server (its nodes' ranks
    # are the bench's own `python -m flexdemo train` processes)
    cmd = ["-m", "flexdemo", "bench", "--preset", "elastic", "--unshaped",
           "--ranks-per-node", "1", "--steps", "100", "--kill-at", "10", "--restart-at", "18",
           "--timeout", "300", "--out", str(out), "train.eval_every=30",
           "train.eval_batches=2"]
    p = run_python(cmd, timeout=600, cwd=Path(__file__).parent.parent)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "fault tolerance costs" in p.stdout and "to the bit" in p.stdout, p.stdout[-2000:]
    data = json.loads((out / "elastic.json").read_text())
    f = data["elastic"]["figures"]
    assert f["healed"] and f["replicas_identical"], f
    own = f["quorum_seconds"] + f["commit_seconds"] + f["snapshot_seconds"]
    assert f["ft_share_of_step"] == pytest.approx(own / f["elastic_step_seconds"])
    assert 0 < f["ft_share_of_step"] < 1
    assert "the quorum, the vote and the undo copy take" in p.stdout
    assert f["cpu_overhead"] == pytest.approx(f["elastic_cpu_seconds"] / f["plain_cpu_seconds"]
                                              - 1)
    assert f["plain_cpu_seconds"] > 0 and "in CPU time (rank 0" in p.stdout
    if sys.platform == "linux":  # torchft's threads' CPU, read from /proc in the run itself
        assert 0 < f["ft_threads_share"] < 1 and "torchft's threads" in p.stdout, f
    assert f["survivors_resume_step"] > f["kill_survivor_step"] >= 10
    assert f["joiner_first_step"] > f["restart_survivor_step"] >= 18
    node0 = data["elastic"]["metrics"]["node0"]
    steps = [r["step"] for r in node0]  # a node that starts late heals to its peer's step
    assert steps == list(range(steps[0], 101)) and steps[0] < f["kill_survivor_step"], steps
    # each line's replicas are its own step's: DeMo sends bytes exactly when a peer is there
    assert all((r["bytes_sent"] > 0) == (r["replicas"] > 1) for r in node0), \
        [(r["step"], r["replicas"], r["bytes_sent"]) for r in node0]
    by_step = {r["step"]: r["replicas"] for r in node0}
    assert by_step[f["kill_survivor_step"]] == 2  # both, until the kill
    after = [by_step[s] for s in steps if s > f["kill_survivor_step"]]
    alone = after.index(1)  # the survivors went on without the killed node ...
    assert 2 in after[alone:] and after[-1] == 2, after  # ... and it came back
    assert (out / "elastic.png").read_bytes()[:8] == PNG
