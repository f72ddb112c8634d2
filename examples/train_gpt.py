"""Train a small byte-level GPT on the standard library's sources with two strategies.

    torchrun --nproc-per-node 4 examples/train_gpt.py --replicate 2   # 2 replicas x 2 shards
    torchrun --nnodes 2 --nproc-per-node 2 ... examples/train_gpt.py  # the same over 2 nodes
    python examples/train_gpt.py                                      # one process
    python examples/train_gpt.py --device cuda --precision bf16       # one GPU

The mesh defaults as in :func:`flexdemo.prepare` and ``flexdemo train``: shard = ranks per node
(``LOCAL_WORLD_SIZE``), replicate = the number of nodes. On one node that is a single replica
that exchanges nothing (said once); ``--replicate 2`` makes two replicas of the node's ranks.

Strategies (run one after the other in the same process group, same seed and data) come
from the one table the bench uses too, :data:`flexdemo.app.strategies.STRATEGIES` (``--help``
lists them): by default ``flexdemo`` (FSDP2 inside a replica, DeMo replication of a decoupled
momentum's top-k DCT across replicas, sign-SGD) and ``hsdp-adamw`` (full fp32 gradient
all-reduce across replicas, AdamW). Replicator settings can follow a name:
``demo-defaults:values=int2:topk=16``. A strategy's mesh layout ``dp`` (shard 1) applies when
neither ``--replicate`` nor ``--shard`` is given.

``--device`` (``auto``: CUDA when available) puts rank ``r`` of a node on ``cuda:LOCAL_RANK``
with NCCL, or on the CPU with gloo; ``--precision bf16`` trains with FSDP2 mixed precision
(bf16 compute, fp32 gradients and master weights).

Rank 0 prints progress and a final table and writes the results as JSON (``--out``). Bytes
are those a rank sends across the replicate dimension (the slow link); FSDP's own traffic
inside a replica is not counted.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import flexdemo
from flexdemo.app.args import (
    Parser,
    check_out_file,
    float_in,
    int_at_least,
    launch_world,
    usage_exit,
)
from flexdemo.app.device import DEVICES, PRECISIONS, resolve_device, to_device
from flexdemo.app.schedule import lr_at
from flexdemo.app.strategies import STRATEGIES, check_strategy, parse_strategy
from flexdemo.app.tasks import (
    GPT,
    PRESETS,
    data_generator,
    evaluate,
    get_batch,
    gpt_config,
    load_corpus,
)
from flexdemo.mesh import mesh_shape

PROG = Path(__file__).name


class UsageError(Exception):
    """Bad input found after the process group started: one line, exit code 2."""


def min_corpus_bytes(model: str) -> int:
    """The smallest ``--corpus-bytes`` for a preset: its validation split (a tenth) must hold
    one window of ``seq_len + 1`` bytes and more."""
    return 10 * (PRESETS[model].seq_len + 2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; bad ones exit with one line and code 2 (before any training)."""
    p = Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=tuple(PRESETS), default="mini",
                   help="GPT preset (default %(default)s)")
    p.add_argument("--steps", type=int_at_least(1), default=250,
                   help="optimizer steps, >= 1 (default %(default)s)")
    p.add_argument("--batch", type=int_at_least(1), default=8,
                   help="sequences per rank per step, >= 1 (default %(default)s)")
    p.add_argument("--lr", type=float_in(0, open_low=True), default=None,
                   help="learning rate (> 0) for every strategy (default: each strategy's own)")
    p.add_argument("--warmup", type=float_in(0, 1), default=0.05,
                   help="warm-up length as a FRACTION of --steps, from 0 to 1 (default "
                        "%(default)s: the first 5%% of the steps); not a number of steps, "
                        "unlike train_hf.py's --warmup")
    p.add_argument("--replicate", type=int_at_least(1), default=None,
                   help="replicas, >= 1 (default: the number of nodes); replicate x shard = "
                        "the ranks launched")
    p.add_argument("--shard", type=int_at_least(1), default=None,
                   help="ranks per replica, >= 1 (default: the ranks per node)")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="auto (CUDA when available), cpu or cuda (cuda:LOCAL_RANK per rank)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="bf16: bf16 compute with fp32 gradients and master weights")
    p.add_argument("--strategies", default="flexdemo,hsdp-adamw",
                   help="comma-separated (default %(default)s), from: " + "; ".join(
                       f"{name} ({s.about})" for name, s in STRATEGIES.items()))
    p.add_argument("--corpus-bytes", type=int_at_least(1), default=4_000_000,
                   help="training text in bytes, validation a tenth of that (default "
                        "%(default)s); at least " + ", ".join(
                            f"{min_corpus_bytes(name)} for {name}" for name in PRESETS))
    p.add_argument("--eval-batches", type=int_at_least(1), default=8,
                   help="validation batches per rank, >= 1 (default %(default)s)")
    p.add_argument("--log-every", type=int_at_least(1), default=25,
                   help="steps between progress lines, >= 1 (default %(default)s)")
    p.add_argument("--seed", type=int_at_least(0, 2**32), default=0,
                   help="random seed, 0 to 2**32 - 1 (default %(default)s)")
    p.add_argument("--out", default="runs/main/results.json",
                   help="the results as JSON, written by rank 0 (default %(default)s)")
    args = p.parse_args(argv)
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if not args.strategies:
        p.error(f"argument --strategies: name at least one, from {', '.join(STRATEGIES)}")
    for s in args.strategies:
        try:
            check_strategy(s)  # builds its replicator once: bad settings fail here
        except ValueError as e:
            p.error(f"argument --strategies: {' '.join(str(e).split())}")
    need = min_corpus_bytes(args.model)
    if args.corpus_bytes < need:
        p.error(f"argument --corpus-bytes: {args.corpus_bytes} is too small for --model "
                f"{args.model} (sequences of {PRESETS[args.model].seq_len} bytes); use at "
                f"least {need}")
    if args.replicate is not None or args.shard is not None or any(
            parse_strategy(s).layout != "dp" for s in args.strategies):
        try:
            mesh_shape(launch_world(), args.replicate, args.shard)
        except ValueError as e:
            p.error(f"argument --replicate/--shard: {e}; launch replicate x shard ranks "
                    "(torchrun --nproc-per-node N) or change --replicate/--shard")
    check_out_file(p, args.out)  # rank 0 writes it after training
    try:
        args.device = resolve_device(args.device)
    except ValueError as e:
        p.error(f"argument --device: {e}")
    return args


