import os
import sys

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))


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
