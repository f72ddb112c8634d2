"""Train a Hugging Face ``transformers`` causal LM through ``flexdemo.prepare()``.

    python examples/train_hf.py --model llama --steps 50                  # one process
    torchrun --nproc-per-node 4 examples/train_hf.py --replicate 2       # 2 replicas x 2 shards
    python examples/train_hf.py --model /path/to/local/model --weights   # local checkpoint

``--model`` is ``gpt2`` or ``llama`` (tiny configs built here, random weights) or a local
directory holding a ``config.json`` (nothing is downloaded): the model is built from that
config, with its weights when ``--weights`` is given. The text is the Python standard library's
own sources, as bytes (token ids 0-255, so any vocabulary of at least 256 fits).

Notes that hold for any model trained through flexdemo:

* ``--precision bf16``: bf16 parameters for forward/backward, gradients reduced in fp32 and kept
  with fp32 master weights (FSDP2 ``MixedPrecisionPolicy``); the replicators see fp32.
* ``--meta``: the model is built on the meta device and materialised shard by shard on the
  target device (``prepare(..., init_fn=...)``), so no rank ever holds the whole model.
* ``--clip``: gradient clipping acts on each replica's own gradient (after FSDP's reduction
  inside the replica, before the exchange across replicas), so it bounds what a replica feeds
  into DeMo's momentum, not the update that is finally applied (DeMo's update is a sign).
* LR schedulers: any ``torch.optim.lr_scheduler`` works on the returned optimizer (its
  ``param_groups`` are the base optimizer's); the learning rate also scales DeMo's momentum.
* ``--accum k``: gradient accumulation. There is no ``no_sync()`` under FSDP2: micro-batches
  but the last skip FSDP's reduce-scatter with ``set_requires_gradient_sync(False)``, and one
  ``step()`` exchanges across replicas once per k micro-batches.
* ``--compile``: ``model.compile()`` after ``prepare()``; the optimizer and its replicators
  run eagerly.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import flexdemo


def _transformers():
    try:
        import transformers
    except ImportError:
        sys.exit("train_hf.py needs the transformers package (pip install transformers); "
                 "flexdemo itself does not")
    return transformers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama", help="gpt2, llama, or a local model directory")
    p.add_argument("--hidden", type=int, default=64, help="width of the gpt2/llama presets")
    p.add_argument("--layers", type=int, default=2, help="depth of the gpt2/llama presets")
    p.add_argument("--weights", action="store_true",
                   help="load the weights from the local model directory")
    p.add_argument("--meta", action="store_true", help="build on the meta device first")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--replicator", default="demo")
    p.add_argument("--optimizer", default="sgd", help="base optimizer: sgd, adamw, adam")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=10, help="linear warm-up steps, then cosine")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=4, help="sequences per micro-batch per rank")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--clip", type=float, default=0.0, help="gradient-norm clip (0: off)")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--replicate", type=int, default=None)
    p.add_argument("--shard", type=int, default=None)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_config(name: str, seq: int, hidden: int = 64, layers: int = 2):
    """A GPT-2 or Llama config (byte vocabulary; tiny by default), or the config of a local
    model directory."""
    tf = _transformers()
    heads = max(1, hidden // 16) if hidden < 1024 else hidden // 128
    if name == "gpt2":
        return tf.GPT2Config(vocab_size=256, n_positions=seq, n_embd=hidden, n_layer=layers,
                             n_head=heads, bos_token_id=0, eos_token_id=0)
    if name == "llama":
        return tf.LlamaConfig(vocab_size=256, hidden_size=hidden,
                              intermediate_size=(hidden * 11 // 4 + 15) // 16 * 16,
                              num_hidden_layers=layers, num_attention_heads=heads,
                              num_key_value_heads=max(1, heads // 2),
                              max_position_embeddings=seq)
    path = Path(name)
    if not (path / "config.json").is_file():
        sys.exit(f"--model {name!r}: not 'gpt2', 'llama' or a local directory with a "
                 "config.json (nothing is downloaded)")
    return tf.AutoConfig.from_pretrained(path, local_files_only=True)


def hf_init_fn(model):
    """``init_fn`` for a meta-built HF model: its own ``_init_weights`` per module, and the
    rotary-embedding tables (computed in ``__init__``, so lost on the meta device) again."""
    def init(module):
        if hasattr(module, "inv_freq") and hasattr(module, "rope_init_fn"):
            inv_freq, scaling = module.rope_init_fn(module.config, module.inv_freq.device)
            module.inv_freq.copy_(inv_freq)
            if hasattr(module, "original_inv_freq"):
                module.original_inv_freq = module.inv_freq.clone()
            if hasattr(module, "attention_scaling"):
                module.attention_scaling = scaling
            return
        if any(True for _ in module.parameters(recurse=False)) or \
                any(True for _ in module.buffers(recurse=False)):
            model._init_weights(module)
    return init


def build_model(args):
    tf = _transformers()
    config = build_config(args.model, args.seq, args.hidden, args.layers)
    if args.weights:
        if args.meta:
            sys.exit("--weights loads a checkpoint; it cannot be combined with --meta")
        return tf.AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True), None
    torch.manual_seed(args.seed)
    if args.meta:
        with torch.device("meta"):
            model = tf.AutoModelForCausalLM.from_config(config)
        return model, hf_init_fn(model)
    return tf.AutoModelForCausalLM.from_config(config), None


def load_text(limit: int = 2_000_000) -> torch.Tensor:
    """The standard library's sources as a byte tensor (the same on every machine)."""
    root = Path(os.__file__).parent
    chunks, size = [], 0
    for f in sorted(root.glob("*.py")):
        data = f.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


