"""Checkpoints: bitwise resume (one process and a 2 x 2 mesh), atomic saves, clear errors."""

import errno
import json
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from ckpt_workers import (
    extra_for,
    fewer_replicas_worker,
    make_single,
    more_replicas_worker,
    rank0_only_worker,
    resume_worker,
    run_steps,
)
from dist_util import run_python, run_world

import flexdemo
import flexdemo.checkpoint as ckpt
import flexdemo.checkpoint.save_load as save_load
from flexdemo.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from flexdemo.checkpoint.files import RANKS_DIR


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------- one process
@pytest.mark.parametrize("kind", ["demo", "diloco", "demo-delayed"])
def test_round_trip_continues_bitwise(tmp_path, kind):
    model, opt = make_single(kind, 0)
    run_steps(model, opt, 2, 0)
    if kind == "diloco":
        assert opt.replicators[0].pending, "fragment 0's sync should be in flight after step 1"
    if kind == "demo-delayed":  # step 1's exchange in flight, step 0's verdict not yet judged
        assert opt.replicators[0].inflight.sent and opt.replicators[0].inflight.verdict
    path = save_checkpoint(tmp_path / "step_000002", model, opt, step=2, extra=extra_for(0))
    assert path == tmp_path / "step_000002"
    run_steps(model, opt, 5, 2)
    expected = params(model)

    model2, opt2 = make_single(kind, 1)  # other initial weights
    assert not equal(params(model2), params(model))
    res = load_checkpoint(path, model2, opt2)
    assert res["step"] == 2 and opt2.steps == 2 and opt2.skipped_steps == 0
    if kind == "demo-delayed":  # the verdict comes back, to be judged at the next step
        assert opt2.replicators[0].inflight.verdict[0] == 0
    want = extra_for(0)
    assert res["extra"].keys() == want.keys()
    assert torch.equal(res["extra"]["rng"], want["rng"])
    assert res["extra"]["rng"].dtype == torch.uint8
    assert torch.equal(res["extra"]["gen"], want["gen"])
    assert res["extra"]["note"] == want["note"] and res["extra"]["data_pos"] == 100
    # the optimizer still shares its parameter groups and state with the base optimizer
    assert opt2.param_groups is opt2.base.param_groups and opt2.state is opt2.base.state
    run_steps(model2, opt2, 5, 2)
    assert equal(params(model2), expected)


def test_save_before_first_step_leaves_optimizer_alone(tmp_path):
    model, opt = make_single("demo", 0)
    path = save_checkpoint(tmp_path / "step_000000", model, opt, step=0)
    assert not any(opt.base.state.values()), "saving must not initialise the base state"
    run_steps(model, opt, 3, 0)
    model2, opt2 = make_single("demo", 1)
    load_checkpoint(path, model2, opt2)
    assert not any(opt2.base.state.values())
    run_steps(model2, opt2, 3, 0)
    assert equal(params(model2), params(model))


def test_latest_checkpoint_and_overwrite(tmp_path):
    assert latest_checkpoint(tmp_path / "nothing") is None
    assert latest_checkpoint(tmp_path) is None
    model, opt = make_single("demo", 0)
    save_checkpoint(tmp_path / "step_2", model, opt, step=2)
    run_steps(model, opt, 1, 0)
    ten = save_checkpoint(tmp_path / "step_10", model, opt, step=10)
    (tmp_path / "step_99").mkdir()  # no marker: not a checkpoint
    shutil.copytree(ten, tmp_path / "step_50.tmp-123")  # temporary: never returned
    assert latest_checkpoint(tmp_path) == ten  # by step, not by name
    run_steps(model, opt, 1, 1)
    save_checkpoint(ten, model, opt, step=10, extra={"again": True})  # replaces it atomically
    assert not (tmp_path / "step_50.tmp-123").exists(), "stale temporary directories are removed"
    model2, opt2 = make_single("demo", 1)
    assert load_checkpoint(latest_checkpoint(tmp_path), model2, opt2)["extra"] == {"again": True}
    assert equal(params(model2), params(model))
    assert sorted(os.listdir(tmp_path)) == ["step_10", "step_2", "step_99"]


