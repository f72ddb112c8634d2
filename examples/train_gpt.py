"""Train a small byte-level GPT on the standard library's sources with two strategies.

    torchrun --nproc-per-node 4 examples/train_gpt.py --replicate 2   # 2 replicas x 2 shards
    torchrun --nnodes 2 --nproc-per-node 2 ... examples/train_gpt.py  # the same over 2 nodes
    python examples/train_gpt.py                                      # one process
    python examples/train_gpt.py --device cuda --precision bf16       # one GPU

Needs only torch and flexdemo (``pip install -e .`` in a clone); the model, the text and the
schedule are in this file. The mesh defaults as in :func:`flexdemo.prepare` and
``flexdemo train``: shard = ranks per node (``LOCAL_WORLD_SIZE``), replicate = the number of
nodes. On one node that is a single replica that exchanges nothing (said once);
``--replicate 2`` makes two replicas of the node's ranks.

Strategies (run one after the other in the same process group, same seed and data) come from
:data:`flexdemo.STRATEGIES`, the table ``flexdemo bench`` uses too (``--help`` lists them): by
default ``flexdemo`` (FSDP2 inside a replica, DeMo replication of a decoupled momentum's top-k
DCT across replicas, sign-SGD) and ``hsdp-adamw`` (full fp32 gradient all-reduce across
replicas, AdamW). Replicator settings can follow a name: ``demo-defaults:values=int2:topk=16``.
A strategy's mesh layout ``dp`` (shard 1) applies when neither ``--replicate`` nor ``--shard``
is given.

``--device`` (``auto``: CUDA when available) puts rank ``r`` of a node on ``cuda:LOCAL_RANK``
with NCCL, or on the CPU with gloo; ``--precision bf16`` trains with FSDP2 mixed precision
(bf16 compute, fp32 gradients and master weights). The learning rate warms up linearly over
the first ``--warmup`` fraction of the steps, then decays along a cosine to a tenth.

Rank 0 prints progress and a final table and writes the results as JSON (``--out``). Bytes
are those a rank sends across the replicate dimension (the slow link); FSDP's own traffic
inside a replica is not counted. Bad arguments end in one line from rank 0 and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig
import time
import warnings
from pathlib import Path
from typing import NamedTuple, NoReturn

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import flexdemo

PROG = Path(__file__).name


# ------------------------------------------------------------------------------------ model
class GPTConfig(NamedTuple):
    """Depth, heads, width and context length of the GPT (the vocabulary: 256 byte values)."""

    n_layer: int = 6
    n_head: int = 6
    d_model: int = 384
    seq_len: int = 128
    vocab: int = 256


PRESETS = {
    "tiny": GPTConfig(n_layer=3, n_head=4, d_model=64, seq_len=64),     # ~0.19M parameters
    "mini": GPTConfig(n_layer=4, n_head=4, d_model=128, seq_len=128),   # ~0.87M parameters
    "small": GPTConfig(n_layer=6, n_head=6, d_model=384, seq_len=128),  # ~10.9M parameters
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                 nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Byte-level GPT: ``model(x)`` gives logits, ``model(x, y)`` the mean cross-entropy. The
    blocks are an ``nn.ModuleList``, so ``prepare()`` makes each one an FSDP unit."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        for m in self.modules():  # GPT-2's initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        for name, p in self.named_parameters():  # residual projections scaled down with depth
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.ln_f(h))
        if y is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# ------------------------------------------------------------------------------------- data
def load_corpus(train_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, val)`` uint8 tensors of the standard library's ``.py`` sources, the same on
    every machine with this Python: files in path order, every 10th to validation (a tenth of
    ``train_bytes``)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted((p for p in root.rglob("*.py")
                    if "site-packages" not in p.relative_to(root).parts and p.is_file()),
                   key=lambda p: p.relative_to(root).as_posix())
    caps = {"train": train_bytes, "val": max(train_bytes // 10, 1)}
    text = {"train": bytearray(), "val": bytearray()}
    for i, path in enumerate(files):
        split = "val" if i % 10 == 9 else "train"
        if len(text[split]) < caps[split]:
            text[split] += path.read_bytes()
        elif all(len(text[s]) >= caps[s] for s in caps):
            break
    train, val = (torch.frombuffer(text[s][:caps[s]], dtype=torch.uint8) for s in caps)
    return train, val


def get_batch(data: torch.Tensor, batch: int, seq_len: int,
              generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random windows of ``data``: inputs and next-byte targets, ``(batch, seq_len)``."""
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch,), generator=generator)
    windows = data[starts[:, None] + torch.arange(seq_len + 1)].long()
    return windows[:, :-1], windows[:, 1:]


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, batches: int, batch: int, seq_len: int,
             seed: int, device: torch.device) -> float:
    """Mean loss over ``batches`` random batches of ``data`` (every rank of a replica must call
    it the same number of times: FSDP gathers parameters in forward)."""
    gen = torch.Generator().manual_seed(seed)
    model.eval()
    total = 0.0
    for _ in range(batches):
        x, y = get_batch(data, batch, seq_len, gen)
        total += float(model(x.to(device), y.to(device)))
    model.train()
    return total / batches


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then a cosine from ``peak`` to ``peak / 10`` at the
    last step."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(max(step - warmup, 0) / max(steps - warmup - 1, 1), 1.0)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))


