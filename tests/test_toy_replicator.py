"""A replicator registered by this test alone trains through ``prepare()`` (2 gloo ranks), the
emulated cluster (``SimulatedReplicas``), the DCP helpers (:mod:`flexdemo.checkpoint.dcp`), the
settings check and DiLoCo's exchange, with no edit anywhere else: the ``Replicator`` contract is
all the rest of flexdemo reads. The registry entry is removed after each test."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_world
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import flexdemo
from flexdemo.replicate import REPLICATORS, make_replicator
from flexdemo.replicate.agreement import Agreement
from flexdemo.transport import all_reduce_bytes, all_reduce_sum

NAME = "toy-scaled-mean"


class ScaledMean(flexdemo.Replicator):
    """``scale`` times the mean of the replicas' gradients, by one fp32 all-reduce (the
    agreement's trailer at its end); keeps the sum of its own inputs (per-replica state)."""

    name = NAME
    syncs_replicas = True  # every replica gets the same mean
    state_tensor_keys = ("seen",)  # fixed-shape tensors: they travel as DCP tensors

    def __init__(self, scale: float = 1.0, **schedule) -> None:
        super().__init__(**schedule)
        self.scale = scale

    def _setup_state(self) -> None:
        self._sizes = [s.numel() for s in self._shapes]
        self._total = sum(self._sizes)
        self._bucket = torch.zeros(self._total + Agreement.trailer_size(self.world),
                                   dtype=torch.float32, device=self.device)
        self.seen = [torch.zeros(s, dtype=torch.float32, device=self.device)
                     for s in self._shapes]

    def payload_bytes(self) -> int:
        return self._bucket.numel() * 4

    def exchange_bytes(self) -> int:
        return all_reduce_bytes(self._bucket.numel(), 4, self.world)

    def replicate(self, grads, lrs, step, communicate):
        flag, code = self.agreement.local(grads)
        if not communicate:
            self.agreement.check_local(flag, step)
            for g, s in zip(grads, self.seen):
                if g is not None:
                    s.add_(g)
            return [None if g is None else g.mul_(self.scale) for g in grads]
        flat, off = self._bucket[: self._total], 0
        for g, n in zip(grads, self._sizes):
            part = flat[off: off + n]
            part.zero_() if g is None else part.copy_(g.reshape(-1))
            off += n
        self.agreement.write_trailer(self._bucket[self._total:], flag, code)
        all_reduce_sum(self._bucket, self.transport, self.stats)
        self.agreement.read_trailer(self._bucket[self._total:], code, step)
        out, off = [], 0
        for g, s, n in zip(grads, self.seen, self._sizes):
            if g is not None:
                s.add_(g)
                g.copy_(flat[off: off + n].view_as(g)).mul_(self.scale / self.world)
            out.append(g)
            off += n
        return out

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["seen"] = [t.clone() for t in self.seen]
        return sd

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        for a, b in zip(self.seen, state["seen"]):
            a.copy_(b)

    def extra_repr(self) -> str:
        return f"scale={self.scale}"


