"""Core costs of DeMo replication on a byte-level GPT: bytes per step, and the replicator's own
compute against forward+backward, an AdamW step and a one-pass floor. The GPT, its text and
batches are those of ``examples/train_gpt.py``.

    python benchmarks/bench_core.py [--device cpu|cuda] [--preset small|124m|350m]
                                    [--batch B --seq T] [--out benchmarks/results/core.json]

a. Bytes a rank sends per step over the replicate dimension: DeMo (all-gather of its payload
   to the ``n - 1`` peers) against an fp32 ring all-reduce (``2 (n-1)/n * 4`` bytes per
   element), for ``n`` = 2 and 4 replicas, for every layout.
b. Compute per layout (``full``: the whole model, data parallel; ``half``: rows
   ``[0, ceil(rows/2))`` of every parameter, the FSDP2 shard of a 2x2 layout; ``shard8``: rows
   ``[0, ceil(rows/8))``, a 1/8 row shard): one DeMo replicator step (transform, top-k, coding,
   error feedback, payload checks, decode, sign; no communication in a group of one), a
   ``torch.optim.AdamW`` step (fused on CUDA, foreach on CPU), the ops one replicator step
   dispatches (``TorchDispatchMode``: ops doing work, and metadata views), the reads of the
   device per step, and on CUDA the kernel launches (``torch.profiler``); plus the floor of
   one batched pass over all 64 x 64 blocks of the layout (two batched products to encode,
   momentum in the DCT domain, top-k per block, the sent coefficients zeroed, two batched
   products to decode, sign).
   Forward+backward runs once per model (bf16 autocast on CUDA). Medians over ``--reps``
   after ``--warmup``; CUDA times with events around synchronised regions; CPU times are the
   main thread's CPU time by default (``--clock wall`` for wall time), which a machine shared
   with other jobs disturbs less.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flexdemo import DeMoReplicator
from flexdemo.compress import dct_matrix
from flexdemo.transport import all_gather_bytes, all_reduce_bytes

ROOT = Path(__file__).resolve().parent.parent
# name: (overrides of the preset "small" of examples/train_gpt.py's GPT); 124m/350m are GPT-2
# small/medium shapes with a GPT-2 vocabulary
PRESETS = {
    "small": {},
    "124m": {"n_layer": 12, "n_head": 12, "d_model": 768, "seq_len": 1024, "vocab": 50257},
    "350m": {"n_layer": 24, "n_head": 16, "d_model": 1024, "seq_len": 1024, "vocab": 50257},
}
LAYOUTS = {"full": 1, "half": 2, "shard8": 8}
VIEW_OPS = {"view", "slice", "select", "alias", "unsqueeze", "permute", "expand", "detach",
            "as_strided", "_reshape_alias", "t", "transpose", "squeeze", "split", "unbind"}


def example_gpt():
    """``examples/train_gpt.py`` as a module: the byte-level GPT (``GPT``, ``PRESETS``), its
    text (``load_corpus``) and batches (``get_batch``), all in public code a user can copy."""
    path = ROOT / "examples" / "train_gpt.py"
    spec = importlib.util.spec_from_file_location("train_gpt", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row_shard(shape: torch.Size, parts: int) -> torch.Size:
    """Local shape of the first FSDP2 shard when dim 0 is split ``parts`` ways."""
    return torch.Size((math.ceil(shape[0] / parts), *shape[1:]))


class Timer:
    """Medians of a function's time: CUDA events on a GPU, else wall or thread CPU time."""

    def __init__(self, device: torch.device, clock: str) -> None:
        self.cuda = device.type == "cuda"
        self.clock = time.thread_time if clock == "thread" else time.perf_counter

    def median(self, fn: Callable[[], None], reps: int, warmup: int,
               setup: Callable[[], None] | None = None) -> float:
        """Median seconds of ``fn`` over ``reps`` runs after ``warmup`` (``setup`` untimed)."""
        return statistics.median(self.samples(fn, reps, warmup, setup))

    def samples(self, fn: Callable[[], None], reps: int, warmup: int,
                setup: Callable[[], None] | None = None,
                deadline: float | None = None) -> list[float]:
        """Seconds of each of ``reps`` runs of ``fn`` after ``warmup`` (``setup`` untimed);
        fewer (at least one) once ``time.perf_counter()`` passes ``deadline``."""
        times: list[float] = []
        for i in range(warmup + reps):
            if deadline is not None and times and time.perf_counter() > deadline:
                break
            if setup is not None:
                setup()
            if self.cuda:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                dt = start.elapsed_time(end) / 1e3
            else:
                t0 = self.clock()
                fn()
                dt = self.clock() - t0
            if i >= warmup:
                times.append(dt)
        return times


