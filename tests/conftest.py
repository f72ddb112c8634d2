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
