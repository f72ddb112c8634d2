"""DiLoCo and Streaming DiLoCo in one process (a group of one) and the quantised codecs."""

import copy

import pytest
import torch
from torch import nn

from flexdemo import DeToNATION, DiLoCoReplicator, FullReplicator, NonFiniteGradientError
from flexdemo.compress.quant import FORMATS, ValueCodec
from flexdemo.replicate import make_replicator
from flexdemo.replicate.agreement import HEADER_BYTES
from flexdemo.replicate.diloco import balanced_fragments


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 40), nn.Tanh(), nn.Linear(40, 24), nn.Tanh(),
                         nn.Linear(24, 3))


def run(m, opt, steps, start=0, seed=0):
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(seed * 1000 + s)
        x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
        (m(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [1, 5, 128, 1001])
def test_codec_round_trip_within_bound(fmt, n):
    torch.manual_seed(n)
    codec = ValueCodec(fmt, block=64)
    x = torch.randn(n) * 5
    buf = torch.zeros(codec.nbytes(n), dtype=torch.uint8)
    codec.encode(x, buf)
    y = codec.decode(buf, n)
    assert bool(((x - y).abs() <= codec.max_error(x) + 1e-12).all())
    if fmt == "fp32":
        assert torch.equal(x, y)


def test_codec_sizes():
    assert ValueCodec("fp32").nbytes(100) == 400
    assert ValueCodec("bf16").nbytes(100) == 200
    assert ValueCodec("int8", 64).nbytes(100) == 100 + 2 * 4
    assert ValueCodec("int4", 64).nbytes(101) == 51 + 2 * 4
    with pytest.raises(ValueError, match="unknown value format"):
        ValueCodec("int5")


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_full_payload_formula(fmt):
    rep = FullReplicator(values=fmt, block=64)
    rep.setup([torch.Size([10, 7]), torch.Size([33])], torch.device("cpu"), None)
    nbytes = HEADER_BYTES + ValueCodec(fmt, 64).nbytes(70 + 33)
    assert rep.payload_bytes() == nbytes + (-nbytes % 8)


def test_balanced_fragments():
    sizes = [1000, 10, 500, 480, 20, 990]
    parts = balanced_fragments(sizes, 2)
    assert sorted(i for p in parts for i in p) == list(range(6))
    loads = [sum(sizes[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(sizes)
    assert loads == [1500, 1500]


@pytest.mark.parametrize("kwargs,match", [
    ({"inner_steps": 0}, "inner_steps"), ({"inner_steps": 10, "fragments": 3}, "does not divide"),
    ({"inner_steps": 10, "fragments": 2, "tau": 5}, "tau"), ({"tau": -1}, "tau"),
    ({"alpha": 1.5}, "alpha"), ({"alpha": -0.1}, "alpha"), ({"outer_lr": -1}, "outer_lr"),
    ({"outer_momentum": 1.0}, "outer_momentum"), ({"exchange": "zip"}, "unknown exchange"),
])
def test_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DiLoCoReplicator(**kwargs)


def test_streaming_syncs_every_parameter_once_per_period():
    m = model()
    rep = DiLoCoReplicator(inner_steps=6, fragments=3, tau=1)
    DeToNATION(m.parameters(), rep, base="sgd", lr=0.01)
    launched = [rep.launch_fragment(t) for t in range(12)]
    assert launched == [None, 0, None, 1, None, 2] * 2
    counts = [0] * len(list(m.parameters()))
    for p in launched[:6]:
        if p is not None:
            for i in rep.parts[p]:
                counts[i] += 1
    assert counts == [1] * len(counts)


def test_sync_resets_to_global_and_outer_step_is_sgd():
    """Group of one, H=3, outer SGD lr 1 without momentum: the pseudo-gradient is global -
    local, so the new global is the local model and nothing changes; with lr 0.5 the new
    parameters are the midpoint of the old global and the local ones. The default outer step
    is the DiLoCo paper's (Nesterov, lr 0.7, momentum 0.9); "diloco-avg" is plain averaging."""
    rep = DiLoCoReplicator()
    assert (rep.outer_lr, rep.outer_momentum, rep.nesterov) == (0.7, 0.9, True)
    avg = make_replicator("diloco-avg")
    assert (avg.outer_lr, avg.outer_momentum) == (1.0, 0.0)
    for kw, expect in (({"outer_lr": 1.0, "outer_momentum": 0.0}, "local"),
                       ({"outer_lr": 0.5, "outer_momentum": 0.0}, "mid")):
        m = model()
        start = [p.detach().clone() for p in m.parameters()]
        rep = DiLoCoReplicator(inner_steps=3, **kw)
        opt = DeToNATION(m.parameters(), rep, base="sgd", lr=0.05)
        run(m, opt, 2)
        ref = copy.deepcopy(m)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        run(ref, ref_opt, 1, start=2)
        run(m, opt, 1, start=2)  # step 2 ends the period: outer step
        for p, q, s in zip(m.parameters(), ref.parameters(), start):
            target = q if expect == "local" else (s + q) / 2
            torch.testing.assert_close(p, target, rtol=1e-6, atol=1e-7)
        assert all(torch.equal(p, g) for p, g in zip(m.parameters(), rep.global_params))


def test_alpha_one_never_touches_the_replica_and_tau_delays():
    m = model()
    ref = copy.deepcopy(m)
    rep = DiLoCoReplicator(inner_steps=4, fragments=2, tau=1, alpha=1.0)
    opt = DeToNATION(m.parameters(), rep, base="adamw", lr=0.01)
    ref_opt = DeToNATION(ref.parameters(), "none", base="adamw", lr=0.01)
    run(m, opt, 9)
    run(ref, ref_opt, 9)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), ref.parameters()))
    # launched after steps 1 and 3 (fragments 0, 1), applied after 2 and 4, ...
    m = model()
    rep = DiLoCoReplicator(inner_steps=4, fragments=2, tau=1, alpha=0.0)
    opt = DeToNATION(m.parameters(), rep, base="adamw", lr=0.01)
    run(m, opt, 2)
    assert set(rep.pending) == {0}
    run(m, opt, 1, start=2)
    assert not rep.pending
    params = list(m.parameters())
    for i in rep.parts[0]:
        assert torch.equal(params[i], rep.global_params[i])


def test_state_round_trip_with_a_sync_in_flight():
    for exchange, kw in (("full", {"values": "int8"}), ("demo", {"topk": 4, "chunk": 8})):
        m = model()
        rep = DiLoCoReplicator(inner_steps=4, fragments=2, tau=1, exchange=exchange,
                               exchange_kwargs=kw)
        opt = DeToNATION(m.parameters(), rep, base="adamw", lr=0.01)
        run(m, opt, 6)  # fragment 0 is launched after step 5 and applied after step 6
        m2 = copy.deepcopy(m)
        rep2 = DiLoCoReplicator(inner_steps=4, fragments=2, tau=1, exchange=exchange,
                                exchange_kwargs=kw)
        opt2 = DeToNATION(m2.parameters(), rep2, base="adamw", lr=0.01)
        sd = copy.deepcopy(opt.state_dict())
        assert rep.pending, "a sync should be in flight at step 6"
        opt2.load_state_dict(sd)
        run(m, opt, 7, start=6)
        run(m2, opt2, 7, start=6)
        assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters()))


