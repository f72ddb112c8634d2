"""Train a Hugging Face ``transformers`` causal LM through ``flexdemo.prepare()``.

    python examples/train_hf.py --model llama --steps 50                  # one process
    torchrun --nproc-per-node 4 examples/train_hf.py --replicate 2       # 2 replicas x 2 shards
    python examples/train_hf.py --model /path/to/local/model --weights   # local checkpoint

``--model`` is ``gpt2`` or ``llama`` (tiny configs built here, random weights) or a local
directory holding a ``config.json`` (nothing is downloaded): the model is built from that
config, with its weights when ``--weights`` is given. The text is the Python standard library's
own sources, as bytes (token ids 0-255, so any vocabulary of at least 256 fits).

Needs torch, flexdemo and ``transformers`` (``pip install transformers``; without it the
arguments are still checked, then it says what to install). ``--replicator`` takes a name of
:data:`flexdemo.REPLICATORS` (default ``demo``), ``--optimizer`` one of
:data:`flexdemo.BASE_OPTIMIZERS` (default ``sgd``: DeMo's sign-SGD); ``--lr`` is the peak of a
linear warm-up over ``--warmup`` steps and a cosine decay; ``--replicate``/``--shard`` set the
mesh as in ``prepare()`` and ``--device auto|cpu|cuda`` where each rank trains (``--help``
lists every option). Bad arguments end in one line from rank 0 and exit code 2.

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
  but the last skip FSDP's reduce-scatter with ``set_requires_gradient_sync(False)`` (at
  ``--shard 1`` the unsharded model has the method too, a no-op), and one ``step()``
  exchanges across replicas once per k micro-batches.
* ``--compile``: ``model.compile()`` after ``prepare()``; the optimizer and its replicators
  run eagerly.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

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


PROG = Path(__file__).name
PRESET_MODELS = ("gpt2", "llama")


def usage_exit(message: str) -> NoReturn:
    """``train_hf.py: error: message`` from rank 0 only, exit code 2 on every rank. The other
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


