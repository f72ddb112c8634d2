"""Safe on an open network: the run secret, the heal transport, who may join a quorum.

The end-to-end tests run real processes on 127.0.0.1: a real lighthouse, replica groups of
tests/elastic_workers.py, and an intruder (tests/intruder_workers.py) that is torchft's own
Manager posing as a group, claiming step 100000 with every parameter 7.0 and a pickled object
that creates a marker file when unpickled. The unit tests talk to a real heal server over a
real socket.
"""

from __future__ import annotations

import io
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from dist_util import Forked
from test_elastic import (
    HERE,
    PYTHONPATH,
    Lighthouse,
    _final,
    _kill_and_restart,
    _progress,
    _same,
    _wait,
    _worker,
    procs,  # noqa: F401 - the fixture
)

from flexdemo.ft.heal import REQUEST_HEADER, HealRefusedError, HealServer, fetch
from flexdemo.ft.membership import UntrustedPeerError, check_members, tag_replica_id
from flexdemo.secret import SECRET_ENV, RunSecret, SecretError, resolve_secret

pytest.importorskip("torchft")

SECRET = "a-test-secret-of-32-characters!!"


# ---------------------------------------------------------------------- the secret
def test_a_short_secret_is_one_line_naming_the_fix(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(SecretError, match=r"^FLEXDEMO_SECRET has 5 characters; a run secret "
                                          r"needs at least 16: make one with"):
        resolve_secret()
    monkeypatch.delenv(SECRET_ENV)
    assert resolve_secret() is None
    assert resolve_secret(SECRET).fingerprint == RunSecret(SECRET).fingerprint
    assert SECRET not in repr(RunSecret(SECRET))


def test_a_mac_is_bound_to_its_purpose_and_its_parts():
    s, other = RunSecret(SECRET), RunSecret(SECRET + "x")
    mac = s.mac("heal-request", 5, "A", "n")
    assert s.verify(mac, "heal-request", 5, "A", "n")
    assert not s.verify(mac, "heal-state", 5, "A", "n")  # another purpose
    assert not s.verify(mac, "heal-request", 6, "A", "n")  # another step
    assert not other.verify(mac, "heal-request", 5, "A", "n")  # another secret
    signed = s.sign("startup-verdict", '{"died": [1]}')
    assert s.open("startup-verdict", signed) == '{"died": [1]}'
    assert s.open("startup-verdict", signed.replace("[1]", "[0]")) is None
    assert other.open("startup-verdict", signed) is None


# ---------------------------------------------------------------------- membership
def test_members_without_the_secret_or_with_a_copied_tag_are_named():
    s = RunSecret(SECRET)
    a, b = tag_replica_id("A", s) + ":u1", tag_replica_id("B", s) + ":u2"
    check_members([a, b], s, "A", "http://lh")  # both proved the secret
    check_members(["A:u1", "X:u3"], None, "A", "http://lh")  # an open run checks nothing
    with pytest.raises(UntrustedPeerError, match=r"holds replica group\(s\) 'X' without the "
                                                 r"run secret's tag"):
        check_members([a, b, "X:0123456789abcdef.0123456789abcdef0123456789abcdef:u3"], s,
                      "A", "http://lh")
    stranger = tag_replica_id("B", RunSecret(SECRET + "other")) + ":u4"
    with pytest.raises(UntrustedPeerError, match="'B' without"):
        check_members([a, stranger], s, "A", "http://lh")
    copy = a.rsplit(":", 1)[0] + ":u9"  # A's tag replayed by another process
    with pytest.raises(UntrustedPeerError, match="two members with the tag of replica "
                                                 r"group\(s\) 'A'"):
        check_members([a, b, copy], s, "B", "http://lh")


# ---------------------------------------------------------------------- the heal server
STATE = {"user": {"flexdemo": {"params": [torch.arange(4.0)], "steps": 3}},
         "torchft": {"step": 3, "batches_committed": 0}}


@pytest.fixture
def server():
    srv = HealServer("127.0.0.1", "127.0.0.1", RunSecret(SECRET), timeout=2.0,
                     say=lambda text: None)
    yield srv
    srv.shutdown()


def _get(url: str, headers: dict | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}),
                                    timeout=5) as answer:
            answer.read()
            return answer.status
    except urllib.error.HTTPError as e:
        assert e.read() == b""  # a refusal carries nothing
        return e.code


