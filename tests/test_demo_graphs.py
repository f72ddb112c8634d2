"""DeMo with ``graphs=True``: no effect off CUDA; on CUDA the replayed graphs give the eager
bits (step sizes that are powers of two scale the basis exactly), follow a changing step size
and step number, and still name a corrupt peer."""

import pytest
import torch

from flexdemo import CorruptPayloadError
from flexdemo.replicate import DeMoReplicator

# padded (131 rows, 67x130), tiling, 1-D and small tensors
SHAPES = [(128, 192), (192,), (7, 9), (131, 70), (256, 128), (64, 64), (67, 130), (200, 64)]
CUDA = torch.cuda.is_available()


def _run(device, steps=7, missing_at=4, **kw):
    """Outputs per step and the final momentum; step sizes are powers of two that change
    every step and differ between tensors from step 5 on; some gradients missing at one
    step."""
    torch.manual_seed(0)
    rep = DeMoReplicator(**kw)
    rep.setup([torch.Size(s) for s in SHAPES], torch.device(device), None)
    outs = []
    for step in range(steps):
        grads = [torch.randn(s).to(device) for s in SHAPES]
        if step == missing_at:
            grads[0] = grads[3] = None
        lrs = [2.0 ** -(8 + step % 3 + (i % 2 if step >= 5 else 0)) for i in range(len(SHAPES))]
        outs.append([None if g is None else g.cpu().clone() for g in rep(grads, lrs, step)])
    return rep, outs


def _same(a, b):
    return all((x is None and y is None) or torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b))


def test_graphs_have_no_effect_off_cuda():
    graphed, a = _run("cpu", graphs=True)
    eager, b = _run("cpu", graphs=False)
    assert not graphed.step_graphs.captured
    # staging="auto" stays direct where there are no graphs
    assert any(s.direct for g in graphed.groups for s in g.segments)
    assert all(_same(x, y) for x, y in zip(a, b))
    assert _same(graphed.delta, eager.delta)


def test_graphs_bad_settings():
    with pytest.raises(ValueError, match="graphs must be True, False or 'auto'"):
        DeMoReplicator(graphs="yes")
    with pytest.raises(ValueError, match="do not combine"):
        DeMoReplicator(graphs=True, compile=True)
    assert "graphs=True" in repr(DeMoReplicator(graphs=True))
    assert DeMoReplicator().graphs == "auto" and "graphs" not in repr(DeMoReplicator())
    assert DeMoReplicator(compile=True).graphs is False  # auto: the compiled selection wins


def test_simulated_replicas_turn_auto_graphs_off():
    """Simulated replicas share one stream from several threads (no capture possible): auto
    graphs are off there, inside composite replicators too."""
    from torch import nn

    from flexdemo import SimulatedReplicas
    from flexdemo.replicate import make_replicator

    def loss(model, batch):
        return model(batch).square().mean()

    sim = SimulatedReplicas(nn.Linear(8, 8), loss, replicas=2, replicator="demo")
    assert all(rep.graphs is False for opt in sim.optimizers for rep in opt.replicators)
    sim = SimulatedReplicas(nn.Linear(8, 8), loss, replicas=2, replicator="demo-warmup")
    inner = [r for opt in sim.optimizers for r in (opt.replicators[0].then,)]
    assert all(r.graphs is False for r in inner)
    assert make_replicator("demo").graphs == "auto"


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device (torch.cuda.is_available)")
@pytest.mark.parametrize("kw", [{}, {"values": "fp32", "topk": 32}, {"overlap": "delayed"},
                                {"transform_dtype": "bf16"}], ids=str)
def test_graphs_equal_eager_on_cuda(kw):
    # 12 steps: the delayed mode alternates two payload buffers, a graph each
    graphed, a = _run("cuda", steps=12, graphs=True, **kw)
    eager, b = _run("cuda", steps=12, graphs=False, **kw)
    kinds = {key[0] for key in graphed.step_graphs.captured}
    # captured, and replayed from step 3 on (the delayed mode's check and decode leave bad
    # peers out on the device)
    want = {"fill", "check-kept", "decode-kept"} if kw.get("overlap") else {
        "fill", "check", "decode"}
    assert want <= kinds
    assert all(_same(x, y) for x, y in zip(a, b))
    assert _same(graphed.delta, eager.delta)


def _corrupt_run(device, graphs):
    """Two peers (this rank's payload twice), the second sending NaN from step 5 on: the error
    and the momentum after it (rolled back to after the momentum update alone)."""
    rep = DeMoReplicator(graphs=graphs, values="fp32")
    shapes = [torch.Size(s) for s in SHAPES]
    rep.setup(shapes, torch.device(device), None)

    calls = [0]

    def exchange(buf):
        out = torch.stack([buf, buf])
        calls[0] += 1
        if calls[0] > 5:
            g = rep.groups[0]
            out[1, g.val_off: g.val_off + 8].view(torch.float32).fill_(float("nan"))
        return out

    rep._exchange = exchange
    torch.manual_seed(0)
    lrs = [2.0 ** -10] * len(shapes)
    for step in range(5):
        rep.replicate([torch.randn(s, device=device) for s in shapes], lrs, step, True)
    with pytest.raises(CorruptPayloadError, match="rank 1") as err:
        rep.replicate([torch.randn(s, device=device) for s in shapes], lrs, 5, True)
    return rep, str(err.value), [d.cpu().clone() for d in rep.delta]


