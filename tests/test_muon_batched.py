"""Batched Newton-Schulz: bitwise torch's per-matrix call, and MuonAdamW's ns_mode."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _zeropower_via_newtonschulz
from torch.utils._python_dispatch import TorchDispatchMode

from flexdemo.app.tasks.gpt import GPT, gpt_config
from flexdemo.muon import MuonAdamW
from flexdemo.newton_schulz import newton_schulz, orthogonalise, shape_groups
from flexdemo.optim import make_base_optimizer

NS = ((DEFAULT_A, DEFAULT_B, DEFAULT_C), 5, EPS)
# tall, wide, square, repeated, one row, and a tall one beside the wide one of its transpose
SHAPES = [(96, 32), (32, 96), (64, 64), (96, 32), (7, 5), (1, 8), (64, 64), (33, 16),
          (96, 32), (16, 33), (192, 64)]
MATMULS = {"mm", "addmm", "bmm", "baddbmm"}


class CountOps(TorchDispatchMode):
    """Counts the aten ops (by name, without overload) run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _mats(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_is_bitwise_torch_per_matrix(dtype):
    mats = _mats(dtype)
    ref = [_zeropower_via_newtonschulz(m.clone(), *NS) for m in mats]
    for mode in ("batched", "per_matrix"):
        out = orthogonalise(mats, *NS, mode=mode)
        for s, a, b in zip(SHAPES, out, ref):
            assert a.dtype == torch.bfloat16 and a.shape == s
            assert torch.equal(a, b), (mode, s)
        if mode == "batched":  # torch's function divides a bf16 input in place; this does not
            assert all(torch.equal(a, b) for a, b in zip(mats, _mats(dtype)))


def test_batched_leaves_a_bf16_momentum_buffer_alone():
    # torch.optim.Muon with bf16 parameters and nesterov=False orthogonalises the momentum
    # buffer itself, and so divides it by its norm in place; the batched mode copies first
    for mode, intact in (("batched", True), ("per_matrix", False)):
        p = torch.nn.Parameter(torch.randn(8, 4, dtype=torch.bfloat16))
        opt = MuonAdamW([p], lr=0.0, nesterov=False, ns_mode=mode)
        p.grad = torch.ones_like(p)
        opt.step()
        buf = opt.state[p]["momentum_buffer"]
        assert torch.equal(buf, torch.full_like(buf, 0.05)) == intact, mode


def test_shape_groups_and_kernel_checks():
    assert shape_groups(SHAPES) == [[0, 3, 8], [1], [2, 6], [4], [5], [7], [9], [10]]
    with pytest.raises(ValueError, match="stack of matrices"):
        newton_schulz(torch.zeros(3, 3), *NS)
    with pytest.raises(ValueError, match="below 100"):
        newton_schulz(torch.zeros(1, 3, 3), NS[0], 100, EPS)
    with pytest.raises(ValueError, match="ns_mode must be one of"):
        orthogonalise([torch.zeros(2, 2)], *NS, mode="fast")


def test_one_matmul_call_per_shape_group():
    mats = [torch.randn(32, 48) for _ in range(6)] + [torch.randn(48, 32) for _ in range(3)]
    calls = {}
    for mode in ("batched", "per_matrix"):
        with CountOps() as count:
            orthogonalise(mats, *NS, mode=mode)
        calls[mode] = sum(n for op, n in count.ops.items() if op in MATMULS)
    assert calls == {"batched": 2 * 3 * 5, "per_matrix": 9 * 3 * 5}


def _train(mode: str, steps: int = 3) -> tuple[torch.nn.Module, MuonAdamW]:
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    opt = MuonAdamW(model.named_parameters(), lr=1e-2, weight_decay=0.1, ns_mode=mode,
                    ns_dtype="bf16")  # torch's precision in both modes
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randint(0, 256, (2, 64), generator=g)
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_muon_adamw_modes_train_alike_with_one_state_layout():
    a, opt_a = _train("batched")
    b, opt_b = _train("per_matrix")
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]  # ns_mode is not in them
    assert {k: sorted(v) for k, v in sa["state"].items()} == \
        {k: sorted(v) for k, v in sb["state"].items()}
    # a checkpoint of one mode resumes in the other, bitwise
    twin = copy.deepcopy(b)
    twin_opt = MuonAdamW(twin.named_parameters(), lr=1e-2, weight_decay=0.1,
                         ns_mode="batched", ns_dtype="bf16")
    twin_opt.load_state_dict(copy.deepcopy(sb))
    x = torch.randint(0, 256, (2, 64))
    for m, o in ((b, opt_b), (twin, twin_opt)):
        m(x, x).backward()
        o.step()
    assert twin_opt.ns_mode == "batched"
    assert all(torch.equal(x, y) for x, y in zip(b.parameters(), twin.parameters()))