# -------------------------------------------------------------------------------- arguments
def usage_exit(message: str) -> NoReturn:
    """``train_gpt.py: error: message`` from rank 0 only, exit code 2 on every rank. The other
    ranks wait a moment: torchrun stops them all once one exits, and rank 0 should say why."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    else:
        time.sleep(3)
    sys.exit(2)


class Parser(argparse.ArgumentParser):
    """Errors are one line (no usage block), said once under torchrun."""

    def error(self, message: str) -> NoReturn:
        usage_exit(f"{message} (see --help)")


def number(cast: type, low: float, high: float | None = None, above: bool = False):
    """An ``argparse`` type: ``cast(text)`` at least ``low`` (more with ``above``), at most
    ``high``."""
    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            kind = "an integer" if cast is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        if not math.isfinite(value) or value < low or (above and value == low) or (
                high is not None and value > high):
            bound = (f"from {low} to {high}" if high is not None else
                     f"greater than {low}" if above else f"at least {low}")
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value
    return parse


def min_corpus_bytes(model: str) -> int:
    """The smallest ``--corpus-bytes`` for a preset: its validation split (a tenth) must hold
    one window of ``seq_len + 1`` bytes and more."""
    return 10 * (PRESETS[model].seq_len + 2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; bad ones exit with one line and code 2 (before any training)."""
    p = Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=tuple(PRESETS), default="mini",
                   help="GPT preset (default %(default)s)")
    p.add_argument("--steps", type=number(int, 1), default=250,
                   help="optimizer steps, >= 1 (default %(default)s)")
    p.add_argument("--batch", type=number(int, 1), default=8,
                   help="sequences per rank per step, >= 1 (default %(default)s)")
    p.add_argument("--lr", type=number(float, 0, above=True), default=None,
                   help="learning rate (> 0) for every strategy (default: each strategy's own)")
    p.add_argument("--warmup", type=number(float, 0, 1), default=0.05,
                   help="warm-up length as a FRACTION of --steps, from 0 to 1 (default "
                        "%(default)s: the first 5%% of the steps); not a number of steps, "
                        "unlike train_hf.py's --warmup")
    p.add_argument("--replicate", type=number(int, 1), default=None,
                   help="replicas, >= 1 (default: the number of nodes); replicate x shard = "
                        "the ranks launched")
    p.add_argument("--shard", type=number(int, 1), default=None,
                   help="ranks per replica, >= 1 (default: the ranks per node)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (CUDA when available), cpu or cuda (cuda:LOCAL_RANK per rank)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: bf16 compute with fp32 gradients and master weights")
    p.add_argument("--strategies", default="flexdemo,hsdp-adamw",
                   help="comma-separated (default %(default)s), from: " + "; ".join(
                       f"{name} ({s.about})" for name, s in flexdemo.STRATEGIES.items()))
    p.add_argument("--corpus-bytes", type=number(int, 1), default=4_000_000,
                   help="training text in bytes, validation a tenth of that (default "
                        "%(default)s); at least " + ", ".join(
                            f"{min_corpus_bytes(name)} for {name}" for name in PRESETS))
    p.add_argument("--eval-batches", type=number(int, 1), default=8,
                   help="validation batches per rank, >= 1 (default %(default)s)")
    p.add_argument("--log-every", type=number(int, 1), default=25,
                   help="steps between progress lines, >= 1 (default %(default)s)")
    p.add_argument("--seed", type=number(int, 0, 2**32 - 1), default=0,
                   help="random seed, 0 to 2**32 - 1 (default %(default)s)")
    p.add_argument("--out", default="runs/main/results.json",
                   help="the results as JSON, written by rank 0 (default %(default)s)")
    args = p.parse_args(argv)
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if not args.strategies:
        p.error("argument --strategies: name at least one, from "
                + ", ".join(flexdemo.STRATEGIES))
    for s in args.strategies:
        try:
            flexdemo.check_strategy(s)  # builds its replicator once: bad settings fail here
        except ValueError as e:
            p.error(f"argument --strategies: {' '.join(str(e).split())}")
        spec = flexdemo.parse_strategy(s)
        if spec.replicator_kwargs.get("pace") is not None or spec.batches != "equal":
            p.error(f"argument --strategies: {s} runs replicas at their own pace or batch, "
                    "which this example's fixed step loop does not; train it with flexdemo "
                    "train or flexdemo bench (docs/stragglers.md)")
    need = min_corpus_bytes(args.model)
    if args.corpus_bytes < need:
        p.error(f"argument --corpus-bytes: {args.corpus_bytes} is too small for --model "
                f"{args.model} (sequences of {PRESETS[args.model].seq_len} bytes); use at "
                f"least {need}")
    if args.replicate is not None or args.shard is not None or any(
            flexdemo.parse_strategy(s).layout != "dp" for s in args.strategies):
        try:
            flexdemo.mesh_shape(int(os.environ.get("WORLD_SIZE", "1")), args.replicate,
                                args.shard)
        except ValueError as e:
            p.error(f"argument --replicate/--shard: {e}; launch replicate x shard ranks "
                    "(torchrun --nproc-per-node N) or change --replicate/--shard")
    out = Path(args.out)  # rank 0 writes it after training: check it now
    if out.is_dir():
        p.error(f"argument --out: {args.out!r} is a directory; give a file name such as "
                f"{str(out / 'results.json')!r}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"argument --out: cannot create {str(out.parent)!r} ({e.strerror or e}); "
                "choose another path")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        p.error(f"argument --out: {str(out.parent)!r} is not a writable directory")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("argument --device: CUDA is not available here; use --device cpu (or auto)")
    return args


