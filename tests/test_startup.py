"""Start-up: a peer that never arrives, or dies while the job assembles, is named by rank by
every survivor (exit code 2), long before the collective timeout (FLEXDEMO_TIMEOUT)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from dist_util import Forked, free_port, reap, spawn_ranks

from flexdemo.secret import RunSecret

ROOT = Path(__file__).parent.parent
TRAIN = ["train", str(ROOT / "configs/gpt.toml"), "task.model=tiny", "task.corpus_bytes=200000",
         "train.batch=2", "train.steps=20", "train.tensorboard=false", "train.progress=false"]
# the collective timeout is far longer than any wait the test allows: only the start-up
# check can end these runs in time (the communicate() timeouts below guard against a hang)
LONG = 900


def _client(port: int) -> dist.TCPStore:
    """A client of the job's store, once rank 0 listens (torch's own connection retries back
    off for seconds at a time)."""
    for _ in range(1200):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            time.sleep(0.1)
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if "flexdemo train: error" in line]


@pytest.mark.multiprocess
@pytest.mark.parametrize("killed", [2, 0])
def test_rank_killed_a_second_after_launch_is_named_by_every_survivor(tmp_path, killed):
    """Four ranks launched; one is killed with SIGKILL a second after launch, before it
    reaches the job (it is a process that stops short of it: a real rank of `flexdemo train`
    reached the job within that second on a fast machine). The three others exit 2 with one
    line naming it, not after FLEXDEMO_TIMEOUT."""
    port = free_port()
    survivors = [r for r in range(4) if r != killed]
    started = spawn_ranks(4, [*TRAIN, f"train.out={tmp_path / 'run'}"], timeout=LONG,
                          ranks=survivors, port=port)
    env = dict(os.environ, RANK=str(killed), LOCAL_RANK="0", WORLD_SIZE="4",
               LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    victim = Forked(["-c", "import time\ntime.sleep(120)\n"], env=env)
    procs = dict(zip(survivors, started)) | {killed: victim}
    try:
        time.sleep(1)
        victim.send_signal(signal.SIGKILL)
        outputs = {r: procs[r].communicate(timeout=240)[0] for r in survivors}
    finally:
        reap(list(procs.values()))
    for rank, text in outputs.items():
        assert procs[rank].returncode == 2, (rank, text[-2000:])
        errors = _errors(text)
        assert len(errors) == 1, (rank, text[-2000:])
        assert f"rank {rank}: start-up: " in errors[0], errors[0]
        assert f"rank {killed}" in errors[0].split("start-up: ", 1)[1], errors[0]
        others = [r for r in survivors if r != rank]
        assert not any(f"rank {r} " in errors[0].split("start-up: ", 1)[1]
                       or f"rank {r}," in errors[0] for r in others), errors[0]
        assert "Traceback" not in text, (rank, text[-2000:])


@pytest.mark.multiprocess
def test_rank_that_dies_after_arriving_is_named_as_dead(tmp_path):
    """Ranks 0, 2 and 3 of four start (rank 1 never does, and the wait for it is long);
    rank 3 is killed once it has registered in the job's store. Ranks 0 and 2 say that rank
    3 died during start-up (rank 1 has not arrived yet) and exit 2, without waiting out
    FLEXDEMO_JOIN_TIMEOUT or FLEXDEMO_TIMEOUT."""
    port = free_port()
    procs = spawn_ranks(4, [*TRAIN, f"train.out={tmp_path / 'run'}"], timeout=LONG,
                        ranks=[0, 2, 3], port=port, env={"FLEXDEMO_JOIN_TIMEOUT": str(LONG)})
    try:
        store = _client(port)
        store.wait(["flexdemo/join/0/info/3"], timedelta(seconds=120))
        procs[2].send_signal(signal.SIGKILL)  # rank 3 (procs: ranks 0, 2, 3)
        outputs = {r: procs[i].communicate(timeout=240)[0] for i, r in ((0, 0), (1, 2))}
    finally:
        reap(procs)
    for i, (rank, text) in enumerate(outputs.items()):
        assert procs[i].returncode == 2, (rank, text[-2000:])
        errors = _errors(text)
        assert len(errors) == 1, (rank, text[-2000:])
        assert "rank 3 (host " in errors[0] and "died during start-up" in errors[0], errors[0]
        assert "rank 1 had not arrived yet" in errors[0], errors[0]
        assert "Traceback" not in text, (rank, text[-2000:])


@pytest.mark.multiprocess
def test_rank_that_dies_while_the_job_is_set_up_is_named(tmp_path):
    """Four ranks join; rank 2 is killed once its trainer heartbeat exists (it is building
    the task or in prepare()'s collectives). The survivors, some of them blocked in
    collectives that wait for rank 2, name it and exit 2, not after FLEXDEMO_TIMEOUT."""
    port = free_port()
    # a larger corpus: building the task (after the join) takes a while, long enough for the
    # kill to land in the set-up
    procs = spawn_ranks(4, [*TRAIN, "task.corpus_bytes=4000000", "train.steps=300",
                            f"train.out={tmp_path / 'run'}"], timeout=LONG, port=port)
    try:
        # the trainer's heartbeats, in the default group's keys ("0/" under "default_pg")
        store = dist.PrefixStore("0/", dist.PrefixStore("default_pg", _client(port)))
        while not store.check(["flexdemo/liveness/hb/2"]):
            assert all(p.poll() is None for p in procs), procs[0].communicate()[0]
            time.sleep(0.05)
        procs[2].send_signal(signal.SIGKILL)
        outputs = {r: procs[r].communicate(timeout=240)[0] for r in (0, 1, 3)}
    finally:
        reap(procs)
    for rank, text in outputs.items():
        assert procs[rank].returncode == 2, (rank, text[-2000:])
        errors = _errors(text)
        assert len(errors) == 1, (rank, text[-2000:])
        assert f"rank {rank}: start-up: lost rank 2 " in errors[0], errors[0]
        assert "Traceback" not in text, (rank, text[-2000:])


@pytest.mark.multiprocess
def test_store_host_dying_while_the_group_is_made_is_named():
    """Rank 0 finishes the start-up handshake and dies before the process group exists: rank
    1, inside init_process_group, names rank 0 in one line (it printed torch's
    DistNetworkError traceback when the store's connection closed there)."""
    port = free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
               FLEXDEMO_TIMEOUT="60", OMP_NUM_THREADS="1")
    host = ("import os, signal, time\nfrom datetime import timedelta\n"
            "from flexdemo.join import join_store\n"
            f"join_store(0, 2, '127.0.0.1', {port}, timedelta(seconds=60))\n"
            "time.sleep(1.0)  # rank 1 is in init_process_group, waiting for rank 0\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    joiner = ("import flexdemo\ntry:\n    flexdemo.init_distributed()\n"
              "except TimeoutError as e:\n    print('ERROR', e)\n")
    procs = [Forked(["-c", host], env=dict(env, RANK="0"), stdout=subprocess.PIPE),
             Forked(["-c", joiner], env=dict(env, RANK="1"), stdout=subprocess.PIPE)]
    try:
        out = procs[1].communicate(timeout=120)[0]
        procs[0].communicate(timeout=30)
    finally:
        reap(procs)
    assert procs[0].returncode == -signal.SIGKILL
    errors = [line for line in out.splitlines() if line.startswith("ERROR")]
    assert procs[1].returncode == 0 and len(errors) == 1, out[-3000:]
    assert "rank 1: start-up: rank 0 (the host of the job's store at " in errors[0], errors[0]
    assert f"127.0.0.1:{port}) died during start-up" in errors[0], errors[0]


def _joiner(extra: str = "") -> str:
    """A rank that calls init_distributed() and prints its one-line error, then ``extra``."""
    return ("import flexdemo\ntry:\n    flexdemo.init_distributed()\n"
            "except TimeoutError as e:\n    print('ERROR', e, flush=True)\n    raise SystemExit\n"
            + extra)


def _rank_2_dies_after_the_join(env: dict, port: int) -> list[str]:
    """Ranks 0 and 1 join (``_joiner``) while rank 2 finishes the join and kills itself
    before the process group exists; the outputs of ranks 0 and 1."""
    dying = ("import os, signal\nfrom datetime import timedelta\n"
             "from flexdemo.join import join_store\n"
             f"join_store(2, 3, '127.0.0.1', {port}, timedelta(seconds={LONG}))\n"
             "os.kill(os.getpid(), signal.SIGKILL)\n")
    procs = [Forked(["-c", _joiner()], env=dict(env, RANK=str(r)), stdout=subprocess.PIPE)
             for r in (0, 1)]
    procs.append(Forked(["-c", dying], env=dict(env, RANK="2"), stdout=subprocess.PIPE))
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs[:2]]
        procs[2].communicate(timeout=30)
    finally:
        reap(procs)
    assert procs[2].returncode == -signal.SIGKILL
    assert all(p.returncode == 0 for p in procs[:2]), outs
    return outs


