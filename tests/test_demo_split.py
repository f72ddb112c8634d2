"""Tensors whose rows need padding are split into their tiling rows (momentum kept as DCT
coefficients, staged straight into block rows) and the rest (one padded row of blocks): the
same algorithm as one padded tensor, and momentum saved before the split still loads."""

import pytest
import torch

from flexdemo.compress import BlockDCT, plan_chunks
from flexdemo.replicate import DeMoReplicator

SHAPES = [(131, 70), (64, 64), (263, 64), (7, 9), (70, 131), (200,), (3, 131)]


def _rep(**kw):
    rep = DeMoReplicator(**kw)
    rep.setup([torch.Size(s) for s in SHAPES], torch.device("cpu"), None)
    return rep


def test_only_row_padded_tensors_are_split():
    rep = _rep()
    parts = {}
    for u in rep.units:
        for i in u.members:
            parts.setdefault(i, []).append(u.part)
    assert parts[0] == [(0, 128), (128, 131)]  # 131 rows: two rows of blocks and 3 rows
    assert parts[2] == [(0, 256), (256, 263)]
    assert parts[1] == [None]  # tiles exactly
    assert parts[4] == [None]  # its columns need padding: not split
    split = [u for u in rep.units if u.part is not None]
    assert [u.padded for u in split] == [False, True, False, True]
    assert all(u.plan.chunk == (64, 70) for u in split[:2])
    assert split[1].plan.padded == (64, 70)  # the rest: one padded row of blocks
    # the same blocks, so the same payload as the tensor padded whole
    assert sum(u.plan.num_blocks for u in split[:2]) == plan_chunks((131, 70)).num_blocks


def _reference(shape, grads, lrs, topk, decay):
    """DeMo on one padded tensor: momentum in the parameter's domain, top-k of the blocked
    DCT, error feedback through the inverse; the outputs of a group of one (no sign)."""
    t = BlockDCT(plan_chunks(shape))
    delta = torch.zeros(shape)
    outs = []
    for g, lr in zip(grads, lrs):
        delta = decay * delta + lr * g
        coef = t.encode(delta)
        idx = coef.abs().topk(topk, dim=1).indices
        sent = torch.zeros_like(coef).scatter_(1, idx, coef.gather(1, idx))
        out = t.decode(sent)
        delta -= out
        outs.append(out)
    return outs


@pytest.mark.parametrize("shape", [(131, 70), (263, 64)])
def test_split_tensor_follows_the_padded_algorithm(shape):
    torch.manual_seed(0)
    steps, topk, decay = 5, 8, 0.9
    grads = [torch.randn(shape) for _ in range(steps)]
    lrs = [0.5, 0.25, 0.25, 1.0, 0.5]
    rep = DeMoReplicator(topk=topk, decay=decay, values="fp32", sign=False)
    rep.setup([torch.Size(shape)], torch.device("cpu"), None)
    assert len(rep.units) == 2
    want = _reference(shape, grads, lrs, topk, decay)
    for step, (g, lr, ref) in enumerate(zip(grads, lrs, want)):
        out = rep([g.clone()], [lr], step)[0]
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_momentum_saved_before_the_split_loads():
    """The layout of earlier versions (one buffer per padded tensor, in its own domain)
    loads into the split units: the tiling rows transformed, the rest as it was."""
    torch.manual_seed(1)
    rep = _rep(values="fp32", sign=False)
    for step in range(3):
        rep([torch.randn(s) for s in SHAPES], [1e-2] * len(SHAPES), step)
    state = rep.state_dict()
    old, units = [], rep.units
    j = 0
    while j < len(units):  # back to one parameter-domain buffer per split tensor
        u = units[j]
        if u.part is None:
            old.append(state["delta"][j])
            j += 1
            continue
        head = u.transform.decode(state["delta"][j])
        old.append(torch.cat([head, state["delta"][j + 1]]))
        j += 2
    assert len(old) == len(units) - 2
    fresh = _rep(values="fp32", sign=False)
    fresh.load_state_dict({**state, "delta": old})
    for mine, theirs in zip(fresh.delta, rep.delta):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7)
    grads = [torch.randn(s) for s in SHAPES]
    a = rep([g.clone() for g in grads], [1e-2] * len(SHAPES), 3)
    b = fresh([g.clone() for g in grads], [1e-2] * len(SHAPES), 3)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="momentum buffers"):
        _rep().load_state_dict({**state, "delta": old[:-1]})
