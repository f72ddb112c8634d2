"""Every replicator reaches the same outcome on every rank, in the same step (2 gloo ranks).

A NaN gradient on rank 1: under ``nonfinite="raise"`` every rank raises at the same step (for
steps that exchange nothing, at the next exchange); under ``"skip"`` the replicas stay bitwise
identical. Quantised Full payloads are checked like DeMo's: a bad one is named or dropped.
"""

import pytest
import torch
from agreement_workers import NONFINITE_CASES, corrupt_worker, nonfinite_worker
from dist_util import run_world

# where every rank must raise, per case (the NaN is on rank 1 at step 3)
RAISE_STEP = {"full-every2": 4, "demo-every2": 4,  # step 3 exchanges nothing: step 4 tells
              "diloco-full": 5, "diloco-demo": 5,  # the next sync, after step 5
              "diloco-stream": 4,  # fragment 1 launched after step 3, applied after step 4
              "demo-delayed": 5}  # applied at step 4 (as zeros), its verdict read at step 5


@pytest.fixture(scope="module")
def nonfinite():
    return run_world(nonfinite_worker, 2)


def _same(a, b, which=None):
    which = range(len(a)) if which is None else which
    return all(torch.equal(a[i], b[i]) for i in which)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [n for n in NONFINITE_CASES if n != "none"])
def test_raise_on_every_rank_at_the_same_step(nonfinite, name):
    step = RAISE_STEP.get(name, 3)
    for res in nonfinite:
        raised = res[name, "raise"]["raised"]
        assert [(s, r) for s, r, _ in raised] == [(step, [1])], (name, raised)
        assert "non-finite" in raised[0][2]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [n for n in NONFINITE_CASES if n != "none"])
def test_skip_keeps_replicas_identical(nonfinite, name):
    r0, r1 = (res[name, "skip"] for res in nonfinite)
    assert r0["raised"] == [] and r1["raised"] == []
    assert r0["finite"] and r1["finite"]
    if not name.endswith("every2"):  # (local steps let replicas drift in any case)
        # DiLoCo: the fragment synced by the last step (streaming: fragment 0; else all)
        which = r0["synced"] if name == "diloco-stream" else None
        assert _same(r0["shards"], r1["shards"], which), f"{name}: replicas differ"
    if name.startswith("diloco") or name.endswith("every2"):
        # the NaN step exchanged nothing: only rank 1 knew of it and skipped it alone
        assert (r0["skipped"], r1["skipped"]) == (0, 1)
    else:
        assert (r0["skipped"], r1["skipped"]) == (1, 1)


@pytest.mark.multiprocess
def test_diloco_bad_parameters_drop_the_sync_everywhere(nonfinite):
    """An Inf parameter on rank 1 (finite gradients) makes a non-finite pseudo-gradient: every
    rank raises at the sync, or skips it and restarts from the global parameters."""
    for res in nonfinite:
        raised = res["diloco-param", "raise"]["raised"]
        assert [(s, r) for s, r, _ in raised] == [(5, [1])]
    r0, r1 = (res["diloco-param", "skip"] for res in nonfinite)
    assert r0["finite"] and r1["finite"] and _same(r0["shards"], r1["shards"])
    # rank 0 skipped the dropped sync; rank 1 also its inner steps 4 and 5, whose gradients
    # the Inf parameter made NaN (it skipped them alone)
    assert (r0["skipped"], r1["skipped"]) == (1, 2)


@pytest.mark.multiprocess
def test_none_keeps_the_outcome_local(nonfinite):
    """No exchange, nobody waits: rank 1 raises (or skips) alone and rank 0 trains on."""
    r0, r1 = (res["none", "raise"] for res in nonfinite)
    assert r0["raised"] == [] and [(s, r) for s, r, _ in r1["raised"]] == [(3, [1])]
    r0, r1 = (res["none", "skip"] for res in nonfinite)
    assert (r0["skipped"], r1["skipped"]) == (0, 1)


@pytest.fixture(scope="module")
def corrupt():
    return run_world(corrupt_worker, 2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["int8-nan-scale", "fp16-overflow"])
def test_bad_quantised_payload_is_named_on_every_rank(corrupt, case):
    for res in corrupt:
        step, global_rank, msg = res[case, "raise"]["caught"]
        assert (step, global_rank) == (1, 1) and "corrupt payload from rank 1" in msg
        assert "non-finite value" in msg
        if case == "fp16-overflow":
            assert "65504" in msg


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["int8-nan-scale", "fp16-overflow"])
def test_bad_quantised_payload_is_dropped_on_every_rank(corrupt, case):
    r0, r1 = (res[case, "drop"] for res in corrupt)
    assert r0["caught"] is None and r1["caught"] is None
    assert r0["dropped"] == r1["dropped"] == 1
    assert r0["finite"] and r1["finite"] and _same(r0["shards"], r1["shards"])


# ---------------------------------------------------------------- the helpers, one process
def test_nonfinite_flag_finds_nan_and_inf_but_not_large_values():
    from flexdemo.replicate.agreement import nonfinite_flag

    big = torch.full((1000,), 3e38)  # finite; its sum overflows
    assert not bool(nonfinite_flag([big, None, torch.zeros(0), torch.ones(3, 4)]))
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.ones(5, 7, dtype=torch.bfloat16)
        t[2, 3] = bad
        assert bool(nonfinite_flag([torch.ones(3), t]))
    assert not bool(nonfinite_flag([None]))
    # on a CPU tensors of a million entries and more take the largest-magnitude norm, smaller
    # ones an fp64 2-norm: both kinds in one call
    large, small = torch.zeros(1 << 20), torch.full((10,), 3e38)
    assert not bool(nonfinite_flag([large, small]))
    for where in (large, small):
        for bad in (float("nan"), -float("inf")):
            where[3] = bad
            assert bool(nonfinite_flag([large, small]))
            where[3] = 0.0


