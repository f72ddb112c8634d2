"""One rank of tests/test_integrations.py: ``python integration_workers.py OUT STACK...``
under torchrun's variables (2 ranks). For each stack named (``hf``, ``accelerate``,
``lightning``: 2 replicas, shard=1; ``hf_shard2``, ``accelerate_shard2``,
``lightning_shard2``: one replica sharded with FSDP2 over both ranks, a 1 x 2 mesh;
``hf_bf16``, ``accelerate_bf16``, ``lightning_bf16``: shard=1 in the framework's bf16
autocast, and for the HF Trainer once more by ``prepare(precision="bf16")``) it trains a tiny
model through the framework with flexdemo's integration and records, per optimizer step, a
checksum of the gradient the optimizer saw (this rank's shard of it when sharded), the bytes
it sent, the loss, and a checksum of the rank's first input; ``plain`` does one step of a
plain loop per model (the bytes the replicator alone sends). Rank r writes
``OUT/rank{r}.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import flexdemo

SEQ = 16


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (its shard of a DTensor)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def grad_sum(model: torch.nn.Module) -> float:
    return float(sum(local(p.grad).double().sum() for p in model.parameters()
                     if p.grad is not None))


def layout(model: torch.nn.Module) -> dict:
    """How the parameters are held: DTensors of which mesh size and placements, this rank's
    elements and the whole model's, their dtypes."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    return {"dtensor": all(isinstance(p, DTensor) for p in params),
            "mesh": sorted({p.device_mesh.size() for p in params if isinstance(p, DTensor)}),
            "placements": sorted({str(p.placements) for p in params if isinstance(p, DTensor)}),
            "local": sum(local(p).numel() for p in params),
            "full": sum(p.numel() for p in params),
            "dtypes": sorted({str(p.dtype) for p in params}),
            "fsdp": type(model).__name__}


def record_compute_dtype(model: torch.nn.Module, into: set[str]) -> None:
    """Add the dtype of the first matmul's output (a Linear, GPT-2's Conv1D) to ``into`` at
    every forward pass."""
    first = next(m for m in model.modules()
                 if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D")
    first.register_forward_hook(lambda module, args, output: into.add(str(output.dtype)))


def grad_dtypes(model: torch.nn.Module) -> set[str]:
    return {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}


def same_local(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Every parameter and buffer of ``a`` bitwise ``b``'s, on this rank (its shards)."""
    after = b.state_dict()
    return all(torch.equal(local(v), local(after[k])) for k, v in a.state_dict().items())


def same_weights(model: torch.nn.Module, checkpoint: Path) -> bool | None:
    """Collective: whether ``from_pretrained(checkpoint)`` (the Trainer's weights file, with
    the Trainer's config) holds ``model``'s whole parameters bitwise (rank 0; None
    elsewhere)."""
    import transformers

    whole = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
             for k, v in model.state_dict().items()}  # gathered from the shards by every rank
    if dist.get_rank() != 0:
        return None
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(checkpoint)).state_dict()
    return loaded.keys() == whole.keys() and all(torch.equal(v, loaded[k])
                                                 for k, v in whole.items())


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


def hf(scratch: Path, shard: int = 1, bf16: str | None = None) -> dict:
    """The Trainer at ``shard`` (2 replicas at shard=1, one at 2); ``bf16``: ``"args"``
    (``TrainingArguments(bf16=True)``: Accelerate's autocast) or ``"prepare"``
    (``prepare(precision="bf16")``: FSDP2's bf16 compute copies). Trained to step 4 with a
    checkpoint at step 2, then resumed from it to step 4 again."""
    import transformers

    from flexdemo.integrations.hf import FlexTrainer

    class Record(transformers.TrainerCallback):
        def __init__(self, model, opt) -> None:
            self.model, self.opt = model, opt
            self.grads: list[float] = []
            self.sent: list[int] = []
            self.lrs: list[float] = []
            self.grad_dtypes: set[str] = set()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.grads.append(grad_sum(self.model))
            self.grad_dtypes |= grad_dtypes(self.model)

        def on_optimizer_step(self, args, state, control, **kwargs):
            self.sent.append(self.opt.last_step_stats()["bytes_sent"])
            self.lrs.append(self.opt.param_groups[0]["lr"])

    def run(out: Path, resume: Path | None = None):
        model, opt = flexdemo.prepare(tiny_gpt2(), "demo", lr=1e-3, replicate=2 // shard,
                                      shard=shard,
                                      precision="bf16" if bf16 == "prepare" else None)
        computed: set[str] = set()  # the dtype of a matmul's output in the forward pass
        record_compute_dtype(model, computed)
        args = transformers.TrainingArguments(
            output_dir=str(out), per_device_train_batch_size=2, per_device_eval_batch_size=4,
            max_steps=4, gradient_accumulation_steps=2, max_grad_norm=1.0, warmup_steps=1,
            lr_scheduler_type="linear", eval_strategy="steps", eval_steps=2,
            save_strategy="steps", save_steps=2, logging_steps=1, report_to=[], use_cpu=True,
            disable_tqdm=True, seed=0, bf16=bf16 == "args")
        record = Record(model, opt)
        trainer = FlexTrainer(model=model, args=args, optimizers=(opt, None),
                              train_dataset=TokenData(64), eval_dataset=TokenData(16),
                              callbacks=[record])
        first = next(iter(trainer.get_train_dataloader()))["input_ids"]
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
        history = trainer.state.log_history
        return model, record, trainer, int(first.sum()), history, computed

    model, record, trainer, first, history, computed = run(scratch / "a")
    resumed, record2, _, _, _, _ = run(scratch / "b", resume=scratch / "a" / "checkpoint-2")
    weights = same_weights(model, scratch / "a" / "checkpoint-4")
    return {"grads": record.grads, "sent": record.sent, "lrs": record.lrs, "first": first,
            "wrapped": type(trainer.model_wrapped).__name__,
            "evals": [e["eval_loss"] for e in history if "eval_loss" in e],
            "losses": [e["loss"] for e in history if "loss" in e],
            "layout": layout(model), "computed": sorted(computed),
            "grad_dtypes": sorted(record.grad_dtypes), "weights_file": weights,
            "resumed_sent": record2.sent, "resume_bitwise": same_local(model, resumed)}