def test_bad_ns_mode_is_one_line():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="ns_mode must be one of"):
        MuonAdamW([p], ns_mode="fused")
    with pytest.raises(ValueError, match="ns_mode: a setting of optimizer 'muon'"):
        make_base_optimizer("sgd", [p], 1e-3, ns_mode="batched")
    assert make_base_optimizer("muon", [p], 1e-3, ns_mode="per_matrix").ns_mode == "per_matrix"


@pytest.mark.parametrize("nesterov", [True, False])
def test_bounded_batches_give_the_same_bits_in_less_memory(nesterov):
    """``ns_batch_numel`` forms, orthogonalises and applies one bounded batch at a time: the
    same parameters as one batch per shape, and a smaller transient peak (counted exactly)."""
    from torch import nn

    from flexdemo import LiveBytes, MuonAdamW

    def run(bound):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 256),
                              nn.Linear(256, 128), nn.Linear(128, 256), nn.Linear(256, 10))
        opt = MuonAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, nesterov=nesterov,
                        ns_batch_numel=bound)
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
        with LiveBytes() as mem:
            for _ in range(3):
                opt.zero_grad()
                model(x).square().mean().backward()
                start = mem.reset_peak()
                opt.step()
        return [p.detach() for p in model.parameters()], mem.peak - start

    whole, peak_whole = run(1 << 30)
    bounded, peak_bounded = run(256 * 256)
    assert all(torch.equal(a, b) for a, b in zip(whole, bounded))
    assert peak_bounded < 0.75 * peak_whole


def test_ns_batch_numel_must_be_positive():
    from flexdemo import MuonAdamW

    with pytest.raises(ValueError, match="ns_batch_numel must be an integer >= 1"):
        MuonAdamW([torch.nn.Parameter(torch.zeros(4, 4))], ns_batch_numel=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nesterov", [True, False])
def test_updates_written_in_bf16_are_the_previous_path_bits(dtype, nesterov):
    """write_updates rounds the fp32 update once as it stores it: the bits of forming the
    update (torch's foreach lerp) and then stacking it in bf16, without the fp32 copy."""
    from flexdemo.muon import write_updates
    from flexdemo.newton_schulz import stack_bf16

    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(48, 32, generator=g).to(dtype) for _ in range(3)]
    bufs = [torch.randn(48, 32, generator=g).to(dtype) for _ in range(3)]
    before = [b.clone() for b in bufs]
    old = stack_bf16(list(torch._foreach_lerp(grads, bufs, 0.95)) if nesterov else bufs)
    new = torch.empty_like(old)
    write_updates(new.unbind(0), grads, bufs, 0.95, nesterov)
    assert torch.equal(old, new)
    assert all(torch.equal(a, b) for a, b in zip(bufs, before))


def test_in_place_newton_schulz_is_bitwise_the_allocating_one():
    """newton_schulz_ reuses its input's storage and one spare stack (square matrices: the
    Gram product goes in the spare too): the bits of torch's per-matrix call."""
    from flexdemo.newton_schulz import newton_schulz_

    g = torch.Generator().manual_seed(1)
    for shape in [(3, 64, 64), (2, 96, 32), (2, 32, 96), (1, 7, 5), (4, 12, 12)]:
        x = torch.randn(shape, generator=g)
        ref = torch.stack([_zeropower_via_newtonschulz(m.clone(), *NS) for m in x])
        kept = x.clone()
        assert torch.equal(newton_schulz(x, *NS), ref) and torch.equal(x, kept)
        stack = x.bfloat16()
        assert torch.equal(newton_schulz_(stack, *NS), ref), shape
        for steps in (0, 1, 2):  # the buffers swap each step: even and odd counts
            one = torch.stack([_zeropower_via_newtonschulz(m.clone(), NS[0], steps, EPS)
                               for m in x])
            assert torch.equal(newton_schulz_(x.bfloat16(), NS[0], steps, EPS), one)
    with pytest.raises(ValueError, match="contiguous bf16 stack"):
        newton_schulz_(torch.zeros(1, 3, 3), *NS)
    with pytest.raises(ValueError, match="contiguous bf16 stack"):
        newton_schulz_(torch.zeros(1, 3, 4, dtype=torch.bfloat16).mT, *NS)


