"""Lightning without DistributedDataParallel (``pip install "flexdemo[lightning]"``).

Lightning's ``"ddp"`` strategies wrap the model in DDP, which all-reduces every gradient in
full before the optimizer's step. :class:`FlexStrategy` is Lightning's
``ModelParallelStrategy`` (which applies no parallelism of its own: the model is prepared in
``LightningModule.configure_model()``) with the data split as DDP splits it: a
``DistributedSampler`` over all ranks, so that every replica, and every rank inside a
sharded replica, reads its own part of the data. (``ModelParallelStrategy``'s defaults split
the data over nodes only: on one node every rank got the same batches.)::

    class Module(L.LightningModule):
        def configure_model(self):
            self.net, self.flex_opt = flexdemo.prepare(build_net(), "demo", lr=1e-3)
        def configure_optimizers(self):
            return self.flex_opt
        ...

    L.Trainer(strategy=FlexStrategy(), accelerator="cpu", devices=2, ...).fit(Module(), loader)

Gradient clipping (``gradient_clip_val``), accumulation (``accumulate_grad_batches``; one
exchange per optimizer step) and lr schedulers are Lightning's. Checkpoints
(``trainer.save_checkpoint``, ``ModelCheckpoint``, ``fit(ckpt_path=...)``): each is a folder
holding :func:`flexdemo.save_checkpoint`'s of the prepared model and its optimizer (every rank
its own state) and ``meta.pt``, Lightning's own state (loops, schedulers, callbacks) from rank
0; resumed at an epoch boundary, a run goes on bitwise (docs/integrations.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..checkpoint import load_checkpoint, save_checkpoint
from . import check_lockstep, require

require("lightning", "lightning", "lightning")

from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402  # after the check

CHECKPOINT_DIR = "flexdemo"  # inside Lightning's checkpoint folder
META_FILE = "meta.pt"  # Lightning's own state (loops, schedulers, callbacks), from rank 0


class FlexStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` with each rank its own ``DistributedSampler`` shard, and no
    DDP; checkpoints of the prepared model and its optimizer by every rank.
    ``process_group_backend`` and ``timeout`` are ``ModelParallelStrategy``'s. Its
    ``device_mesh`` (nodes x ranks per node) is Lightning's and unused: flexdemo's mesh is
    ``opt.mesh``."""

    def __init__(self, *, process_group_backend: str | None = None,
                 timeout: Any = None) -> None:
        extra = {} if timeout is None else {"timeout": timeout}
        super().__init__(data_parallel_size="auto", tensor_parallel_size="auto",
                         process_group_backend=process_group_backend, **extra)

    def setup_optimizers(self, trainer: Any) -> None:
        """Lightning's, then a DiLoCo pace that is not lockstep refused, before the first
        step (:func:`flexdemo.integrations.check_lockstep`)."""
        super().setup_optimizers(trainer)
        for opt in self.optimizers:
            check_lockstep(opt, "FlexStrategy")

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """One part of the data per rank, as under DDP."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # ---------------------------------------------------------------- checkpoints per rank
    def _prepared(self) -> tuple[nn.Module, Any]:
        """The module ``flexdemo.prepare()`` returned inside the LightningModule, and its
        optimizer (the one configured that replicates)."""
        assert self.lightning_module is not None
        models = [m for m in self.lightning_module.modules()
                  if getattr(m, "_flexdemo_prepared", False)]
        opts = [o for o in self.optimizers if hasattr(o, "last_step_stats")]
        if len(models) != 1 or len(opts) != 1:
            raise ValueError(f"FlexStrategy checkpoints one model from flexdemo.prepare() and "
                             f"its optimizer; the LightningModule holds {len(models)} such "
                             f"models and configures {len(opts)} such optimizers")
        return models[0], opts[0]

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # saved by save_checkpoint, every rank its own

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # saved by save_checkpoint, every rank its own

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        """Collective: the prepared model and its optimizer by every rank
        (:func:`flexdemo.save_checkpoint`), Lightning's own state by rank 0."""
        if storage_options is not None:
            raise TypeError("FlexStrategy.save_checkpoint takes no storage_options")
        path = Path(self.broadcast(str(filepath)))
        model, opt = self._prepared()
        if self.global_rank == 0:
            path.mkdir(parents=True, exist_ok=True)
        self.barrier()
        save_checkpoint(path / CHECKPOINT_DIR, model, opt, step=int(checkpoint["global_step"]))
        if self.global_rank == 0:
            meta = {k: v for k, v in checkpoint.items()
                    if k not in ("state_dict", "optimizer_states")}
            torch.save(meta, path / META_FILE)
        self.barrier()

    def load_checkpoint(self, checkpoint_path: Any,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Collective: the prepared model and its optimizer back (every rank its own), and
        Lightning's own state for the Trainer to restore."""
        path = Path(self.broadcast(str(checkpoint_path)))
        if not (path / CHECKPOINT_DIR).is_dir():
            raise ValueError(f"{path} holds no {CHECKPOINT_DIR}/ folder: it was not written by "
                             "FlexStrategy")
        model, opt = self._prepared()
        load_checkpoint(path / CHECKPOINT_DIR, model, opt)
        return torch.load(path / META_FILE, weights_only=False)  # Lightning's: loops, callbacks


__all__ = ["FlexStrategy"]
