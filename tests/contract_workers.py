"""Workers of the replicator contract test: every registered replicator on 2 real ranks."""

from __future__ import annotations

import contextlib

import torch
from dist_workers import Tiny, batch, shards
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import flexdemo
from flexdemo import NonFiniteGradientError
from flexdemo.replicate import REPLICATORS

# small settings so that a few steps exercise every part (DiLoCo syncs after steps 1, 3, 5)
SETTINGS = {"demo": {"topk": 4, "chunk": 8}, "diloco": {"inner_steps": 2},
            # the frontier presets are DiLoCo: H=2 as above, their exchanges at small sizes
            "muloco": {"inner_steps": 2}, "diloco-avg": {"inner_steps": 2},
            "sparseloco": {"inner_steps": 2, "exchange_kwargs": {"topk": 4, "chunk": 8}},
            "muloco-int4": {"inner_steps": 2, "exchange_kwargs": {"block": 16}},
            "sparseloco-dct": {"inner_steps": 2, "exchange_kwargs": {"topk": 4, "chunk": 8}},
            # topk 8 for steps 0-2, then 4: the state round trip and the NaN fall after it
            "demo-warmup": {"warmup_topk": 8, "warmup_steps": 3, "topk": 4, "chunk": 8},
            "random": {"rate": 0.25}, "striding": {"rate": 0.25}, "slicing": {"rate": 0.25},
            # "auto" decided before step 0 (link and compute given): full sync, as its choice
            "auto": {"link": "100gbit,0.01ms", "compute_seconds": 1.0, "candidates": ["full"],
                     "verbose": False}}
STEPS = 6


def _opt(name: str, model: nn.Module) -> flexdemo.DeToNATION:
    rep = REPLICATORS[name](**SETTINGS.get(name, {}))
    return flexdemo.DeToNATION(model.parameters(), rep, base="sgd", lr=0.05)


def _step(model, opt, rank: int, s: int, nan: bool = False) -> None:
    x, y = batch(rank, s)
    (model(x) - y).pow(2).mean().backward()
    if nan:
        model.out.weight.grad[0, 0] = float("nan")
    opt.step()
    opt.zero_grad()


def _model() -> nn.Module:
    torch.manual_seed(0)  # the same start on every rank
    return Tiny()


def contract_worker(rank: int, world: int) -> dict:
    out = {}
    for name in REPLICATORS:
        res = out[name] = {}
        model = _model()
        opt = _opt(name, model)
        rep = opt.replicators[0]
        sent, formula = [], []
        for s in range(STEPS):
            _step(model, opt, rank, s)
            sent.append(opt.last_step_stats()["bytes_sent"])
            formula.append(rep.exchange_bytes())  # of the step just run (phases may differ)
        res["shards"] = shards(model)
        res["sent"] = sent
        res["exchange_bytes"] = rep.exchange_bytes()
        res["formula"] = formula
        res["communicates"] = [rep.communicates(s) for s in range(STEPS)]
        # state round trip: a fresh optimizer loaded from the state gives the same next step
        state = opt.state_dict()
        twin = _model()
        with torch.no_grad():
            for p, q in zip(twin.parameters(), model.parameters()):
                p.copy_(q)
        twin_opt = _opt(name, twin)
        twin_opt.load_state_dict(state)
        _step(model, opt, rank, STEPS)
        _step(twin, twin_opt, rank, STEPS)
        res["resumed_same"] = all(torch.equal(a, b) for a, b in
                                  zip(shards(model), shards(twin)))
        # non-finite agreement: NaN on rank 1 at step STEPS + 1
        raised = None
        for s in range(STEPS + 1, STEPS + 4):
            try:
                _step(model, opt, rank, s, nan=rank == 1 and s == STEPS + 1)
            except NonFiniteGradientError as e:
                raised = (s, e.ranks)
                break
        res["raised"] = raised
    return out


# ---------------------------------------------------------------- op and host-sync counts
class OpCounter(TorchDispatchMode):
    """Counts dispatched ops; host reads are ``aten._local_scalar_dense`` dispatches and
    ``Tensor.tolist`` calls (which read memory without a dispatch on CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting():
    counter = OpCounter()
    tolist = torch.Tensor.tolist

    def counted_tolist(t):
        counter.syncs += 1
        return tolist(t)

    torch.Tensor.tolist = counted_tolist
    try:
        with counter:
            yield counter
    finally:
        torch.Tensor.tolist = tolist


class Layers(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(layers)])
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x)


COUNTED = {
    "full": ("full", {}),
    "full-int8": ("full", {"values": "int8", "block": 32}),
    "full-fp16": ("full", {"values": "fp16"}),
    "random": ("random", {"rate": 0.25}),
    "striding": ("striding", {"rate": 0.25}),
    "slicing": ("slicing", {"rate": 0.25}),
    "full-every2": ("full", {"replicate_every": 2}),  # step 3 exchanges nothing
    # step 3 launches and applies the second sync (the first made the outer momentum)
    "diloco": ("diloco", {"inner_steps": 2}),
    "diloco-inner": ("diloco", {"inner_steps": 8}),  # step 3 is an inner step
    "diloco-int4": ("diloco", {"inner_steps": 2,
                               "exchange_kwargs": {"values": "int4", "block": 32}}),
    # step 3 hands the momentum over to the topk-16 phase (these layers' small tensors make
    # one block whose shape, and so DeMo's selection path at topk 64, follows their number)
    "demo-warmup": ("demo-warmup", {"warmup_steps": 3}),
}


def count_worker(rank: int, world: int) -> dict:
    """Ops and host reads of one replicator step (step 3, after 3 warm-up steps), for models
    of 2 and 8 identical layers."""
    out = {}
    for name, (kind, kw) in COUNTED.items():
        for layers in (2, 8):
            torch.manual_seed(0)
            model = Layers(layers)
            rep = REPLICATORS[kind](**kw)
            opt = flexdemo.DeToNATION(model.parameters(), rep, base="sgd", lr=0.05)
            for s in range(4):
                g = torch.Generator().manual_seed(10 * rank + s)
                x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
                (model(x) - y).pow(2).mean().backward()
                if s < 3:
                    opt.step()
                    opt.zero_grad()
            grads = [p.grad for p in model.parameters()]
            lrs = [0.05] * len(grads)
            with counting() as c:
                rep(grads, lrs, 3)
                rep.after_step(3)
            out[name, layers] = {"ops": c.ops, "syncs": c.syncs, "tensors": len(grads)}
    return out
