"""The torchft lighthouse lost and restarted, and torchft's logs: real processes, a real
lighthouse binary, real SIGKILLs (helpers shared with tests/test_elastic.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_elastic import (
    WAIT,
    Lighthouse,
    _final,
    _metrics,
    _no_torchft_noise,
    _ok,
    _progress,
    _same,
    _train,
    _wait,
    _worker,
    procs,  # noqa: F401 - the fixture
)

from flexdemo.app.train.preempt import PREEMPTED_EXIT_CODE
from flexdemo.checkpoint import check_checkpoint

pytest.importorskip("torchft")


def _until(what: str, done, running: list, timeout: float = WAIT) -> None:
    """Wait (bounded) until ``done()``, while every process of ``running`` runs."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        assert all(p.poll() is None for p in running), f"a process ended before {what}"
        time.sleep(0.05)


def _at(tmp: Path, out: str, step: int) -> bool:
    """Whether group ``out`` has committed its step ``step`` (counted from 0)."""
    path = tmp / out / "progress0"
    return path.exists() and (step, 2, 1) in _progress(tmp, out)


@pytest.mark.multiprocess
def test_a_lighthouse_restarted_on_its_address_loses_no_step(tmp_path, procs):  # noqa: F811
    """A and B1 (min_replicas 2); B1 is SIGKILLed in step 3 and B2 joins in its place (a
    second quorum id); both hold before step 6, the lighthouse is SIGKILLed, the groups go on
    and find it gone, and it is restarted on the same address 1.5 s later, within the quorum
    timeout: it numbers its quorums from 1 again, and every step from 6 on is committed once
    by both groups, which end bitwise equal. B2 runs with torchft's logs in full (verbose), A
    with the default (no torchft INFO line, no traceback); each says the lighthouse was lost,
    then back."""
    lh = Lighthouse(2, tmp_path / "lighthouse-1.log")
    go = tmp_path / "go"
    common = ["--replicator", "demo", "--steps", "9", "--timeout", "30", "--min-replicas", "2"]
    try:
        a = _worker(procs, tmp_path, lh.url, "A", "A", *common, "--hold", f"6:{go}")
        b1 = _worker(procs, tmp_path, lh.url, "B", "B1", *common, "--die-at", "3")
        assert _wait(b1, tmp_path, "B1") == -9
        b2 = _worker(procs, tmp_path, lh.url, "B", "B2", *common, "--hold", f"6:{go}",
                     "--verbose")
        _until("step 5", lambda: _at(tmp_path, "A", 5) and _at(tmp_path, "B2", 5), [a, b2])
        lh.stop()
        go.write_text("go\n")
        time.sleep(1.5)
        lh = Lighthouse(2, tmp_path / "lighthouse-2.log", port=lh.port)
        _ok(a, tmp_path, "A")
        _ok(b2, tmp_path, "B2")
    finally:
        lh.stop()
    for out, rid in (("A", "A"), ("B2", "B")):
        rows = [row for row in _progress(tmp_path, out) if row[0] >= 6]
        assert rows == [(s, 2, 1) for s in range(6, 9)], rows
        log = (tmp_path / f"{out}.log").read_text()
        assert f"replica group {rid!r} lost the torchft lighthouse at {lh.url}" in log, log
        assert "answers again; going on" in log, log[-3000:]
    fa, fb = _final(tmp_path, "A"), _final(tmp_path, "B2")
    assert fa["step"] == fb["step"] == 9
    assert _same(fa["params"], fb["params"])
    _no_torchft_noise((tmp_path / "A.log").read_text())
    assert "[INFO]" in (tmp_path / "B2.log").read_text()  # verbose: torchft's own lines


@pytest.mark.multiprocess
def test_a_lost_lighthouse_saves_every_group_and_exits_3(tmp_path, procs):  # noqa: F811
    """`flexdemo train` as groups A and B; the lighthouse is SIGKILLed and never comes back:
    after quorum_timeout (3 s) each group saves its last committed step (every logged step
    covered, an intact checkpoint that a resume picks) and exits 3 with one line that names the lost
    lighthouse; no traceback, no torchft INFO line."""
    lh = Lighthouse(2, tmp_path / "lighthouse.log")
    try:
        runs = {rid: _train(procs, tmp_path, lh.url, rid, rid, 200, quorum_timeout=3)
                for rid in ("A", "B")}
        _until("2 logged steps", lambda: all(len(_metrics(tmp_path, r)) >= 2 for r in runs),
               list(runs.values()))
    finally:
        lh.stop()
    for rid, p in runs.items():
        rc = _wait(p, tmp_path, rid)
        log = (tmp_path / f"{rid}.log").read_text()
        assert rc == PREEMPTED_EXIT_CODE, f"{rid} exited with {rc}:\n{log[-3000:]}"
        lines = [x for x in log.splitlines() if x.startswith("flexdemo train: ")]
        steps = [r["step"] for r in _metrics(tmp_path, rid)]
        last = steps[-1]
        saved = tmp_path / rid / "checkpoints" / f"step_{last:06d}"
        assert steps == list(range(1, last + 1)), steps
        assert lines == [
            f"flexdemo train: lighthouse lost: replica group {rid!r} lost the torchft "
            f"lighthouse at {lh.url}: it did not answer for 3 s (quorum_timeout); saved step "
            f"{last} to {saved}; start the lighthouse again at its address and continue with "
            f"resume=true (exit code 3)"], log[-3000:]
        status = check_checkpoint(saved)  # what a resume picks: intact, at that step
        assert (status.state, status.step) == ("intact", last), status
        _no_torchft_noise(log)