def test_offload_keeps_global_on_cpu_and_same_result():
    results = []
    for offload in (False, True):
        m = model()
        rep = DiLoCoReplicator(inner_steps=3, offload=offload)
        opt = DeToNATION(m.parameters(), rep, base="adamw", lr=0.01)
        run(m, opt, 7)
        assert all(g.device.type == "cpu" for g in rep.global_params)
        results.append([p.detach().clone() for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_full_settings_and_group_of_one():
    with pytest.raises(ValueError, match="on_bad_peer must be 'raise' or 'drop'"):
        FullReplicator(values="int8", on_bad_peer="ignore")
    rep = FullReplicator(values="int4", block=32, on_bad_peer="drop")
    rep.setup([torch.Size([10, 7]), torch.Size([33])], torch.device("cpu"), None)
    assert rep.exchange_bytes() == 0 and rep.payload_bytes() > 0  # a group of one sends nothing
    assert rep.state_dict()["dropped_payloads"] == 0


def test_diloco_nonfinite_in_a_group_of_one():
    """Alone, a NaN inner step raises at once (raise) or is skipped (skip); a sync whose
    pseudo-gradient is NaN is dropped and the replica restarts from the global parameters."""
    for policy in ("raise", "skip"):
        m = model()
        opt = DeToNATION(m.parameters(), DiLoCoReplicator(inner_steps=2), base="sgd", lr=0.05,
                         nonfinite=policy)
        run(m, opt, 1)
        m[0].weight.data[0, 0] = float("nan")  # every later gradient is NaN
        x = torch.randn(4, 6)
        m(x).sum().backward()
        if policy == "raise":
            with pytest.raises(NonFiniteGradientError, match="diloco: non-finite"):
                opt.step()
        else:
            opt.step()  # step 1 ends with a sync: its NaN pseudo-gradient drops it
            assert opt.skipped_steps == 1 and opt.steps == 2
            assert bool(torch.isfinite(m[0].weight).all())  # restarted from global