def test_failed_commit_leaves_previous_checkpoint(tmp_path, monkeypatch):
    model, opt = make_single("demo", 0)
    good = save_checkpoint(tmp_path / "step_000001", model, opt, step=1)
    expected = params(model)
    run_steps(model, opt, 1, 0)

    def boom(tmp, final):
        assert (tmp / ckpt.MARKER_FILE).exists() and (tmp / ".metadata").exists()
        raise OSError("disk full (simulated)")

    with pytest.raises(ValueError, match="cannot be pickled"):  # fails before writing
        save_checkpoint(tmp_path / "step_000002", model, opt, step=2, extra={"f": lambda: 0})
    assert os.listdir(tmp_path) == ["step_000001"]
    monkeypatch.setattr(save_load, "_commit", boom)
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(tmp_path / "step_000002", model, opt, step=2)
    assert latest_checkpoint(tmp_path) == good
    assert os.listdir(tmp_path) == ["step_000001"]  # the temporary directory was removed
    model2, opt2 = make_single("demo", 1)
    load_checkpoint(good, model2, opt2)
    assert equal(params(model2), expected)


@pytest.mark.multiprocess
def test_killed_during_save_leaves_previous_checkpoint(tmp_path):
    """A process that dies between writing everything and the rename (no clean-up runs)."""
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from ckpt_workers import make_single, run_steps
        import flexdemo.checkpoint as ckpt
        import flexdemo.checkpoint.save_load as save_load
        model, opt = make_single("demo", 0)
        run_steps(model, opt, 2, 0)
        ckpt.save_checkpoint({str(tmp_path)!r} + "/step_000002", model, opt, step=2)
        run_steps(model, opt, 2, 2)
        save_load._commit = lambda tmp, final: os._exit(17)
        ckpt.save_checkpoint({str(tmp_path)!r} + "/step_000004", model, opt, step=4)
    """)
    proc = run_python(["-c", code], timeout=120)  # (forked from the preloaded fork server)
    assert proc.returncode == 17, proc.stderr
    stale = [d for d in os.listdir(tmp_path) if ".tmp-" in d]
    assert len(stale) == 1 and (tmp_path / stale[0] / ckpt.MARKER_FILE).exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000002"
    # the survivor is loadable and resumes where the dead run was at step 2
    model, opt = make_single("demo", 0)
    run_steps(model, opt, 4, 0)
    model2, opt2 = make_single("demo", 1)
    assert load_checkpoint(tmp_path / "step_000002", model2, opt2)["step"] == 2
    run_steps(model2, opt2, 2, 2)
    assert equal(params(model2), params(model))
    with pytest.raises(ValueError, match="not a complete"):
        load_checkpoint(tmp_path / stale[0], model2, opt2)
    save_checkpoint(tmp_path / "step_000004", model2, opt2, step=4)
    assert sorted(os.listdir(tmp_path)) == ["step_000002", "step_000004"]


def test_missing_incomplete_and_root_directories_raise(tmp_path):
    model, opt = make_single("demo", 0)
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint(tmp_path / "step_000007", model, opt)
    path = save_checkpoint(tmp_path / "step_000007", model, opt, step=7)
    with pytest.raises(ValueError, match="directory of checkpoints"):
        load_checkpoint(tmp_path, model, opt)
    (path / ckpt.MARKER_FILE).unlink()
    with pytest.raises(ValueError, match="not a complete flexdemo checkpoint"):
        load_checkpoint(path, model, opt)
    assert latest_checkpoint(tmp_path) is None


def test_other_model_or_optimizer_raises(tmp_path):
    model, opt = make_single("demo", 0)
    path = save_checkpoint(tmp_path / "step_000001", model, opt, step=1)
    other, other_opt = make_single("demo", 0, width=7)
    with pytest.raises(ValueError, match=r"another model.*out\.weight \(6, 32\) -> \(7, 32\)"):
        load_checkpoint(path, other, other_opt)
    model2, diloco_opt = make_single("diloco", 0)
    with pytest.raises(ValueError, match="replicators"):
        load_checkpoint(path, model2, diloco_opt)


# ---------------------------------------------------------------------------- 4 ranks, 2 x 2
@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt4")
    return root, run_world(resume_worker, 4, str(root))


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["demo", "diloco"])
def test_distributed_resume_is_bitwise_on_every_rank(world4, kind):
    _, results = world4
    for rank, res in enumerate(results):
        r = res[kind]
        assert r["found"] and r["differs_before"], rank
        assert r["bitwise"], f"{kind}: rank {rank} diverged after resuming"
        assert r["step"] == r["steps"] == (3 if kind == "demo" else 4)
        assert r["extra_ok"], f"rank {rank} did not get its own extra back"
    if kind == "diloco":
        assert all(res["diloco_in_flight"] for res in results)
        # inner steps differ per replica: the model and AdamW state are stored per rank
        assert results[0]["diloco"]["layout"] == "per_rank"
    else:  # DeMo keeps replicas bitwise identical: one copy of the model suffices
        assert results[0]["demo"]["layout"] == "shared"


@pytest.mark.multiprocess
def test_distributed_each_rank_gets_its_own_demo_delta(world4):
    _, results = world4
    coords = [res["demo"]["coord"] for res in results]
    assert coords == [[0, 0], [0, 1], [1, 0], [1, 1]]
    for rank, res in enumerate(results):
        assert equal(res["demo"]["saved_delta"], res["demo"]["loaded_delta"]), rank
    for a, b in ((0, 2), (1, 3)):  # the two replicas of one shard hold different momentum
        da, db = results[a]["demo"]["saved_delta"], results[b]["demo"]["saved_delta"]
        assert not equal(da, db), "the test needs replicas whose DeMo deltas differ"


@pytest.mark.multiprocess
def test_distributed_other_mesh_raises(world4):
    _, results = world4
    for res in results:
        msg = res["mesh_error"]
        assert msg is not None and "2 x 2" in msg and "4 x 1" in msg and "replicate=2" in msg


@pytest.mark.multiprocess
def test_other_world_size_raises(world4):
    root, _ = world4
    path = root / "demo" / "step_000003"
    meta = json.loads((path / ckpt.META_FILE).read_text())
    assert meta["world_size"] == 4 and meta["mesh_shape"] == [2, 2]
    assert len(os.listdir(path / RANKS_DIR)) == 4
    model, opt = make_single("demo", 0)  # one process
    with pytest.raises(ValueError, match=r"written by 4 rank\(s\).*runs 1 rank"):
        load_checkpoint(path, model, opt)


@pytest.mark.multiprocess
def test_state_saved_on_rank_0_only_is_refused_on_every_rank(tmp_path):
    """torch.save(opt.state_dict()) on rank 0, loaded on both: one line on every rank saying
    that each rank saves its own state, before anything is loaded, and the ranks stay in step
    (no rank goes on into a collective the other never joins)."""
    results = run_world(rank0_only_worker, 2, str(tmp_path))
    for rank, res in enumerate(results):
        msg = res["error"]
        assert msg is not None and "\n" not in msg, (rank, msg)
        assert "state of rank(s) [0], not of this rank (1)" in msg, (rank, msg)
        assert "Save it on every rank: flexdemo.save_checkpoint" in msg, (rank, msg)
        assert res["total"] == 2.0 and res["steps"] == 2  # nothing was loaded
    assert "failed on rank(s) [1]" in results[0]["error"]


# ---------------------------------------------------------------------------- storage faults
def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "simulated.distcp")


@pytest.mark.parametrize("where", ["dcp", "rank_file"])
def test_full_disk_during_save_is_one_line_and_keeps_the_previous_checkpoint(
        tmp_path, monkeypatch, where):
    model, opt = make_single("demo", 0)
    good = save_checkpoint(tmp_path / "step_000001", model, opt, step=1)
    run_steps(model, opt, 1, 0)
    if where == "dcp":  # DCP wraps it in a CheckpointException (a BaseException)
        monkeypatch.setattr(dcp_filesystem, "_write_item", _no_space)
    else:
        monkeypatch.setattr(save_load, "fsync_write", _no_space)
    with pytest.raises(ckpt.CheckpointError) as info:
        save_checkpoint(tmp_path / "step_000002", model, opt, step=2)
    msg = str(info.value)
    assert "\n" not in msg and "no space left on device" in msg and "step_000002" in msg, msg
    assert isinstance(info.value, Exception)  # `except Exception` sees it
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == good and os.listdir(tmp_path) == ["step_000001"]
    load_checkpoint(good, *make_single("demo", 1))


@pytest.mark.parametrize("damage", ["truncate", "remove"])
def test_damaged_distcp_file_is_one_line_naming_it(tmp_path, damage):
    model, opt = make_single("demo", 0)
    path = save_checkpoint(tmp_path / "step_000001", model, opt, step=1)
    (data,) = path.glob("*.distcp")
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 3])
    else:
        data.unlink()
    with pytest.raises(ckpt.CheckpointError) as info:
        load_checkpoint(path, *make_single("demo", 1))
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg and "Traceback" not in msg, msg
    assert data.name in msg, msg
    if damage == "remove":
        assert "is missing" in msg, msg
    else:
        assert "is truncated" in msg, msg
    assert info.value.cause == "damaged"
    # without the digests, DCP's own failure is still one line naming the cause
    with pytest.raises(ckpt.CheckpointError) as info:
        load_checkpoint(path, *make_single("demo", 1), verify=False)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg, msg
    if damage == "remove":
        assert "no such file or directory" in msg and data.name in msg, msg
    else:
        assert "truncated or corrupt" in msg, msg


# ---------------------------------------------------------------------------- integrity
def _write_inside(path: Path, data: bytes, at: int | None = None) -> None:
    """Overwrite ``len(data)`` bytes in the middle of ``path`` (its size stays the same)."""
    size = path.stat().st_size
    at = max(0, size // 2 - len(data) // 2) if at is None else at
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data[: max(0, size - at)])


def test_every_file_is_recorded_with_its_sha256(tmp_path):
    import hashlib

    from flexdemo.checkpoint import check_checkpoint

    model, opt = make_single("demo", 0)
    run_steps(model, opt, 1, 0)
    path = save_checkpoint(tmp_path / "step_000001", model, opt, step=1)
    marker = json.loads((path / ckpt.MARKER_FILE).read_text())
    on_disk = sorted(str(f.relative_to(path)) for f in path.rglob("*")
                     if f.is_file() and f.name != ckpt.MARKER_FILE)
    assert sorted(marker["files"]) == on_disk
    assert marker["ranks"] == {"0": on_disk}
    for name, d in marker["files"].items():
        data = (path / name).read_bytes()
        assert d == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    status = check_checkpoint(path)
    assert status.state == "intact" and status.ok and not status.problems


@pytest.mark.parametrize("damage", ["zeros-distcp", "random-distcp", "garbage-json",
                                    "random-metadata", "garbage-marker"])
def test_damaged_checkpoint_is_refused_naming_the_file(tmp_path, damage):
    """Bytes changed inside a file (size unchanged) used to load silently or fail deep in
    DCP; the digests name the file before anything is loaded."""
    model, opt = make_single("demo", 0)
    run_steps(model, opt, 1, 0)
    path = save_checkpoint(tmp_path / "step_000001", model, opt, step=1)
    (data,) = path.glob("*.distcp")
    target, junk = {
        "zeros-distcp": (data, bytes(4096)),
        "random-distcp": (data, os.urandom(4096)),
        "garbage-json": (path / ckpt.META_FILE, b"}{ not json"),
        "random-metadata": (path / ".metadata", os.urandom(64)),
        "garbage-marker": (path / ckpt.MARKER_FILE, b"\x00garbage"),
    }[damage]
    _write_inside(target, junk, at=0 if damage.startswith("garbage") else None)
    model2, opt2 = make_single("demo", 1)
    before = params(model2)
    with pytest.raises((ckpt.CheckpointError, ValueError)) as info:
        load_checkpoint(path, model2, opt2)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg and target.name in msg, msg
    assert equal(params(model2), before), "nothing may be loaded from a damaged checkpoint"
    if damage != "garbage-marker":
        assert info.value.cause == "damaged" and "differs from what was written" in msg, msg
    status = ckpt.verify_checkpoint(path)
    assert status.state == "damaged" and target.name in status.describe()



# ---------------------------------------------------------------------------- real file systems
def test_full_tmpfs_is_no_space_and_keeps_the_previous_checkpoint(small_tmpfs):
    """A 1 MiB tmpfs: the second checkpoint (340 KB each) does not fit beside a filler file.
    torch's writer reports that as RuntimeError('[enforce fail at inline_container.cc:...]
    unexpected pos ...'), which used to read "truncated or corrupt"."""
    root = small_tmpfs / "checkpoints"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(200, 200))
    opt = flexdemo.DeToNATION(model.parameters(), flexdemo.DeMoReplicator(topk=4, chunk=8),
                              base="sgd", lr=0.01)
    model(torch.randn(2, 200)).sum().backward()
    opt.step()
    good = save_checkpoint(root / "step_000001", model, opt, step=1)
    (small_tmpfs / "filler").write_bytes(bytes(500_000))
    with pytest.raises(ckpt.CheckpointError) as info:
        save_checkpoint(root / "step_000002", model, opt, step=2)
    msg = str(info.value)
    assert "\n" not in msg and "step_000002" in msg, msg
    assert info.value.cause == "no space" and "no space left on device" in msg, msg
    assert "bytes free" in msg, msg  # found by the probe write: torch raised a RuntimeError
    assert "corrupt" not in msg and "truncated" not in msg, msg
    assert sorted(os.listdir(root)) == ["step_000001"]  # no half-written directory left
    assert ckpt.verify_checkpoint(good).state == "intact"
    (small_tmpfs / "filler").unlink()
    saved = params(model)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert load_checkpoint(good, model, opt)["step"] == 1 and equal(params(model), saved)


