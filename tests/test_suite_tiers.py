"""The suite's two tiers: every test that conftest.LONG_TIER moves to the longer tier exists
(a renamed test or parameter would otherwise fall silently back into the quick tier)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LONG_TIER

HERE = Path(__file__).parent


@pytest.mark.multiprocess
def test_every_long_tier_entry_names_a_collected_test_and_leaves_the_quick_tier():
    files = [str(HERE / f) for f in LONG_TIER]
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-o",
                          "addopts=", "-m", "long", "-p", "no:cacheprovider", *files],
                         capture_output=True, text=True, cwd=HERE.parent, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    long_ids = {line.strip().split("tests/", 1)[-1] for line in run.stdout.splitlines()
                if "::" in line}
    wanted = {f"{f}::{t}" for f, tests in LONG_TIER.items() for t in tests}
    assert not wanted - long_ids, sorted(wanted - long_ids)
