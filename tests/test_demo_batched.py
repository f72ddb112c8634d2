"""The batched DeMo step: bitwise equal to coding each tensor on its own, a number of ops
that does not grow with the number of tensors, at most one read of the device per step,
corrupt payloads named in both overlap modes, untouched state after a non-finite input."""

import pytest
import torch
from demo_workers import VARIANTS, batched_worker, corrupt_worker
from dist_util import run_world
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from flexdemo import DeToNATION, NonFiniteGradientError
from flexdemo.replicate import DeMoReplicator

# padded tensors (131 rows, 7x9, 67x130), exact tilings, 1-D and small tensors, one block
SHAPES = [(128, 192), (192,), (7, 9), (131, 70), (256, 128), (300,), (64, 64), (65,),
          (384, 384), (67, 130), (5, 3, 4), (200, 64), (1, 256)]

CONFIGS = {
    "default": {}, "fp32": {"values": "fp32", "topk": 32}, "int8": {"values": "int8"},
    "sign": {"values": "sign", "topk": 4}, "bf16-transform": {"transform_dtype": "bf16"},
    "plain-topk": {"transform": "none"}, "no-sign": {"sign": False, "values": "bf16"},
    "dense-decode": {"topk": 48, "sign": False, "values": "fp32"},
    "separate-small": {"small": "separate"}, "delayed": {"overlap": "delayed"},
}


def _run(steps=5, **kw):
    """Outputs per step and final momentum, with gradients missing at steps 2 and 3 and
    step sizes that differ between tensors from step 3 on."""
    torch.manual_seed(0)
    rep = DeMoReplicator(**kw)
    rep.setup([torch.Size(s) for s in SHAPES], torch.device("cpu"), None)
    outs = []
    for step in range(steps):
        grads = [torch.randn(s) for s in SHAPES]
        if step == 2:
            grads[0] = grads[3] = grads[1] = None
        if step == 3:
            grads[8] = None
        lrs = [1e-2 if step < 3 or i % 3 else 3e-3 for i in range(len(SHAPES))]
        outs.append([None if g is None else g.clone() for g in rep(grads, lrs, step)])
    return rep, outs


def _same(a, b):
    return all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_batched_equals_per_tensor(name):
    """All tensors of a block shape coded as one batch: the same bits as one tensor at a
    time (bucket=False makes every tensor its own group, with its own collective)."""
    batched, a = _run(**CONFIGS[name])
    if name == "delayed":  # one collective only: compare with the synchronous batched step
        sync, b = _run()
        assert all(g is None or not g.any() for g in a[0])  # nothing to apply at step 0
        for late, now in zip(a[1:], b[:-1]):  # step t applies what step t - 1 sent
            assert all(x is None or y is None or torch.equal(x, y) for x, y in zip(late, now))
        assert _same(batched.delta, sync.delta)
        return
    single, b = _run(bucket=False, **CONFIGS[name])
    assert len(batched.groups) < len(single.groups) == len(single.units)
    assert all(_same(x, y) for x, y in zip(a, b))
    assert _same(batched.delta, single.delta)


@pytest.mark.parametrize("name", ["default", "fp32", "bf16-transform", "delayed", "no-sign",
                                  "dense-decode"])
def test_image_staging_gives_the_same_bits(name):
    """Every tensor staged through an image (contiguous copies in and out, one gather per
    group: the default on CUDA) gives the bits of staging straight into block rows."""
    image, a = _run(staging="image", **CONFIGS[name])
    direct, b = _run(staging="direct", **CONFIGS[name])
    assert all(not s.direct for g in image.groups for s in g.segments)
    assert any(s.direct for g in direct.groups for s in g.segments)
    assert all(_same(x, y) for x, y in zip(a, b))
    assert _same(image.delta, direct.delta)
    assert "staging='image'" in repr(image)
    with pytest.raises(ValueError, match="staging must be"):
        DeMoReplicator(staging="flat")


@pytest.mark.multiprocess
def test_compiled_selection_gives_the_same_bits():
    shapes = [torch.Size([128, 192]), torch.Size([256, 128]), torch.Size([70])]

    def run(**kw):
        torch.manual_seed(0)
        rep = DeMoReplicator(**kw)
        rep.setup(shapes, torch.device("cpu"), None)
        outs = [rep([torch.randn(s) for s in shapes], [1e-2] * 3, step) for step in range(3)]
        return rep, outs

    compiled, a = run(compile=True)
    eager, b = run()
    assert compiled.compile  # it compiled (a failure would have switched it off, warning)
    assert all(_same(x, y) for x, y in zip(a, b)) and _same(compiled.delta, eager.delta)


def test_missing_gradients_keep_their_momentum_bitwise():
    rep, _ = _run(steps=2)
    before = [d.clone() for d in rep.delta]
    grads = [torch.randn(s) for s in SHAPES]
    gone = [0, 3, 7]  # a tiled weight, a padded one, a member of the small batch
    for i in gone:
        grads[i] = None
    out = rep(grads, [1e-2] * len(SHAPES), 2)
    for j, u in enumerate(rep.units):
        if all(i in gone for i in u.members):
            assert torch.equal(rep.delta[j], before[j])
        else:
            assert not torch.equal(rep.delta[j], before[j])
    assert all(out[i] is None for i in gone)


