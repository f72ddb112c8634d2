"""The undo copy of a fault-tolerant step (``flexdemo.ft.state``), in one process: it reuses
the last copy's tensors, is bitwise what a fresh deep copy would be, and never writes into
tensors that a restore made live state. (The failed votes of real runs: test_elastic.py.)"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from flexdemo import DeToNATION
from flexdemo.ft.state import copy_into, restore, snapshot
from flexdemo.replicate import make_replicator

# (DiLoCo's outer momentum appears at its first sync: with H=1 the state is settled after
# step 0, as the tests below need; plain averaging has none, so H=2 keeps an inner step)
REPLICATORS = {"demo": {"topk": 4, "chunk": 16}, "full": {}, "random": {"rate": 0.25},
               "diloco": {"inner_steps": 1}, "diloco-avg": {"inner_steps": 2}}


def _opt(name: str) -> tuple[nn.Module, DeToNATION]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    rep = make_replicator(name, **REPLICATORS[name])
    return net, DeToNATION(net.parameters(), rep, base="adamw", lr=1e-2)


def _step(net: nn.Module, opt: DeToNATION, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    opt.zero_grad()
    nn.functional.mse_loss(net(x), y).backward()
    opt.step()


def _tensors(snap) -> list[torch.Tensor]:
    return [t for t in tree_leaves([snap.params, snap.base, snap.replicators])
            if isinstance(t, torch.Tensor)]


def _live(opt: DeToNATION) -> set[int]:
    """The storages of every tensor of the optimizer's live state."""
    trees = [[p.detach() for p in opt.params], opt.base.state_dict()]
    trees += [r.live_state() for r in opt.replicators]
    return {t.untyped_storage().data_ptr() for t in tree_leaves(trees)
            if isinstance(t, torch.Tensor) and t.numel()}


def _equal(a, b) -> bool:
    la, lb = tree_leaves(a), tree_leaves(b)
    return len(la) == len(lb) and all(
        torch.equal(x, y) and x.dtype == y.dtype if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(la, lb))


@pytest.mark.parametrize("name", sorted(REPLICATORS))
def test_the_undo_copy_reuses_the_last_ones_tensors(name):
    """From the second step on, every tensor of the undo copy is the last copy's (no
    allocation), holding bitwise what a fresh copy of the state holds."""
    net, opt = _opt(name)
    _step(net, opt, 0)  # the state's shapes are settled (AdamW's moments exist)
    first = snapshot(opt)
    _step(net, opt, 1)
    ids = [id(t) for t in _tensors(first)]
    again = snapshot(opt, first)
    assert [id(t) for t in _tensors(again)] == ids
    fresh = snapshot(opt)
    assert _equal([again.params, again.base, again.replicators],
                  [fresh.params, fresh.base, fresh.replicators])
    assert not {t.untyped_storage().data_ptr() for t in _tensors(again)} & _live(opt)


@pytest.mark.parametrize("name", sorted(REPLICATORS))
def test_a_restored_copy_lends_only_its_parameters(name):
    """After a restore, ``load_state_dict`` may keep the copy's tensors as the live state
    (torch's optimizers do): the next copy reuses only the parameters' copies and writes into
    no live tensor, so a second undo is exact."""
    net, opt = _opt(name)
    _step(net, opt, 0)
    snap = snapshot(opt)
    before = copy.deepcopy([snap.params, snap.base, snap.replicators])
    _step(net, opt, 1)
    restore(opt, snap)  # a failed vote
    again = snapshot(opt, snap)
    assert [id(t) for t in again.params] == [id(t) for t in snap.params]
    assert not {t.untyped_storage().data_ptr() for t in _tensors(again)} & _live(opt)
    _step(net, opt, 1)  # the retried step, voted down again
    restore(opt, again)
    now = snapshot(opt)
    assert _equal([now.params, now.base, now.replicators], before)


def test_copy_into_falls_back_to_a_clone_where_the_spare_does_not_fit():
    a = {"x": [torch.ones(3), torch.zeros(2)], "n": 3, "t": (torch.ones(1),)}
    spare = {"x": [torch.empty(3), torch.empty(4)], "t": None}
    out = copy_into(a, spare)
    assert out["x"][0] is spare["x"][0] and out["x"][1] is not spare["x"][1]
    assert _equal(out, a) and out["t"][0] is not a["t"][0]


def test_copy_into_is_a_deep_copy_of_plain_values_and_parameters():
    """Plain leaves come back as deepcopy gives them (the same immutable objects), mutable
    ones copied; a tensor that needs its gradient is cloned with the flag kept."""
    w = nn.Parameter(torch.randn(3))
    tree = {"step": 7, "lr": 1e-3, "name": "adamw", "flag": None, "dtype": torch.float32,
            "betas": (0.9, 0.99), "hist": [1, 2], "w": w, "nested": {"t": [torch.arange(4.0)]}}
    first = copy_into(tree)
    assert _equal(first, tree) and first == copy.deepcopy(tree) | {"w": first["w"],
                                                                    "nested": first["nested"]}
    assert first["name"] is tree["name"] and first["betas"] == (0.9, 0.99)
    assert first["hist"] is not tree["hist"]  # a list: copied, as deepcopy does
    assert first["w"] is not w and first["w"].requires_grad
    with torch.no_grad():
        w.add_(1.0)
    tree["nested"]["t"][0].mul_(2.0)
    again = copy_into(tree, first)
    assert again["nested"]["t"][0] is first["nested"]["t"][0]
    assert _equal(again, tree)


def test_demos_live_state_is_its_momentum_not_a_copy():
    """DeMo's momentum lives as strided views of its blocks (not contiguous for a 64 x 128
    weight); the live state hands over those tensors themselves, so an undo copy copies each
    once (a reshape to rows would copy them first), and a restore loads them back exactly."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 4))
    rep = make_replicator("demo")
    opt = DeToNATION(net.parameters(), rep, base="sgd", lr=1e-2)
    net(torch.randn(2, 64)).sum().backward()
    opt.step()
    assert not all(d.is_contiguous() for d in rep.delta)  # the case that a reshape copies
    live = rep.live_state()["delta"]
    assert all(a is b for a, b in zip(live, rep.delta)) and len(live) == len(rep.delta)
    saved = rep.state_dict()
    for d in rep.delta:
        d.zero_()
    rep.load_state_dict(saved)
    assert all(torch.equal(d.reshape(d.shape[0], -1), s) for d, s in zip(rep.delta,
                                                                         saved["delta"]))