def test_trailer_and_header_carry_flag_and_code():
    from flexdemo.replicate.agreement import (
        HEADER_BYTES,
        Agreement,
        NonFiniteGradientError,
        check_headers,
        write_header,
    )

    grads = [torch.ones(3), None, torch.ones(2)]
    rows = []
    for rank in range(3):  # what each of 3 ranks writes; their sum is what all-reduce gives
        a = Agreement("x", rank, 3, torch.device("cpu"))
        flag, code = a.local([torch.full((2,), float("nan")) if rank == 2 else grads[0]],
                             grads)
        trailer = torch.zeros(Agreement.trailer_size(3))
        a.write_trailer(trailer, flag, code)
        rows.append(trailer)
    with pytest.raises(NonFiniteGradientError, match=r"rank\(s\) \[2\]") as e:
        a.read_trailer(sum(rows), code, step=5)
    assert e.value.ranks == [2] and e.value.step == 5
    buf = torch.zeros(2, HEADER_BYTES, dtype=torch.uint8)
    write_header(buf[0], 7, torch.tensor(False), code)
    write_header(buf[1], 7, False, code ^ 1)  # disagrees on the parameters in use
    with pytest.raises(RuntimeError, match="disagree on which parameters"):
        check_headers("x", buf, 7, code)
    with pytest.raises(RuntimeError, match="malformed payload from rank 0"):
        check_headers("x", buf, 8, code)


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "int8", "int4"])
def test_codec_decodes_rows_at_once(fmt):
    from flexdemo.compress.quant import ValueCodec

    codec = ValueCodec(fmt, 16)
    n = 37
    width = codec.nbytes(n) + 5
    width += -width % 8  # padded and 8-byte aligned rows, like gathered buckets
    rows = torch.zeros(3, width, dtype=torch.uint8)
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    for r, x in enumerate(xs):
        codec.encode(x, rows[r])
    both = codec.decode(rows, n)
    assert both.shape == (3, n)
    for r in range(3):
        assert torch.equal(both[r], codec.decode(rows[r], n))


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16", "int8", "int4"])
@pytest.mark.parametrize("n", [37, 48, 1])  # a short last block, whole blocks, one value
def test_codec_decodes_into_a_buffer_with_the_same_bits(fmt, n):
    from flexdemo.compress.quant import ValueCodec

    codec = ValueCodec(fmt, 16)
    data = torch.zeros(codec.nbytes(n) + 3, dtype=torch.uint8)
    codec.encode(torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3, data)
    out = torch.full((codec.room(n) + 2,), float("nan"))  # stale contents are overwritten
    got = codec.decode_into(data, n, out)
    assert got.data_ptr() == out.data_ptr() and got.shape == (n,)
    assert torch.equal(got, codec.decode(data, n))


@pytest.mark.multiprocess
def test_diloco_failed_sync_in_flight_survives_a_checkpoint():
    from agreement_workers import diloco_checkpoint_worker

    results = run_world(diloco_checkpoint_worker, 2)
    for res in results:
        assert res["original"]["raised"] == res["resumed"]["raised"] == [(4, [1])]
        assert _same(res["original"]["shards"], res["resumed"]["shards"])


@pytest.mark.multiprocess
def test_a_chain_agrees_across_all_its_groups():
    """DeMo in pairs then Full over 4 ranks: the pair {2, 3} learns of rank 1's NaN through
    Full's exchange in the same step (before, ranks 2 and 3 waited in Full's all-reduce)."""
    from agreement_workers import chain_worker

    results = run_world(chain_worker, 4)
    for res in results:
        assert res["raise"]["raised"] == [2]
        assert res["skip"]["raised"] == [] and res["skip"]["skipped"] == 1
    for res in results[1:]:
        assert _same(results[0]["skip"]["shards"], res["skip"]["shards"])


@pytest.mark.multiprocess
def test_the_other_shards_of_a_replica_agree_too():
    """With FSDP shards, only the ranks holding the bad shard see the NaN; one tiny
    all-reduce over the shard group tells the others, so all four ranks act alike."""
    from agreement_workers import sharded_worker

    results = run_world(sharded_worker, 4)
    for name, step in (("demo", 3), ("full", 3), ("diloco", 5)):
        assert [res[name, "raise"]["raised"] for res in results] == [[step]] * 4, name
        skipped = [res[name, "skip"]["skipped"] for res in results]
        # DiLoCo's inner steps are local: both shards of rank 1's replica skip, the other
        # replica trains on (the sync after step 5 makes them identical again)
        assert skipped == ([1, 1, 0, 0] if name == "diloco" else [1] * 4), name
        for shard in (0, 1):  # replicas of each shard stay identical
            a, b = (res[name, "skip"]["shards"] for res in results
                    if res[name, "skip"]["coord"][1] == shard)
            assert _same(a, b), (name, shard)


@pytest.mark.multiprocess
def test_a_nan_is_reported_by_global_rank():
    """On a 2 x 2 mesh the replicate group of global rank 3 is {1, 3}: its NaN used to be
    reported as "rank(s) [1] of the group" (its index in the group)."""
    from agreement_workers import global_rank_worker

    results = run_world(global_rank_worker, 4)
    for rank in (1, 3):  # the replica group that holds rank 3
        assert results[rank]["ranks"] == [3], results[rank]
        assert "rank(s) [3]" in results[rank]["message"], results[rank]["message"]
    for rank in (0, 2):  # rank 2 shares a replica with rank 3: its flag travels there
        assert results[rank]["ranks"] == [2], results[rank]