def test_step_workspace_is_a_few_bf16_copies_of_a_batch():
    """The step's transient bytes, counted exactly: the update written in bf16 and
    orthogonalised in place, so at most 4 bf16 copies of a batch (2 bytes x 4 x its
    entries; 3 when square) where forming the fp32 update and allocating each product took
    7. The default bound is the largest matrix's entries, at least 1M off CUDA."""
    from flexdemo import LiveBytes
    from flexdemo.newton_schulz import NS_BATCH_MIN

    shapes = [(64, 64)] * 6 + [(48, 96)] * 3 + [(96, 48)] * 2
    bound = 2 * 64 * 64
    results = {}
    for mode, numel in (("batched", bound), ("batched", None), ("per_matrix", None)):
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
        opt = MuonAdamW(params, lr=1e-2, weight_decay=0.1, ns_mode=mode, ns_batch_numel=numel,
                        ns_dtype="bf16")
        with LiveBytes() as mem:
            for _ in range(2):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=g)
                start = mem.reset_peak()
                opt.step()
        results[mode, numel] = [p.detach() for p in params], mem.peak - start, opt
    _, ws, _ = results["batched", bound]
    assert ws <= 2 * 3 * bound  # the square batch: the stack, the spare and the product
    _, ws_default, opt = results["batched", None]
    assert opt.ns_batch_numel == NS_BATCH_MIN  # every matrix here is smaller
    assert ws_default <= 2 * 4 * sum(64 * 64 for s in shapes if s == (64, 64))
    ref = results["per_matrix", None][0]
    for key in (("batched", bound), ("batched", None)):
        assert all(torch.equal(a, b) for a, b in zip(results[key][0], ref)), key
    big = [torch.nn.Parameter(torch.zeros(1200, 1000)), torch.nn.Parameter(torch.zeros(8, 8))]
    assert MuonAdamW(big).ns_batch_numel == 1200 * 1000


def _iterate_fp64(x: torch.Tensor) -> torch.Tensor:
    """The Newton-Schulz iteration in fp64 from the same bf16 start: the reference both
    precisions approximate."""
    tall = x.shape[1] > x.shape[2]
    y = x.bfloat16().double()
    y = y.mT if tall else y
    y = y / y.norm(dim=(1, 2), keepdim=True).clamp(min=EPS)
    (a, b, c), steps, _ = NS
    for _ in range(steps):
        g = y @ y.mT
        y = a * y + (b * g + c * g @ g) @ y
    return y.mT if tall else y


def test_fp32_newton_schulz_is_closer_to_exact_and_keeps_the_bf16_layout():
    """ns_dtype="fp32": the iterations in an fp32 copy, the result rounded to bf16 in the
    input's storage with the layout the bf16 path gives; within bf16 rounding of the fp64
    iteration, where bf16 iterations are several times further off."""
    from flexdemo.newton_schulz import newton_schulz_

    g = torch.Generator().manual_seed(2)
    # (6, 256, 256) and (3, 600, 200) run in parts of 4 and of 2 matrices
    for shape in [(3, 64, 64), (2, 96, 32), (2, 32, 96), (1, 7, 5), (6, 256, 256),
                  (3, 600, 200)]:
        x = torch.randn(shape, generator=g)
        exact = _iterate_fp64(x)
        stack = x.bfloat16()
        fp32 = newton_schulz_(stack, *NS, dtype=torch.float32)
        bf16 = newton_schulz_(x.bfloat16(), *NS)
        assert fp32.dtype == torch.bfloat16 and fp32.shape == bf16.shape, shape
        assert fp32.stride() == bf16.stride(), shape
        assert fp32.untyped_storage().data_ptr() == stack.untyped_storage().data_ptr()
        e32, e16 = (((y.double() - exact).norm() / exact.norm()).item() for y in (fp32, bf16))
        assert e32 < 0.004 and e32 * 3 < e16, (shape, e32, e16)
        start = x.bfloat16()  # no steps: only scaled to norm 1, in place
        none = newton_schulz_(start, NS[0], 0, EPS, dtype=torch.float32)
        scaled = x.bfloat16().double() / x.bfloat16().double().norm(dim=(1, 2), keepdim=True)
        assert none is start and torch.allclose(none.double(), scaled, rtol=0.008, atol=0)
    with pytest.raises(ValueError, match="torch.bfloat16 or torch.float32"):
        newton_schulz_(torch.zeros(1, 3, 3, dtype=torch.bfloat16), *NS, dtype=torch.float16)