def test_read_only_file_system_is_permission(small_tmpfs):

    root = small_tmpfs / "checkpoints"
    model, opt = make_single("demo", 0)
    good = save_checkpoint(root / "step_000001", model, opt, step=1)
    run = subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr
    with pytest.raises(ckpt.CheckpointError) as info:
        save_checkpoint(root / "step_000002", model, opt, step=2)
    msg = str(info.value)
    assert "\n" not in msg and "read-only file system" in msg, msg
    assert info.value.cause == "permission"
    assert ckpt.verify_checkpoint(good).state == "intact"


def test_verify_command_lists_each_checkpoint(tmp_path, capsys):
    from flexdemo.app.cli import main

    root = tmp_path / "run" / "checkpoints"
    model, opt = make_single("demo", 0)
    for step in (2, 4):
        run_steps(model, opt, 2, step - 2)
        save_checkpoint(root / f"step_{step:06d}", model, opt, step=step)
    assert main(["checkpoint", "verify", str(tmp_path / "run")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all("intact (step" in line for line in lines), lines
    (data,) = (root / "step_000004").glob("*.distcp")
    _write_inside(data, bytes(4096))
    (root / "step_000006.tmp-123").mkdir()  # an interrupted save: not damaged
    (root / "step_000008").mkdir()  # final-named without its marker: no save leaves that
    assert main(["checkpoint", "verify", str(root)]) == 1
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert len(lines) == 4, lines
    assert "step_000002" in lines[0] and "intact" in lines[0]
    assert "step_000004" in lines[1] and "damaged" in lines[1] and data.name in lines[1]
    assert "step_000006.tmp-123" in lines[2] and "incomplete" in lines[2]
    assert "step_000008" in lines[3] and "damaged: no COMPLETE marker" in lines[3]
    assert "2 of 4 checkpoint(s) damaged" in out.err
    assert main(["checkpoint", "verify", str(root / "step_000002")]) == 0
    assert main(["checkpoint", "verify", str(tmp_path / "nothing")]) == 2


@pytest.fixture(scope="module")
def regrouped(world4):
    """The 2 x 2 checkpoints resumed by 1 replica (1 x 2), saved, and resumed by 2 (2 x 2)."""
    root, _ = world4
    return run_world(fewer_replicas_worker, 2, str(root)), \
        run_world(more_replicas_worker, 4, str(root))


@pytest.mark.multiprocess
def test_resume_on_fewer_replicas_keeps_the_continuing_replicas_state(world4, regrouped):
    _, saved = world4
    fewer, _ = regrouped
    for rank, res in enumerate(fewer):  # ranks 0, 1: replica 0 of the saved 2 x 2 job
        assert equal(res["demo"]["delta"], saved[rank]["demo"]["saved_delta"]), rank
        assert res["demo"]["steps"] == 3 and res["diloco"]["steps"] == 4
        assert res["demo"]["extra_ok"] and res["diloco"]["extra_ok"], rank


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["demo", "diloco"])
def test_resume_on_more_replicas_starts_new_ones_from_replica_0(regrouped, kind):
    """A new replica takes replica 0's shards, counters and extra and zero per-replica state;
    the continuing replica keeps its own; DeMo keeps the replicas identical afterwards."""
    fewer, more = regrouped
    for rank in (2, 3):  # replica 1 (new) of shard rank - 2
        peer = rank - 2
        assert equal(more[rank][kind]["shards"], more[peer][kind]["shards"]), rank
        assert more[rank][kind]["steps"] == fewer[peer][kind]["steps"]
        assert more[rank][kind]["extra"]["rank"] == peer  # replica 0's data position
        if kind == "demo":
            assert equal(more[peer]["demo"]["delta"], fewer[peer]["demo"]["delta"])
            assert any(d.abs().sum() > 0 for d in more[peer]["demo"]["delta"])
            assert all(torch.count_nonzero(d) == 0 for d in more[rank]["demo"]["delta"])
            assert equal(more[rank]["demo"]["after"], more[peer]["demo"]["after"])
