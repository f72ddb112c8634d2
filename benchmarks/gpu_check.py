"""Check flexdemo on a machine with a GPU: training through prepare() in fp32 and bf16, a
meta-device model, checkpoints (DCP's own helpers and flexdemo's), the HF example.

    python benchmarks/gpu_check.py                            # one GPU, one process
    torchrun --nproc-per-node 4 benchmarks/gpu_check.py       # four GPUs: replicas exchange

Prints one table row per check (PASS / FAIL / SKIP with numbers) and exits 1 if any check
failed. Without a GPU it says so in one line and exits 0. On one process the mesh has one
replica: DeMo still encodes and decodes its payload (the same kernels), it only sends nothing.
Timings are wall-clock per optimizer step after one CUDA synchronisation at the end, warm-up
steps included; they are indications, not benchmarks.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import flexdemo  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class Net(nn.Module):
    """A small residual MLP whose blocks are FSDP units (an ``nn.ModuleList``)."""

    def __init__(self, width: int = 256, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(64, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width),
                                                  nn.GELU()) for _ in range(depth))
        self.out = nn.Linear(width, 16)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        return self.out(h)


def data(device, rank: int, n: int = 64):
    g = torch.Generator().manual_seed(rank)
    teacher = torch.randn(64, 16, generator=g) / 8
    while True:
        x = torch.randn(n, 64, generator=g)
        yield x.to(device), torch.tanh(x @ teacher).to(device)


def run(model, opt, steps: int, device, rank: int) -> dict:
    it = data(device, rank)
    losses = []
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        x, y = next(it)
        loss = (model(x).float() - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    torch.cuda.synchronize()
    ms = 1e3 * (time.perf_counter() - t0) / steps
    losses = torch.stack(losses).tolist()
    return {"first": losses[0], "last": losses[-1], "ms": ms,
            "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
            "sent": opt.bytes_sent}


def summary(r: dict) -> str:
    return (f"loss {r['first']:.4f} -> {r['last']:.4f}, {r['ms']:.1f} ms/step, "
            f"peak {r['peak_mib']:.0f} MiB, sent {r['sent']:,} B")


def fresh(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def prepare(model, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", flexdemo.NoReplicationWarning)
        return flexdemo.prepare(model, *args, device="cuda", **kwargs)


# ---------------------------------------------------------------------------- checks
def check_train(precision: str, replicator: str, optimizer: str, lr: float, **kw):
    def check(rank, steps):
        model, opt = prepare(fresh(), replicator, optimizer, lr, precision=precision, **kw)
        seen = set()
        rep = opt.replicators[0]
        call = rep.replicate

        def spy(grads, lrs, step, communicate):
            seen.update(g.dtype for g in grads if g is not None)
            return call(grads, lrs, step, communicate)

        rep.replicate = spy
        r = run(model, opt, steps, torch.device("cuda"), rank)
        masters = {p.dtype for p in model.parameters()}
        ok = r["last"] < r["first"] and seen == {torch.float32} and masters == {torch.float32}
        if precision == "bf16":
            with torch.no_grad():
                out = model(torch.randn(2, 64, device="cuda"))
            ok = ok and out.dtype == torch.bfloat16
        note = f"; replicator saw {sorted(map(str, seen))}, masters {sorted(map(str, masters))}"
        # DeMo replicators (also inside a phased one or as DiLoCo's exchange) graph their
        # step by default on CUDA
        demos = [x for x in [rep, getattr(rep, "then", None), *getattr(rep, "exchanges", [])]
                 if isinstance(x, flexdemo.DeMoReplicator)]
        if demos and (kw.get("replicator_kwargs") or {}).get("graphs", "auto"):
            captured = sum(len(x.step_graphs.captured) for x in demos)
            ok = ok and captured > 0
            note += f"; {captured} CUDA graphs captured"
        return ok, summary(r) + note
    return check


def check_meta(rank, steps):
    with torch.device("meta"):
        model = Net(width=1024, depth=8)
    model, opt = prepare(model, "demo", "sgd", 3e-3, precision="bf16")
    on = {str(p.device) for p in model.parameters()}
    finite = all(bool(torch.isfinite(_local(p.detach())).all()) for p in model.parameters())
    r = run(model, opt, steps, torch.device("cuda"), rank)
    ok = finite and all(d.startswith("cuda") for d in on) and r["last"] < r["first"]
    return ok, f"{sum(p.numel() for p in model.parameters()):,} params on {sorted(on)}; " \
        + summary(r)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard (FSDP2 parameters and their
    optimizer state), or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _tensors(model, opt) -> list[torch.Tensor]:
    out = [_local(p).detach().clone() for p in model.parameters()]
    for p in opt.params:
        out += [_local(v).detach().clone() for _, v in sorted(opt.base.state.get(p, {}).items())
                if isinstance(v, torch.Tensor)]
    for r in opt.replicators:
        out += [d.detach().clone() for d in getattr(r, "delta", []) if d is not None]
    return out


def _compare(a, b) -> tuple[bool, float]:
    same = len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    diff = max(((x.float() - y.float()).abs().max().item() for x, y in zip(a, b)
                if x.numel()), default=0.0)
    return same, diff


def check_dcp(rank, steps):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def make(seed):
        rep = flexdemo.DeMoReplicator(sign=False)
        return prepare(fresh(seed), rep, "adamw", 1e-3, precision="bf16")

    with tempfile.TemporaryDirectory() as tmp:
        if dist.get_world_size() > 1:  # one directory for all ranks
            names = [tmp]
            dist.broadcast_object_list(names, src=0)
            tmp = names[0]
        model, opt = make(0)
        run(model, opt, 3, torch.device("cuda"), rank)
        saved = _tensors(model, opt)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{tmp}/ckpt")
        run(model, opt, 2, torch.device("cuda"), rank)
        expected = _tensors(model, opt)
        model2, opt2 = make(1)
        msd2, osd2 = get_state_dict(model2, opt2)
        dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=f"{tmp}/ckpt")
        set_state_dict(model2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
        same, diff = _compare(saved, _tensors(model2, opt2))
        run(model2, opt2, 2, torch.device("cuda"), rank)
        same_next, diff_next = _compare(expected, _tensors(model2, opt2))
        if dist.get_world_size() > 1:
            dist.barrier()
    return same and same_next, (f"{len(saved)} tensors; after load bitwise={same} (max diff "
                                f"{diff:.1e}); 2 more steps bitwise={same_next} (max diff "
                                f"{diff_next:.1e})")


def check_flexdemo_checkpoint(rank, steps):
    with tempfile.TemporaryDirectory() as tmp:
        if dist.get_world_size() > 1:
            names = [tmp]
            dist.broadcast_object_list(names, src=0)
            tmp = names[0]
        model, opt = prepare(fresh(0), "demo", "adamw", 1e-3)
        run(model, opt, 3, torch.device("cuda"), rank)
        path = flexdemo.save_checkpoint(f"{tmp}/step_3", model, opt, step=3)
        saved = _tensors(model, opt)
        model2, opt2 = prepare(fresh(1), "demo", "adamw", 1e-3)
        res = flexdemo.load_checkpoint(path, model2, opt2)
        same, diff = _compare(saved, _tensors(model2, opt2))
        if dist.get_world_size() > 1:
            dist.barrier()
    return same and res["step"] == 3, f"step {res['step']}; bitwise={same} (max diff {diff:.1e})"


def check_hf(extra: list[str]):
    def check(rank, steps):
        path = ROOT / "examples" / "train_hf.py"
        spec = importlib.util.spec_from_file_location("train_hf", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = mod.main(["--device", "cuda", "--steps", str(steps), "--log-every", "1000",
                          *extra])
        ok = r["losses"][-1] < r["losses"][0] and r["device"].startswith("cuda")
        return ok, (f"{r['params']:,} params, loss {r['losses'][0]:.3f} -> "
                    f"{r['losses'][-1]:.3f}, {r['step_ms']:.1f} ms/step, mesh {r['mesh']}")
    return check


def check_app(precision: str, device: str = "cuda"):
    """``flexdemo train`` (the application) on CUDA: a small GPT for a few steps, one process,
    through its own config (written to a temporary folder) and its own process group."""
    def check(rank, steps):
        import json

        from flexdemo.app.config.files import load_config
        from flexdemo.app.train.trainer import Trainer

        with tempfile.TemporaryDirectory() as tmp:
            cfg_path = Path(tmp) / "gpt.toml"
            cfg_path.write_text(
                '[task]\nname = "gpt"\nmodel = "mini"\ncorpus_bytes = 400000\n\n'
                '[strategy]\nreplicator = "demo"\noptimizer = "sgd"\nlr = 3e-3\n\n'
                f'[train]\nsteps = {steps}\nbatch = 8\nwarmup = 2\neval_every = 0\n'
                'eval_batches = 2\nlog_every = 10\ntensorboard = false\nprogress = false\n'
                f'device = "{device}"\nprecision = "{precision}"\nout = "{tmp}/run"\n')
            lines: list[str] = []
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer = Trainer(load_config(cfg_path), echo=lines.append)
                summary = trainer.run()
            rows = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl")
                    .read_text().splitlines()]
            on = {str(p.device) for p in trainer.model.parameters()}
        first, last = rows[0]["loss"], summary["train_loss"]
        ok = (summary["device"].startswith(device) and summary["precision"] == precision
              and all(d.startswith(device) for d in on) and len(rows) == steps
              and last < first)
        return ok, (f"{summary['params']:,} params on {summary['device']}, loss {first:.4f} "
                    f"-> {last:.4f} (mean of the last steps), val {summary['val_loss']:.4f}, "
                    f"{summary['step_seconds'] * 1e3:.1f} ms/step")
    return check


def main(argv: list[str] | None = None) -> int:
    from flexdemo.app.args import Parser, int_at_least

    p = Parser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--steps", type=int_at_least(1), default=30,
                   help="training steps per check, >= 1 (default %(default)s)")
    p.add_argument("--only", default="", help="run the checks whose name contains this")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}); nothing to check")
        return 0
    flexdemo.init_distributed("cuda")
    rank = dist.get_rank()
    checks = [
        ("prepare demo fp32", check_train("fp32", "demo", "sgd", 3e-3)),
        ("prepare demo bf16", check_train("bf16", "demo", "sgd", 3e-3)),
        ("prepare demo bf16 eager", check_train("bf16", "demo", "sgd", 3e-3,
                                                replicator_kwargs={"graphs": False})),
        ("prepare demo delayed bf16", check_train("bf16", "demo", "sgd", 3e-3,
                                                  replicator_kwargs={"overlap": "delayed"})),
        ("prepare demo-warmup bf16", check_train("bf16", "demo-warmup", "sgd", 3e-3,
                                                 replicator_kwargs={"warmup_steps": 10})),
        ("prepare diloco demo-exchange bf16", check_train(
            "bf16", "diloco", "adamw", 1e-3,
            replicator_kwargs={"inner_steps": 3, "exchange": "demo"})),
        ("prepare full+adamw bf16", check_train("bf16", "full", "adamw", 1e-3)),
        ("prepare full int8+adamw bf16", check_train("bf16", "full", "adamw", 1e-3,
                                                     replicator_kwargs={"values": "int8"})),
        ("prepare diloco bf16", check_train("bf16", "diloco", "adamw", 1e-3,
                                            replicator_kwargs={"inner_steps": 5})),
        ("meta-device init bf16", check_meta),
        ("DCP get/set_state_dict", check_dcp),
        ("flexdemo.save/load_checkpoint", check_flexdemo_checkpoint),
    ]
    try:
        import transformers  # noqa: F401
        checks += [
            ("HF llama bf16", check_hf(["--model", "llama", "--precision", "bf16"])),
            ("HF llama meta bf16", check_hf(["--model", "llama", "--meta", "--precision",
                                             "bf16"])),
            ("HF gpt2 fp32 adamw", check_hf(["--model", "gpt2", "--optimizer", "adamw",
                                             "--lr", "1e-3"])),
        ]
        hf_skip = None
    except ImportError:
        hf_skip = "transformers is not installed"
    checks = [(name, fn) for name, fn in checks if args.only in name]
    rows = []
    for name, fn in checks:
        try:
            ok, detail = fn(rank, args.steps)
            rows.append((name, "PASS" if ok else "FAIL", detail))
        except Exception as e:  # a failed check is a row, the others still run
            rows.append((name, "FAIL", f"{type(e).__name__}: {e}".splitlines()[0][:300]))
            if rank == 0:
                traceback.print_exc()
    if hf_skip:
        rows.append(("HF example", "SKIP", hf_skip))
    if dist.get_world_size() == 1:
        checks_app = [(f"flexdemo train {p}", check_app(p)) for p in ("fp32", "bf16")]
    else:  # its outputs go to one rank's temporary folder
        checks_app = []
        rows.append(("flexdemo train", "SKIP", "checked in a single process only (python "
                     "benchmarks/gpu_check.py)"))
    checks_app = [(name, fn) for name, fn in checks_app if args.only in name]
    for name, fn in checks_app:
        try:
            ok, detail = fn(rank, args.steps)
            rows.append((name, "PASS" if ok else "FAIL", detail))
        except Exception as e:  # a failed check is a row
            rows.append((name, "FAIL", f"{type(e).__name__}: {e}".splitlines()[0][:300]))
            traceback.print_exc()
    if rank == 0:
        name = torch.cuda.get_device_name()
        print(f"\ngpu_check: {name}, torch {torch.__version__}, {dist.get_world_size()} "
              f"rank(s)")
        width = max(len(r[0]) for r in rows)
        for n, status, detail in rows:
            print(f"{n:<{width}}  {status:<4}  {detail}")
    dist.destroy_process_group()
    return 1 if any(r[1] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
