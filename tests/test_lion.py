"""The Lion base optimizer: its update rule, its limits, and its use by name."""

import pytest
import torch
from torch import nn

from flexdemo import DeToNATION
from flexdemo.lion import Lion


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(5, 7, generator=g)),
            nn.Parameter(torch.randn(3, generator=g))]


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def test_lion_matches_its_formula_over_steps():
    params = _params()
    ref = [p.detach().clone() for p in params]
    moms = [torch.zeros_like(p) for p in ref]
    lr, b1, b2, wd = 0.01, 0.8, 0.95, 0.1
    opt = Lion(params, lr=lr, betas=(b1, b2), weight_decay=wd)
    for step in range(4):
        _grads(params, step)
        for p, r, m in zip(params, ref, moms):
            u = torch.sign(b1 * m + (1 - b1) * p.grad)
            r.mul_(1 - lr * wd).add_(u, alpha=-lr)
            m.mul_(b2).add_(p.grad, alpha=1 - b2)
        opt.step()
        for p, r in zip(params, ref):
            torch.testing.assert_close(p.detach(), r, rtol=0, atol=1e-6)
    # every entry moved by lr per step (apart from the weight decay)
    assert opt.state[params[0]]["exp_avg"].abs().sum() > 0


def test_lion_without_momentum_is_sign_sgd():
    params, ref = _params(), _params()
    _grads(params, 3)
    _grads(ref, 3)
    Lion(params, lr=0.05, betas=(0.0, 0.0)).step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach(), r.detach() - 0.05 * torch.sign(r.grad))


def test_lion_skips_parameters_without_gradient():
    params = _params()
    before = params[1].detach().clone()
    _grads(params[:1], 0)
    Lion(params, lr=0.1).step()
    assert torch.equal(params[1].detach(), before)


@pytest.mark.parametrize("kwargs, match", [
    ({"lr": -1.0}, "lr must be"),
    ({"betas": (0.9, 1.5)}, "betas must be"),
    ({"betas": (0.9,)}, "betas must be"),
    ({"weight_decay": -0.1}, "weight_decay must be"),
])
def test_lion_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Lion(_params(), **kwargs)


def test_lion_by_name_as_base_optimizer():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    x = torch.randn(64, 6)
    y = x @ torch.randn(6, 1)
    opt = DeToNATION(m.parameters(), "none", base="lion", lr=3e-3,
                     base_kwargs={"betas": (0.9, 0.99)})
    assert isinstance(opt.base, Lion)
    first = None
    for _ in range(60):
        loss = (m(x) - y).pow(2).mean()
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert (m(x) - y).pow(2).mean().item() < 0.3 * first