# --------------------------------------------------------------------------------- training
def mean_over_ranks(value: float, device: torch.device) -> float:
    """The mean of ``value`` over all ranks (reduced on ``device``: NCCL needs CUDA tensors)."""
    if dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def local(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (FSDP2 makes parameters DTensors of row shards)."""
    return p.to_local() if hasattr(p, "to_local") else p


@torch.no_grad()
def replica_drift(model: nn.Module, group: dist.ProcessGroup) -> float:
    """Largest elementwise difference of the local parameters across the replicas, max over
    all ranks (0 when replicas are in sync)."""
    flat = torch.cat([local(p).reshape(-1).float() for p in model.parameters()])
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    d = (hi - lo).max().double().reshape(1)
    dist.all_reduce(d, op=dist.ReduceOp.MAX)
    return float(d)


class UsageError(Exception):
    """Bad input found after the process group started: one line, exit code 2."""


def run_strategy(name: str, args: argparse.Namespace, train: torch.Tensor,
                 val: torch.Tensor) -> dict:
    """Train a fresh model with one strategy; returns its summary (identical on all ranks)."""
    spec = flexdemo.parse_strategy(name)
    lr = args.lr if args.lr is not None else spec.lr
    layout = {"replicate": args.replicate, "shard": args.shard}
    if spec.layout == "dp" and args.replicate is None and args.shard is None:
        layout = {"replicate": None, "shard": 1}
    cfg = PRESETS[args.model]
    torch.manual_seed(args.seed)  # same initial model on every rank and for every strategy
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", flexdemo.NoReplicationWarning)
        try:
            model, opt = flexdemo.prepare(
                model, replicator=spec.replicator, optimizer=spec.optimizer, lr=lr,
                replicator_kwargs=spec.replicator_kwargs or None,
                optimizer_kwargs=spec.optimizer_kwargs or None,
                device=args.device, precision=args.precision, **layout)
        except ValueError as e:  # settings only the started process group can check
            raise UsageError(f"strategy {name!r}: {' '.join(str(e).split())}") from e
    rank, mesh = dist.get_rank(), opt.mesh
    device = next(model.parameters()).device  # cuda:LOCAL_RANK or the CPU
    if rank == 0 and any(issubclass(w.category, flexdemo.NoReplicationWarning) for w in caught):
        how = ("launch several ranks (torchrun) to train replicas" if dist.get_world_size() == 1
               else "pass --replicate 2 to replicate across the ranks of one node")
        print(f"[{name}] note: the mesh has a single replica (replicate 1 x shard "
              f"{mesh['shard'].size()}), so {spec.replicator!r} exchanges nothing; {how}",
              flush=True)
    local_params = sum(local(p).numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(args.seed + rank)  # each rank draws its own batches
    warmup = max(1, int(args.warmup * args.steps))
    losses: list[float] = []
    pending: list[torch.Tensor] = []
    history: list[dict] = []
    step_times: list[float] = []
    sent = 0
    t0 = time.perf_counter()
    for step in range(args.steps):
        t_step = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, lr, warmup)
        x, y = get_batch(train, args.batch, cfg.seq_len, gen)
        loss = model(x.to(device), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        sent += opt.last_step_stats()["bytes_sent"]
        pending.append(loss.detach())
        step_times.append(time.perf_counter() - t_step)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            losses += torch.stack(pending).float().tolist()  # one host read per log line
            pending = []
            window = losses[-args.log_every:]
            avg = mean_over_ranks(sum(window) / len(window), device)
            elapsed = time.perf_counter() - t0
            history.append({"step": step + 1, "train_loss": avg, "seconds": elapsed})
            if rank == 0:
                print(f"[{name}] step {step + 1:4d}/{args.steps}  loss {avg:.4f}  "
                      f"lr {opt.param_groups[0]['lr']:.2e}  {elapsed:6.1f}s  "
                      f"sent {sent / 2**20:8.2f} MiB", flush=True)
    seconds = time.perf_counter() - t0
    drift = replica_drift(model, mesh["replicate"].get_group())
    tail = losses[-min(len(losses), args.log_every):]
    val_loss = evaluate(model, val, args.eval_batches, args.batch, cfg.seq_len,
                        seed=10_000 + args.seed + rank, device=device)
    per_step = mean_over_ranks(sent / args.steps, device)
    steady = sorted(step_times[min(3, len(step_times) - 1):])  # leave out warm-up steps
    result = {
        "strategy": name, "replicator": repr(opt.replicators[0]), "optimizer": spec.optimizer,
        "lr": lr, "steps": args.steps, "device": str(device), "precision": args.precision,
        "params": n_params, "local_params": local_params,
        "mesh": {"replicate": mesh["replicate"].size(), "shard": mesh["shard"].size()},
        "train_loss": mean_over_ranks(sum(tail) / len(tail), device),
        "val_loss": mean_over_ranks(val_loss, device), "seconds": seconds,
        "step_seconds_median": mean_over_ranks(steady[len(steady) // 2], device),
        "comm_seconds": mean_over_ranks(opt.comm_seconds, device),
        "replica_max_abs_diff": drift, "bytes_sent_per_step": per_step,
        "mb_sent_per_step": per_step / 1e6, "bytes_per_param_per_step": per_step / local_params,
        "history": history,
    }
    del model, opt
    dist.barrier()
    return result


def print_table(results: list[dict]) -> None:
    """The summary table (rank 0)."""
    head = (f"{'strategy':<17} {'train':>7} {'val':>7} {'seconds':>8} {'MB/rank/step':>13} "
            f"{'B/param/step':>13} {'replica diff':>13}")
    print("\n" + head + "\n" + "-" * len(head))
    for r in results:
        print(f"{r['strategy']:<17} {r['train_loss']:7.4f} {r['val_loss']:7.4f} "
              f"{r['seconds']:8.1f} {r['mb_sent_per_step']:13.4f} "
              f"{r['bytes_per_param_per_step']:13.4f} {r['replica_max_abs_diff']:13.2e}")


def main(argv: list[str] | None = None) -> list[dict]:
    """Run every requested strategy; returns the results."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    train, val = load_corpus(args.corpus_bytes)
    results = []
    try:
        for name in args.strategies:
            try:
                results.append(run_strategy(name, args, train, val))
            except UsageError as e:  # raised alike on every rank, before any collective
                usage_exit(str(e))
        if dist.get_rank() == 0:
            cfg = PRESETS[args.model]
            print(f"\nmodel {args.model} ({results[0]['params'] / 1e6:.2f}M params), "
                  f"world {dist.get_world_size()}, mesh {results[0]['mesh']}, "
                  f"{args.steps} steps x {args.batch} x {cfg.seq_len} tokens per rank")
            print_table(results)
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"config": vars(args), "world": dist.get_world_size(),
                                       "results": results}, indent=2))
            print(f"\nwrote {out}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
