"""Ranks built with other settings than their peers fail at construction, alike."""

import pytest
from dist_util import run_world
from dist_workers import settings_worker


@pytest.mark.multiprocess
def test_ranks_with_other_settings_fail_at_construction_on_every_rank():
    res = run_world(settings_worker, 2)
    assert res[0]["same"] == res[1]["same"] == "ok"
    named = {"topk": "payload bytes", "seed": "seed", "nonfinite": "nonfinite = 'raise'",
             "base": "base optimizer = 'SGD'", "diloco": "inner_steps = 2"}
    for case, text in named.items():
        for rank in (0, 1):
            msg = res[rank][case]
            assert "with other settings than this rank" in msg and f"ranks [{1 - rank}]" in msg, msg
        assert text in res[0][case], res[0][case]
    for rank in (0, 1):  # other replicators: named by kind
        msg = res[rank]["kinds"]
        assert "built another optimizer" in msg and f"ranks [{1 - rank}]" in msg, msg
    assert "DeMoReplicator" in res[0]["kinds"] and "FullReplicator" in res[1]["kinds"]