def text_batch(gpt, cfg, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch ``(x, y)`` of ``batch`` x ``cfg.seq_len`` bytes of the example's text (seed 0),
    on ``device``."""
    train, _ = gpt.load_corpus(max(1_000_000, 4 * cfg.seq_len))
    x, y = gpt.get_batch(train, batch, cfg.seq_len, torch.Generator().manual_seed(0))
    return x.to(device), y.to(device)


def forward_backward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, timer: Timer,
                     reps: int, warmup: int) -> tuple[float, list[torch.Tensor]]:
    """Median seconds of ``model``'s forward+backward on ``(x, y)`` (bf16 autocast on CUDA),
    and the fp32 gradients of one more pass (the model's own ``.grad`` cleared)."""
    cuda = x.device.type == "cuda"

    def fwd_bwd() -> None:
        model.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(x, y)
        loss.backward()

    fb = timer.median(fwd_bwd, reps, warmup)
    fwd_bwd()
    grads = [q.grad.detach().float().clone() for q in model.parameters()]
    model.zero_grad(set_to_none=True)
    return fb, grads


def layout_copies(params: list[torch.Tensor], grads: list[torch.Tensor],
                  parts: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """fp32 copies of the first FSDP2 row shard (dim 0 split ``parts`` ways) of every
    parameter and its gradient: one rank's tensors in that layout."""
    shapes = [row_shard(q.shape, parts) for q in params]
    ps = [q.detach()[: s[0]].float().clone() for q, s in zip(params, shapes)]
    gs = [g[: s[0]].clone() for g, s in zip(grads, shapes)]
    return ps, gs


class OpCount(TorchDispatchMode):
    """Ops dispatched (work and metadata views apart) and reads of the device."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.views = self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        if func.overloadpacket.__name__ in VIEW_OPS:
            self.views += 1
        else:
            self.ops += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        counter, self.plain_tolist = self, torch.Tensor.tolist

        def tolist(t):  # not dispatched: counted where it is called
            # (not a host copy filled a step before without waiting: DeMo's deferred verdict)
            counter.reads += not getattr(t, "_flexdemo_host_copy", False)
            return counter.plain_tolist(t)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self.plain_tolist
        return super().__exit__(*exc)


def kernel_launches(fn: Callable[[], None]) -> tuple[int, int]:
    """CUDA kernels and CUDA graphs one call of ``fn`` launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
             "cudaLaunchCooperativeKernel")
    kernels = sum(1 for e in prof.events() if e.name in names)
    graphs = sum(1 for e in prof.events() if e.name == "cudaGraphLaunch")
    return kernels, graphs


def step_profile(fn: Callable[[], None], top: int, cuda: bool) -> dict:
    """Where one call of ``fn`` spends its time (``torch.profiler``): on CUDA the GPU kernels'
    time and the ``top`` kernels by total device time; on CPU the ops' own (self) CPU time and
    the ``top`` ops. Both against the profiled call's wall time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        fn()
        sync()
    wall = time.perf_counter() - t0
    per: dict[str, list[float]] = {}
    if cuda:
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                us = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)
                per.setdefault(e.name, []).append(us)
        rows = sorted(((sum(v), len(v), k) for k, v in per.items()), reverse=True)
    else:
        rows = sorted(((a.self_cpu_time_total, a.count, a.key) for a in prof.key_averages()),
                      reverse=True)
    return {"what": "GPU kernels" if cuda else "CPU ops (self time)",
            "total_ms": sum(r[0] for r in rows) / 1e3, "profiled_wall_ms": wall * 1e3,
            "top": [{"ms": us / 1e3, "calls": n, "name": k[:90]} for us, n, k in rows[:top]]}


def sync_warnings(fn: Callable[[], None]) -> int:
    """Synchronising CUDA calls one call of ``fn`` makes (``set_sync_debug_mode("warn")``)."""
    import warnings

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum(1 for w in caught if "synchroniz" in str(w.message).lower())


def traffic(local_params: int, payload: int, replicas: int) -> dict:
    """Bytes per rank per step of DeMo (``payload`` bytes all-gathered) vs. an fp32 ring
    all-reduce of ``local_params`` elements."""
    demo = all_gather_bytes(payload, replicas)
    dense = all_reduce_bytes(local_params, 4, replicas)
    return {"replicas": replicas, "local_params": local_params, "payload_bytes": payload,
            "demo_bytes": demo, "allreduce_bytes": dense,
            "demo_bytes_per_param": demo / local_params,
            "allreduce_bytes_per_param": dense / local_params, "ratio": dense / demo}


def floor_pass(numel: int, device: torch.device, topk: int, lr: float,
               decay: float) -> tuple[Callable[[], None], Callable[[], None]]:
    """One batched pass over all 64 x 64 blocks of ``numel`` entries: encode (two batched
    products), momentum in the DCT domain, top-k per block, sent coefficients zeroed, decode
    (two batched products), sign. Returns (setup, step)."""
    nb = math.ceil(numel / 4096)
    d = dct_matrix(64, device=device)
    dt = d.t().contiguous()
    grad = torch.randn(nb, 64, 64, device=device) * 1e-3
    coef = torch.zeros(nb, 4096, device=device)

    def step() -> None:
        fresh = torch.matmul(torch.matmul(d, grad), dt)  # encode
        coef.mul_(decay).add_(fresh.view(nb, 4096), alpha=lr)  # momentum, DCT domain
        idx = torch.topk(coef.abs(), topk, dim=1, sorted=False).indices
        vals = coef.gather(1, idx)
        coef.scatter_(1, idx, 0.0)  # error feedback: the sent ones leave the momentum
        dense = torch.zeros_like(coef).scatter_(1, idx, vals).view(nb, 64, 64)
        torch.matmul(torch.matmul(dt, dense), d).sign_()  # decode, sign

    return (lambda: None), step


def buffer_bytes(rep: DeMoReplicator) -> int:
    """Bytes of the replicator's own buffers (momentum, staging, images, workspace, payload
    buckets; shared storage counted once), on any device."""
    seen: dict[int, int] = {}
    tensors = [t for g in rep.groups for t in (g.coef, g.xh, g.img, g.xpad)]
    tensors += list(vars(rep.layout.work).values()) + list(rep.send_buffers)
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def time_layout(params: list[torch.Tensor], grads: list[torch.Tensor], args, timer: Timer,
                device: torch.device) -> dict:
    """Replicator step, AdamW step, ops, reads (and on CUDA kernels, syncs), floor."""
    kw = rep_kwargs(args)
    cuda = device.type == "cuda"
    if cuda:  # earlier layouts' replicators (reference cycles) freed first
        gc.collect()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_reserved()
    rep = DeMoReplicator(**kw)
    rep.setup([p.shape for p in params], device, None)
    work = [torch.empty_like(g) for g in grads]
    lrs = [args.lr] * len(params)
    step = [0]

    def fresh() -> None:
        torch._foreach_copy_(work, grads)

    @torch.no_grad()
    def replicate() -> None:
        rep(work, lrs, step[0])
        step[0] += 1

    out = {"replicator_s": timer.median(replicate, args.reps, args.warmup, setup=fresh),
           "payload_bytes": rep.payload_bytes(), "buffer_bytes": buffer_bytes(rep)}
    if cuda:  # what the replicator holds: its buffers, and its CUDA graphs' memory pools
        torch.cuda.empty_cache()
        out["held_bytes"] = torch.cuda.memory_reserved() - base
    fresh()
    with OpCount() as c:
        replicate()
    out.update(ops=c.ops, views=c.views, reads=c.reads)
    if cuda:
        fresh()
        out["kernel_launches"], out["graph_launches"] = kernel_launches(replicate)
        fresh()
        out["sync_warnings"] = sync_warnings(replicate)

    if args.profile:
        fresh()
        out["profile"] = step_profile(replicate, args.profile, cuda)

    adam_params = [p.detach().clone().requires_grad_(True) for p in params]
    for p, g in zip(adam_params, grads):
        p.grad = g.clone()
    fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
    adam = torch.optim.AdamW(adam_params, lr=args.lr, **fused)
    out["adamw_s"] = timer.median(adam.step, args.reps, args.warmup)
    del adam, adam_params

    setup, floor = floor_pass(sum(p.numel() for p in params), device, args.topk, args.lr,
                              args.decay)
    out["floor_s"] = timer.median(floor, args.reps, args.warmup, setup=setup)
    return out


def rep_kwargs(args) -> dict:
    return {"topk": args.topk, "chunk": args.chunk, "values": args.values,
            "transform_dtype": args.transform_dtype, "decay": args.decay,
            "bucket": not args.per_tensor, "overlap": args.overlap, "compile": args.compile,
            "graphs": True if args.graphs else False if args.eager else "auto",
            "staging": args.staging, "momentum_dtype": args.momentum_dtype,
            **({} if args.group_numel is None else
               {"group_numel": args.group_numel if args.group_numel > 0 else None})}


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print the tables, write JSON."""
    p = argparse.ArgumentParser(description="DeMo bytes and compute on a byte-level GPT")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--preset", "--model", dest="preset", default="small", choices=PRESETS)
    p.add_argument("--vocab", type=int, default=None, help="override the preset's vocabulary")
    p.add_argument("--batch", type=int, default=None, help="default 4 on CPU, 8 on CUDA")
    p.add_argument("--seq", type=int, default=None, help="default the preset's seq_len")
    p.add_argument("--layouts", default="full,half,shard8",
                   help=f"comma-separated, of {sorted(LAYOUTS)}")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--topk", type=int, default=16)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--decay", type=float, default=0.999)
    p.add_argument("--values", default="int2", help="value format (fp32, int8, int2, sign, ...)")
    p.add_argument("--transform-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="precision of the forward DCT's products")
    p.add_argument("--overlap", default="none", choices=["none", "delayed"])
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the top-k selection (compile=True)")
    p.add_argument("--graphs", action="store_true",
                   help="graphs=True: CUDA graphs of the step's device work (default: the "
                        "library's 'auto', on CUDA)")
    p.add_argument("--eager", action="store_true", help="graphs=False: the eager step")
    p.add_argument("--staging", default="auto", choices=["auto", "direct", "image"],
                   help="DeMo's staging of the gradients (auto: images under CUDA graphs "
                        "below 500k entries per tensor, else direct)")
    p.add_argument("--per-tensor", action="store_true",
                   help="bucket=False: every tensor its own group (for comparison)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="the step's N costliest GPU kernels (CUDA) or CPU ops")
    p.add_argument("--group-numel", type=int, default=None,
                   help="DeMo's group_numel (default: the library's; 0: one group per shape)")
    p.add_argument("--momentum-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="DeMo's momentum_dtype (bf16: stored in bf16, rounded stochastically)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1, help="CPU threads")
    p.add_argument("--clock", default="thread", choices=["thread", "wall"],
                   help="CPU timing: the main thread's CPU time (one thread) or wall time")
    p.add_argument("--out", default="benchmarks/results/core.json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    layouts = [s for s in args.layouts.split(",") if s]
    unknown = [s for s in layouts if s not in LAYOUTS]
    if unknown:
        p.error(f"unknown layouts {unknown}; choose from {sorted(LAYOUTS)}")
    torch.set_num_threads(args.threads)
    clock = "wall" if args.threads > 1 else args.clock
    timer = Timer(device, clock)
    torch.manual_seed(0)

    overrides = dict(PRESETS[args.preset])
    if args.vocab is not None:
        overrides["vocab"] = args.vocab
    if args.seq is not None:
        overrides["seq_len"] = args.seq
    gpt = example_gpt()
    cfg = gpt.PRESETS["small"]._replace(**overrides)
    batch = args.batch or (8 if device.type == "cuda" else 4)
    model = gpt.GPT(cfg).to(device)
    params = list(model.parameters())
    n_params = sum(q.numel() for q in params)

    # compute (and the payload size for the traffic table) -----------------------------
    x, y = text_batch(gpt, cfg, batch, device)
    fb, grads = forward_backward(model, x, y, timer, args.reps, args.warmup)
    compute = {"forward_backward_s": fb, "batch": batch, "seq_len": cfg.seq_len, "layouts": []}
    for name in layouts:
        ps, gs = layout_copies(params, grads, LAYOUTS[name])
        t = time_layout(ps, gs, args, timer, device)
        compute["layouts"].append({
            "layout": name, "local_params": sum(q.numel() for q in ps), **t,
            "replicator_pct_of_fwd_bwd": 100 * t["replicator_s"] / fb,
            "adamw_pct_of_fwd_bwd": 100 * t["adamw_s"] / fb,
            "floor_pct_of_fwd_bwd": 100 * t["floor_s"] / fb,
        })
        del ps, gs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    bytes_rows = [{"layout": r["layout"], **traffic(r["local_params"], r["payload_bytes"], n)}
                  for r in compute["layouts"] for n in (2, 4)]

    # report ---------------------------------------------------------------------------
    dev_name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()
    print(f"{args.preset}: {n_params / 1e6:.1f}M parameters (d{cfg.d_model}, {cfg.n_layer} "
          f"layers, vocab {cfg.vocab}); DeMo topk={args.topk} chunk={args.chunk} "
          f"values={args.values} transform {args.transform_dtype} overlap={args.overlap}"
          f"{' momentum bf16' if args.momentum_dtype == 'bf16' else ''}"
          f"{' per-tensor' if args.per_tensor else ''}{' compiled' if args.compile else ''}"
          f" graphs={'on' if args.graphs else 'off' if args.eager else 'auto'}"
          f" staging={args.staging}; "
          f"{device.type} ({dev_name}), torch "
          f"{torch.__version__}, {args.threads} thread(s), {clock} clock\n")
    head = (f"{'layout':<7} {'n':>2} {'local params':>13} {'DeMo B/step':>12} "
            f"{'fp32 AR B/step':>15} {'DeMo B/param':>13} {'ratio':>7}")
    print(head + "\n" + "-" * len(head))
    for r in bytes_rows:
        print(f"{r['layout']:<7} {r['replicas']:>2} {r['local_params']:>13,} "
              f"{r['demo_bytes']:>12,} {r['allreduce_bytes']:>15,} "
              f"{r['demo_bytes_per_param']:>13.4f} {r['ratio']:>6.1f}x")
    print(f"\nforward+backward (batch {batch} x {cfg.seq_len}"
          f"{', bf16 autocast' if device.type == 'cuda' else ''}): {fb * 1e3:.1f} ms "
          f"(median of {args.reps})")
    cuda = device.type == "cuda"
    head = (f"{'layout':<7} {'local params':>13} {'DeMo ms':>8} {'% f+b':>6} {'floor ms':>9} "
            f"{'AdamW ms':>9} {'buf GB':>7} {'ops':>5} {'views':>6} {'reads':>6}"
            + (f" {'kernels':>8} {'graphs':>6} {'syncs':>6} {'held GB':>8}" if cuda else ""))
    print(head + "\n" + "-" * len(head))
    for r in compute["layouts"]:
        print(f"{r['layout']:<7} {r['local_params']:>13,} {r['replicator_s'] * 1e3:>8.1f} "
              f"{r['replicator_pct_of_fwd_bwd']:>5.1f}% {r['floor_s'] * 1e3:>9.1f} "
              f"{r['adamw_s'] * 1e3:>9.1f} {r['buffer_bytes'] / 2**30:>7.2f} {r['ops']:>5} "
              f"{r['views']:>6} {r['reads']:>6}"
              + (f" {r['kernel_launches']:>8} {r['graph_launches']:>6} {r['sync_warnings']:>6}"
                 f" {r['held_bytes'] / 2**30:>8.2f}" if cuda else ""))
    for r in compute["layouts"]:
        if "profile" in r:
            pr = r["profile"]
            print(f"\n{r['layout']}: {pr['what']} {pr['total_ms']:.1f} ms in a profiled step "
                  f"of {pr['profiled_wall_ms']:.1f} ms wall")
            for k in pr["top"]:
                print(f"  {k['ms']:7.2f} ms {k['calls']:4d}x  {k['name']}")

    result = {
        "preset": args.preset, "params": n_params, "config": cfg._asdict(),
        "replicator": rep_kwargs(args), "device": device.type, "device_name": dev_name,
        "torch": torch.__version__, "threads": args.threads, "clock": clock,
        "python": platform.python_version(), "machine": platform.machine(), "reps": args.reps,
        "bytes": bytes_rows, "compute": compute,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