def accelerate(shard: int = 1, mixed_precision: str = "no") -> dict:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from flexdemo.integrations.accelerate import prepare

    model, opt = flexdemo.prepare(mlp(), "demo", lr=1e-3, replicate=2 // shard, shard=shard)
    computed: set[str] = set()  # the dtype of a matmul's output in the forward pass
    record_compute_dtype(model, computed)
    loader = torch.utils.data.DataLoader(mlp_data(), batch_size=4, shuffle=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
    # Accelerate keeps one configuration a process: let this one replace the last (as the
    # Trainer does when it builds its Accelerator)
    AcceleratorState._reset_state()
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True,
                              mixed_precision=mixed_precision)
    model, wrapped_opt, loader, sched = prepare(accelerator, model, opt, loader, sched)
    grads, sent, losses, dtypes, first = [], [], [], set(), None
    for x, y in loader:
        first = float(x.sum()) if first is None else first
        with accelerator.accumulate(model):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            losses.append(float(loss))
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                grads.append(grad_sum(model))
                dtypes |= grad_dtypes(model)
            wrapped_opt.step()
            sched.step()
            wrapped_opt.zero_grad()
            if accelerator.sync_gradients:
                sent.append(opt.last_step_stats()["bytes_sent"])
        if len(sent) == 3:
            break
    return {"grads": grads, "sent": sent, "first": first, "wrapped": type(model).__name__,
            "losses": losses, "layout": layout(model), "computed": sorted(computed),
            "grad_dtypes": sorted(dtypes)}


def lightning(scratch: Path, shard: int = 1, precision: str = "32-true") -> dict:
    import lightning as L

    from flexdemo.integrations.lightning import FlexStrategy

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.grads: list[float] = []
            self.sent: list[int] = []
            self.losses: list[float] = []
            self.computed: set[str] = set()  # the dtype of a matmul's output, forward
            self.grad_dtypes: set[str] = set()
            self.first: float | None = None

        def configure_model(self) -> None:
            self.net, self.flex_opt = flexdemo.prepare(mlp(), "demo", lr=1e-3,
                                                       replicate=2 // shard, shard=shard)
            record_compute_dtype(self.net, self.computed)

        def configure_optimizers(self):
            sched = torch.optim.lr_scheduler.LambdaLR(self.flex_opt,
                                                      lambda s: min(1.0, (s + 1) / 2))
            return {"optimizer": self.flex_opt, "lr_scheduler": sched}

        def training_step(self, batch, i):
            if self.first is None:
                self.first = float(batch[0].sum())
            loss = torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])
            self.losses.append(float(loss))
            return loss

        def on_before_optimizer_step(self, optimizer) -> None:
            self.grads.append(grad_sum(self.net))
            self.grad_dtypes |= grad_dtypes(self.net)

        def on_train_batch_end(self, outputs, batch, i) -> None:
            if len(self.sent) < len(self.grads):  # an optimizer step ended this batch
                self.sent.append(self.flex_opt.last_step_stats()["bytes_sent"])

    def fit(module: Module, ckpt_path: Path | None = None, **limits) -> L.Trainer:
        trainer = L.Trainer(strategy=FlexStrategy(), accelerator="cpu", devices=2,
                            accumulate_grad_batches=2, gradient_clip_val=1.0, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, precision=precision, **limits)
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
    return {"grads": module.grads, "sent": module.sent, "first": module.first,
            "wrapped": type(trainer.strategy.model).__name__, "losses": module.losses,
            "layout": layout(module.net), "computed": sorted(module.computed),
            "grad_dtypes": sorted(module.grad_dtypes),
            "resume_bitwise": same_local(through.net, resumed.net),
            "resumed_steps": resumed.flex_opt.steps, "resumed_sent": resumed.sent}


def main() -> None:
    out, stacks = Path(sys.argv[1]), sys.argv[2:]
    result: dict = {"plain": plain(stacks)}
    rank = dist.get_rank()
    runs = {"hf": lambda: hf(out / "hf"), "hf_shard2": lambda: hf(out / "hf_shard2", shard=2),
            "hf_bf16": lambda: {how: hf(out / f"hf_bf16_{how}", bf16=how)
                                for how in ("args", "prepare")},
            "accelerate": accelerate, "accelerate_shard2": lambda: accelerate(shard=2),
            "accelerate_bf16": lambda: accelerate(mixed_precision="bf16"),
            "lightning": lambda: lightning(out / "lightning"),
            "lightning_shard2": lambda: lightning(out / "lightning_shard2", shard=2),
            "lightning_bf16": lambda: lightning(out / "lightning_bf16",
                                                precision="bf16-mixed")}
    for stack in stacks:  # Lightning last: its teardown may end the process group
        result[stack] = runs[stack]()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