def mean_over_ranks(value: float, device: torch.device) -> float:
    """The mean of ``value`` over all ranks (reduced on ``device``: NCCL needs CUDA tensors)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


@torch.no_grad()
def replica_drift(model: torch.nn.Module, group: dist.ProcessGroup) -> float:
    """Largest elementwise difference of the local parameters across the replicas, max over
    all ranks (0 when replicas are in sync)."""
    flat = torch.cat([(p.to_local() if hasattr(p, "to_local") else p).reshape(-1).float()
                      for p in model.parameters()])
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    d = (hi - lo).max().double().reshape(1)
    dist.all_reduce(d, op=dist.ReduceOp.MAX)
    return float(d)


def run_strategy(name: str, args: argparse.Namespace, train: torch.Tensor,
                 val: torch.Tensor, layout: dict) -> dict:
    """Train a fresh model with one strategy; returns its summary (identical on all ranks)."""
    spec = parse_strategy(name)
    lr = args.lr if args.lr is not None else spec.lr
    if spec.layout == "dp" and args.replicate is None and args.shard is None:
        layout = {"replicate": None, "shard": 1}
    warmup = max(1, int(args.warmup * args.steps))
    cfg = gpt_config(args.model)
    torch.manual_seed(args.seed)  # same initial model on every rank and for every strategy
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", flexdemo.NoReplicationWarning)
        try:
            model, opt = flexdemo.prepare(model, replicator=spec.replicator,
                                          optimizer=spec.optimizer, lr=lr,
                                          replicator_kwargs=spec.replicator_kwargs or None,
                                          optimizer_kwargs=spec.optimizer_kwargs or None,
                                          device=args.device, precision=args.precision,
                                          **layout)
        except ValueError as e:  # settings only the started process group can check
            raise UsageError(f"strategy {name!r}: {' '.join(str(e).split())}") from e
    rank = dist.get_rank()
    if rank == 0 and any(issubclass(w.category, flexdemo.NoReplicationWarning) for w in caught):
        how = ("launch several ranks (torchrun) to train replicas" if dist.get_world_size() == 1
               else "pass --replicate 2 to replicate across the ranks of one node")
        print(f"[{name}] note: the mesh has a single replica (replicate 1 x shard "
              f"{opt.mesh['shard'].size()}), so {spec.replicator!r} exchanges nothing; {how}",
              flush=True)
    local_params = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                       for p in model.parameters())
    mesh = opt.mesh
    gen = data_generator(args.seed, rank)
    losses: list[float] = []
    pending: list[torch.Tensor] = []
    history: list[dict] = []
    sent = 0
    step_times: list[float] = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        t_step = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, lr, warmup)
        x, y = to_device(get_batch(train, args.batch, cfg.seq_len, gen), args.device)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sent += opt.last_step_stats()["bytes_sent"]
        pending.append(loss.detach())
        step_times.append(time.perf_counter() - t_step)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            losses += torch.stack(pending).float().tolist()  # one host read per log line
            pending = []
            avg = mean_over_ranks(sum(losses[-args.log_every:]) / len(losses[-args.log_every:]),
                                  args.device)
            elapsed = time.perf_counter() - t0
            history.append({"step": step + 1, "train_loss": avg, "seconds": elapsed})
            if rank == 0:
                print(f"[{name}] step {step + 1:4d}/{args.steps}  loss {avg:.4f}  "
                      f"lr {opt.param_groups[0]['lr']:.2e}  {elapsed:6.1f}s  "
                      f"sent {sent / 2**20:8.2f} MiB", flush=True)
    seconds = time.perf_counter() - t0
    drift = replica_drift(model, mesh["replicate"].get_group())
    tail = losses[-min(len(losses), args.log_every):]
    dev = args.device
    train_loss = mean_over_ranks(sum(tail) / len(tail), dev)
    val_loss = mean_over_ranks(evaluate(model, val, args.eval_batches, args.batch, cfg.seq_len,
                                        seed=10_000 + args.seed + rank, device=dev), dev)
    per_step = mean_over_ranks(sent / max(args.steps, 1), dev)
    comm = mean_over_ranks(opt.comm_seconds, dev)
    steady = sorted(step_times[min(3, len(step_times) - 1):])  # leave out warm-up steps
    step_median = mean_over_ranks(steady[len(steady) // 2], dev) if steady else 0.0
    result = {
        "strategy": name, "replicator": repr(opt.replicators[0]),
        "optimizer": spec.optimizer,
        "lr": lr, "steps": args.steps, "device": str(dev), "precision": args.precision,
        "params": n_params, "local_params": local_params,
        "mesh": {"replicate": mesh["replicate"].size(), "shard": mesh["shard"].size()},
        "train_loss": train_loss, "val_loss": val_loss, "seconds": seconds,
        "step_seconds_median": step_median,
        "comm_seconds": comm, "replica_max_abs_diff": drift, "bytes_sent_per_step": per_step,
        "mb_sent_per_step": per_step / 1e6,
        "bytes_per_param_per_step": per_step / local_params,
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
    layout = {"replicate": args.replicate, "shard": args.shard}
    train, val = load_corpus(args.corpus_bytes)
    results = []
    try:
        for name in args.strategies:
            try:
                results.append(run_strategy(name, args, train, val, layout))
            except UsageError as e:  # raised alike on every rank, before any collective
                usage_exit(PROG, str(e))
        if dist.get_rank() == 0:
            r0 = results[0] if results else {}
            print(f"\nmodel {args.model} ({r0.get('params', 0) / 1e6:.2f}M params), "
                  f"world {dist.get_world_size()}, mesh {r0.get('mesh')}, "
                  f"{args.steps} steps x {args.batch} x {gpt_config(args.model).seq_len} "
                  "tokens per rank")
            print_table(results)
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            payload = {"config": {k: str(v) if isinstance(v, torch.device) else v
                                  for k, v in vars(args).items()},
                       "world": dist.get_world_size(), "results": results}
            out.write_text(json.dumps(payload, indent=2))
            print(f"\nwrote {out}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
