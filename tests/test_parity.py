"""A paper's name runs that paper's algorithm (issue 57): each named preset's update against a
reference written here from the paper's description, over several syncs with error
feedback, on 2 and 3 in-process replicas; the mean over the senders against a dense
reference; our DiLoCo against torchft's own ``torchft.local_sgd.DiLoCo``; and the bytes of
every preset at 2, 4 and 8 replicas.

The replicas run in threads on an :class:`~flexdemo.transport.InProcessHub`. Its all-reduce
adds in gloo's ring order, where a value's position decides which replica's part comes
first; the references and torchft's per-tensor all-reduce see other positions than our
bucket, so these tests all-reduce in rank order (``((x0 + x1) + x2)`` wherever a value sits:
:class:`RankOrder`) on both sides. With that one convention of the collective fixed, every
comparison below is bitwise (``torch.equal``)."""

from __future__ import annotations

import math

import pytest
import torch
from dist_util import RankOrder, alike, outer_sync
from torch import nn

from flexdemo import DeToNATION
from flexdemo.replicate import DeMoReplicator, DiLoCoReplicator, make_replicator
from flexdemo.simulate import run_replicas
from flexdemo.transport import InProcessHub

LR = 1e-2


def _net() -> nn.Module:
    """Sides that 64 divides (128 x 64: two 64 x 64 chunks) and sides it does not (100 x 128:
    chunks of 50 x 64; biases of 128 and 100)."""
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 100))


#: the model, with the same initial parameters on every replica
model_fn = alike(_net)


def batch(r: int, step: int):
    g = torch.Generator().manual_seed(1000 * r + step)
    return torch.randn(8, 64, generator=g), torch.randn(8, 100, generator=g)


def loss_of(model, r, step):
    x, y = batch(r, step)
    return nn.functional.mse_loss(model(x), y)


def run_ours(world: int, replicator, steps: int, base: str = "adamw") -> list[list[torch.Tensor]]:
    """Every replica's parameters after ``steps`` steps of ``replicator()`` (a factory)."""
    hub = InProcessHub(world, timeout=60)

    def work(r):
        model = model_fn()
        opt = DeToNATION(model.parameters(), replicator(), base=base, lr=LR,
                         group=RankOrder(hub, r))
        for s in range(steps):
            loss_of(model, r, s).backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    return run_replicas(hub, work)


# ---------------------------------------------------------------------- the references
def stat2_tensor(v: torch.Tensor) -> torch.Tensor:
    """MuLoCo's and SparseLoCo's 2-bit values, decoded: one codebook for the tensor ``v``, 4
    bins of width 6 std / 4 around its mean (std over n - 1), a value's bin the nearest
    integer (ties to even) of ``(v - mean) / width + 2`` within [0, 3], each bin decoded to
    the mean plus the mean of the centred values in it; statistics in fp64, rounded once."""
    flat = v.reshape(-1)
    n = flat.numel()
    mean = flat.double().sum().div(n).float()
    c = flat - mean
    std = (c.double().square().sum() / (n - 1)).sqrt() if n > 1 else torch.tensor(0.0)
    width = (std * 6 / 4).float()
    if not (math.isfinite(width.item()) and width.item() > 0):
        width = torch.tensor(1.0)
    code = torch.clamp(torch.round(c / width + 2), 0, 3)
    out = torch.empty_like(flat)
    for b in range(4):
        member = code == b
        if member.any():
            out[member] = (c[member].double().sum() / member.sum()).float() + mean
    return out.view(v.shape)


def largest_divisor(d: int, most: int = 64) -> int:
    return max(c for c in range(1, min(d, most) + 1) if d % c == 0)


