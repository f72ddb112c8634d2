"""Elastic, fault-tolerant replication on torchft: real processes, a real lighthouse, real kills.

Every replica group is one process (tests/elastic_workers.py) on CPU and gloo; the lighthouse
is torchft's on 127.0.0.1 (flexdemo.ft.lighthouse.launcher). Every wait is bounded. The processes
that run Python are forked from the preloaded fork server (tests/dist_util.py's ``Forked``):
real processes, killed with real signals, without 4 s of imports each.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
from dist_util import Forked, run_python

import flexdemo
from flexdemo.ft import lighthouse
from flexdemo.ft.config import TorchFTMissingError
from flexdemo.tools.ranks import free_port
from flexdemo.transport import Pending, Transport

pytest.importorskip("torchft")

HERE = Path(__file__).parent
# the workers import this checkout's flexdemo (not whichever one is installed)
PYTHONPATH = os.pathsep.join([str(HERE), str(HERE.parent / "src")])
WAIT = 180  # seconds any one process may run


def _lighthouse_launcher() -> list[str]:
    try:
        return lighthouse.launcher()
    except TorchFTMissingError:
        pytest.skip("neither torchft's extension module nor its torchft_lighthouse binary is "
                    "installed")


def _listening_port(pid: int) -> int | None:
    """The TCP port that process ``pid`` listens on (Linux's /proc), None while it listens on
    none."""
    try:
        sockets = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed meanwhile
                continue
            if link.startswith("socket:["):
                sockets.add(link[len("socket:["):-1])
        for table in ("tcp", "tcp6"):
            with open(f"/proc/{pid}/net/{table}") as f:
                for row in f.read().splitlines()[1:]:
                    cols = row.split()
                    if cols[3] == "0A" and cols[9] in sockets:  # LISTEN, one of its sockets
                        return int(cols[1].rsplit(":", 1)[1], 16)
    except OSError:  # it exited
        return None
    return None


class Lighthouse:
    """torchft's lighthouse on 127.0.0.1 and a port of its own choice, or ``port`` (stopped by
    :meth:`stop`). A group counts as dead after 3 s without a heartbeat: long enough for a
    loaded machine.

    It is torchft's ``lighthouse_main`` (what the wheel's ``torchft_lighthouse`` script runs)
    in a Python that loads torchft's extension alone (``lighthouse.launcher()``, as `flexdemo
    lighthouse` and the elastic bench run it); the wheel's script imports torch first, about
    1.5 s of CPU, and on the loaded 2-core machine its lighthouse once took over the 30 s
    bound to listen. ``cli``: through `flexdemo lighthouse` itself (forked,
    :class:`dist_util.Forked`). It binds port 0, and the
    port is read from /proc: no other process can take the port between its choice and the
    bind (the lighthouse does not exit when its port is taken: it spins, silent)."""

    def __init__(self, min_replicas: int, log: Path, cli: bool = False,
                 port: int | None = None) -> None:
        launcher = _lighthouse_launcher()  # (skips without it)
        flags = ["--bind", f"127.0.0.1:{port or 0}", "--min_replicas", str(min_replicas),
                 "--join_timeout_ms", "2000", "--heartbeat_timeout_ms", "3000",
                 "--quorum_tick_ms", "50"]
        self._log = None
        if cli:
            self.proc: subprocess.Popen | Forked = Forked(
                ["-m", "flexdemo", "lighthouse", *flags], stdout=log)
        else:
            self._log = open(log, "w")
            self.proc = subprocess.Popen([*launcher, *flags], stdout=self._log,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            found = _listening_port(self.proc.pid) if port is None else port
            try:
                if found is None:
                    raise OSError("not listening yet")
                socket.create_connection(("127.0.0.1", found), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"the lighthouse did not start; see {log}") from None
                time.sleep(0.05)
        self.port = found
        self.url = f"http://127.0.0.1:{found}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        if self._log is not None:
            self._log.close()


@pytest.fixture
def procs():
    started: list[Forked] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)


def _worker(procs: list, tmp: Path, url: str, rid: str, out: str, *args: str,
            log: str | None = None) -> Forked:
    """``python -m elastic_workers ...`` as replica group ``rid``, writing to ``tmp/out``;
    its output in ``tmp/{log or out}.log``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=PYTHONPATH)
    p = Forked(["-m", "elastic_workers", "--lighthouse", url, "--replica-id", rid, "--out",
                str(tmp / out), *args], env=env, cwd=HERE, stdout=tmp / f"{log or out}.log")
    procs.append(p)
    return p


def _group(procs: list, tmp: Path, url: str, rid: str, out: str, ranks: int,
           *args: str) -> list[tuple[Forked, str]]:
    """One replica group of ``ranks`` processes (torchrun's variables, its own store port)."""
    port, group = free_port(), []
    for r in range(ranks):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=PYTHONPATH, RANK=str(r),
                   LOCAL_RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        name = f"{out}-r{r}"
        p = Forked(["-m", "elastic_workers", "--lighthouse", url, "--replica-id", rid,
                    "--out", str(tmp / out), *args], env=env, cwd=HERE,
                   stdout=tmp / f"{name}.log")
        procs.append(p)
        group.append((p, name))
    return group


def _wait(p: Forked, tmp: Path, name: str) -> int:
    try:
        return p.wait(timeout=WAIT)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(timeout=30)
        raise AssertionError(f"{name} did not finish within {WAIT} s; log:\n"
                             f"{(tmp / f'{name}.log').read_text()[-3000:]}") from None


def _ok(p: Forked, tmp: Path, name: str) -> None:
    rc = _wait(p, tmp, name)
    assert rc == 0, f"{name} exited with {rc}; log:\n{(tmp / f'{name}.log').read_text()[-3000:]}"


def _progress(tmp: Path, out: str, rank: int = 0) -> list[tuple[int, int, int]]:
    rows = [line.split() for line in (tmp / out / f"progress{rank}").read_text().splitlines()]
    return [tuple(map(int, row[:3])) for row in rows]


def _until_alone(tmp: Path, out: str, rank: int = 0, groups: int = 1) -> None:
    """Wait (bounded) until ``out`` has committed a step with ``groups`` groups: the survivors
    went on without the killed group (then it may restart)."""
    deadline = time.monotonic() + WAIT
    path = tmp / out / f"progress{rank}"
    while not (path.exists() and any(n == groups and c for _, n, c in _progress(tmp, out, rank))):
        assert time.monotonic() < deadline, f"{out} did not go on with {groups} group(s)"
        time.sleep(0.1)


def _final(tmp: Path, out: str, rank: int = 0) -> dict:
    return torch.load(tmp / out / f"final{rank}.pt")


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _no_torchft_noise(log: str) -> None:
    """torchft's logs by default: no INFO line (its Rust side's or its Python loggers'), no
    traceback, each of its errors as our one line."""
    assert "[INFO]" not in log and " INFO " not in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    raw = [x for x in log.splitlines() if "got exception" in x
           and not x.startswith("flexdemo: torchft error: ")]
    assert not raw, raw


def _kill_and_restart(tmp: Path, procs: list, replicator: str, join: int,
                      *extra: str) -> None:
    """A and B1 start together, B1 is killed (SIGKILL) in step 5, A goes on alone and waits at
    step ``join`` for B2, which restarts afresh and heals from A; both train 15 steps. The
    survivor's and the joiner's logs hold none of torchft's INFO lines or tracebacks (A's step
    5 failed in torchft's collectives: its error is one line)."""
    lh = Lighthouse(1, tmp / "lighthouse.log")
    try:
        ready_a = tmp / "a-ready"
        ready1, ready2 = tmp / "b1-ready", tmp / "b2-ready"
        common = ["--replicator", replicator, "--steps", "15", "--timeout", "30", *extra]
        a = _worker(procs, tmp, lh.url, "A", "A", *common, "--hold", f"0:{ready1}",
                    "--hold", f"{join}:{ready2}", "--ready-file", str(ready_a))
        b1 = _worker(procs, tmp, lh.url, "B", "B1", *common, "--die-at", "5",
                     "--ready-file", str(ready1), "--hold", f"0:{ready_a}")
        assert _wait(b1, tmp, "B1") == -9  # killed by SIGKILL, mid-run
        _until_alone(tmp, "A")
        b2 = _worker(procs, tmp, lh.url, "B", "B2", *common, "--ready-file", str(ready2))
        _ok(a, tmp, "A")
        _ok(b2, tmp, "B2")
    finally:
        lh.stop()
    for name in ("A", "B2"):
        _no_torchft_noise((tmp / f"{name}.log").read_text())


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("replicator", ["full", "demo", "diloco", "random", "diloco-int4-rs",
                                        "demo-delayed", "diloco-streaming"])
def test_killed_group_restarts_heals_and_ends_identical(tmp_path, procs, replicator):
    """B is killed (SIGKILL) in step 5 (a DiLoCo sync: H=3); A's step 5 fails and is undone
    (with an exchange in flight, delayed DeMo and streaming DiLoCo: step 6, in which step 5's
    exchange fails), A goes on alone; B
    restarts, heals from A (under DiLoCo between two syncs), and at the
    end both groups hold bitwise the same parameters (DiLoCo: its last step is a sync; streaming
    DiLoCo, whose syncs land a step after their launch: the same global copy)."""
    # A waits at step 9 for B2 to be up (B2 joins before the end; streaming DiLoCo: at step 10,
    # while A's sync launched after step 9 is in flight)
    join = 10 if replicator == "diloco-streaming" else 9
    _kill_and_restart(tmp_path, procs, replicator, join)
    pa, pb = _progress(tmp_path, "A"), _progress(tmp_path, "B2")
    if replicator in ("demo-delayed", "diloco-streaming"):  # step 5's exchange (in flight)
        # fails while step 6 runs: that step is undone; or the lighthouse has left B out of
        # step 6's quorum already (a fast machine reaches it after B's heartbeats stopped
        # counting): the new quorum drops the exchange in flight and step 6 commits alone
        assert (6, 1, 0) in pa or (5, 2, 0) in pa or (6, 1, 1) in pa, \
            f"no step with the dying B undone, nor step 6 taken alone: {pa}"
    else:
        assert (5, 2, 0) in pa, f"A's step 5 with the dying B was not undone: {pa}"
    assert any(n == 1 and c for _, n, c in pa), f"A never went on alone: {pa}"
    assert pb[0][0] >= join, f"B2 did not heal to A's step: {pb}"
    assert all(n == 2 and c for _, n, c in pb), f"B2 did not train with A: {pb}"
    fa, fb = _final(tmp_path, "A"), _final(tmp_path, "B2")
    assert fa["step"] == fb["step"] == 15
    if replicator != "diloco-streaming":  # its fragments are not all synced in the last step
        assert _same(fa["params"], fb["params"])
    if replicator.startswith("diloco"):
        assert _same(fa["global"], fb["global"])


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("order", ["forward-zero", "zero-last", "forward-keep", "none",
                                   "zero-first"])
def test_every_loop_order_survives_a_kill_and_a_rejoin(tmp_path, procs, order):
    """The same kill and restart as above (DeMo), with the loop in another order (the worker's
    ``--order``: zero_grad after the forward pass, after the step, zero_grad(set_to_none=False),
    or none at all). The restarted B heals before its first forward pass wherever the loop's
    zero_grad is: its first step commits with A's, no step of B is undone, and both end bitwise
    equal. (zero_grad after the forward pass healed B there, and its backward pass raised
    "modified by an inplace operation".)"""
    _kill_and_restart(tmp_path, procs, "demo", 9, "--order", order)
    pa, pb = _progress(tmp_path, "A"), _progress(tmp_path, "B2")
    assert (5, 2, 0) in pa, f"A's step 5 with the dying B was not undone: {pa}"
    assert any(n == 1 and c for _, n, c in pa), f"A never went on alone: {pa}"
    assert pb[0][0] >= 9, f"B2 did not heal to A's step: {pb}"
    assert all(n == 2 and c for _, n, c in pb), f"B2 did not train with A: {pb}"
    fa, fb = _final(tmp_path, "A"), _final(tmp_path, "B2")
    assert fa["step"] == fb["step"] == 15
    assert _same(fa["params"], fb["params"])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_group_a_joiner_heals_from_commits_under_min_replicas(tmp_path, procs):
    """min_replicas 2: B1 leaves cleanly after step 4, so A's next quorum runs behind its
    forward pass (its last step committed) and waits for B2, which heals from A. A's step must
    count B2 and commit: torchft's own count of that quorum's participants (the groups at the
    newest step) is 1, and A used to vote no, heal from B2 in turn, and the two groups took
    turns failing until one of them finished."""
    lh = Lighthouse(2, tmp_path / "lighthouse.log")
    try:
        common = ["--replicator", "demo", "--min-replicas", "2", "--timeout", "30"]
        a = _worker(procs, tmp_path, lh.url, "A", "A", *common, "--steps", "10")
        b1 = _worker(procs, tmp_path, lh.url, "B", "B1", *common, "--steps", "4")
        _ok(b1, tmp_path, "B1")
        b2 = _worker(procs, tmp_path, lh.url, "B", "B2", *common, "--steps", "10")
        _ok(a, tmp_path, "A")
        _ok(b2, tmp_path, "B2")
    finally:
        lh.stop()
    pa, pb = _progress(tmp_path, "A"), _progress(tmp_path, "B2")
    assert [s for s, _, _ in pa] == list(range(10)), f"A undid a step: {pa}"
    assert all(n == 2 and c for _, n, c in pa), f"A's steps did not all commit with 2: {pa}"
    assert pb[0][0] == 4 and all(n == 2 and c for _, n, c in pb), f"B2 did not heal: {pb}"
    fa, fb = _final(tmp_path, "A"), _final(tmp_path, "B2")
    assert fa["step"] == fb["step"] == 10 and _same(fa["params"], fb["params"])


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("order", ["zero-first", "forward-zero"])
def test_a_group_healed_after_its_forward_pass_votes_no(tmp_path, procs, order):
    """B joins A's run with its first quorum behind its forward pass (``--heal-late``), so
    torchft heals it after that pass and B's gradients come from its state before the heal. It
    takes part in the exchange with zero gradients and votes no: its step is undone, A's step
    commits, B heals again in its next quorum (formed before the forward pass, also where the
    loop's zero_grad comes after it), and both groups end bitwise equal. (Reporting the error
    before the exchange made torchft skip B's collectives, and A waited for them until its
    timeout.)"""
    lh = Lighthouse(1, tmp_path / "lighthouse.log")
    try:
        ready_b = tmp_path / "b-ready"
        common = ["--replicator", "demo", "--steps", "10", "--timeout", "30", "--order", order]
        a = _worker(procs, tmp_path, lh.url, "A", "A", *common, "--hold", f"5:{ready_b}")
        _until_alone(tmp_path, "A")  # A trains alone first: B has to heal from it
        b = _worker(procs, tmp_path, lh.url, "B", "B", *common, "--heal-late",
                    "--ready-file", str(ready_b))
        _ok(a, tmp_path, "A")
        _ok(b, tmp_path, "B")
    finally:
        lh.stop()
    pa, pb = _progress(tmp_path, "A"), _progress(tmp_path, "B")
    joined = next(step for step, n, _ in pa if n == 2)  # A's first step with B
    assert joined >= 1 and all(c for _, _, c in pa), f"A did not train alone, then with B: {pa}"
    # B's first step (numbered before its heal) was undone; then it trains on from A's next
    assert pb[0] == (0, 2, 0), f"B's late-healed step was not undone: {pb}"
    assert pb[1][0] == joined + 1, f"B did not heal to A's next step: {pb}"
    assert all(n == 2 and c for _, n, c in pb[1:]), f"B did not go on with A: {pb}"
    fa, fb = _final(tmp_path, "A"), _final(tmp_path, "B")
    assert fa["step"] == fb["step"] == 10
    assert _same(fa["params"], fb["params"])  # (DeMo's momenta are each replica's own)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("replicator,fail,steps", [("full", 3, 7), ("demo", 3, 7),
                                                    ("diloco", 5, 9), ("random", 3, 7),
                                                    ("demo-delayed", 3, 7),
                                                    ("diloco-streaming", 6, 9)])
def test_failed_commit_is_undone_exactly(tmp_path, procs, replicator, fail, steps):
    """Step ``fail``'s commit vote fails on both groups (a real Manager error after the
    exchange; under DiLoCo, H=3, a sync, retried at the next quorum): the run then is bitwise
    the run without that failure, the replicators' momenta and DiLoCo's global copy included.
    DeMo's delayed mode and streaming DiLoCo (tau=1) are the exception: torchft forms a new
    quorum after a failed vote, so the exchange in flight into the failed step is dropped
    (``quorum_changed``; DeMo returns its own part to its momentum); the groups stay bitwise
    identical (streaming DiLoCo: their global copies)."""
    _failed_and_clean_runs(tmp_path, procs, [fail], "--replicator", replicator, "--steps",
                           str(steps))
    for r in ("A", "B"):
        f, c = _final(tmp_path, f"fail-{r}"), _final(tmp_path, f"clean-{r}")
        assert f["step"] == c["step"] == steps
        if replicator in ("demo-delayed", "diloco-streaming"):  # the exchange in flight into
            assert not _same(f["params"], c["params"])  # the failed step was dropped
            continue
        assert _same(f["params"], c["params"])
        for key in ("delta", "global", "buffers"):
            assert _same(f.get(key, []), c.get(key, []))
    fa, fb = _final(tmp_path, "fail-A"), _final(tmp_path, "fail-B")
    if replicator == "diloco-streaming":  # replicas differ between a fragment's syncs
        assert _same(fa["global"], fb["global"])
    else:
        assert _same(fa["params"], fb["params"])


def _failed_and_clean_runs(tmp: Path, procs: list, fails: list[int], *args: str) -> None:
    """Two groups (min_replicas 2) train with ``args`` twice: with the commit votes of steps
    ``fails`` failing once (on both groups) as ``fail-{A,B}``, and without as
    ``clean-{A,B}``; each failed step was attempted once more."""
    for run, extra in (("fail", [x for k in fails for x in ("--fail-commit", str(k))]),
                       ("clean", [])):
        lh = Lighthouse(2, tmp / f"lighthouse-{run}.log")
        try:
            common = [*args, "--min-replicas", "2", *extra]
            ws = [(_worker(procs, tmp, lh.url, r, f"{run}-{r}", *common), f"{run}-{r}")
                  for r in ("A", "B")]
            for p, name in ws:
                _ok(p, tmp, name)
        finally:
            lh.stop()
    for r in ("A", "B"):
        failed, clean = _progress(tmp, f"fail-{r}"), _progress(tmp, f"clean-{r}")
        assert all((k, 2, 0) in failed for k in fails), failed
        assert len(failed) == len(clean) + len(fails), (failed, clean)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_failed_votes_after_a_restore_are_undone_exactly(tmp_path, procs):
    """A restore hands the undo copy's tensors to the optimizer's state (AdamW's
    ``load_state_dict`` keeps them): the undo copies after it must not be written into them.
    Steps 3 and 5 fail (real Manager errors): the run is bitwise the run without failures,
    AdamW's moments and DeMo's momenta included (with an undo copy that aliased the live
    state, step 5's undo would keep its moments)."""
    _failed_and_clean_runs(tmp_path, procs, [3, 5], "--replicator", "demo", "--optimizer",
                           "adamw", "--steps", "8")
    for r in ("A", "B"):
        f, c = _final(tmp_path, f"fail-{r}"), _final(tmp_path, f"clean-{r}")
        assert f["step"] == c["step"] == 8
        for key in ("params", "delta", "moments"):
            assert _same(f[key], c[key]), key
    assert _same(_final(tmp_path, "fail-A")["params"], _final(tmp_path, "fail-B")["params"])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_three_groups_one_killed_and_restarted(tmp_path, procs):
    """3 groups under DeMo: C is killed in step 5, A and B undo it and go on as 2; C restarts,
    heals, and at the end all three hold bitwise the same parameters."""
    lh = Lighthouse(1, tmp_path / "lighthouse.log")
    r = {g: tmp_path / f"{g}-ready" for g in ("A", "B", "C1", "C2")}
    common = ["--replicator", "demo", "--steps", "14", "--timeout", "30"]
    try:
        ab = [_worker(procs, tmp_path, lh.url, g, g, *common, "--ready-file", str(r[g]),
                      "--hold", f"0:{r[other]},{r['C1']}", "--hold", f"9:{r['C2']}")
              for g, other in (("A", "B"), ("B", "A"))]
        c1 = _worker(procs, tmp_path, lh.url, "C", "C1", *common, "--die-at", "5",
                     "--ready-file", str(r["C1"]), "--hold", f"0:{r['A']},{r['B']}")
        assert _wait(c1, tmp_path, "C1") == -9
        _until_alone(tmp_path, "A", groups=2)
        c2 = _worker(procs, tmp_path, lh.url, "C", "C2", *common, "--ready-file", str(r["C2"]))
        for p, name in ((ab[0], "A"), (ab[1], "B"), (c2, "C2")):
            _ok(p, tmp_path, name)
    finally:
        lh.stop()
    for g in ("A", "B"):
        prog = _progress(tmp_path, g)
        assert (4, 3, 1) in prog and (5, 3, 0) in prog and (5, 2, 1) in prog, prog
    assert _progress(tmp_path, "C2")[0][0] >= 9
    fa, fb, fc = (_final(tmp_path, g) for g in ("A", "B", "C2"))
    assert fa["step"] == fb["step"] == fc["step"] == 14
    assert _same(fa["params"], fb["params"]) and _same(fa["params"], fc["params"])


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("order", ["zero-first", "forward-zero"])
def test_sharded_groups_rank_r_replicates_with_rank_r(tmp_path, procs, order):
    """2 groups x 2 ranks (FSDP2 shards inside a group), DeMo: B is killed whole in step 5 and
    restarts; rank r of B heals from rank r of A, and at the end each rank's shards are
    bitwise those of the same rank of the other group. With zero_grad after the forward pass,
    B heals in the forward pre-hook, before FSDP2 gathers the shards it wrote."""
    lh = Lighthouse(1, tmp_path / "lighthouse.log")
    try:
        ready_a = tmp_path / "a-ready"
        ready1, ready2 = tmp_path / "b1-ready", tmp_path / "b2-ready"
        common = ["--replicator", "demo", "--steps", "12", "--timeout", "30", "--order", order]
        # a group's quorum request waits for all its ranks: hold on every rank's file (a
        # rank slow to start on a loaded machine would otherwise leave A to train on alone)
        a = _group(procs, tmp_path, lh.url, "A", "A", 2, *common, "--hold",
                   f"0:{ready1},{ready1}.r1", "--hold", f"8:{ready2},{ready2}.r1",
                   "--ready-file", str(ready_a))
        b1 = _group(procs, tmp_path, lh.url, "B", "B1", 2, *common, "--die-at", "5",
                    "--ready-file", str(ready1), "--hold", f"0:{ready_a},{ready_a}.r1")
        # rank 0 hosts the group's Manager server: when it dies first, rank 1 may stop with
        # an error (a one-line one when in its quorum) instead of reaching its own kill
        codes = [_wait(p, tmp_path, name) for p, name in b1]
        assert codes[0] == -9 and codes[1] != 0, codes
        if codes[1] == 2:
            errors = [x for x in (tmp_path / "B1-r1.log").read_text().splitlines()
                      if x.startswith("error:")]
            assert len(errors) == 1 and errors[0].startswith(
                "error: rank 1 of replica group 'B' lost its group's Manager server"), errors
        _until_alone(tmp_path, "A", rank=1)
        b2 = _group(procs, tmp_path, lh.url, "B", "B2", 2, *common, "--ready-file",
                    str(ready2))
        for p, name in a + b2:
            _ok(p, tmp_path, name)
    finally:
        lh.stop()
    assert (5, 2, 0) in _progress(tmp_path, "A", 1)
    finals = {(g, r): _final(tmp_path, g, r) for g in ("A", "B2") for r in (0, 1)}
    for r in (0, 1):
        assert _progress(tmp_path, "B2", r)[0][0] >= 8
        assert finals["A", r]["step"] == finals["B2", r]["step"] == 12
        assert _same(finals["A", r]["params"], finals["B2", r]["params"])
    assert not _same(finals["A", 0]["params"], finals["A", 1]["params"])  # other shards


@pytest.mark.multiprocess
@pytest.mark.slow
def test_resume_on_other_groups(tmp_path, procs):
    """A and B train 6 steps under DeMo and save their checkpoints. A resumes alone from its
    own; a new group C joins and heals from A: A keeps its momentum, C starts from zero, and
    they end bitwise identical (a checkpoint of 2 groups resumed on 2 other ones)."""
    common = ["--replicator", "demo", "--timeout", "30"]
    lh = Lighthouse(2, tmp_path / "lighthouse-1.log")
    try:
        ws = [(_worker(procs, tmp_path, lh.url, g, f"{g}1", *common, "--steps", "6",
                       "--save", str(tmp_path / f"ckpt-{g}" / "step6")), f"{g}1")
              for g in ("A", "B")]  # a parent folder each (a save clears scratch in its parent)
        for p, name in ws:
            _ok(p, tmp_path, name)
    finally:
        lh.stop()
    lh = Lighthouse(2, tmp_path / "lighthouse-2.log")
    try:
        ws = [(_worker(procs, tmp_path, lh.url, g, f"{g}2", *common, "--steps", "10", *extra),
               f"{g}2") for g, extra in (("A", ["--resume", str(tmp_path / "ckpt-A" / "step6")]),
                                         ("C", []))]
        for p, name in ws:
            _ok(p, tmp_path, name)
    finally:
        lh.stop()
    pa, pc = _progress(tmp_path, "A2"), _progress(tmp_path, "C2")
    assert pa[0][0] == 6 and pc[0][0] == 6, (pa, pc)
    assert all(n == 2 and c for _, n, c in pa + pc)
    fa, fc = _final(tmp_path, "A2"), _final(tmp_path, "C2")
    assert fa["step"] == fc["step"] == 10
    assert _same(fa["params"], fc["params"])
    assert not _same(fa["delta"], fc["delta"])  # A's own momentum went on; C's started at 0


@pytest.mark.multiprocess
def test_too_few_replicas_wait_bounded_and_say_so(tmp_path, procs):
    """min_replicas=2 with one group: it says it waits, then exits naming what it waited for
    (the lighthouse started by `flexdemo lighthouse`)."""
    lh = Lighthouse(1, tmp_path / "lighthouse.log", cli=True)
    try:
        p = _worker(procs, tmp_path, lh.url, "A", "A", "--min-replicas", "2", "--timeout", "4")
        rc = _wait(p, tmp_path, "A")
    finally:
        lh.stop()
    log = (tmp_path / "A.log").read_text()
    assert rc == 2, log[-3000:]
    waiting = [x for x in log.splitlines() if "is waiting for a quorum" in x]
    assert len(waiting) == 1 and "2 replica group(s)" in waiting[0]
    last = log.strip().splitlines()[-1]
    assert last.startswith("error: replica group 'A' waited 4 s for a quorum of 2"), last
    assert lh.url in last


@pytest.mark.multiprocess
def test_a_hand_built_optimizer_needs_its_model_watched(tmp_path):
    """A DeToNATION built by hand under fault tolerance does not know the model whose forward
    pass a joiner must heal before: its first step refuses in one line that says what to do.
    Watched, a loop with zero_grad after the forward pass commits, and the model may be copied
    meanwhile (the copy's hook is inert)."""
    lh = Lighthouse(1, tmp_path / "lighthouse.log")
    code = (
        "import copy, torch, flexdemo\n"
        f"ft = flexdemo.FaultTolerance(lighthouse='{lh.url}', replica_id='A', timeout=20, "
        "hostname='127.0.0.1')\n"
        "net = torch.nn.Linear(4, 4)\n"
        "opt = flexdemo.DeToNATION(net.parameters(), 'full', fault_tolerance=ft)\n"
        "try:\n"
        "    opt.zero_grad()\n"
        "except ValueError as e:\n"
        "    print(e)\n"
        "opt = flexdemo.DeToNATION(net.parameters(), 'full', fault_tolerance=ft)\n"
        "opt.fault_tolerance.watch(net)\n"
        "twin = copy.deepcopy(net)\n"
        "loss = net(torch.ones(2, 4)).sum()\n"
        "opt.zero_grad()\n"
        "loss.backward()\n"
        "opt.step()\n"
        "twin(torch.ones(2, 4))\n"
        "print(opt.steps, opt.last_step_stats()['committed'])\n"
        "opt.fault_tolerance.shutdown()\n")
    try:
        r = run_python(["-c", code], timeout=WAIT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    finally:
        lh.stop()
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == [
        "under fault tolerance the optimizer heals a replica group before its forward pass "
        "and needs the model for that: call opt.fault_tolerance.watch(model) before the first "
        "step (flexdemo.prepare does)", "1 True"], r.stdout


COMPOSED = """
import json, torch, flexdemo
from flexdemo.ft import ElasticOptimizer, Phase
ft = flexdemo.FaultTolerance(lighthouse=URL, replica_id='A', timeout=20, hostname='127.0.0.1')
net, opt = flexdemo.prepare(torch.nn.Linear(4, 4), replicator='full', lr=0.1, device='cpu',
                            fault_tolerance=ft)
session, inner = opt.session, opt.inner
out = {'kinds': [isinstance(opt, ElasticOptimizer), isinstance(opt, torch.optim.Optimizer),
                 isinstance(inner, ElasticOptimizer), inner.fault_tolerance is None,
                 opt.fault_tolerance is session, opt.param_groups is inner.param_groups],
       'phases': [session.phase.name], 'inner_steps': []}
seen = []  # the inner optimizer's steps: who ran it, in which phase of the session
opt.register_step_pre_hook(lambda o, args, kw: seen.append([o is inner, session.phase.name]))
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
for order in ('zero-first', 'forward-zero', 'none'):
    n = len(seen)
    if order == 'zero-first':
        opt.zero_grad()
        out['phases'].append(session.phase.name)
    loss = net(torch.ones(2, 4)).sum()
    if order == 'forward-zero':
        opt.zero_grad()
        out['phases'].append(session.phase.name)
    loss.backward()
    opt.step()
    sched.step()
    out['phases'].append(session.phase.name)
    out['inner_steps'].append(seen[n:])
    if order == 'none':
        net.zero_grad()
out['steps'] = [opt.steps, inner.steps, opt.last_step_stats()['committed']]
out['lr'] = [g['lr'] for g in inner.param_groups]
opt.load_state_dict(opt.state_dict())
undo = session.start_step()
try:
    session.start_step()
except RuntimeError as e:
    out['twice'] = str(e)
out['finish'] = [session.finish_step(undo), session.phase.name,
                 isinstance(session.phase, Phase)]
session.shutdown()
print(json.dumps(out))
"""


@pytest.mark.multiprocess
def test_the_session_wraps_the_optimizer_whose_step_runs_once(tmp_path):
    """prepare(fault_tolerance=...) returns the session around a plain optimizer: one call of
    the inner optimizer's step per step() (inside the quorum), the session's place in its
    cycle one Phase, an LR scheduler and the state dicts as with the optimizer itself, and a
    move outside the cycle refused."""
    lh = Lighthouse(1, tmp_path / "lighthouse.log")
    try:
        r = run_python(["-c", f"URL = {lh.url!r}\n" + COMPOSED], timeout=WAIT,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    finally:
        lh.stop()
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["kinds"] == [True, True, False, True, True, True]
    # each step() ran the inner step exactly once, as the inner optimizer, while STEPPING
    assert out["inner_steps"] == [[[True, "STEPPING"]]] * 3, out["inner_steps"]
    # the first quorum is formed in zero_grad (a joiner heals there); later ones behind the
    # forward pass (launched, joined in step()); no zero_grad: step() forms it
    assert out["phases"] == ["NEW", "JOINED", "IDLE", "LAUNCHED", "IDLE", "IDLE"], out["phases"]
    assert out["steps"] == [3, 3, True]
    assert out["lr"] == [0.1 * 0.5 ** 3]
    assert out["twice"] == ("fault tolerance: STEPPING -> STEPPING is not a step of the "
                            "session's cycle")
    assert out["finish"] == [True, "IDLE", True]


@pytest.mark.multiprocess
def test_replica_id_used_twice_is_one_line(tmp_path, procs):
    lh = Lighthouse(2, tmp_path / "lighthouse.log")
    try:
        ws = [_worker(procs, tmp_path, lh.url, "A", f"A{i}", "--timeout", "10") for i in (1, 2)]
        codes = [_wait(p, tmp_path, f"A{i}") for p, i in zip(ws, (1, 2))]
    finally:
        lh.stop()
    assert codes == [2, 2], codes
    for i in (1, 2):  # (torchft's checkpoint server may log a request after it)
        log = (tmp_path / f"A{i}.log").read_text()
        errors = [x for x in log.splitlines() if x.startswith("error:")]
        assert errors == ["error: replica id 'A' is used by 2 live replica groups of the "
                          "quorum: give every node its own replica_id (FLEXDEMO_REPLICA_ID)"], \
            log[-3000:]


@pytest.mark.multiprocess
def test_unreachable_lighthouse_is_one_line(tmp_path, procs):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    p = _worker(procs, tmp_path, url, "A", "A", "--timeout", "3")
    rc = _wait(p, tmp_path, "A")
    last = (tmp_path / "A.log").read_text().strip().splitlines()[-1]
    assert rc == 2
    assert last.startswith("error: replica group 'A' could not reach the torchft lighthouse "
                           f"at {url} within 3 s"), last


BLOCK_TORCHFT = "import sys; sys.modules['torchft'] = None\n"


def _python(code: str) -> subprocess.CompletedProcess:
    """``python -c CODE`` without torchft (forked: the fork server does not import it)."""
    return run_python(["-c", BLOCK_TORCHFT + code], timeout=WAIT,
                      env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.multiprocess
def test_without_torchft_fault_tolerance_names_the_extra():
    r = _python("import flexdemo\n"
                "try:\n"
                "    flexdemo.FaultTolerance(lighthouse='http://127.0.0.1:1', replica_id='A')\n"
                "except ModuleNotFoundError as e:\n"
                "    print(e)\n")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines == ['fault tolerance needs torchft, which is not installed: '
                     'pip install "flexdemo[ft]"']


@pytest.mark.multiprocess
def test_without_torchft_nothing_changes():
    r = _python("import torch, flexdemo\n"
                "m, opt = flexdemo.prepare(torch.nn.Linear(4, 4), replicator='demo')\n"
                "m(torch.ones(2, 4)).sum().backward(); opt.step()\n"
                "assert opt.fault_tolerance is None and 'replicas' not in opt.last_step_stats()\n"
                "print('ok')\n")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_a_torchft_without_the_internals_we_drive_is_one_line():
    """Every elastic test builds a real torchft Manager and passes this check; a torchft
    that lacks one of the internals (as a later one might) is refused naming it."""
    from torchft._torchft import ManagerClient
    from torchft.manager import Manager

    from flexdemo.ft.torchft_api import INTERNALS, TorchFTVersionError, check_internals

    assert callable(Manager._apply_pending_state_dict)  # the rest are set by its __init__
    assert callable(ManagerClient._quorum)
    missing = ("_healing", "_apply_pending_state_dict")
    older = type("Older", (), dict.fromkeys(n for n in INTERNALS["Manager"] if n not in missing))()
    client = type("Client", (), {"_quorum": None})()
    version = importlib.metadata.version("torchft")
    with pytest.raises(TorchFTVersionError) as e:
        check_internals({"Manager": older, "ManagerClient": client})
    assert str(e.value) == (
        f"torchft {version} lacks Manager._healing, Manager._apply_pending_state_dict, "
        "which flexdemo's fault tolerance drives (it is built on "
        "torchft 0.2); install it: pip install 'torchft>=0.2,<0.3'")


def test_unsupported_replicators_are_refused_in_one_line():
    from flexdemo import DeMoReplicator, DiLoCoReplicator, FullReplicator, PhasedReplicator
    from flexdemo.ft.state import check_supported

    for rep, words in ((PhasedReplicator(FullReplicator(), DeMoReplicator(), 2), "not supp"),
                       (DiLoCoReplicator(inner_steps=4, tau=1, exchange="demo"),
                        r"tau=1\) with an exchange that keeps per-replica state")):
        with pytest.raises(ValueError, match=words) as e:
            check_supported(rep)
        assert "\n" not in str(e.value)
    # refused before any connection (nothing listens at this lighthouse)
    ft = flexdemo.FaultTolerance(lighthouse=f"http://127.0.0.1:{free_port()}", replica_id="A")
    with pytest.raises(ValueError, match="'phased' is not supported yet"):
        flexdemo.DeToNATION(torch.nn.Linear(4, 4).parameters(),
                            PhasedReplicator(FullReplicator(), DeMoReplicator(), 2),
                            fault_tolerance=ft)
    with pytest.raises(TypeError, match="must be a flexdemo.FaultTolerance"):
        flexdemo.DeToNATION(torch.nn.Linear(4, 4).parameters(), "full",
                            fault_tolerance={"lighthouse": "x"})


class _TwoPeers(Transport):
    """A group of two in which the peer sent this rank's payload; ``corrupt``: the peer's
    payload arrives as zeros (a bad header)."""

    def __init__(self) -> None:
        self.size, self.rank, self.corrupt = 2, 0, False

    def global_rank(self, r: int) -> int:
        return r

    def all_reduce_sum_(self, buf, async_op=False):
        raise NotImplementedError

    def all_gather_into(self, out, inp, async_op=False):
        out.view(2, -1).copy_(inp.reshape(1, -1).expand(2, -1))
        if self.corrupt:
            out.view(2, -1)[1].zero_()
        return Pending(out) if async_op else None  # (a handle already complete)


@pytest.mark.parametrize("arrived", [False, True])
def test_delayed_demo_returns_its_exchange_in_flight(arrived):
    """DeMo's delayed mode under a quorum change: the exchange in flight is dropped and this
    replica's own payload goes back into its momentum, bitwise the momentum that the
    synchronous mode restores when a bad payload stops its step (from the send buffer, or
    from its row of the payloads once they arrived, as after a snapshot or a checkpoint)."""
    from flexdemo import DeMoReplicator
    from flexdemo.replicate import CorruptPayloadError

    shapes = [torch.Size([24, 40]), torch.Size([40]), torch.Size([7, 5])]
    torch.manual_seed(0)
    grads = [torch.randn(s) for s in shapes]
    lrs = [0.1] * len(shapes)
    kw = {"topk": 3, "chunk": 8, "values": "int8"}
    sync, bad = DeMoReplicator(**kw), _TwoPeers()
    sync.setup(shapes, torch.device("cpu"), bad)
    bad.corrupt = True  # after the set-up's shape check
    with pytest.raises(CorruptPayloadError):
        sync([g.clone() for g in grads], lrs, 0)  # its error feedback undone
    delayed = DeMoReplicator(overlap="delayed", **kw)
    delayed.setup(shapes, torch.device("cpu"), _TwoPeers())
    delayed([g.clone() for g in grads], lrs, 0)
    sent = [d.clone() for d in delayed.delta]
    if arrived:
        delayed.load_state_dict(delayed.state_dict())  # the payloads, no send buffer needed
        delayed.send_buffers[0].zero_()
    delayed.quorum_changed()
    assert delayed.inflight.sent is None
    assert any(not torch.equal(a, b) for a, b in zip(sent, delayed.delta))  # it sent something
    assert _same(list(delayed.delta), list(sync.delta))


def _train(procs: list, tmp: Path, url: str, rid: str, out: str, steps: int,
           quorum_timeout: int = 120) -> Forked:
    """``flexdemo train`` as replica group ``rid`` (one process), full sync, quorums of 2."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    p = Forked(
        ["-m", "flexdemo", "train", str(HERE.parent / "configs/gpt.toml"),
         "task.model=tiny", "task.corpus_bytes=200000", "train.batch=4", "train.warmup=2",
         "train.eval_every=10", "train.eval_batches=2", "train.log_every=5",
         "train.tensorboard=false", "train.checkpoint_every=0", f"train.steps={steps}",
         f"train.out={tmp / out}", "strategy.replicator=full", "strategy.optimizer=adamw",
         "mesh.replicate=1", "mesh.shard=1", "fault_tolerance.enabled=true",
         f"fault_tolerance.lighthouse={url}", f"fault_tolerance.replica_id={rid}",
         "fault_tolerance.min_replicas=2", "fault_tolerance.timeout=20",
         f"fault_tolerance.quorum_timeout={quorum_timeout}",
         "fault_tolerance.hostname=127.0.0.1"],
        env=env, cwd=tmp, stdout=tmp / f"{out}.log")
    procs.append(p)
    return p


def _kill_after(p: Forked, tmp: Path, out: str, steps: int) -> None:
    """SIGKILL the `flexdemo train` process ``p`` once it has logged ``steps`` steps."""
    deadline = time.monotonic() + WAIT
    while len(_metrics(tmp, out)) < steps:
        assert time.monotonic() < deadline and p.poll() is None, \
            (tmp / f"{out}.log").read_text()[-3000:]
        time.sleep(0.05)
    p.kill()
    assert _wait(p, tmp, out) == -9


def _metrics(tmp: Path, out: str) -> list[dict]:
    path = tmp / out / "metrics.jsonl"
    if not path.exists():
        return []
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_flexdemo_train_follows_the_committed_steps(tmp_path, procs):
    """`flexdemo train` with [fault_tolerance]: B is killed mid-run; A's step with the dying
    B is undone and run again, A waits (min_replicas 2) until B restarts; the new B heals to
    A's step and its loop goes on from there; both end at the last step with the same
    parameters (the same validation loss to the bit)."""
    steps = 30
    lh = Lighthouse(2, tmp_path / "lighthouse.log")
    try:
        a = _train(procs, tmp_path, lh.url, "A", "A", steps)
        b1 = _train(procs, tmp_path, lh.url, "B", "B1", steps)
        _kill_after(b1, tmp_path, "B1", 8)
        b2 = _train(procs, tmp_path, lh.url, "B", "B2", steps)
        _ok(a, tmp_path, "A")
        _ok(b2, tmp_path, "B2")
    finally:
        lh.stop()
    ma, mb = _metrics(tmp_path, "A"), _metrics(tmp_path, "B2")
    assert [r["step"] for r in ma] == list(range(1, steps + 1)), [r["step"] for r in ma]
    # the same initial weights, but each replica group draws its own batches
    assert ma[0]["loss"] != _metrics(tmp_path, "B1")[0]["loss"]
    assert all(r["replicas"] == 2 for r in ma + mb)
    first = mb[0]["step"]
    assert first > 8, f"B2 did not heal to A's step: it began at step {first}"
    assert [r["step"] for r in mb] == list(range(first, steps + 1))
    assert mb[0]["lr"] == ma[first - 1]["lr"]  # the schedule follows the healed step
    import json

    sa, sb = (json.loads((tmp_path / o / "summary.json").read_text()) for o in ("A", "B2"))
    assert sa["val_loss"] == sb["val_loss"], (sa["val_loss"], sb["val_loss"])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_flexdemo_train_waiting_too_long_for_a_quorum_is_one_line(tmp_path, procs):
    """`flexdemo train` under min_replicas 2: B is killed (SIGKILL) mid-run and never comes
    back; A waits quorum_timeout (8 s) for a second group, then exits with code 1 and one line
    naming the wait and the lighthouse, no traceback."""
    lh = Lighthouse(2, tmp_path / "lighthouse.log")
    try:
        a = _train(procs, tmp_path, lh.url, "A", "A", 200, quorum_timeout=8)
        b = _train(procs, tmp_path, lh.url, "B", "B", 200, quorum_timeout=8)
        _kill_after(b, tmp_path, "B", 5)
        assert _wait(a, tmp_path, "A") == 1
    finally:
        lh.stop()
    log = (tmp_path / "A.log").read_text()
    assert "QuorumTimeoutError" not in log, log[-3000:]  # (torchft logs the dead peer's)
    lines = [line for line in log.splitlines() if line.strip()]
    assert lines[-1].startswith("flexdemo train: error: "), log[-3000:]
    errors = [line for line in lines if line.startswith("flexdemo train: ")]
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"flexdemo train: error: replica group 'A' waited 8 s for a "
                                f"quorum of 2 replica group(s) at {lh.url}"), errors
    assert errors[0].endswith("; start more replica groups or lower min_replicas"), errors


@pytest.mark.multiprocess
def test_flexdemo_train_with_a_torchft_lacking_an_internal_is_one_line(tmp_path, procs):
    """A real lighthouse and a real Manager, which the check is told to find lacking one more
    internal (as a later torchft's might): `flexdemo train` exits with code 2 and one line."""
    lh = Lighthouse(1, tmp_path / "lighthouse.log")
    code = ("import sys, flexdemo.ft.torchft_api as t\n"
            "t.INTERNALS['Manager'] += ('_gone_in_a_later_torchft',)\n"
            "from flexdemo.app.cli import entry\n"
            "sys.argv = ['flexdemo', 'train', 'task.corpus_bytes=20000', 'train.steps=2',\n"
            f"            'train.out={tmp_path / 'run'}', 'fault_tolerance.enabled=true',\n"
            f"            'fault_tolerance.lighthouse={lh.url}', 'fault_tolerance.replica_id=A',\n"
            "            'fault_tolerance.hostname=127.0.0.1']\n"
            "entry()\n")
    try:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("WORLD_SIZE", None)
        r = run_python(["-c", code], timeout=WAIT, env=env, cwd=tmp_path)
    finally:
        lh.stop()
    lines = [line for line in r.stderr.splitlines() if line.startswith("flexdemo train: ")]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    version = importlib.metadata.version("torchft")
    assert lines == [f"flexdemo train: error: torchft {version} lacks "
                     "Manager._gone_in_a_later_torchft, which flexdemo's fault tolerance drives "
                     "(it is built on torchft 0.2); install it: pip install 'torchft>=0.2,<0.3'"
                     ], lines


@pytest.mark.multiprocess
def test_flexdemo_train_without_its_lighthouse_is_one_line(tmp_path):
    """Nothing listens at the lighthouse's address: `flexdemo train` exits with code 1 and one
    line naming the lighthouse (not the job's rendezvous, which it did not use)."""
    url = f"http://127.0.0.1:{free_port()}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    r = run_python(["-m", "flexdemo", "train", "task.corpus_bytes=20000", "train.steps=2",
                    f"train.out={tmp_path / 'run'}", "fault_tolerance.enabled=true",
                    f"fault_tolerance.lighthouse={url}", "fault_tolerance.replica_id=A",
                    "fault_tolerance.hostname=127.0.0.1", "fault_tolerance.timeout=3"],
                   timeout=WAIT, env=env, cwd=tmp_path)
    lines = [line for line in r.stderr.splitlines() if line.startswith("flexdemo train: ")]
    assert r.returncode == 1 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith(f"flexdemo train: error: replica group 'A' could not reach the "
                               f"torchft lighthouse at {url} within 3 s"), lines