def test_the_heal_server_listens_on_the_given_address_only(server):
    assert server._server.socket.getsockname()[0] == "127.0.0.1"
    assert server.address() == f"http://127.0.0.1:{server.port}/checkpoint/"


def test_a_heal_request_without_the_secret_gets_nothing(server):
    server.serve(3, STATE)
    url = f"{server.address()}3/full"
    assert _get(url) == 403  # no MAC
    s = RunSecret(SECRET + "-another")
    assert _get(url, {REQUEST_HEADER: f"X n1 {s.mac('heal-request', 3, 'X', 'n1')}"}) == 403
    mine = RunSecret(SECRET)
    header = {REQUEST_HEADER: f"A n2 {mine.mac('heal-request', 3, 'A', 'n2')}"}
    assert _get(url, header) == 200
    assert _get(url, header) == 403  # the same request replayed
    got = fetch(server.address(), 3, "A", mine, timeout=5)
    assert torch.equal(got["user"]["flexdemo"]["params"][0], torch.arange(4.0))


def test_a_heal_answer_not_signed_with_the_secret_is_refused(server):
    server.serve(3, STATE)
    with pytest.raises(HealRefusedError, match="refused this group's MAC: its run secret "
                                               "differs"):
        fetch(server.address(), 3, "A", RunSecret(SECRET + "-another"), timeout=5)
    open_server = HealServer("127.0.0.1", "127.0.0.1", None, timeout=2.0)
    try:
        open_server.serve(3, STATE)
        with pytest.raises(HealRefusedError, match="is not signed with the run secret: "
                                                   "refused, not loaded"):
            fetch(open_server.address(), 3, "A", RunSecret(SECRET), timeout=5)
    finally:
        open_server.shutdown()


def test_a_heal_state_of_another_step_or_with_code_is_refused(tmp_path):
    marker = tmp_path / "ran"

    class Code:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    srv = HealServer("127.0.0.1", "127.0.0.1", None, timeout=2.0)
    try:
        srv.serve(3, {**STATE, "torchft": {"step": 100000}})
        with pytest.raises(HealRefusedError, match="is of step 100000, the quorum asked for "
                                                   "step 3: refused"):
            fetch(srv.address(), 3, "A", None, timeout=5)
        srv.serve(3, {**STATE, "code": Code()})
        with pytest.raises(HealRefusedError, match="is not plain tensors and containers: "
                                                   "refused, not run"):
            fetch(srv.address(), 3, "A", None, timeout=5)
    finally:
        srv.shutdown()
    assert not marker.exists()
    buf = io.BytesIO()
    torch.save({"code": Code()}, buf)  # the payload would have run it
    torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert marker.exists()


# ---------------------------------------------------------------------- real processes
def _intruder(started: list, tmp: Path, url: str, *args: str, wait: bool = True) -> Forked:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=PYTHONPATH)
    env.pop(SECRET_ENV, None)  # it does not know the secret
    p = Forked(["-m", "intruder_workers", "--lighthouse", url, "--marker",
                str(tmp / "pwned"), *args], env=env, cwd=HERE, stdout=tmp / "intruder.log")
    started.append(p)
    if not wait:
        return p
    deadline = time.monotonic() + 60
    while "intruder up" not in (tmp / "intruder.log").read_text():
        assert time.monotonic() < deadline and p.poll() is None, \
            (tmp / "intruder.log").read_text()[-2000:]
        time.sleep(0.1)
    time.sleep(1.0)  # its heartbeats reach the lighthouse
    return p