def sparseloco_select(e: torch.Tensor) -> torch.Tensor:
    """SparseLoCo's selection of the error buffer ``e`` of one tensor: chunks whose sides are
    the largest divisors up to 64 of the tensor's (a vector: chunks along it), the top
    ``round(64 * chunk / 4096)`` (at least 1) of each chunk by magnitude; a 0/1 mask."""
    m = e.reshape(1, -1) if e.dim() == 1 else e.reshape(e.shape[0], -1)
    rows, cols = m.shape
    cr = 1 if e.dim() == 1 else largest_divisor(rows)
    cc = largest_divisor(cols)
    k = max(1, round(64 * cr * cc / 4096))
    chunks = m.reshape(rows // cr, cr, cols // cc, cc).permute(0, 2, 1, 3).reshape(-1, cr * cc)
    mask = torch.zeros_like(chunks).scatter_(1, chunks.abs().topk(k, dim=1).indices, 1.0)
    return mask.reshape(rows // cr, cols // cc, cr, cc).permute(0, 2, 1, 3).reshape(e.shape)


def exchange_mean(kind: str, pseudo: list[list[torch.Tensor]], err: list[list[torch.Tensor]]):
    """The replicas' averaged pseudo-gradient per tensor, by the paper's exchange ``kind``
    (``err``: each replica's error-feedback buffers, updated in place)."""
    world, out = len(pseudo), []
    for i in range(len(pseudo[0])):
        total = torch.zeros_like(pseudo[0][i])
        count = torch.zeros_like(total)
        for r in range(world):  # rank order
            d = pseudo[r][i]
            if kind == "diloco":
                total += d
                continue
            e = err[r][i]
            e.mul_(0.9 if kind == "muloco" else 0.95).add_(d)  # e = beta e + delta
            if kind == "muloco":
                sent = stat2_tensor(e)
            else:
                mask = sparseloco_select(e)
                sent = torch.zeros_like(e)
                sent[mask.bool()] = stat2_tensor(e[mask.bool()])
                count += mask
            e.sub_(sent)  # what was sent leaves the buffer
            total += sent
        out.append(total / count.clamp(min=1) if kind == "sparseloco" else total / world)
    return out


OUTER = {"diloco": (0.7, 0.9), "muloco": (0.7, 0.6), "sparseloco": (1.0, 0.0)}
H = {"diloco": 4, "muloco": 4, "sparseloco": 4}


def reference(kind: str, world: int, syncs: int) -> list[list[torch.Tensor]]:
    """The paper's algorithm on ``world`` replicas for ``syncs`` periods of H AdamW steps:
    each replica steps from the global parameters on its own batches, the pseudo-gradients
    ``global - local`` are exchanged (:func:`exchange_mean`), an outer SGD step (Nesterov
    where it has momentum) moves the global parameters, and every replica restarts there."""
    models = [model_fn() for _ in range(world)]
    inner = [torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.0) for m in models]
    glob = [nn.Parameter(p.detach().clone()) for p in models[0].parameters()]
    lr, momentum = OUTER[kind]
    outer = torch.optim.SGD(glob, lr=lr, momentum=momentum, nesterov=momentum > 0)
    err = [[torch.zeros_like(g) for g in glob] for _ in range(world)]
    step = 0
    for _ in range(syncs):
        for _ in range(H[kind]):
            for r, (m, opt) in enumerate(zip(models, inner)):
                loss_of(m, r, step).backward()
                opt.step()
                opt.zero_grad()
            step += 1
        with torch.no_grad():
            pseudo = [[g - p for g, p in zip(glob, m.parameters())] for m in models]
            outer_sync(glob, models, exchange_mean(kind, pseudo, err), outer)
    return [[p.detach().clone() for p in m.parameters()] for m in models]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["diloco", "muloco", "sparseloco"])
def test_a_paper_preset_is_the_papers_algorithm(kind, world):
    """Three syncs (error feedback carried through two of them), bitwise the reference on
    every replica."""
    syncs = 3
    ours = run_ours(world, lambda: make_replicator(kind, inner_steps=H[kind]),
                    syncs * H[kind])
    ref = reference(kind, world, syncs)
    for r in range(world):
        for a, b in zip(ours[r], ref[r]):
            assert torch.equal(a, b), (kind, world, r, (a - b).abs().max().item())
    assert not torch.equal(ref[0][0], model_fn()[0].weight.detach())  # it moved


def test_the_sparseloco_preset_sends_what_the_paper_sends():
    """Chunks of the largest divisor up to 64 per side with k scaled (64 of a full 64 x 64
    chunk), 1-D tensors on their own (a bias of 128: 2 chunks of 64, one value each), one
    2-bit codebook per tensor (16 bytes), 12-bit indices of a 64 x 64 chunk."""
    ex = make_replicator("sparseloco").exchange
    ex.setup([torch.Size(s) for s in [(128, 64), (128,), (100, 128), (100,), (7,)]],
             torch.device("cpu"), None)
    plans = [(u.members, u.plan.chunk, u.k) for u in ex.units]
    assert plans == [([0], (64, 64), 64), ([1], (1, 64), 1), ([2], (50, 64), 50),
                     ([3], (1, 50), 1), ([4], (1, 7), 1)]
    assert [g.units[0].members for g in ex.groups] == [[0], [1], [2], [3], [4]]
    sent = sum(g.n_sel for g in ex.groups)
    assert sent == 2 * 64 + 2 + 4 * 50 + 2 + 1
    bits = {64 * 64: 12, 64: 6, 50 * 64: 12, 50: 6, 7: 3}
    assert [g.bits for g in ex.groups] == [bits[g.block_numel] for g in ex.groups]