@pytest.fixture
def registered():
    REPLICATORS[NAME] = ScaledMean
    try:
        yield
    finally:
        del REPLICATORS[NAME]


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------- 2 gloo ranks
def toy_worker(rank: int, world: int, root: str) -> dict:
    from dist_workers import Tiny, shards, train

    REPLICATORS[NAME] = ScaledMean  # this process's registry: the test's entry alone
    try:
        def make(seed):
            torch.manual_seed(seed + rank)  # prepare() copies rank 0's weights
            return flexdemo.prepare(Tiny(), NAME, optimizer="adamw", lr=0.01,
                                    replicate=world, shard=1,
                                    replicator_kwargs={"scale": 0.5})

        model, opt = make(0)
        stats = train(model, opt, 3, rank)
        out = {"shards": shards(model), "identical": opt.replicas_identical(),
               "sent": [s["bytes_sent"] for s in stats],
               "exchange_bytes": opt.replicators[0].exchange_bytes(),
               "seen": [t.clone() for t in opt.replicators[0].seen]}
        msd, osd = get_state_dict(model, opt)
        flat = osd["state"][next(iter(osd["state"]))]
        out["seen_as_dcp_tensors"] = sum(
            isinstance(v, torch.Tensor) for k, v in flat.items() if "/replicators/0/seen/" in k)
        torch.distributed.checkpoint.save({"model": msd, "optim": osd},
                                          checkpoint_id=f"{root}/toy")
        train(model, opt, 2, rank, start=3)
        expected = shards(model)

        model2, opt2 = make(100)  # other weights
        msd2, osd2 = get_state_dict(model2, opt2)
        flexdemo.checkpoint.dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=f"{root}/toy")
        set_state_dict(model2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
        out["loaded_seen"] = _equal(opt2.replicators[0].seen, out["seen"])
        out["loaded_steps"] = opt2.steps
        train(model2, opt2, 2, rank, start=3)
        out["next_same"] = _equal(shards(model2), expected)

        try:  # the settings check: ranks built with another scale are refused on every rank
            torch.manual_seed(0)
            flexdemo.prepare(Tiny(), NAME, replicate=world, shard=1,
                             replicator_kwargs={"scale": 0.5 + rank})
            out["refused"] = None
        except ValueError as e:
            out["refused"] = str(e)
        return out
    finally:
        del REPLICATORS[NAME]


@pytest.mark.multiprocess
def test_toy_replicator_trains_through_prepare_and_dcp(tmp_path):
    res = run_world(toy_worker, 2, str(tmp_path))
    a, b = res
    assert _equal(a["shards"], b["shards"]), "replicas differ"
    assert not _equal(a["seen"], b["seen"])  # per-replica state really differs
    for r in res:
        assert r["identical"]  # declared by syncs_replicas: checkpoints store params once
        assert r["sent"] == [r["exchange_bytes"]] * 3 and r["exchange_bytes"] > 0
        assert r["seen_as_dcp_tensors"] == len(r["seen"]) > 0
        assert r["loaded_seen"] and r["loaded_steps"] == 3 and r["next_same"]
        assert r["refused"] is not None and "scale" in r["refused"], r["refused"]
    assert NAME not in REPLICATORS


# ---------------------------------------------------------------------- one process
def _loss(model, batch):
    x, y = batch
    return (model(x) - y).pow(2).mean()


def _batches(step: int, n: int):
    g = torch.Generator().manual_seed(step)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(n)]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


@pytest.mark.parametrize("replicator", [NAME, "diloco"])
def test_toy_replicator_trains_in_simulated_replicas(registered, replicator):
    kwargs = ({"scale": 0.5} if replicator == NAME
              else {"inner_steps": 2, "exchange": NAME, "exchange_kwargs": {"scale": 1.0}})
    sim = flexdemo.SimulatedReplicas(_model, _loss, replicas=2, replicator=replicator,
                                     replicator_kwargs=kwargs, lr=0.1, seed=0)
    before = [p.detach().clone() for p in sim.models[0].parameters()]
    for step in range(4):
        sim.step(_batches(step, 2))
    a, b = ([p.detach() for p in m.parameters()] for m in sim.models)
    assert _equal(a, b) and not _equal(a, before)
    opt = sim.optimizers[0]
    assert opt.replicas_identical() == (replicator == NAME)
    assert opt.bytes_sent > 0
    assert "seen" in {k for r in opt.replicators for k in r.tensor_state_keys()}
    sd = opt.state_dict()  # the DCP layout: the toy's state as tensors, per rank
    assert any("/seen/" in k for k in sd["state"][0])


def test_toy_replicator_settings_are_checked_by_name(registered):
    rep = make_replicator(NAME, scale=2.0)
    assert isinstance(rep, ScaledMean) and rep.scale == 2.0
    with pytest.raises(ValueError, match="no setting 'scal'.*'scale'"):
        make_replicator(NAME, scal=2.0)


def test_the_registry_is_left_as_it_was():
    assert NAME not in REPLICATORS
