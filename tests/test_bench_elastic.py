"""``flexdemo bench --preset elastic``: options, and a real run in which a node is killed with
SIGKILL and restarted (torchft's lighthouse, gloo, unshaped loopback)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from dist_util import run_python

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


@pytest.mark.parametrize("kwargs, message", [
    ({"kill_at": 5}, "add --preset elastic"),
    ({"preset": "elastic", "strategies": "flexdemo,hsdp-adamw"}, "one strategy at one"),
    ({"preset": "elastic", "strategies": "demo-dp"}, "use --ranks-per-node 1"),
    ({"preset": "elastic", "nodes": 1}, "--nodes 2 or more"),
    ({"preset": "elastic", "kill_at": 50, "restart_at": 50}, "--kill-at < --restart-at"),
])
def test_elastic_bad_options_are_one_line(kwargs, message):
    with pytest.raises(BenchError) as e:
        bench_options(**kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


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