@pytest.mark.parametrize("world", [2, 3])
def test_the_mean_over_senders_is_exact_against_a_dense_reference(world):
    """SparseLoCo's mean: a coordinate two replicas sent is their mean, one only one replica
    sent is that replica's value (the mean over all replicas would halve it)."""
    shapes = [torch.Size(s) for s in [(128, 64), (100, 128), (100,)]]
    hub = InProcessHub(world, timeout=30)
    common = [torch.randn(s, generator=torch.Generator().manual_seed(i))
              for i, s in enumerate(shapes)]  # so that replicas share some picks
    grads = [[c + torch.randn(c.shape, generator=torch.Generator().manual_seed(9 + 10 * r + i))
              for i, c in enumerate(common)] for r in range(world)]

    def work(r):
        rep = DeMoReplicator(topk=64, chunk=64, chunking="divisor", small="separate",
                             transform="none", values="fp32", decay=0.0, sign=False,
                             scale_by_lr=False, mean="senders")
        rep.setup(shapes, torch.device("cpu"), hub.transport(r))
        return [t.clone() for t in rep([g.clone() for g in grads[r]], [1.0] * 3, 0)]

    out = run_replicas(hub, work)
    counts = []
    for i in range(len(shapes)):
        total, count = torch.zeros(shapes[i]), torch.zeros(shapes[i])
        for r in range(world):
            mask = sparseloco_select(grads[r][i])
            total += grads[r][i] * mask
            count += mask
        want = total / count.clamp(min=1)
        counts.append(count.reshape(-1))
        for r in range(world):
            assert torch.equal(out[r][i], want)
    count = torch.cat(counts)
    assert count.max() > 1 and (count == 1).any()  # shared and single-sender coordinates


# ---------------------------------------------------------------------- torchft's DiLoCo
class _Work:
    """A completed all-reduce, as torchft's fragments wait on it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.fut = torch.futures.Future()
        self.fut.set_result(tensor)

    def wait(self, timeout=None) -> bool:
        return True

    def get_future(self):
        return self.fut


class _Manager:
    """What torchft's DiLoCo asks of its Manager, for one replica over a hub: the average of
    ``allreduce`` (the sum over the replicas divided by their number), a ``should_commit``
    that always agrees and counts the step, and state-dict hooks that do nothing (no
    failures, no healing here)."""

    _use_async_quorum = False  # torchft's DiLoCo reads this field

    def __init__(self, transport: RankOrder) -> None:
        self.transport, self.step = transport, 0

    def allreduce(self, tensor, should_quantize=False, **_):
        self.transport.all_reduce_sum_(tensor)
        tensor /= self.transport.size
        return _Work(tensor)

    def should_commit(self, *_, **__) -> bool:
        self.step += 1
        return True

    def current_step(self) -> int:
        return self.step

    def start_quorum(self, *_, **__) -> None:
        pass

    def register_state_dict_fn(self, *_) -> None:
        pass

    def allow_state_dict_read(self) -> None:
        pass

    def disallow_state_dict_read(self) -> None:
        pass


TORCHFT = [  # (inner optimizer, outer lr, outer momentum, H, fragments)
    ("sgd", 1.0, 0.0, 4, 1),     # plain averaging
    ("adamw", 0.7, 0.9, 4, 1),   # the DiLoCo paper's outer Nesterov step
    ("sgd", 0.7, 0.9, 4, 2),     # streaming, 2 fragments
    ("adamw", 0.7, 0.9, 6, 3),   # streaming, 3 fragments
    ("adamw", 1.0, 0.0, 4, 2),   # streaming with plain averaging
]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("base,outer_lr,momentum,inner_steps,fragments", TORCHFT)
def test_our_diloco_is_torchfts_bitwise(base, outer_lr, momentum, inner_steps, fragments,
                                        world):
    """torchft's ``DiLoCo`` (its hooks on a plain torch optimizer, a minimal Manager over the
    same rank-order all-reduce) and our ``DiLoCoReplicator`` with the same settings end at the
    same bits on every replica after three periods. Streaming's overlap (``tau``) and mixing
    (``alpha``) are left out: torchft launches a fragment ``tau`` steps before its boundary
    and we at it, and torchft mixes with ``lerp`` where we multiply and add."""
    local_sgd = pytest.importorskip(
        "torchft.local_sgd", reason="torchft is not installed: no reference DiLoCo to match")
    steps = 3 * inner_steps
    hub = InProcessHub(world, timeout=60)
    parts: list[list[int]] = []

    def ours():
        rep = DiLoCoReplicator(inner_steps, outer_lr=outer_lr, outer_momentum=momentum,
                               fragments=fragments)
        return rep

    mine = run_ours(world, ours, steps, base=base)
    probe = model_fn()
    rep = ours()
    DeToNATION(probe.parameters(), rep, base=base, lr=LR)
    parts = rep.parts  # which parameters form each fragment (largest first, balanced)

    def theirs(r):
        model = model_fn()
        params = list(model.parameters())
        frags = []
        for part in parts:
            frag = nn.Module()
            for j, i in enumerate(part):
                frag.register_parameter(f"p{j}", params[i])
            frags.append(frag)
        inner = (torch.optim.AdamW(params, lr=LR, weight_decay=0.0) if base == "adamw"
                 else torch.optim.SGD(params, lr=LR, weight_decay=0.0))
        # an outer optimizer per fragment, as torchft's streaming expects (one over the whole
        # model would also step the other fragments, with the inner step's gradients)
        outer = [torch.optim.SGD(f.parameters(), lr=outer_lr, momentum=momentum,
                                 nesterov=momentum > 0) for f in frags]
        with local_sgd.DiLoCo(_Manager(RankOrder(hub, r)), frags, inner, outer,
                              sync_every=inner_steps):
            for s in range(steps):
                loss_of(model, r, s).backward()
                inner.step()
                inner.zero_grad()
        return [p.detach().clone() for p in params]

    ref = run_replicas(hub, theirs)
    for r in range(world):
        for a, b in zip(mine[r], ref[r]):
            assert torch.equal(a, b), (r, (a - b).abs().max().item())


# ---------------------------------------------------------------------- bytes
PRESETS = ["diloco", "diloco-avg", "muloco", "muloco-int4", "sparseloco", "sparseloco-dct"]


def aligned(x: int) -> int:
    return x + -x % 8


def payload_by_hand(name: str, shapes: list[torch.Size]) -> int | None:
    """One replica's payload of a sync, from the wire formats (None: not a gathered one)."""
    header, n = 32, sum(s.numel() for s in shapes)
    if name == "muloco":  # 16 bytes of fp32 bin means per tensor, then 2 bits per value
        return aligned(header + 16 * len(shapes) + math.ceil(2 * n / 8))
    if name == "sparseloco":  # per tensor: its indices, then 16 bytes of codebook, 2-bit codes
        body = 0
        for s in shapes:
            ex = DeMoReplicator(topk=64, chunk=64, chunking="divisor")
            ex.setup([s], torch.device("cpu"), None)
            (g,) = ex.groups
            body += aligned(math.ceil(g.n_sel * g.bits / 8))
            body += aligned(16 + math.ceil(2 * g.n_sel / 8))
        return header + body
    return None


