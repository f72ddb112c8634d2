"""``prepare()``: hybrid sharding (FSDP2 inside a node) plus a replicating optimizer.

Large models: build the model on the meta device (``with torch.device("meta"): ...``) and give
``prepare()`` the device to train on. The model is sharded while it holds no memory, then each
rank allocates only its shards (``to_empty``) and initialises them (every module's
``reset_parameters()``, or ``init_fn(module)``). Replicas then receive the shards of the first
replica (one broadcast over the replicate dimension), so they start bitwise identical whatever
random-number state each rank had: a seed would have to be equal on every rank *and* draw the
same numbers for differently laid out shards, which a broadcast does not need to assume.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .buffers import BUFFER_POLICIES
from .decay import NoDecay, no_decay_names
from .dtensor import local_tensor
from .mesh import DEFAULT_TIMEOUT, build_mesh, check_mesh, init_distributed
from .muon import with_model_rule
from .optim import DeToNATION
from .replicate import NoReplication, Replicator, make_replicator

if TYPE_CHECKING:
    from types import FrameType

    from .ft.optimizer import ElasticOptimizer

__all__ = ["NoReplicationWarning", "broadcast_module", "broadcast_tensors",
           "default_shard_units", "prepare"]

PRECISIONS = ("fp32", "bf16")


class NoReplicationWarning(UserWarning):
    """The mesh has a single replica: the replicator has nothing to exchange."""


def default_shard_units(model: nn.Module) -> list[nn.Module]:
    """Modules sharded as their own FSDP unit: the members of every ``nn.ModuleList`` that do
    not sit inside another such member (a block's own list of layers stays in the block)."""
    units = [m for mod in model.modules() if isinstance(mod, nn.ModuleList) for m in mod]
    nested = {id(d) for u in units for d in u.modules() if d is not u}
    return [u for u in units if id(u) not in nested]


@torch.no_grad()
def broadcast_tensors(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None,
                      src: int = 0) -> None:
    """Overwrite ``tensors`` with those of rank ``src`` of ``group`` (default: the world).

    All tensors travel as the bytes of one buffer: one collective, whatever their number and
    dtypes. DTensors contribute their local shard.
    """
    group = group or dist.group.WORLD
    if dist.get_world_size(group) == 1:
        return
    assert group is not None  # the default group exists: torch.distributed is initialised
    locals_ = [local_tensor(t) for t in tensors if t.numel()]
    if not locals_:
        return
    sizes = [t.numel() * t.element_size() for t in locals_]
    offsets, off = [], 0
    for n in sizes:
        offsets.append(off)
        off += -(-n // 8) * 8  # 8-byte aligned, so every slice can be viewed as its dtype
    buf = torch.zeros(off, dtype=torch.uint8, device=locals_[0].device)
    for t, o, n in zip(locals_, offsets, sizes):
        buf[o:o + n].copy_(t.detach().reshape(-1).view(torch.uint8))
    dist.broadcast(buf, src=dist.get_global_rank(group, src), group=group)
    for t, o, n in zip(locals_, offsets, sizes):
        t.copy_(buf[o:o + n].view(t.dtype).view(t.shape))


def broadcast_module(model: nn.Module, src: int = 0,
                     group: dist.ProcessGroup | None = None) -> None:
    """Copy rank ``src``'s parameters and buffers to every rank of ``group`` (one collective)."""
    broadcast_tensors(list(model.parameters()) + list(model.buffers()), group, src)


# ---------------------------------------------------------------------------- checks
def _check_replicators(replicator) -> None:
    items = replicator if isinstance(replicator, (list, tuple)) else [replicator]
    bad = [r for r in items if not isinstance(r, (str, Replicator))]
    if bad or not items:
        what = type(bad[0]).__name__ if bad else "an empty list"
        raise TypeError(f"replicator must be a name (e.g. 'demo'), a Replicator instance or a "
                        f"list of them, got {what}: {bad[0] if bad else replicator!r}")


def _loaded_fsdp():
    """``torch.distributed.fsdp`` if it is loaded, else None. No module is wrapped in FSDP or
    sharded with ``fully_shard`` before it is; prepare() imports it only to shard, since it
    brings DTensor and sympy (about a second of CPU in each process)."""
    return sys.modules.get("torch.distributed.fsdp")


def _wrapper(model: nn.Module) -> str | None:
    """The name of a data-parallel wrapper (DDP, FSDP1, DataParallel) in ``model``, if any."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    fsdp = _loaded_fsdp()
    kinds: tuple[type, ...] = (DistributedDataParallel, DataParallel)
    if fsdp is not None:
        kinds += (fsdp.FullyShardedDataParallel,)
    for m in model.modules():
        if isinstance(m, kinds):
            return type(m).__name__
    return None


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare() takes an nn.Module, got {type(model).__name__}")
    if getattr(model, "_flexdemo_prepared", False):
        raise ValueError("this model was already passed to flexdemo.prepare(); call prepare() "
                         "once per model and keep the optimizer it returned")
    wrapped = _wrapper(model)
    if wrapped is not None:
        raise ValueError(f"the model is wrapped in {wrapped}, which synchronises gradients "
                         "itself (every gradient crosses the link in full, on top of the "
                         "replicator); pass the unwrapped model (model.module) to prepare()")
    fsdp = _loaded_fsdp()
    if fsdp is not None and any(isinstance(m, fsdp.FSDPModule) for m in model.modules()):
        raise ValueError("the model is already sharded with fully_shard; give prepare() the "
                         "unsharded model, or build flexdemo.DeToNATION over your sharded model")
    params = list(model.named_parameters())
    if not params:
        raise ValueError("the model has no parameters")
    cplx = [n for n, p in params if p.is_complex()]
    if cplx:
        raise ValueError(f"complex parameters are not supported ({cplx[0]}"
                         f"{f' and {len(cplx) - 1} more' if len(cplx) > 1 else ''}); store "
                         "them as real tensors (torch.view_as_real) and view them as complex "
                         "in forward")


def _syncs_gradients(ddp: nn.Module, model: nn.Module) -> bool:
    """Whether DistributedDataParallel ``ddp`` all-reduces gradients of ``model``'s
    parameters (those it was told to ignore it leaves alone)."""
    inner = getattr(ddp, "module", None)
    if not isinstance(inner, nn.Module):
        return False
    ignored = getattr(ddp, "parameters_to_ignore", ())
    synced = {id(p) for n, p in inner.named_parameters() if n not in ignored and p.requires_grad}
    return any(id(p) in synced for p in model.parameters())


def _refuse_data_parallel(module: nn.Module, args: Any) -> None:
    """A forward pre-hook of every prepared model: refuse to run inside
    DistributedDataParallel (a framework's wrap after prepare(), of the model or of a module
    holding it), which would all-reduce every gradient in full before the optimizer's step.
    A walk up the Python stack for DDP's ``forward`` (microseconds); nothing while compiled.
    A module-level function, so that a pickled model keeps its hooks."""
    if torch.compiler.is_compiling():
        return
    from torch.nn.parallel import DistributedDataParallel

    code = DistributedDataParallel.forward.__code__
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            ddp = frame.f_locals.get("self")
            if isinstance(ddp, DistributedDataParallel) and _syncs_gradients(ddp, module):
                raise RuntimeError(
                    f"the model prepared by flexdemo.prepare() runs inside {type(ddp).__name__}, "
                    "which all-reduces every gradient in full before the optimizer's step (on "
                    "top of the replicator's exchange); train the model prepare() returned "
                    "without wrapping it, and keep frameworks from wrapping it (Hugging Face "
                    "Trainer, Accelerate, Lightning's 'ddp' strategies do; "
                    "flexdemo.integrations has a way for each: docs/integrations.md)")
        frame = frame.f_back


def _no_reduction_to_skip(requires_gradient_sync: bool, *, recurse: bool = True) -> None:
    """``set_requires_gradient_sync`` of a model that prepare() left unsharded (shard=1), as
    FSDP2's modules have it: gradient accumulation's switch works at any shard. Here there is
    no reduction inside a replica to skip: the gradients of several backward passes add up
    in ``.grad`` either way, and the replicators exchange at ``opt.step()``."""
    if not isinstance(requires_gradient_sync, bool):
        raise TypeError(f"set_requires_gradient_sync takes True or False, got "
                        f"{requires_gradient_sync!r}")


def _model_device(model: nn.Module) -> torch.device:
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise ValueError(f"the model's parameters live on several devices {devices}; move it "
                         "to one device (or build it on 'meta') before prepare()")
    return devices.pop()


def target_device(current: torch.device, device) -> torch.device:
    """The device to train on: ``device`` ('auto', 'cpu', 'cuda', 'cuda:1', ...) or, when
    None, the model's own device (CUDA if available for a model on 'meta')."""
    if device is None:
        device = "auto" if current.type == "meta" else current
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or a torch.device, got "
                         f"{device!r}") from e
    if device.type == "meta":
        raise ValueError("device='meta' cannot train; give the device to materialise the "
                         "model on, e.g. device='cuda'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available here; use device='cpu' or "
                         "'auto'")
    return device


def _fsdp_options(fsdp_kwargs: dict | None, precision: str | None) -> dict:
    opts = dict(fsdp_kwargs or {})
    if opts:
        from torch.distributed.fsdp import fully_shard

        allowed = set(inspect.signature(fully_shard).parameters) - {"module", "mesh"}
        odd = sorted(set(opts) - allowed)
        if odd:
            raise ValueError(f"fsdp_kwargs {odd} are not fully_shard options; accepted: "
                             f"{sorted(allowed)} (the mesh comes from prepare())")
    if precision not in (None, *PRECISIONS):
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "bf16":
        if "mp_policy" in opts:
            raise ValueError("give either precision='bf16' or fsdp_kwargs['mp_policy'], not "
                             "both")
        from torch.distributed.fsdp import MixedPrecisionPolicy

        # bf16 copies of the parameters for forward/backward; gradients reduced and kept in
        # fp32 next to the fp32 master weights, so replicators and the optimizer see fp32
        opts["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                 reduce_dtype=torch.float32)
    return opts


def _reset_fn(m: nn.Module) -> Callable | None:
    """A module's own initialiser: ``reset_parameters()``, or ``_reset_parameters()`` (the name
    some torch modules, e.g. ``nn.MultiheadAttention``, use)."""
    for name in ("reset_parameters", "_reset_parameters"):
        fn = getattr(m, name, None)
        if callable(fn):
            return fn
    return None


def _check_initialisable(model: nn.Module) -> None:
    """Every module that owns parameters or buffers must be able to initialise them."""
    for name, m in model.named_modules():
        owns = next(m.parameters(recurse=False), None) is not None or \
            next(m.buffers(recurse=False), None) is not None
        if owns and _reset_fn(m) is None:
            raise ValueError(
                f"module {name or '<root>'!r} ({type(m).__name__}) holds parameters or buffers "
                "but has no reset_parameters(), so a model on the meta device cannot be "
                "initialised; pass prepare(..., init_fn=fn) where fn(module) initialises a "
                "module's own tensors")


@torch.no_grad()
def _materialise(model: nn.Module, device: torch.device, init_fn: Callable | None) -> None:
    """Allocate the shards on ``device`` and initialise them, children before parents (the
    order of eager construction, and of ``model.apply``), so a parent's initialiser wins."""
    model.to_empty(device=device)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DTensor random operators")
        for m in reversed(list(model.modules())):
            if init_fn is not None:
                init_fn(m)
            elif (fn := _reset_fn(m)) is not None:
                fn()


def _warn_single_replica(mesh: DeviceMesh, reps) -> None:
    if mesh["replicate"].size() > 1 or all(isinstance(r, NoReplication) or r.name == "auto"
                                           for r in reps):  # "auto" says so in its own line
        return
    shard = mesh["shard"].size()
    warnings.warn(
        f"flexdemo.prepare: the mesh is replicate x shard = 1 x {shard}, a single replica, so "
        "the replicator exchanges nothing. The shard size defaults to the ranks per node "
        "(LOCAL_WORLD_SIZE); to replicate across ranks of one node pass replicate= (e.g. "
        "prepare(..., replicate=2)), or run on several nodes",
        NoReplicationWarning, stacklevel=3)


# ---------------------------------------------------------------------------- prepare
def prepare(model: nn.Module, replicator: str | Replicator | Sequence = "demo",
            optimizer: str | Callable = "sgd", lr: float = 1e-3, *,
            mesh: DeviceMesh | None = None, replicate: int | None = None,
            shard: int | None = None, weight_decay: float = 0.0,
            no_decay: NoDecay = False, replicator_kwargs: dict | None = None,
            optimizer_kwargs: dict | None = None,
            shard_units: Callable[[nn.Module], list[nn.Module]] | None = None,
            sync_init: bool = True, nonfinite: str = "raise",
            device: str | torch.device | None = None, fsdp_kwargs: dict | None = None,
            init_fn: Callable[[nn.Module], None] | None = None,
            precision: str | None = None, buffers: str = "mean",
            timeout: timedelta | None = DEFAULT_TIMEOUT,
            fault_tolerance=None) -> tuple[nn.Module, DeToNATION | ElasticOptimizer]:
    """Shard ``model`` with FSDP2 inside each replica and return it with its optimizer.

    The world is arranged as a ``(replicate, shard)`` mesh (default: ``shard`` = ranks per node
    from ``LOCAL_WORLD_SIZE``). Parameters are sharded with ``fully_shard`` over the shard
    dimension (skipped when it has one rank and no FSDP option is asked for: plain data
    parallelism), and the returned :class:`~flexdemo.optim.DeToNATION` optimizer replicates
    across the replicate dimension. The process group is created if needed (gloo for CPU,
    nccl for CUDA), also for a single process without torchrun.

    Args beyond the optimizer's own:
        no_decay: parameters that get no weight decay (neither ``weight_decay`` nor one in
            ``optimizer_kwargs``): ``True`` gives none to norms and biases
            (:func:`flexdemo.decay.no_decay_names`: fewer than 2 dimensions, normalisation
            modules by type, names ending in ``bias`` or naming a norm); or a rule
            ``(name, param) -> bool``, or a list of parameter names. Default: decay all.
        device: where to train: ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"``
            (each rank on ``cuda:LOCAL_RANK``); default: the model's device. A model on the
            ``meta`` device is sharded first, then materialised on ``device``.
        init_fn: ``init_fn(module)`` initialises one module's own tensors after a meta model
            is materialised (called for every module, children first); default:
            ``module.reset_parameters()`` (or ``_reset_parameters()``).
        fsdp_kwargs: passed to every ``fully_shard`` call (``mp_policy``,
            ``reshard_after_forward``, ``offload_policy``, ...).
        precision: ``"bf16"``: bf16 parameters for compute, fp32 gradients reduced and kept
            with fp32 master weights (FSDP2 ``MixedPrecisionPolicy``); replicators see fp32.
        buffers: ``"mean"`` (default) averages floating-point buffers (BatchNorm statistics)
            over all ranks whenever the replicators exchange; ``"none"`` leaves them per rank.
            See :mod:`flexdemo.buffers`.
        fault_tolerance: a :class:`flexdemo.FaultTolerance`: each node (this job's world) is
            one torchft replica group, and the replicators exchange over the groups of each
            step's quorum, which may come and go (:mod:`flexdemo.ft`, docs/elastic.md). The
            optimizer returned is then an :class:`~flexdemo.ft.optimizer.ElasticOptimizer`:
            its session around the DeToNATION (``opt.inner``), used the same way.

    Which strategy (measured in ``benchmarks/quality.py``; docs/optimizers.md): for the best
    validation loss at a few hundredths of a byte per parameter per step, MuLoCo-style
    plain averaging, ``prepare(model, "diloco-avg", "muon", lr=...,
    replicator_kwargs={"inner_steps": 20, "exchange_kwargs": {"values": "int4"}})``; for
    DeMo's byte budget, DeMo with an orthogonalised step, ``prepare(model, "demo", "muon",
    replicator_kwargs={"topk": 64, "decay": 0.9, "sign": False, "scale_by_lr": False},
    optimizer_kwargs={"momentum": 0.0})``.
    Muon's best lr was 10-30x AdamW's (match_rms_adamw scaling): sweep upwards from yours.
    Or ``prepare(model, "auto", optimizer=...)``: the link and the step are measured and the
    strategy chosen to fit them, in one logged line (docs/auto.md).

    Example: ``model, opt = flexdemo.prepare(model, replicator="demo", lr=1e-3)``.
    """
    _check_model(model)
    _check_replicators(replicator)
    for name, kw in (("replicator_kwargs", replicator_kwargs),
                     ("optimizer_kwargs", optimizer_kwargs)):
        if kw is not None and not isinstance(kw, dict):
            raise TypeError(f"{name} must be a dict of settings, got {type(kw).__name__}")
    if replicator_kwargs and not isinstance(replicator, str):
        raise ValueError("replicator_kwargs go with a replicator given by name")
    if buffers not in BUFFER_POLICIES:
        raise ValueError(f"buffers must be one of {BUFFER_POLICIES}, got {buffers!r}")
    if init_fn is not None and not callable(init_fn):
        raise TypeError(f"init_fn must be a callable fn(module), got {type(init_fn).__name__}")
    fsdp_opts = _fsdp_options(fsdp_kwargs, precision)
    current = _model_device(model)
    target = target_device(current, device)
    on_meta = current.type == "meta"
    if on_meta and init_fn is None:
        _check_initialisable(model)
    init_distributed(target, timeout)
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    if mesh is None:
        mesh = build_mesh(target.type, replicate, shard)
    else:
        check_mesh(mesh)
        if mesh.size() != dist.get_world_size():
            raise ValueError(f"the mesh spans {mesh.size()} ranks, the world has "
                             f"{dist.get_world_size()}")
        if replicate is not None or shard is not None:
            raise ValueError("give either mesh= or replicate=/shard=, not both")
    reps = [make_replicator(replicator, **(replicator_kwargs or {}))] \
        if isinstance(replicator, (str, Replicator)) else [make_replicator(r) for r in replicator]
    if fault_tolerance is None:  # under fault tolerance the replicas are the replica groups
        _warn_single_replica(mesh, reps)
    if not on_meta:
        if current != target:
            model.to(target)
        if sync_init:  # one copy of the whole model before sharding
            broadcast_module(model)
    sharded = mesh["shard"].size() > 1 or bool(fsdp_opts)
    if sharded:
        from torch.distributed.fsdp import fully_shard

        units = (shard_units or default_shard_units)(model)
        for unit in units:
            if unit is not model:
                fully_shard(unit, mesh=mesh["shard"], **fsdp_opts)
        fully_shard(model, mesh=mesh["shard"], **fsdp_opts)
    if on_meta:
        _materialise(model, target, init_fn)
        if sync_init:  # shards initialise independently; replicas take the first one's
            broadcast_module(model, group=mesh["replicate"].get_group())
    model._flexdemo_prepared = True  # type: ignore[assignment]  # a marker, not a submodule
    if not sharded:  # FSDP2's accumulation switch, a no-op here: the same loop at any shard
        model.set_requires_gradient_sync = _no_reduction_to_skip  # type: ignore[assignment]
    model.register_forward_pre_hook(_refuse_data_parallel)
    if no_decay is True:  # the rule with module types (norm layers found by type)
        no_decay = no_decay_names(model)
    args = (list(model.named_parameters()), reps)
    kwargs: dict[str, Any] = dict(
        base=optimizer, lr=lr, weight_decay=weight_decay, nonfinite=nonfinite, mesh=mesh,
        base_kwargs=with_model_rule(model, optimizer, optimizer_kwargs), no_decay=no_decay)
    opt: DeToNATION | ElasticOptimizer
    if fault_tolerance is None:
        inner = opt = DeToNATION(*args, group=mesh["replicate"].get_group(), **kwargs)
    else:  # the session around the optimizer; the replicate group: each quorum's groups
        from .ft.optimizer import ElasticOptimizer

        opt = ElasticOptimizer.build(DeToNATION, *args, fault_tolerance=fault_tolerance,
                                     **kwargs)
        assert isinstance(opt.inner, DeToNATION)
        inner = opt.inner
        opt.session.watch(model)  # a group heals before the forward pass, in any loop
    for rep in inner.replicators:  # "auto": a full-sync choice after its warm-up needs it
        if hasattr(rep, "bind_optimizer"):
            rep.bind_optimizer(inner)
    inner.sync_buffers(model, policy=buffers)
    return model, opt