def _refused(tmp: Path, name: str, p: Forked, words: str) -> str:
    rc = _wait(p, tmp, name)
    log = (tmp / f"{name}.log").read_text()
    assert rc == 2, f"{name} exited with {rc}; log:\n{log[-3000:]}"
    lines = [x for x in log.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and words in lines[0], log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    return lines[0]


def _never_jumped(tmp: Path, out: str) -> None:
    path = tmp / out / "progress0"
    rows = _progress(tmp, out) if path.exists() else []
    assert all(step < 1000 for step, _, _ in rows), rows


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("order", ["zero-first", "forward-zero", "zero-last"])
def test_a_group_without_the_secret_is_named_by_every_honest_group(tmp_path, procs,  # noqa: F811
                                                                    monkeypatch, order):
    """An intruder without the secret claims step 100000 with poisoned parameters and a
    pickle: both honest groups (with the secret) name it in one line and stop (exit 2); none
    ran its pickle, took its parameters or jumped to its step. Whatever the loop's order:
    the quorum forms in zero_grad() or in the model's forward pre-hook."""
    lh = Lighthouse(1, tmp_path / "lighthouse.log")
    try:
        _intruder(procs, tmp_path, lh.url, "--replica-id", "X")
        monkeypatch.setenv(SECRET_ENV, SECRET)
        common = ["--replicator", "demo", "--steps", "8", "--timeout", "20", "--order", order]
        honest = [(_worker(procs, tmp_path, lh.url, r, r, *common), r) for r in ("A", "B")]
        for p, name in honest:
            line = _refused(tmp_path, name, p, "holds replica group(s) 'X' without the run "
                                               "secret's tag")
            assert f"replica group {name!r}" in line
            _never_jumped(tmp_path, name)
    finally:
        lh.stop()
    assert not (tmp_path / "pwned").exists(), "the intruder's pickle ran"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_copied_tag_without_the_secret_is_named_at_the_next_quorum(tmp_path, procs,  # noqa: F811
                                                                       monkeypatch):
    """An intruder reads group B's tagged id from the lighthouse's status page, waits until B
    has left, and joins with it: the tag checks out, but it cannot prove the secret for the
    new quorum, so A names B's id as copied and stops (exit 2) before any heal or exchange;
    the intruder's pickle never ran and A never jumped to its step."""
    lh = Lighthouse(1, tmp_path / "lighthouse.log")
    try:
        monkeypatch.setenv(SECRET_ENV, SECRET)
        copied, up = tmp_path / "copied", tmp_path / "x-up"
        # both wait at step 2 until the id is copied (a group alone with a live peer that does
        # not ask for a quorum has no majority), B leaves after it, A waits at step 4 for X
        a = _worker(procs, tmp_path, lh.url, "A", "A", "--replicator", "demo", "--steps", "12",
                    "--timeout", "12", "--hold", f"2:{copied}", "--hold", f"4:{up}")
        b = _worker(procs, tmp_path, lh.url, "B", "B", "--replicator", "demo", "--steps", "3",
                    "--timeout", "12", "--hold", f"2:{copied}")
        x = _intruder(procs, tmp_path, lh.url, "--copy", "B", "--copied", str(copied),
                      "--after", str(tmp_path / "B" / "final0.pt"), "--up", str(up),
                      wait=False)
        assert _wait(b, tmp_path, "B") == 0
        line = _refused(tmp_path, "A", a, "replica group(s) 'B' of the quorum carry a valid "
                                          "tag but did not prove the run secret")
        assert line.startswith("error: replica group 'A'")
        _never_jumped(tmp_path, "A")
        assert x.poll() is None or x.returncode == 0
    finally:
        lh.stop()
    assert not (tmp_path / "pwned").exists(), "the intruder's pickle ran"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_without_a_secret_a_pickled_heal_state_is_refused_not_run(tmp_path,
                                                                  procs):  # noqa: F811
    """An open run (no secret): the intruder is the heal source (its step is the quorum's
    newest), but its state holds a pickled object: the honest group refuses the heal in one
    line and stops; the pickle never ran and no parameter of it was taken. (torchft's own
    transport loads it with weights_only=False: the marker file appeared.)"""
    lh = Lighthouse(1, tmp_path / "lighthouse.log")
    try:
        _intruder(procs, tmp_path, lh.url, "--replica-id", "X")
        a = _worker(procs, tmp_path, lh.url, "A", "A", "--replicator", "demo", "--steps", "8",
                    "--timeout", "20")
        _refused(tmp_path, "A", a, "refused to heal: the state served at")
        assert "is not plain tensors and containers: refused, not run" in \
            (tmp_path / "A.log").read_text()
        _never_jumped(tmp_path, "A")
    finally:
        lh.stop()
    assert not (tmp_path / "pwned").exists(), "the intruder's pickle ran"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_honest_runs_with_the_secret_heal_and_match_runs_without(tmp_path, monkeypatch,
                                                                  procs):  # noqa: F811
    """A group killed and restarted heals from its peer through the authenticated transport;
    the run with the secret ends bitwise where the run without it does, and each group's
    start-up line says whether the run is open."""
    runs = {}
    for label, secret in (("open", None), ("secret", SECRET)):
        tmp = tmp_path / label
        tmp.mkdir()
        if secret is None:
            monkeypatch.delenv(SECRET_ENV, raising=False)
        else:
            monkeypatch.setenv(SECRET_ENV, secret)
        _kill_and_restart(tmp, procs, "demo", 9)
        runs[label] = (_final(tmp, "A"), _final(tmp, "B2"))
        log = (tmp / "B2.log").read_text()
        if secret is None:
            assert "replica group 'B': this run is OPEN (no FLEXDEMO_SECRET)" in log, log
        else:
            fp = RunSecret(secret).fingerprint
            assert f"replica group 'B': run secret {fp} (fingerprint)" in log, log
            assert "the heal server listens on 127.0.0.1:" in log
            assert "its store on 127.0.0.1:" in log
    for i in range(2):
        assert _same(runs["open"][i]["params"], runs["secret"][i]["params"])
    assert _same(runs["secret"][0]["params"], runs["secret"][1]["params"])


def test_the_lighthouse_listens_on_loopback_unless_told():
    from flexdemo.ft.lighthouse import OPTIONS

    assert dict((n, d) for n, d, _ in OPTIONS)["--bind"] == "127.0.0.1:29510"


# ---------------------------------------------------------------------- liveness
def test_a_forged_liveness_verdict_never_stops_a_run_with_the_secret(capfd):
    """Someone writes a verdict naming rank 1 as lost into the job's store, at the plain key
    and at the secret-scoped one: with the secret, rank 0's heartbeat thread does not act on
    it and says so once; a real death is still named by every survivor, the same verdict."""
    import torch.distributed as dist

    from flexdemo.app.train.liveness import Heartbeat
    from flexdemo.tools.ranks import free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 3, is_master=True, wait_for_workers=False)
    stores = [server] + [dist.TCPStore("127.0.0.1", port, 3, is_master=False)
                         for _ in range(2)]
    secret = RunSecret(SECRET)
    heard: list[list[int]] = []
    beats = [Heartbeat(r, 3, interval=0.1, store=stores[r], secret=secret,
                       on_verdict=heard.append if r == 0 else None) for r in range(3)]
    try:
        for prefix in (Heartbeat.PREFIX, beats[0].prefix):
            server.set(f"{prefix}verdict", "[1]")  # forged: rank 1 is alive
        time.sleep(1.5)  # 15 beats: the forged verdict was seen and ignored
        assert heard == []
        assert capfd.readouterr().err.count("ignored a liveness verdict") == 1
        server.delete_key(f"{beats[0].prefix}verdict")
        beats[2].stop()  # rank 2 dies
        assert beats[1].lost_ranks() == ([2], "")
        deadline = time.monotonic() + 60
        while not heard and time.monotonic() < deadline:
            time.sleep(0.05)
        assert heard == [[2]]
    finally:
        for b in beats:
            b.stop()
    unsigned = Heartbeat(0, 3, interval=0.1, store=stores[0])  # no secret: the plain keys
    try:
        assert unsigned.prefix == Heartbeat.PREFIX
    finally:
        unsigned.stop()


def test_the_lighthouse_says_where_it_listens_and_what_its_dashboard_allows():
    from flexdemo.ft.lighthouse import exposure

    assert exposure("127.0.0.1:29510").startswith("listening on 127.0.0.1:29510 (loopback only)")
    wide = exposure("[::]:29510")
    assert "(every interface)" in wide and "POST /replica/<id>/kill" in wide
    assert "FLEXDEMO_SECRET" in exposure("10.8.0.1:29510")


def test_a_job_reached_beyond_loopback_without_a_secret_says_it_is_open():
    """Rank 0 says so at start-up where the job's store is reached beyond loopback and there
    is no run secret (a job on one machine says nothing)."""
    from flexdemo.join import OPEN_NOTE, _loopback

    assert _loopback("127.0.0.1") and _loopback("localhost") and _loopback("::1")
    assert not _loopback("203.0.113.7")  # not this machine's: reached over a network
    line = OPEN_NOTE.format(addr="10.8.0.1", port=29500)
    assert line.startswith("flexdemo: this job is open (no FLEXDEMO_SECRET): its store at "
                           "10.8.0.1:29500") and line.endswith("(docs/security.md)")
