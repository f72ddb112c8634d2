import inspect
import os
import sys
from pathlib import Path

# MKL's threads, for the whole process, before torch loads it: torch.set_num_threads below
# sets the calling thread's OpenMP threads, and a Python thread (the in-process replicas of
# many tests) would let MKL split a matrix product over the cores again, in another order (on
# an AMD EPYC host: 1-ulp differences from the single-threaded reference)
os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
_HERE = Path(__file__).resolve().parent

# Each pytest process computes on one thread (the processes it starts choose their own, as
# before): the suite runs 4 xdist workers on 2 cores, and with torch's default of a thread
# per core each, OpenMP's waiting threads spin on cores another worker needs
# (test_demo_batched.py and test_muon_batched.py in one process: 51 -> 12 s of CPU on the
# loaded 2-core machine, the same results)
torch.set_num_threads(1)


@pytest.fixture
def one_thread():
    """One intra-op thread, as in the gloo workers (same kernels, same bits)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def single_process():
    """In-process ``flexdemo train`` creates a one-rank process group; remove it afterwards."""
    was = dist.is_initialized()
    for key in ("WORLD_SIZE", "RANK"):
        assert key not in os.environ
    yield
    if dist.is_initialized() and not was:
        dist.destroy_process_group()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 1 MiB tmpfs mounted on a fresh folder (unmounted afterwards), for storage faults
    that only a real file system raises (torch's writer on a full disk). Skips, saying why,
    only where mounting is not permitted (not root, or no CAP_SYS_ADMIN in a container)."""
    import shutil
    import subprocess

    mount = shutil.which("mount")
    if mount is None:
        pytest.skip("no mount command to make a small tmpfs with")
    where = tmp_path / "tmpfs"
    where.mkdir()
    run = subprocess.run([mount, "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
                         capture_output=True, text=True)
    if run.returncode != 0:
        reason = (run.stderr or run.stdout).strip()
        if os.geteuid() != 0 or "permission" in reason.lower() or "not permitted" in reason:
            pytest.skip(f"cannot mount a tmpfs here: {reason or 'not root'}")
        raise RuntimeError(f"mount -t tmpfs failed: {reason}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


# ------------------------------------------------------------------ the suite in parallel
# `bash run.sh test` runs the suite on several pytest-xdist workers (pyproject.toml's addopts:
# `-n 4 --dist loadgroup`). A module-scoped fixture is built once per worker that runs a test
# using it, so the tests sharing one (a world of gloo ranks computed once, asserted on by many
# tests) go to one worker together: one xdist_group per set of module fixtures that tests of a
# module use together. Every other test is scheduled on its own.


def _shared_fixture_group(item: pytest.Item, links: dict[str, str]) -> str | None:
    """The group of ``item``: its module and the first of the module-scoped fixtures of the
    test files that it uses, joined with those of the module's other tests (``links``: a
    union-find over ``module::fixture``); None when it uses none."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    module = item.nodeid.split("::", 1)[0]
    shared = []
    for name, defs in info.name2fixturedefs.items():
        d = defs[-1]
        if d.scope in ("module", "class", "package") and _HERE in Path(
                inspect.getsourcefile(d.func) or "/").resolve().parents:  # ours, not a plugin's
            shared.append(f"{module}::{name}")
    if not shared:
        return None
    first = _root(links, shared[0])
    for key in shared[1:]:
        links[_root(links, key)] = first
    return first


def _root(links: dict[str, str], key: str) -> str:
    """The group ``key`` belongs to now (``links``' union-find)."""
    while links.setdefault(key, key) != key:
        key = links[key]
    return key


# ------------------------------------------------------------------ the two tiers
# `bash run.sh test` runs the quick tier; `bash run.sh test -m long` the longer one, and CI runs
# both. A family of multi-process variants of one behaviour (a kill and a rejoin under each
# replicator, each loop order, each unreadable path) keeps in the quick tier the variants that
# take the most distinct code paths; the rest of the family runs in the longer tier, as do
# the end-to-end runs of a tool whose behaviour the quick tier tests piece by piece. The
# key is the test's id within its file (pytest's node id after the file).
LONG_TIER: dict[str, tuple[str, ...]] = {
    "test_elastic.py": (
        # a kill and a rejoin: quick under delayed DeMo (an exchange in flight) and DiLoCo
        "test_killed_group_restarts_heals_and_ends_identical[full]",
        "test_killed_group_restarts_heals_and_ends_identical[demo]",
        "test_killed_group_restarts_heals_and_ends_identical[random]",
        "test_killed_group_restarts_heals_and_ends_identical[diloco-int4-rs]",
        "test_killed_group_restarts_heals_and_ends_identical[diloco-streaming]",
        # a failed commit: quick under DeMo and streaming DiLoCo (a sync in flight)
        "test_failed_commit_is_undone_exactly[full-3-7]",
        "test_failed_commit_is_undone_exactly[diloco-5-9]",
        "test_failed_commit_is_undone_exactly[random-3-7]",
        "test_failed_commit_is_undone_exactly[demo-delayed-3-7]",
        # loop orders: quick with zero_grad after the forward pass (the order that once
        # crashed) and after the step; zero_grad first runs quick in the sharded test
        "test_every_loop_order_survives_a_kill_and_a_rejoin[forward-keep]",
        "test_every_loop_order_survives_a_kill_and_a_rejoin[none]",
        "test_every_loop_order_survives_a_kill_and_a_rejoin[zero-first]",
        "test_a_group_healed_after_its_forward_pass_votes_no[zero-first]",
        "test_sharded_groups_rank_r_replicates_with_rank_r[forward-zero]",
    ),
    "test_resume_faults.py": (
        # a folder verify may not read: quick when it is one checkpoint
        "test_verify_of_a_folder_this_user_may_not_read_is_one_line[run]",
        "test_verify_of_a_folder_this_user_may_not_read_is_one_line[checkpoints]",
        "test_verify_of_a_folder_this_user_may_not_read_is_one_line[COMPLETE]",
    ),
    "test_startup.py": (
        "test_rank_killed_a_second_after_launch_is_named_by_every_survivor[0]",
    ),
    "test_security.py": (
        # an intruder in every loop order: quick with zero_grad first and after the forward
        "test_a_group_without_the_secret_is_named_by_every_honest_group[zero-last]",
    ),
    "test_train.py": (
        "test_killed_rank_of_four_is_the_only_one_named_by_every_survivor[auto-4x1]",
        # the default mesh: quick with the ranks on one node, the same rule with one per node
        "test_default_mesh_is_the_same_for_train_and_the_example[one-rank-per-node]",
    ),
    "test_cluster.py": (
        # a signal to the emulated cluster: quick with SIGINT, the same path for SIGTERM
        "test_cli_signal_stops_ranks_and_removes_namespaces[15-143]",
    ),
    "test_demo_batched.py": (
        # the compiled selection must give the eager path's bits (the eager path runs quick);
        # inductor's C++ build costs more than a minute of CPU here
        "test_compiled_selection_gives_the_same_bits",
    ),
    "test_gpu_evidence.py": (
        # the GPU command end to end on the CPU; its budget cuts and its one line without a
        # GPU run quick
        "test_smoke_writes_every_table_json_and_plot",
    ),
    "test_bench_elastic.py": (
        # the elastic bench end to end (about 2 min of CPU on the 2-core machine, an eighth of
        # the quick tier's): a kill, a heal and a bitwise end run quick in test_elastic.py,
        # and the bench's figures and report on a recorded run in this file
        "test_killed_node_leaves_and_heals_back",
    ),
    "test_examples.py": (
        # torchrun starting a script's ranks runs quick with the README's usage example
        # (test_docs.py), the GPT example on two ranks quick with the ranks forked; the HF
        # example's loop runs quick in one process
        "test_hf_two_ranks_under_torchrun_replicate",
    ),
    "test_bench.py": (
        # the bench's fallback to loopback runs quick for a user without root
        "test_root_without_network_namespaces_falls_back",
    ),
    "test_memory.py": (
        "test_demo_bf16_momentum_resumes_bitwise[kw1]",
        "test_demo_bf16_momentum_resumes_bitwise[kw3]",
    ),
}


def _mark_long_tier(items: list[pytest.Item]) -> None:
    """Mark the tests named in :data:`LONG_TIER` ``long`` (test_layout checks that every
    entry names a test)."""
    wanted = {(f, t) for f, tests in LONG_TIER.items() for t in tests}
    for item in items:
        file, _, rest = item.nodeid.partition("::")
        if (Path(file).name, rest) in wanted:
            item.add_marker(pytest.mark.long)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups, and before -m selects
def pytest_collection_modifyitems(config, items):
    _mark_long_tier(items)
    links: dict[str, str] = {}
    keys = {item: _shared_fixture_group(item, links) for item in items}
    for item, key in keys.items():
        if key is not None:  # its group's root once every item is linked
            item.add_marker(pytest.mark.xdist_group(_root(links, key)))