@pytest.mark.parametrize("overlap", ["none", "delayed"])
@pytest.mark.parametrize("where", [(9, (3, 4), "nan"), (8, (70, 5), "inf"), (1, (7,), "-inf")],
                         ids=["padded-nan", "tiling-inf", "small-neginf"])
@pytest.mark.parametrize("kw", [{}, {"transform_dtype": "bf16", "values": "fp32"},
                                {"staging": "image"}],
                         ids=["fp32", "bf16-transform", "image-staging"])
def test_non_finite_input_leaves_the_momentum_untouched(overlap, where, kw):
    """The non-finite flag is found on the device before the momentum update; the rank's
    momentum stays bitwise as it was (no copy of it is kept), it sends zeros, and its header
    carries the flag."""
    rep, _ = _run(steps=3, overlap=overlap, **kw)
    assert not hasattr(rep, "_saved")
    before = [d.clone() for d in rep.delta]
    grads = [torch.randn(s) for s in SHAPES]
    i, at, value = where
    grads[i][at] = float(value)
    lrs = [1e-2] * len(SHAPES)
    if overlap == "none":
        with pytest.raises(NonFiniteGradientError, match="step 3"):
            rep(grads, lrs, 3)
    else:  # applied one step later as zeros (on the device), raised the step after that
        rep(grads, lrs, 3)
        buf = rep.send_buffers[3 % len(rep.send_buffers)].clone()
        assert _same(rep.delta, before)
        out = rep([torch.randn(s) for s in SHAPES], lrs, 4)
        assert all(not g.any() for g in out)  # the flagged payload's update is left out
        with pytest.raises(NonFiniteGradientError, match="step 3"):
            rep([torch.randn(s) for s in SHAPES], lrs, 5)
        rep.send_buffers[3 % len(rep.send_buffers)] = buf  # what step 3 sent, for the checks below
        before = rep.delta  # (step 4 updated the momentum)
    assert _same(rep.delta, before)
    buf = rep.send_buffers[3 % len(rep.send_buffers)]
    assert buf[:32].view(torch.int64)[2].item() == 1  # the header's non-finite flag
    for g in rep.groups:  # every value sent is zero
        assert not rep.codec.decode(buf[g.val_off: g.end].unsqueeze(0), g.blocks, g.k).any()


def test_corrupt_payload_in_delayed_mode_is_named():
    torch.manual_seed(0)
    rep = DeMoReplicator(overlap="delayed", topk=4, chunk=8)
    rep.setup([torch.Size([8, 12]), torch.Size([12])], torch.device("cpu"), None)
    grads = [torch.randn(8, 12), torch.randn(12)]
    rep(grads, [1.0, 1.0], 0)
    step1 = [torch.randn(8, 12), torch.randn(12)]
    rep(step1, [1.0, 1.0], 1)
    _, handle, _, _ = rep.inflight.sent
    g = rep.groups[0]
    handle.wait()[0, g.idx_off: g.val_off] = 0  # repeated indices in what rank 0 sent
    # step 2 applies it without reading the device: the only peer is left out (zeros)
    out = rep([torch.randn(8, 12), torch.randn(12)], [1.0, 1.0], 2)
    assert not any(o.any() for o in out)
    with pytest.raises(Exception, match="rank 0 .*step 1: repeated index"):
        rep([torch.randn(8, 12), torch.randn(12)], [1.0, 1.0], 3)


def _corrupt_delayed(on_bad_peer):
    """A delayed replicator after step 1 whose in-flight payload (rank 0's own) repeats an
    index, and step 1's gradients."""
    torch.manual_seed(0)
    rep = DeMoReplicator(overlap="delayed", topk=4, chunk=8, on_bad_peer=on_bad_peer)
    rep.setup([torch.Size([8, 12]), torch.Size([12])], torch.device("cpu"), None)
    rep([torch.randn(8, 12), torch.randn(12)], [1.0, 1.0], 0)
    rep([torch.randn(8, 12), torch.randn(12)], [1.0, 1.0], 1)
    g = rep.groups[0]
    rep.inflight.sent.payloads.wait()[0, g.idx_off: g.val_off] = 0
    return rep


def test_dropped_payload_in_delayed_mode_is_counted_the_step_after():
    rep = _corrupt_delayed("drop")
    out = rep([torch.randn(8, 12), torch.randn(12)], [1.0, 1.0], 2)
    assert not any(o.any() for o in out) and rep.dropped_payloads == 0
    with pytest.warns(RuntimeWarning, match="dropped the payload of rank 0 at step 1"):
        out = rep([torch.randn(8, 12), torch.randn(12)], [1.0, 1.0], 3)
    assert rep.dropped_payloads == 1
    assert all(o.any() for o in out)  # step 2's payload was sound


