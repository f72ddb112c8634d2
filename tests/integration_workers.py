"""One rank of tests/test_integrations.py: ``python integration_workers.py OUT STACK...``
under torchrun's variables (2 ranks, shard=1). For each stack named (``hf``, ``accelerate``,
``lightning``) it trains a tiny model through the framework with flexdemo's integration and
records, per optimizer step, a checksum of the gradient the optimizer saw, the bytes it sent
and a checksum of the rank's first input; ``plain`` does one step of a plain loop per model
(the bytes the replicator alone sends). Rank r writes ``OUT/rank{r}.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import flexdemo

SEQ = 16


def grad_sum(model: torch.nn.Module) -> float:
    return float(sum(p.grad.double().sum() for p in model.parameters() if p.grad is not None))


def tiny_gpt2():
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=32, n_layer=2,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def mlp_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g),
                                          torch.randint(0, 4, (64,), generator=g))


class TokenData(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.x = torch.randint(0, 256, (n, SEQ), generator=torch.Generator().manual_seed(n))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def plain(stacks: list[str]) -> dict:
    """Bytes one plain-loop step sends, per model (what the replicator alone sends)."""
    out = {}
    models = {"mlp": (mlp, lambda m: m(torch.randn(4, 16)).sum())}
    if "hf" in stacks:
        x = torch.randint(0, 256, (2, SEQ))
        models["gpt2"] = (tiny_gpt2, lambda m: m(input_ids=x, labels=x).loss)
    for name, (build, loss) in models.items():
        model, opt = flexdemo.prepare(build(), "demo", lr=1e-3, shard=1)
        loss(model).backward()
        opt.step()
        out[name] = opt.last_step_stats()["bytes_sent"]
    return out


def hf(scratch: Path) -> dict:
    import transformers

    from flexdemo.integrations.hf import FlexTrainer

    class Record(transformers.TrainerCallback):
        def __init__(self, model, opt) -> None:
            self.model, self.opt = model, opt
            self.grads: list[float] = []
            self.sent: list[int] = []
            self.lrs: list[float] = []

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.grads.append(grad_sum(self.model))

        def on_optimizer_step(self, args, state, control, **kwargs):
            self.sent.append(self.opt.last_step_stats()["bytes_sent"])
            self.lrs.append(self.opt.param_groups[0]["lr"])

    def run(out: Path, resume: Path | None = None):
        model, opt = flexdemo.prepare(tiny_gpt2(), "demo", lr=1e-3, shard=1)
        args = transformers.TrainingArguments(
            output_dir=str(out), per_device_train_batch_size=2, per_device_eval_batch_size=4,
            max_steps=4, gradient_accumulation_steps=2, max_grad_norm=1.0, warmup_steps=1,
            lr_scheduler_type="linear", eval_strategy="steps", eval_steps=2,
            save_strategy="steps", save_steps=2, logging_steps=1, report_to=[], use_cpu=True,
            disable_tqdm=True, seed=0)
        record = Record(model, opt)
        trainer = FlexTrainer(model=model, args=args, optimizers=(opt, None),
                              train_dataset=TokenData(64), eval_dataset=TokenData(16),
                              callbacks=[record])
        first = next(iter(trainer.get_train_dataloader()))["input_ids"]
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
        evals = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
        return model, record, trainer, int(first.sum()), evals

    model, record, trainer, first, evals = run(scratch / "a")
    resumed, record2, _, _, _ = run(scratch / "b", resume=scratch / "a" / "checkpoint-2")
    after = resumed.state_dict()
    bitwise = all(torch.equal(v, after[k]) for k, v in model.state_dict().items())
    return {"grads": record.grads, "sent": record.sent, "lrs": record.lrs, "first": first,
            "wrapped": type(trainer.model_wrapped).__name__, "evals": evals,
            "resumed_sent": record2.sent, "resume_bitwise": bitwise}


def accelerate() -> dict:
    from accelerate import Accelerator

    from flexdemo.integrations.accelerate import prepare

    model, opt = flexdemo.prepare(mlp(), "demo", lr=1e-3, shard=1)
    loader = torch.utils.data.DataLoader(mlp_data(), batch_size=4, shuffle=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    model, wrapped_opt, loader, sched = prepare(accelerator, model, opt, loader, sched)
    grads, sent, first = [], [], None
    for x, y in loader:
        first = float(x.sum()) if first is None else first
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                grads.append(grad_sum(model))
            wrapped_opt.step()
            sched.step()
            wrapped_opt.zero_grad()
            if accelerator.sync_gradients:
                sent.append(opt.last_step_stats()["bytes_sent"])
        if len(sent) == 3:
            break
    return {"grads": grads, "sent": sent, "first": first, "wrapped": type(model).__name__}


def lightning(scratch: Path) -> dict:
    import lightning as L

    from flexdemo.integrations.lightning import FlexStrategy

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.grads: list[float] = []
            self.sent: list[int] = []
            self.first: float | None = None

        def configure_model(self) -> None:
            self.net, self.flex_opt = flexdemo.prepare(mlp(), "demo", lr=1e-3, shard=1)

        def configure_optimizers(self):
            sched = torch.optim.lr_scheduler.LambdaLR(self.flex_opt,
                                                      lambda s: min(1.0, (s + 1) / 2))
            return {"optimizer": self.flex_opt, "lr_scheduler": sched}

        def training_step(self, batch, i):
            if self.first is None:
                self.first = float(batch[0].sum())
            return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def on_before_optimizer_step(self, optimizer) -> None:
            self.grads.append(grad_sum(self.net))

        def on_train_batch_end(self, outputs, batch, i) -> None:
            if len(self.sent) < len(self.grads):  # an optimizer step ended this batch
                self.sent.append(self.flex_opt.last_step_stats()["bytes_sent"])

    def fit(module: Module, ckpt_path: Path | None = None, **limits) -> L.Trainer:
        trainer = L.Trainer(strategy=FlexStrategy(), accelerator="cpu", devices=2,
                            accumulate_grad_batches=2, gradient_clip_val=1.0, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, **limits)
        loader = torch.utils.data.DataLoader(mlp_data(), batch_size=4, shuffle=True)
        trainer.fit(module, loader, ckpt_path=ckpt_path)
        return trainer

    module = Module()
    trainer = fit(module, max_steps=3)
    # a checkpoint at the end of epoch 0 (4 steps), resumed to the end of epoch 1: bitwise
    # the run that went through
    through, first, resumed = Module(), Module(), Module()
    fit(through, max_epochs=2)
    fit(first, max_epochs=1).save_checkpoint(scratch / "epoch1")
    fit(resumed, scratch / "epoch1", max_epochs=2)
    after = resumed.net.state_dict()
    bitwise = all(torch.equal(v, after[k]) for k, v in through.net.state_dict().items())
    return {"grads": module.grads, "sent": module.sent, "first": module.first,
            "wrapped": type(trainer.strategy.model).__name__, "resume_bitwise": bitwise,
            "resumed_steps": resumed.flex_opt.steps, "resumed_sent": resumed.sent}


def main() -> None:
    out, stacks = Path(sys.argv[1]), sys.argv[2:]
    result: dict = {"plain": plain(stacks)}
    rank = dist.get_rank()
    runs = {"hf": lambda: hf(out / "hf"), "accelerate": accelerate,
            "lightning": lambda: lightning(out / "lightning")}
    for stack in stacks:  # Lightning last: its teardown may end the process group
        result[stack] = runs[stack]()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