def test_fp32_newton_schulz_works_in_parts_of_bounded_size():
    """The fp32 iterations' workspace, counted exactly: one part's fp32 copy and products,
    whatever the stack's size. Square parts: 3 fp32 copies of the part; otherwise the copy
    and two r x r products."""
    from flexdemo import LiveBytes
    from flexdemo.newton_schulz import WIDE_PART_NUMEL, newton_schulz_

    def workspace(shape: tuple[int, int, int]) -> int:
        with LiveBytes() as mem:
            stack = torch.randn(shape).bfloat16()
            start = mem.reset_peak()
            newton_schulz_(stack, *NS, dtype=torch.float32)
            return mem.peak - start

    part = WIDE_PART_NUMEL  # 4 square 256 x 256 matrices
    assert workspace((4, 256, 256)) <= 3 * 4 * part + 4096
    assert workspace((12, 256, 256)) == workspace((4, 256, 256))  # three parts, one at a time
    r, k = 128, 2048  # one tall matrix, a part of its own
    assert workspace((1, k, r)) <= 4 * (r * k + 2 * r * r) + 4096
    assert workspace((3, k, r)) == workspace((1, k, r))


def test_muon_adamw_ns_dtype_fp32_steps_alike_and_checks_its_setting():
    """The same training in both precisions: near each other, not equal; the setting is one
    line when wrong, reaches MuonAdamW through make_base_optimizer, and is not state."""
    a, opt_a = _train("batched")
    b = copy.deepcopy(a)
    opt_b = MuonAdamW(b.named_parameters(), lr=1e-2, weight_decay=0.1, ns_dtype="fp32")
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    before = [p.detach().clone() for p in a.parameters()]
    x = torch.randint(0, 256, (2, 64))
    for m, o in ((a, opt_a), (b, opt_b)):
        m(x, x).backward()
        o.step()
    step_a = torch.cat([(p - q).flatten() for p, q in zip(a.parameters(), before)])
    step_b = torch.cat([(p - q).flatten() for p, q in zip(b.parameters(), before)])
    rel = ((step_a - step_b).norm() / step_a.norm()).item()
    assert 0 < rel < 0.05, rel  # bf16 iterations are about 1% off the exact ones
    assert opt_a.state_dict()["param_groups"] == opt_b.state_dict()["param_groups"]
    p = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="ns_dtype must be one of"):
        MuonAdamW([p], ns_dtype="fp16")
    with pytest.raises(ValueError, match="use ns_mode='batched'"):
        MuonAdamW([p], ns_dtype="fp32", ns_mode="per_matrix")
    with pytest.raises(ValueError, match="ns_dtype: a setting of optimizer 'muon'"):
        make_base_optimizer("adamw", [p], 1e-3, ns_dtype="fp32")
    assert make_base_optimizer("muon", [p], 1e-3, ns_dtype="fp32").ns_dtype == "fp32"


def test_ns_dtype_auto_is_fp32_on_the_cpu_and_bf16_elsewhere():
    """The default, "auto": on the CPU the fp32 iterations (bitwise ns_dtype="fp32"), on any
    other device torch's bf16; under per_matrix torch's function whatever the device."""
    from flexdemo.newton_schulz import ns_compute_dtype

    assert MuonAdamW([torch.nn.Parameter(torch.zeros(2, 2))]).ns_dtype == "auto"
    assert ns_compute_dtype("auto", torch.device("cpu")) == torch.float32
    assert ns_compute_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert ns_compute_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))

    def one_step(**kw) -> list[torch.Tensor]:
        m = copy.deepcopy(model)
        opt = MuonAdamW(m.named_parameters(), lr=1e-2, weight_decay=0.1, **kw)
        m(x, x).backward()
        opt.step()
        return [p.detach() for p in m.parameters()]

    def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return all(torch.equal(u, v) for u, v in zip(a, b))

    auto = one_step()
    assert equal(auto, one_step(ns_dtype="fp32")) and not equal(auto, one_step(ns_dtype="bf16"))
    assert equal(one_step(ns_mode="per_matrix"), one_step(ns_mode="per_matrix", ns_dtype="bf16"))