def _verdicts(outs: list[str]) -> list[str]:
    """What each of ranks 0 and 1 said of rank 2: one ERROR line naming it alone."""
    verdicts = []
    for rank, out in enumerate(outs):
        errors = [line for line in out.splitlines() if line.startswith("ERROR")]
        assert len(errors) == 1, out[-3000:]
        head, said = errors[0].split(" start-up: ", 1)
        assert head == f"ERROR rank {rank}:", errors[0]
        assert said.startswith("rank 2 (host ") and "died during start-up" in said, errors[0]
        assert "rank 0" not in said and "rank 1" not in said, errors[0]
        verdicts.append(said)
    return verdicts


@pytest.mark.multiprocess
def test_rank_dying_between_the_join_and_the_group_is_named_by_every_survivor():
    """Rank 2 of three finishes the join and is killed before it enters the process group's
    rendezvous, where gloo waits for its address with no sign of life. Ranks 0 (the store's
    host) and 1 name it in one line, the same verdict, long before FLEXDEMO_TIMEOUT (they
    once waited all of it there)."""
    port = free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="3",
               FLEXDEMO_TIMEOUT=str(LONG), FLEXDEMO_JOIN_TIMEOUT="5", OMP_NUM_THREADS="1")
    verdicts = _verdicts(_rank_2_dies_after_the_join(env, port))
    assert verdicts[0] == verdicts[1]