def test_corrupt_peer_named_with_graphs_off_cuda():
    rep, msg, _ = _corrupt_run("cpu", True)
    assert "non-finite" in msg and not rep.step_graphs.captured


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device (torch.cuda.is_available)")
def test_graphs_name_a_corrupt_peer_on_cuda():
    """After the check's graph is captured: the same error and the same rolled-back momentum
    as eager CUDA."""
    rep, msg, delta = _corrupt_run("cuda", True)
    assert any(key[0] == "check" for key in rep.step_graphs.captured)
    _, eager_msg, eager_delta = _corrupt_run("cuda", False)
    assert msg == eager_msg
    assert all(torch.equal(x, y) for x, y in zip(delta, eager_delta))


def _delayed_corrupt_run(device, graphs, monkeypatch, corrupt=True):
    """Delayed mode, two peers (this rank's payload twice), the second sending NaN at step 5:
    the outputs of steps 0-6 and the error at step 7 (None when ``corrupt`` is False)."""
    import flexdemo.replicate.demo.delayed as delayed_module

    rep = DeMoReplicator(graphs=graphs, values="fp32", overlap="delayed")
    shapes = [torch.Size(s) for s in SHAPES]
    rep.setup(shapes, torch.device(device), None)

    def gather(buf, group, stats, async_op=False):
        out = torch.stack([buf, buf])
        if corrupt and int(out[0, 8:16].view(torch.int64)) == 5:  # (the test may read)
            g = rep.groups[0]
            out[1, g.val_off: g.val_off + 8].view(torch.float32).fill_(float("nan"))
        return out

    monkeypatch.setattr(delayed_module, "all_gather", gather)  # the delayed mode's exchange
    torch.manual_seed(0)
    lrs = [2.0 ** -10] * len(shapes)
    outs = [[g.cpu().clone() for g in rep.replicate(
        [torch.randn(s, device=device) for s in shapes], lrs, step, True)] for step in range(7)]
    err = None
    try:
        rep.replicate([torch.randn(s, device=device) for s in shapes], lrs, 7, True)
    except CorruptPayloadError as e:
        err = str(e)
    return rep, outs, err


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not CUDA, reason="CUDA graphs need a CUDA device (torch.cuda.is_available)"))])
def test_delayed_mode_leaves_a_corrupt_peer_out_then_names_it(device, monkeypatch):
    """Step 6 applies step 5's payloads with the bad peer left out on the device (both peers
    sent the same, so the mean of the good one is the uncorrupted mean); step 7 names it. On
    CUDA, with the check and decode graphs replayed, as eagerly."""
    rep, outs, err = _delayed_corrupt_run(device, True, monkeypatch)
    _, clean, none = _delayed_corrupt_run(device, True, monkeypatch, corrupt=False)
    assert none is None and "rank 1" in err and "step 5" in err and "non-finite" in err
    assert all(_same(a, b) for a, b in zip(outs, clean))
    if device == "cuda":
        assert {"check-kept", "decode-kept"} <= {key[0] for key in rep.step_graphs.captured}
        _, eager, eager_err = _delayed_corrupt_run(device, False, monkeypatch)
        assert eager_err == err and all(_same(a, b) for a, b in zip(outs, eager))


@pytest.mark.skipif(not CUDA, reason="synchronisations are a CUDA notion (torch.cuda)")
def test_delayed_optimizer_step_does_not_synchronise():
    """After the warm-up, a delayed DeMo optimizer step makes no synchronising CUDA call
    (``set_sync_debug_mode("error")`` raises on one)."""
    from torch import nn

    from flexdemo import DeToNATION

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64)).cuda()
    opt = DeToNATION(model.parameters(), DeMoReplicator(overlap="delayed"), lr=1e-3,
                     base_kwargs={"foreach": True})
    x = torch.randn(8, 64, device="cuda")
    for step in range(8):
        model(x).pow(2).mean().backward()
        if step >= 4:  # graphs captured at step 2
            torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        opt.zero_grad()
    assert any(key[0] == "check-kept" for key in opt.replicators[0].step_graphs.captured)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device (torch.cuda.is_available)")
@pytest.mark.parametrize("overlap", ["none", "delayed"])
def test_every_stage_of_a_step_shape_is_graphed_with_many_groups(overlap):
    """A step of 40 groups (delayed mode: two send buffers too) is graphed whole after the
    warm-up: every key that ran eagerly was captured (a cap on graphs rather than step shapes
    once left a third of a delayed step eager)."""
    from flexdemo.replicate.demo import graphs as graphs_module

    shapes = [(256, 256)] * 10
    rep = DeMoReplicator(overlap=overlap, group_numel=64 * 256, graphs=True)
    rep.setup([torch.Size(s) for s in shapes], torch.device("cuda"), None)
    assert len(rep.groups) >= 40 > graphs_module.MAX_SHAPES
    for step in range(8):
        rep([torch.randn(s, device="cuda") for s in shapes], [2.0 ** -10] * len(shapes), step)
    sg = rep.step_graphs
    assert len(sg.shapes) == 1 and set(sg.warm) <= set(sg.captured)
    assert sum(key[0].startswith("decode") for key in sg.captured) >= 40