@pytest.mark.parametrize("name", PRESETS)
def test_bytes_sent_and_received_are_exact_at_2_4_and_8_replicas(name):
    """Two syncs at 2, 4 and 8 replicas: every replica sends and receives its exchange's
    bytes for a period, the gathered presets ``n - 1`` payloads of the size their wire
    format gives; the fp32 mean an all-reduce's ``2 (n - 1) / n``; the int4 reduce-scatter at
    most two payloads whatever ``n``."""
    shapes = [p.shape for p in model_fn().parameters()]
    per_sync = {}
    for n in (2, 4, 8):
        hub = InProcessHub(n, timeout=60)

        def work(r, hub=hub):
            model = model_fn()
            opt = DeToNATION(model.parameters(), make_replicator(name, inner_steps=2),
                             base="adamw", lr=LR, group=hub.transport(r))
            for s in range(4):  # two syncs
                loss_of(model, r, s).backward()
                opt.step()
                opt.zero_grad()
            rep = opt.replicators[0]
            return rep.exchange_bytes(), rep.exchanges[0].payload_bytes(), opt.comm_stats()[0]

        out = run_replicas(hub, work)
        one, payload = out[0][0], out[0][1]
        for period, _, stats in out:
            assert period == one
            assert stats["bytes_sent"] == 2 * one and stats["bytes_received"] == 2 * one
        want = payload_by_hand(name, shapes)
        if want is not None:  # gathered: n - 1 payloads of the format's size
            assert payload == want and one == (n - 1) * payload
        if name.startswith("diloco"):  # fp32 all-reduce: 2 (n - 1) / n of the values
            assert one >= 2 * (n - 1) * 4 * sum(s.numel() for s in shapes) // n
        per_sync[n] = one
    if name == "muloco-int4":
        assert per_sync[8] <= 2 * per_sync[2] * 1.1