def test_deferred_verdict_survives_a_checkpoint():
    """The verdict of the payloads applied last is judged after a resume."""
    rep = _corrupt_delayed("raise")
    rep([torch.randn(8, 12), torch.randn(12)], [1.0, 1.0], 2)
    state = rep.state_dict()
    assert state["verdict"]["step"] == 1
    fresh = DeMoReplicator(overlap="delayed", topk=4, chunk=8)
    fresh.setup([torch.Size([8, 12]), torch.Size([12])], torch.device("cpu"), None)
    fresh.load_state_dict(state)
    with pytest.raises(Exception, match="rank 0 .*step 1: repeated index"):
        fresh([torch.randn(8, 12), torch.randn(12)], [1.0, 1.0], 3)


class _Count(TorchDispatchMode):
    """Ops dispatched, and reads of the device (``.item()``, ``bool()``, ``int()`` dispatch
    ``_local_scalar_dense``; ``tolist`` and ``numpy`` are counted where they are called)."""

    VIEWS = {"view", "slice", "select", "alias", "unsqueeze", "permute", "expand", "detach",
             "as_strided", "_reshape_alias", "t", "transpose", "squeeze", "split"}

    def __init__(self):
        super().__init__()
        self.ops = self.views = self.reads = self.host_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        if func.overloadpacket.__name__ in self.VIEWS:
            self.views += 1
        else:
            self.ops += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        counter = self
        self._saved = torch.Tensor.tolist, torch.Tensor.numpy

        def tolist(t):
            if getattr(t, "_flexdemo_host_copy", False):  # filled a step before, not waited for
                counter.host_reads += 1
            else:
                counter.reads += 1
            return counter._saved[0](t)

        def numpy(t, *a, **k):
            counter.reads += 1
            return counter._saved[1](t, *a, **k)

        torch.Tensor.tolist, torch.Tensor.numpy = tolist, numpy
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.Tensor.numpy = self._saved
        return super().__exit__(*exc)


def _layers(n):
    """``n`` identical layers; 1024 small entries each, so the batch of small tensors tiles
    into 64 x 64 blocks (the same groups) at every multiple of 4 layers."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(128, 384), nn.Tanh(), nn.Linear(384, 128),
                                         nn.LayerNorm(128), nn.LayerNorm(128))
                           for _ in range(n)])


def _count_step(layers, overlap="none", steps=3):
    """Counts of the last of ``steps`` optimizer steps (SGD base with foreach updates)."""
    m = _layers(layers)
    opt = DeToNATION(m.parameters(), DeMoReplicator(overlap=overlap), lr=1e-3,
                     base_kwargs={"foreach": True})
    x = torch.randn(8, 128)
    counts = []
    for _ in range(steps):
        m(x).pow(2).mean().backward()
        with _Count() as c:
            opt.step()
        opt.zero_grad()
        counts.append(c)
    return len(list(m.parameters())), counts


def test_ops_per_step_do_not_grow_with_the_number_of_tensors():
    small_n, small = _count_step(4)
    large_n, large = _count_step(40)
    assert large_n == 10 * small_n == 320
    a, b = small[-1], large[-1]
    assert a.ops == b.ops  # every op that does work runs once per group
    # only metadata views of the weights' gradients (two per weight) grow with the tensors
    assert b.views - a.views <= 2 * (large_n - small_n) / 4


def test_ops_for_80_tensors_within_one_and_a_half_times_those_for_8():
    n8, (*_, a) = _count_step(1)
    n80, (*_, b) = _count_step(10)
    assert (n8, n80) == (8, 80)
    assert b.ops + b.views <= 1.5 * (a.ops + a.views)


@pytest.mark.parametrize("overlap", ["none", "delayed"])
def test_one_read_of_the_device_per_step(overlap):
    _, counts = _count_step(4, overlap)
    reads = [c.reads for c in counts]
    if overlap == "none":
        assert reads == [1, 1, 1]  # the verdict of the step's payload checks
    else:  # no read of the device: the verdict is judged a step later from a host copy
        assert reads == [0, 0, 0]
        assert [c.host_reads for c in counts] == [0, 0, 1]


@pytest.fixture(scope="module")
def two_ranks():
    return run_world(batched_worker, 2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_two_ranks_batched_equals_per_tensor(two_ranks, name):
    for res in two_ranks:
        assert _same(res[name, True], res[name, False])
    assert _same(two_ranks[0][name, True], two_ranks[1][name, True])


@pytest.mark.multiprocess
def test_two_ranks_delayed_replicas_identical(two_ranks):
    assert _same(two_ranks[0]["delayed"], two_ranks[1]["delayed"])
    assert not _same(two_ranks[0]["delayed"], two_ranks[0]["int2", True])


@pytest.mark.multiprocess
def test_two_ranks_corrupt_payload_named_in_both_modes():
    results = run_world(corrupt_worker, 2)
    for res in results:
        for overlap in ("none", "delayed"):
            msg, global_rank, step = res[overlap]
            assert global_rank == 1 and step == 2, (overlap, msg)
            assert "corrupt payload from rank 1" in msg and "non-finite value" in msg
