"""Lion: a sign step of an interpolated momentum (Chen et al. 2023), as a base optimizer.

Per parameter: ``u = sign(beta1 * m + (1 - beta1) * g)``; ``p -= lr * (u + weight_decay * p)``;
``m = beta2 * m + (1 - beta2) * g``. Every parameter moves by ``lr`` per step, as with a
sign-SGD DeMo, but through a momentum of the gradient it is given.

Two uses in flexdemo: with a ``"full"`` replicator it is the sign-based optimizer with an
exact mean gradient (what a sign step can reach when nothing is compressed); with a DeMo
replicator at ``sign=False`` it takes the decoded mean of the replicas as its gradient, so its
momentum gathers the coefficients sent over several steps before the sign (``beta1 = beta2 =
0`` is sign-SGD DeMo; with the usual betas the quality benchmark found it worse than sign-SGD
DeMo). Every replica receives the same gradient and so keeps the same bits.
"""

from __future__ import annotations

import torch


class Lion(torch.optim.Optimizer):
    """Lion with the usual defaults (``betas=(0.9, 0.99)``); use an lr about 3-10x below
    AdamW's. One multi-tensor pass per parameter group."""

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        if not isinstance(lr, (int, float)) or not lr >= 0.0:
            raise ValueError(f"lr must be a number >= 0, got {lr!r}")
        if (len(betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b <= 1.0
                                       for b in betas)):
            raise ValueError(f"betas must be two numbers in [0, 1], got {betas!r}")
        if not isinstance(weight_decay, (int, float)) or not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be a number >= 0, got {weight_decay!r}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas),
                                  "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("Lion does not take sparse gradients")
            grads = [p.grad for p in params]
            for p in params:
                if "exp_avg" not in self.state[p]:
                    self.state[p]["exp_avg"] = torch.zeros_like(p)
            moms = [self.state[p]["exp_avg"] for p in params]
            lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
            upd = torch._foreach_mul(moms, b1)
            torch._foreach_add_(upd, grads, alpha=1.0 - b1)
            torch._foreach_sign_(upd)
            if wd:
                torch._foreach_mul_(params, 1.0 - lr * wd)
            torch._foreach_add_(params, upd, alpha=-lr)
            torch._foreach_mul_(moms, b2)
            torch._foreach_add_(moms, grads, alpha=1.0 - b2)
        return loss