@pytest.mark.multiprocess
def test_group_made_within_the_join_window_keeps_the_collective_timeout():
    """The group's rendezvous is bounded by the join's window (2 s here); the group it makes
    waits the collective timeout (60 s): rank 1 enters an all-reduce 6 s after rank 0, and
    both sum."""
    port = free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
               FLEXDEMO_TIMEOUT="60", FLEXDEMO_JOIN_TIMEOUT="2", OMP_NUM_THREADS="1")
    reduce = ("import os, time, torch\nimport torch.distributed as dist\n"
              "if dist.get_rank() == 1:\n    time.sleep(6)\n"
              "t = torch.ones(1) * (dist.get_rank() + 1)\ndist.all_reduce(t)\n"
              "print('SUM', int(t.item()), flush=True)\ndist.destroy_process_group()\n")
    procs = [Forked(["-c", _joiner(reduce)], env=dict(env, RANK=str(r)),
                    stdout=subprocess.PIPE) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        reap(procs)
    for p, out in zip(procs, outs):
        assert p.returncode == 0 and "SUM 3" in out.splitlines(), out[-3000:]


# ------------------------------------------------------------------ a run secret
# The job's store has no authentication: whoever reaches its port can write there. These
# tests host the store themselves, as torchrun's agent does (TORCHELASTIC_USE_AGENT_STORE), so
# that what they write is in before any rank joins.
SECRET = "start-up-tests-secret-0123456789"
JOINED = ("import torch.distributed as dist\nprint('JOINED', dist.get_world_size(), flush=True)\n"
          "dist.destroy_process_group()\n")
WARNING = "flexdemo: ignored a start-up verdict in the store that is not signed with the run secret"


def _agent_job(world: int, secret: str | None, **env: str) -> tuple[dist.TCPStore, dict]:
    """The job's store, hosted here, and the ranks' environment (``secret``: FLEXDEMO_SECRET)."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    base = {k: v for k, v in os.environ.items() if k != "FLEXDEMO_SECRET"}
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                TORCHELASTIC_USE_AGENT_STORE="True", FLEXDEMO_TIMEOUT=str(LONG),
                OMP_NUM_THREADS="1", **env)
    return store, base if secret is None else dict(base, FLEXDEMO_SECRET=secret)


def _start_after_a_forged_verdict(secret: str | None) -> list[str]:
    """Two ranks started after someone wrote a verdict naming rank 1 as dead into the store."""
    store, env = _agent_job(2, secret, FLEXDEMO_JOIN_TIMEOUT="60")
    store.set("flexdemo/join/0/outcome", '{"died": [1], "absent": [], "waited": null}')
    procs = [Forked(["-c", _joiner(JOINED)], env=dict(env, RANK=str(r)), stdout=subprocess.PIPE)
             for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        reap(procs)
    assert all(p.returncode == 0 for p in procs), outs
    return outs


@pytest.mark.multiprocess
def test_forged_verdict_is_ignored_with_a_run_secret():
    """With FLEXDEMO_SECRET on every rank, a verdict that someone wrote into the job's store
    before the ranks joined is not signed: both ranks start, each with one warning line."""
    for out in _start_after_a_forged_verdict(SECRET):
        assert "JOINED 2" in out.splitlines() and "ERROR" not in out, out[-3000:]
        warnings = [line for line in out.splitlines() if WARNING in line]
        assert len(warnings) == 1, out[-3000:]
        assert "(key flexdemo/join/0/outcome); someone else can write to this job's store: see "\
            "docs/security.md" in warnings[0], warnings[0]


@pytest.mark.multiprocess
def test_forged_verdict_is_taken_without_a_run_secret():
    """Without a secret (an open run) the same forged verdict is taken: both ranks refuse to
    start, naming the healthy rank 1 as dead (what a secret prevents)."""
    for rank, out in enumerate(_start_after_a_forged_verdict(None)):
        errors = [line for line in out.splitlines() if line.startswith("ERROR")]
        assert len(errors) == 1 and "JOINED" not in out, out[-3000:]
        assert errors[0].startswith(f"ERROR rank {rank}: start-up: rank 1 "), errors[0]
        assert "died during start-up" in errors[0], errors[0]


@pytest.mark.multiprocess
def test_dead_rank_is_named_by_every_survivor_with_signed_verdicts():
    """With a run secret, rank 2 of three finishes the join and is killed before the process
    group exists; a forged verdict naming rank 0 waits in the store. Ranks 0 and 1 ignore it
    (one warning line each) and both name rank 2, through the signed verdict at the key named
    by the secret."""
    store, env = _agent_job(3, SECRET, FLEXDEMO_JOIN_TIMEOUT="5")
    plain = "flexdemo/join/0/group/outcome"
    store.set(plain, "[0]")
    outs = _rank_2_dies_after_the_join(env, int(env["MASTER_PORT"]))
    verdicts = _verdicts(outs)
    for out in outs:
        warnings = [line for line in out.splitlines() if WARNING in line]
        assert len(warnings) == 1 and f"(key {plain})" in warnings[0], out[-3000:]
    assert verdicts[0] == verdicts[1]
    secret = RunSecret(SECRET)
    key = f"{plain}/{secret.mac('startup-key', plain)[:16]}"
    assert store.get(plain) == b"[0]"  # the forged one, untouched
    assert secret.open("startup-verdict", store.get(key).decode()) == f"{key}\n[2]"


@pytest.mark.multiprocess
def test_ranks_with_different_run_secrets_name_the_mismatch():
    """Rank 0 runs with a secret, rank 1 without: their keys differ, so neither sees the other
    arrive; each names the other as started with another FLEXDEMO_SECRET, not as missing."""
    store, env = _agent_job(2, None, FLEXDEMO_JOIN_TIMEOUT="3")
    procs = [Forked(["-c", _joiner(JOINED)], env=dict(env, RANK="0", FLEXDEMO_SECRET=SECRET),
                    stdout=subprocess.PIPE),
             Forked(["-c", _joiner(JOINED)], env=dict(env, RANK="1"), stdout=subprocess.PIPE)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        reap(procs)
    for rank, out in enumerate(outs):
        errors = [line for line in out.splitlines() if line.startswith("ERROR")]
        assert procs[rank].returncode == 0 and len(errors) == 1, out[-3000:]
        assert (f"start-up: rank {1 - rank} started with another FLEXDEMO_SECRET than this rank"
                in errors[0]), errors[0]