def batches(text: torch.Tensor, batch: int, seq: int, rank: int, seed: int, device):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    while True:
        idx = torch.randint(0, text.numel() - seq - 1, (batch,), generator=g)
        x = torch.stack([text[i: i + seq] for i in idx.tolist()])
        yield x.to(device, non_blocking=True)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    model, init_fn = build_model(args)
    model, opt = flexdemo.prepare(
        model, args.replicator, args.optimizer, args.lr, device=args.device,
        precision=args.precision, init_fn=init_fn, replicate=args.replicate, shard=args.shard)
    rank = dist.get_rank()
    device = next(p.device for p in model.parameters())
    if args.compile:
        model.compile()
    warm, total = max(args.warmup, 1), max(args.steps, 1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, max(0, s - warm) / max(1, total - warm)))))
    data = batches(load_text(), args.batch, args.seq, rank, args.seed, device)
    sharded = hasattr(model, "set_requires_gradient_sync")
    step_losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        t0 = time.perf_counter()
        total_loss = torch.zeros((), device=device)
        for micro in range(args.accum):
            if sharded:  # reduce-scatter inside the replica only on the last micro-batch
                model.set_requires_gradient_sync(micro == args.accum - 1)
            x = next(data)
            loss = model(input_ids=x, labels=x).loss / args.accum
            loss.backward()
            total_loss += loss.detach()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad()
        sched.step()
        step_losses.append(total_loss)  # stays on the device: no synchronisation per step
        if step % args.log_every == 0 or step == args.steps - 1:
            shown = total_loss.clone()
            dist.all_reduce(shown)  # the mean over ranks, for the log
            if rank == 0:
                print(f"step {step:5d}  loss {shown.item() / dist.get_world_size():.4f}  "
                      f"lr {sched.get_last_lr()[0]:.2e}  "
                      f"sent {opt.last_step_stats()['bytes_sent']:,} B  "
                      f"{1e3 * (time.perf_counter() - t0):.0f} ms", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    all_losses = torch.stack(step_losses)
    dist.all_reduce(all_losses)
    losses = (all_losses / dist.get_world_size()).tolist()
    mesh = opt.mesh
    result = {"losses": losses, "step_ms": 1e3 * elapsed / max(args.steps, 1),
              "mesh": (mesh["replicate"].size(), mesh["shard"].size()),
              "device": str(device), "precision": args.precision,
              "params": sum(p.numel() for p in model.parameters()),
              "bytes_sent": opt.bytes_sent}
    if rank == 0:
        print(f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f}, mean step "
              f"{result['step_ms']:.0f} ms (first steps included), mesh {result['mesh']}, "
              f"{result['params']:,} params on {result['device']} ({args.precision})", flush=True)
    return result


if __name__ == "__main__":
    main()
    if dist.is_initialized():
        dist.destroy_process_group()
