"""torch's DCP helpers (get_state_dict + flexdemo.checkpoint.dcp.load) on another mesh, replicator
setting or model: flexdemo's own one line, the same as flexdemo.load_checkpoint's, not DCP's
"Size mismatch" traceback."""

import pytest
from dist_util import run_world
from libgpu_workers import dcp_mismatch_worker


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_world(dcp_mismatch_worker, 2, str(tmp_path_factory.mktemp("dcpmis")))


@pytest.mark.multiprocess
@pytest.mark.parametrize("case,says", [("mesh", "2 x 1 mesh, but this job runs 2 rank(s) as 1 x 2"),
                                       ("replicator", "topk 4 (now 8)"),
                                       ("model", "written for another model")])
def test_dcp_path_refuses_with_the_native_line(results, case, says):
    for res in results:
        lines = res[case]
        assert lines.get("dcp_type") == "CheckpointMismatchError", lines
        assert says in lines["dcp"], lines
        assert "\n" not in lines["dcp"] and "Size mismatch" not in lines["dcp"], lines
        assert lines["dcp"] == lines["native"], lines
        assert lines["untouched"], "nothing may be loaded before the refusal"
