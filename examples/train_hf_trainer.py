"""Train a Hugging Face causal LM with the ``transformers.Trainer``, the exchange between
replicas done by flexdemo's optimizer (no DistributedDataParallel).

    torchrun --nproc-per-node 2 examples/train_hf_trainer.py --replicate 2     # 2 replicas
    torchrun --nproc-per-node 2 examples/train_hf_trainer.py --replicate 2 --resume

Needs transformers and accelerate (``pip install "flexdemo[hf]"``). The model is a tiny GPT-2
built from a config (random weights, nothing is downloaded); the text is the Python standard
library's own sources as bytes, cut into windows: the Trainer's distributed sampler gives each
rank its own windows. ``flexdemo.integrations.hf.FlexTrainer`` is the Trainer with the model
kept out of DDP and checkpoints saved by every rank (each replica's optimizer state is its
own); the lr schedule (``--warmup`` steps of warm-up, then linear decay), gradient clipping
(``--clip``), accumulation (``--accum``), evaluation and logging are the Trainer's.
Checkpoints go to ``--out`` every ``--save-every`` steps; ``--resume`` continues from the
newest one. Rank 0 prints the Trainer's log lines and, at the end, the bytes each optimizer
step sent to the other replicas.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

import flexdemo

try:
    import transformers

    from flexdemo.integrations.hf import FlexTrainer
except ImportError as e:  # one line: what to install
    raise SystemExit(f"train_hf_trainer.py: {e}") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    p.add_argument("--batch", type=int, default=4, help="sequences per micro-batch per rank")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--hidden", type=int, default=64, help="GPT-2 width (hidden // 16 heads)")
    p.add_argument("--layers", type=int, default=2, help="GPT-2 depth")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip (0: off)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps, then linear decay")
    p.add_argument("--replicator", default="demo", help="what crosses between replicas")
    p.add_argument("--optimizer", default="sgd", help="base optimizer (sgd: DeMo's sign-SGD)")
    p.add_argument("--replicate", type=int, default=None, help="replicas (prepare()'s)")
    p.add_argument("--shard", type=int, default=None, help="ranks per replica (prepare()'s)")
    p.add_argument("--save-every", type=int, default=10, help="steps between checkpoints")
    p.add_argument("--eval-every", type=int, default=10, help="steps between evaluations")
    p.add_argument("--out", default="runs/hf_trainer", help="checkpoints and logs")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    return p.parse_args(argv)


class Windows(torch.utils.data.Dataset):
    """Consecutive ``seq``-byte windows of the standard library's sources."""

    def __init__(self, seq: int, start: int, count: int) -> None:
        files = sorted(Path(os.__file__).parent.glob("*.py"))
        data = b"".join(f.read_bytes() for f in files[:40])[start * seq:(start + count) * seq]
        self.x = torch.frombuffer(bytearray(data), dtype=torch.uint8).long().view(-1, seq)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=args.hidden,
                                     n_layer=args.layers, n_head=max(1, args.hidden // 16),
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    model, opt = flexdemo.prepare(model, args.replicator, args.optimizer, args.lr,
                                  replicate=args.replicate, shard=args.shard, device="auto")
    cpu = not torch.cuda.is_available()  # (on CPU the Trainer must be told, or it sees 1 rank)
    training = transformers.TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=args.batch, gradient_accumulation_steps=args.accum,
        max_grad_norm=args.clip, warmup_steps=args.warmup, lr_scheduler_type="linear",
        eval_strategy="steps", eval_steps=args.eval_every, save_strategy="steps",
        save_steps=args.save_every, logging_steps=max(1, args.steps // 10), report_to=[],
        disable_tqdm=True, seed=0, use_cpu=cpu, dataloader_pin_memory=not cpu)
    sent: list[int] = []

    class BytesSent(transformers.TrainerCallback):
        def on_optimizer_step(self, *_, **__) -> None:
            sent.append(opt.last_step_stats()["bytes_sent"])

    trainer = FlexTrainer(model=model, args=training, optimizers=(opt, None),
                          train_dataset=Windows(args.seq, 0, 4096),
                          eval_dataset=Windows(args.seq, 4096, 64), callbacks=[BytesSent()])
    resume = args.resume and any(Path(args.out).glob("checkpoint-*"))
    trainer.train(resume_from_checkpoint=True if resume else None)
    if dist.get_rank() == 0:
        print(f"done: {trainer.state.global_step} steps, {len(sent)} here, bytes sent per step "
              f"{sorted(set(sent))}, mesh {tuple(opt.mesh.shape)}", flush=True)


if __name__ == "__main__":
    main()
    if dist.is_initialized():
        dist.destroy_process_group()