def preset_heads(hidden: int) -> tuple[int, int]:
    """Attention heads and key-value heads of the gpt2/llama presets of width ``hidden``."""
    heads = max(1, hidden // 16) if hidden < 1024 else hidden // 128
    return heads, max(1, heads // 2)


def preset_width_ok(model: str, hidden: int) -> bool:
    """Whether the ``model`` preset can be built ``hidden`` wide: the heads divide the width,
    and for llama the key-value heads divide the heads and a head's width is even (rotary)."""
    heads, kv = preset_heads(hidden)
    if hidden % heads:
        return False
    return model != "llama" or (heads % kv == 0 and hidden // heads % 2 == 0)


def check_model(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--model`` and the options that depend on it, before transformers is imported."""
    if args.model in PRESET_MODELS:
        if args.weights:
            p.error(f"argument --weights: --model {args.model} is built here with random "
                    "weights; --weights needs --model DIR, a local model directory")
        if not preset_width_ok(args.model, args.hidden):
            near = [h for h in range(max(1, args.hidden - 256), args.hidden + 257)
                    if h % (16 if h < 1024 else 128) == 0 and preset_width_ok(args.model, h)]
            below = [h for h in near if h < args.hidden][-1:]
            above = [h for h in near if h > args.hidden][:1]
            heads, kv = preset_heads(args.hidden)
            shape = (f"{heads} heads, {kv} key-value heads, an even head width"
                     if args.model == "llama" else f"{heads} heads of equal width")
            p.error(f"argument --hidden: {args.hidden} does not fit the {args.model} preset "
                    f"({shape}); use e.g. {' or '.join(map(str, below + above))}")
        return
    path = Path(args.model)
    config = path / "config.json"
    if not config.is_file():
        p.error(f"argument --model: {args.model!r} is neither {' nor '.join(PRESET_MODELS)} "
                "nor a local directory with a config.json (nothing is downloaded)")
    try:
        settings = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        p.error(f"argument --model: cannot read {str(config)!r}: {' '.join(str(e).split())}")
    if not isinstance(settings, dict):
        p.error(f"argument --model: {str(config)!r} does not hold a JSON object")
    vocab = settings.get("vocab_size")
    if isinstance(vocab, int) and vocab < 256:
        p.error(f"argument --model: vocab_size {vocab} in {str(config)!r} is below 256; the "
                "text is bytes 0-255, so the vocabulary needs at least 256 entries")
    for key in ("max_position_embeddings", "n_positions"):
        limit = settings.get(key)
        if isinstance(limit, int) and args.seq > limit:
            p.error(f"argument --seq: {args.seq} exceeds the model's {key}={limit} "
                    f"({str(config)!r}); use --seq {limit} or less")
    if args.weights:
        if args.meta:
            p.error("argument --meta: not allowed with --weights (a checkpoint is loaded, not "
                    "initialised); drop one of them")
        if not any(any(path.glob(pattern)) for pattern in ("*.safetensors", "*.bin",
                                                            "*.index.json")):
            p.error(f"argument --weights: {args.model!r} holds no weights (*.safetensors, "
                    "*.bin); drop --weights to train from random weights")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; bad ones exit with one line and code 2 (before transformers is
    imported or anything trains)."""
    p = Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama",
                   help="gpt2, llama (tiny presets, random weights) or a local model directory "
                        "with a config.json (default %(default)s)")
    p.add_argument("--hidden", type=number(int, 1), default=64,
                   help="width of the gpt2/llama presets, hidden // 16 heads (hidden // 128 "
                        "from 1024 on): multiples of 32 fit, from 1024 on multiples of 256 "
                        "(default %(default)s)")
    p.add_argument("--layers", type=number(int, 1), default=2,
                   help="depth of the gpt2/llama presets, >= 1 (default %(default)s)")
    p.add_argument("--weights", action="store_true",
                   help="load the weights from the local model directory")
    p.add_argument("--meta", action="store_true", help="build on the meta device first")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto (CUDA when available), cpu or cuda (cuda:LOCAL_RANK per rank)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                   help="bf16: bf16 compute with fp32 gradients and master weights")
    replicators = sorted(flexdemo.REPLICATORS)  # names prepare() takes
    p.add_argument("--replicator", default="demo", type=str.lower, choices=replicators,
                   metavar="NAME", help="what crosses between replicas: "
                   + ", ".join(replicators) + " (default %(default)s)")
    p.add_argument("--optimizer", default="sgd", type=str.lower,
                   choices=tuple(flexdemo.BASE_OPTIMIZERS),
                   help="base optimizer (default %(default)s)")
    p.add_argument("--lr", type=number(float, 0, above=True), default=3e-3,
                   help="peak learning rate, > 0 (default %(default)s)")
    p.add_argument("--warmup", type=number(int, 0), default=10,
                   help="linear warm-up as a NUMBER OF STEPS, >= 0 (default %(default)s), then "
                        "cosine decay; not a fraction, unlike train_gpt.py's --warmup")
    p.add_argument("--steps", type=number(int, 1), default=50,
                   help="optimizer steps, >= 1 (default %(default)s)")
    p.add_argument("--batch", type=number(int, 1), default=4,
                   help="sequences per micro-batch per rank, >= 1 (default %(default)s)")
    p.add_argument("--seq", type=number(int, 2, 1_000_000), default=128,
                   help="tokens per sequence, 2 to 1000000 (default %(default)s)")
    p.add_argument("--accum", type=number(int, 1), default=1,
                   help="micro-batches per optimizer step, >= 1 (default %(default)s)")
    p.add_argument("--clip", type=number(float, 0), default=0.0,
                   help="gradient-norm clip, >= 0 (default 0: off)")
    p.add_argument("--compile", action="store_true", help="model.compile() after prepare()")
    p.add_argument("--replicate", type=number(int, 1), default=None,
                   help="replicas, >= 1 (default: the number of nodes); replicate x shard = "
                        "the ranks launched")
    p.add_argument("--shard", type=number(int, 1), default=None,
                   help="ranks per replica, >= 1 (default: the ranks per node)")
    p.add_argument("--log-every", type=number(int, 1), default=10,
                   help="steps between progress lines, >= 1 (default %(default)s)")
    p.add_argument("--seed", type=number(int, 0, 2**32 - 1), default=0,
                   help="random seed, 0 to 2**32 - 1 (default %(default)s)")
    args = p.parse_args(argv)
    check_model(p, args)
    try:
        flexdemo.mesh_shape(int(os.environ.get("WORLD_SIZE", "1")), args.replicate,
                            args.shard)
    except ValueError as e:
        p.error(f"argument --replicate/--shard: {e}; launch replicate x shard ranks "
                "(torchrun --nproc-per-node N) or change --replicate/--shard")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("argument --device: CUDA is not available here; use --device cpu (or auto)")
    return args


def build_config(name: str, seq: int, hidden: int = 64, layers: int = 2):
    """A GPT-2 or Llama config (byte vocabulary; tiny by default), or the config of a local
    model directory."""
    tf = _transformers()
    heads, kv_heads = preset_heads(hidden)
    if name == "gpt2":
        return tf.GPT2Config(vocab_size=256, n_positions=seq, n_embd=hidden, n_layer=layers,
                             n_head=heads, bos_token_id=0, eos_token_id=0)
    if name == "llama":
        return tf.LlamaConfig(vocab_size=256, hidden_size=hidden,
                              intermediate_size=(hidden * 11 // 4 + 15) // 16 * 16,
                              num_hidden_layers=layers, num_attention_heads=heads,
                              num_key_value_heads=kv_heads,
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
    if args.weights:  # parse_args: a local directory, not with --meta
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
    try:
        model, opt = flexdemo.prepare(
            model, args.replicator, args.optimizer, args.lr, device=args.device,
            precision=args.precision, init_fn=init_fn, replicate=args.replicate,
            shard=args.shard)
    except ValueError as e:  # settings only the started process group can check
        if dist.is_initialized():
            dist.destroy_process_group()
        usage_exit(" ".join(str(e).split()))
    rank = dist.get_rank()
    device = next(p.device for p in model.parameters())
    if args.compile:
        model.compile()
    warm, total = max(args.warmup, 1), max(args.steps, 1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, max(0, s - warm) / max(1, total - warm)))))
    data = batches(load_text(), args.batch, args.seq, rank, args.seed, device)
    step_losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        t0 = time.perf_counter()
        total_loss = torch.zeros((), device=device)
        for micro in range(args.accum):
            # reduce-scatter inside the replica only on the last micro-batch (any shard)
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
