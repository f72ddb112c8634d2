"""Training configuration: sections ``task``, ``strategy``, ``mesh``, ``train``,
``fault_tolerance`` and ``resume``.

A config is a TOML file (or YAML, with pyyaml installed, or JSON)::

    resume = false                 # true: continue from the newest intact checkpoint

    [task]
    name = "gpt"                   # gpt | vit | t5
    model = "mini"                 # the task's size preset

    [strategy]
    replicator = "demo"            # demo | full | none | random | striding | slicing | diloco
    optimizer = "sgd"              # sgd (sign-SGD with demo) | adamw | adam | lion | muon
    lr = 3e-3

    [strategy.replicator_kwargs]
    topk = 32

    [mesh]
    replicate = 2                  # omitted or "auto": from the world size
    shard = 2                      # omitted or "auto": ranks per node

    [train]
    steps = 200
    device = "auto"                # auto (CUDA when available) | cpu | cuda
    precision = "fp32"             # fp32 | bf16 (mixed precision, fp32 master weights)

Every key has a default (:class:`Config`); overrides ``section.key=value`` (the value in TOML
syntax, bare words are strings) replace single keys. An override that switches
``strategy.replicator`` (or ``strategy.optimizer``) to another one also drops the file's
``replicator_kwargs`` (``optimizer_kwargs``), which belong to the old one, unless the overrides
set them too. :func:`~flexdemo.app.config.files.load_config` checks names, types
and ranges and raises :class:`ConfigError` with a one-line message that names the key and, for
a misspelt key, the closest valid one.

Each task owns its ``[task]`` keys: a :class:`~flexdemo.app.tasks.TaskConfig` subclass in the
task's module, named in its :data:`~flexdemo.app.tasks.TASKS` entry.

This module holds the sections (dataclasses with the defaults); reading, overrides and
writing are in :mod:`~flexdemo.app.config.files`, the checks in
:mod:`~flexdemo.app.config.checks`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ...ft.config import FaultToleranceSettings
from ...optim import BASE_OPTIMIZERS
from ...replicate import REPLICATORS
from ..device import DEVICES, PRECISIONS
from ..schedule import SCHEDULES
from ..tasks import TASKS, GPTTaskConfig, TaskConfig

__all__ = ["Config", "ConfigError", "FaultToleranceConfig", "MeshConfig", "StrategyConfig",
           "TrainConfig", "choices"]


class ConfigError(ValueError):
    """An invalid configuration; the message is one line meant for the user."""


@dataclass
class StrategyConfig:
    """How replicas stay in sync: replicator, base optimizer and their settings."""

    replicator: str = "demo"
    replicator_kwargs: dict = field(default_factory=dict)
    optimizer: str = "sgd"
    optimizer_kwargs: dict = field(default_factory=dict)
    lr: float = 3e-3
    weight_decay: float = 0.0
    nonfinite: str = "raise"
    """``raise`` stops on a NaN/Inf gradient; ``skip`` skips such steps on every replica."""


@dataclass
class MeshConfig:
    """The ``(replicate, shard)`` layout of the ranks; ``None`` (omitted, or ``"auto"``)
    derives a size from the world size and the ranks per node."""

    replicate: int | None = None
    shard: int | None = None


@dataclass
class TrainConfig:
    """The training loop: length, batch, schedule, evaluation, checkpoints and outputs."""

    steps: int = 100
    batch: int = 8
    """Examples per rank per step; at most each rank's share of the training items (refused
    at start-up otherwise)."""
    warmup: int = 10
    """Steps of linear learning-rate warm-up; one longer than the run is cut to ``steps``
    (with a note when the config set it)."""
    schedule: str = "cosine"
    """``cosine`` (decays to ``min_lr`` x lr at the last step) or ``constant``."""
    min_lr: float = 0.1
    """Final learning rate of the cosine schedule, as a fraction of ``strategy.lr``."""
    eval_every: int = 50
    """Evaluate every N steps (0: only after the last step)."""
    eval_batches: int = 4
    """Validation batches per rank per evaluation (vit: 0 means the whole split)."""
    checkpoint_every: int = 0
    """Save a checkpoint every N steps and after the last one (0: never)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep (0: all)."""
    stop_at: int = 0
    """Stop after this step (with a checkpoint, if enabled) although ``steps`` is larger, for
    time-sliced jobs; 0: run to the end. The schedule still follows ``steps``."""
    log_every: int = 10
    """Progress line every N steps when no progress bar is shown."""
    seed: int = 0
    out: str = "runs/train"
    overwrite: bool = False
    """Start afresh: a fresh run deletes the checkpoints of an earlier run in ``out`` (those
    set aside as damaged too), and a resume that finds no intact checkpoint although the run
    got further (checkpoints set aside as damaged, steps in ``metrics.jsonl``) starts at step 0
    instead of refusing (exit code 2)."""
    max_skipped: float = 0.25
    """With ``strategy.nonfinite = "skip"``: stop (one line, exit code 1) once more than this
    fraction of ``steps`` was skipped for NaN/Inf gradients, instead of finishing as if the
    run trained; 1 never stops."""
    resume_fallback: bool = True
    """On resume, a damaged checkpoint (files that do not match their recorded digests, no
    ``COMPLETE`` marker, an unreadable ``flexdemo.json``) is set aside (renamed
    ``<name>.damaged``) and the newest intact one is used, with one line saying so; ``false``:
    refuse to start instead (exit code 2). Files this user may not read are no damage: always
    refused, nothing renamed."""
    threads: int = 0
    """torch threads per rank (0: torch's default, which follows OMP_NUM_THREADS; torchrun and
    flexdemo cluster set that to 1)."""
    timeout: float = 0.0
    """Seconds a collective may wait for a peer before the run stops (0: FLEXDEMO_TIMEOUT if
    set, else the library's default, :data:`flexdemo.mesh.DEFAULT_TIMEOUT_SECONDS`)."""
    batches: str = "equal"
    """``equal``: ``batch`` on every rank; ``balanced``: each replica's batch sized to its
    speed, measured over the first steps (``batch`` x replicas in all), for exchanges at every
    step weighted by tokens (:mod:`flexdemo.app.train.speeds`)."""
    pace_budget: str = "steps"
    """A run with a pace (``strategy.replicator_kwargs.pace``): ``steps``: it lasts
    ``ceil(steps / H)`` syncs (the fastest replica runs ``steps``); ``tokens``: it lasts until
    the replicas together have taken ``steps`` x replicas steps, the data of a synchronous run
    of ``steps`` (:mod:`flexdemo.app.train.speeds`)."""
    slowdown: float = 1.0
    """For benchmarks: the ranks of ``slow_ranks`` make each step last this many times its
    measured compute time (sleeping the difference after the step): an emulated slower GPU
    (:mod:`flexdemo.app.train.speeds`). 1: off."""
    slow_ranks: list[int] = field(default_factory=list)
    """The ranks ``slowdown`` slows (global ranks); empty: every rank."""
    tensorboard: bool = True
    progress: bool = True
    device: str = "auto"
    """``auto`` (CUDA when available, else CPU), ``cpu`` or ``cuda`` (each rank on
    ``cuda:LOCAL_RANK``, NCCL between ranks; gloo on the CPU)."""
    precision: str = "fp32"
    """``fp32``, or ``bf16``: bf16 parameters for forward and backward, gradients reduced and
    kept in fp32 next to fp32 master weights (FSDP2 mixed precision; the replicators see
    fp32)."""

    @property
    def warmup_steps(self) -> int:
        """The warm-up as run: ``warmup``, at most ``steps`` (the config's one clamp; applied
        by :func:`~flexdemo.app.config.checks.resolve`, read by the trainer)."""
        return min(self.warmup, max(self.steps, 0))


@dataclass
class FaultToleranceConfig(FaultToleranceSettings):
    """Elastic replication on torchft (docs/elastic.md): the library's own settings,
    :class:`flexdemo.ft.config.FaultToleranceSettings` (so the keys, their types and defaults
    are :class:`flexdemo.FaultTolerance`'s), plus ``enabled``. An omitted key is unset
    (``None``): the library's default, or the environment variable it names, filled in by
    :func:`~flexdemo.app.config.checks.resolve`. Built into a
    :class:`flexdemo.FaultTolerance` by :func:`~flexdemo.app.config.checks.fault_tolerance`,
    only there."""

    enabled: bool = False
    """``true``: pass these settings to :func:`flexdemo.prepare` as ``fault_tolerance``
    (needs torchft: ``pip install "flexdemo[ft]"``)."""

    def __post_init__(self) -> None:
        # as before the keys were the library's: "" or 0 for a key whose default is unset
        # (None) means unset, as omitting it does
        for f in fields(FaultToleranceSettings):
            value = getattr(self, f.name)
            if f.default is None and not isinstance(value, bool) and value in ("", 0):
                setattr(self, f.name, None)


@dataclass
class Config:
    """A whole training configuration."""

    task: TaskConfig = field(default_factory=GPTTaskConfig)
    """The task's own section (:attr:`flexdemo.app.tasks.TaskSpec.config`), picked by its
    ``name``."""
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    resume: bool | str = False
    """``true``: continue from the newest intact checkpoint in ``train.out`` (step 0 if the run
    has none yet; refused if it got further, unless ``train.overwrite``); a path: that
    checkpoint (or the newest one under that folder)."""


BATCHES = ("equal", "balanced")
PACE_BUDGETS = ("steps", "tokens")
"""``train.pace_budget``: a paced run's length, the fastest replica's steps or the job's tokens."""
"""``train.batches``: every rank at ``train.batch``, or each replica's batch sized to its speed."""

SECTIONS: dict[str, type] = {"task": TaskConfig, "strategy": StrategyConfig,
                             "mesh": MeshConfig, "train": TrainConfig,
                             "fault_tolerance": FaultToleranceConfig}
TOP_LEVEL = ("resume",)
def choices() -> dict[str, tuple[str, ...]]:
    """The valid values of the keys with a fixed set of them, read from the registries (tasks,
    base optimizers, schedules) when asked, so that an entry added there is valid here."""
    return {"task.name": tuple(TASKS), "strategy.optimizer": tuple(BASE_OPTIMIZERS),
            "strategy.replicator": tuple(sorted(REPLICATORS)),
            "strategy.nonfinite": ("raise", "skip"), "train.schedule": SCHEDULES,
            "train.batches": BATCHES, "train.pace_budget": PACE_BUDGETS,
            "train.device": DEVICES, "train.precision": PRECISIONS}
