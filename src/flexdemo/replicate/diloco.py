"""DiLoCo and Streaming DiLoCo as a replicator.

Inner steps are local: the base optimizer (e.g. AdamW) steps on each replica's own gradient.
Every ``inner_steps`` (H) steps a fragment of the parameters is synchronised:

1. the pseudo-gradient ``global - local`` of the fragment is exchanged over the group by an
   *exchange* replicator (default: the fp32 mean, :class:`FullReplicator`; or quantised with
   ``FullReplicator(values="int8" | "int4" | "bf16" | "fp16")``; or compressed with error
   feedback: ``"demo"`` (DCT top-k) or ``"topk"`` (plain top-k per block));
2. an outer optimizer steps the global copy of the fragment with the averaged pseudo-gradient
   as its gradient: by default the DiLoCo paper's, SGD with Nesterov momentum 0.9 and lr 0.7
   (``outer_lr=1.0, outer_momentum=0.0``, the ``"diloco-avg"`` preset, sets the global copy
   to the replicas' mean instead: plain averaging, which ``benchmarks/quality.py`` measured
   ahead of the paper's step at 2 and 4 replicas, H=20, on its small GPTs);
3. the replica's parameters are mixed with the new global ones:
   ``local = alpha * local + (1 - alpha) * global`` (``alpha = 0``, the default, restarts every
   replica from the same global parameters, bitwise identical).

Plain DiLoCo has one fragment. Streaming DiLoCo (``fragments = F``) splits the parameters into F
fragments of similar byte size and syncs one fragment every ``H / F`` steps, in turn, so every
parameter is synced once per H steps. With ``tau > 0`` a fragment's exchange is launched
asynchronously after step ``t`` and applied after step ``t + tau``, overlapping the
communication with ``tau`` inner steps (the pseudo-gradient is the one taken at launch; the
result is mixed into the parameters as they are at apply time). ``keep_overlap=True`` (with
``tau > 0``, ``alpha=0``) keeps the ``tau`` steps a replica took meanwhile instead of mixing
them away: at the apply it moves to the new global parameters plus its progress since the
launch (``local = global + local - local_at_launch``; one more copy of the parameters holds
where it stood). Then no step's work is lost to the overlap, the replicas differ by their
steps since the launch, and a run that ends (:meth:`DiLoCoReplicator.settle` applies the
syncs in flight at once) ends with every replica at the global parameters.

``keep_unsent=True`` (with an exchange that keeps error feedback and can tell what it sent:
``"demo"``, ``"topk"``, or a quantised ``"full"``) lets every replica keep its own progress
that the exchange has not sent yet: after a sync a replica restarts from the global
parameters minus its residual (``residual = decay * residual + progress - sent``, mirroring
the exchange's error feedback in the parameters' layout; ``progress`` is how far it moved
since its last restart), instead of dropping that progress until the residual is sent.
Replicas then differ by their residuals. It costs one more copy of the parameters per
replica (the residual; the restart point is the global parameters minus it) and needs
``tau=0``, ``alpha=0``, more than one replica to differ from plain DiLoCo, and no fault
tolerance.

Steps count from 0; fragment ``p`` is launched after step ``t`` when
``(t + 1) % H == ((p + 1) * H / F) % H``. The global copy and the outer optimizer state can live
on the CPU (``offload=True``), the global copy in bf16 (``global_dtype="bf16"``: the outer
step in fp32, the replicas restart from its result, the stored copy rounded stochastically).

Non-finite gradients: inner steps exchange nothing, so a replica whose gradient is NaN/Inf
skips that inner step alone (it is counted in the optimizer's ``skipped_steps``). Under
``nonfinite="raise"`` it marks its next pseudo-gradient non-finite, so the exchange's own
agreement makes every replica raise at that sync, in the same step. A sync whose
pseudo-gradient is non-finite on some replica is dropped on every replica: each restarts the
fragment from the global parameters, takes no outer step, and raises (or, under ``"skip"``,
counts a skipped step); replicas stay bitwise identical.

Replicas of different speeds (``pace=``, :mod:`.pace`): each replica syncs after its own
number of inner steps (given, measured in the first period and fixed, or measured at every
sync and changed past a tolerance: ``pace="adaptive"``), and the
pseudo-gradients are averaged weighted by each replica's steps or reported tokens
(:meth:`DiLoCoReplicator.count_tokens`); with equal weights, the bits of no pace. It needs
``fragments=1`` and no ``keep_unsent``; ``tau > 0`` with ``keep_overlap=True`` (the steps in
flight count in the next period); :meth:`~DiLoCoReplicator.launch_fragment` then does not
tell the syncs (``pace.count`` and ``pace.since`` do).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import nullcontext
from typing import NoReturn, cast

import torch

from .agreement import NonFiniteGradientError, global_rank_of, mark_nonfinite, nonfinite_flag
from .base import Replicator
from .demo.settings import resolve_group_numel
from .elastic_pace import ElasticPace
from .pace import Pace, check_group, make_pace
from .registry import REPLICATORS
from .rounding import STATE_DTYPES, StochasticRounding, check_state_dtype

# exchanges that are a registered replicator with other settings: name -> (registry name, settings)
EXCHANGE_ALIASES: dict[str, tuple[str, dict]] = {"topk": ("demo", {"transform": "none"})}


def make_exchange(spec, **kwargs) -> Replicator:
    """The exchange replicator of a pseudo-gradient: an (unused) instance, or a name resolved
    through :data:`~flexdemo.replicate.REPLICATORS` (or :data:`EXCHANGE_ALIASES`), built with
    the settings its class declares for use as an exchange (``exchange_settings``: DeMo's
    plain error feedback), then ``kwargs``."""
    if isinstance(spec, Replicator):
        if kwargs:
            raise ValueError("exchange_kwargs go with an exchange given by name")
        if spec.shapes is not None:
            raise ValueError("the exchange replicator is already in use; pass a fresh one")
        ex = spec
    else:
        name, alias = (EXCHANGE_ALIASES.get(spec, (spec, {})) if isinstance(spec, str)
                       else (spec, {}))
        factory = REPLICATORS.get(name) if isinstance(name, str) and name != "diloco" else None
        if factory is None:
            names = sorted(n for n in {*REPLICATORS, *EXCHANGE_ALIASES} if n != "diloco")
            raise ValueError(f"unknown exchange {spec!r}; choose one of {names} or pass a "
                             "Replicator instance")
        ex = factory(**{**getattr(factory, "exchange_settings", {}), **alias, **kwargs})
    if getattr(ex, "weights", "equal") != "equal":
        raise ValueError("DiLoCo's exchange weighs nothing (weights='tokens' is for per-step "
                         "replicators): weigh DiLoCo's replicas with pace=Pace(weights="
                         "'tokens')")
    return ex


def balanced_fragments(sizes: list[int], fragments: int) -> list[list[int]]:
    """Split parameter indices into ``fragments`` groups of similar total size.

    Largest first, each into the currently lightest fragment (ties: lowest index); indices
    within a fragment are sorted. No fragment exceeds the ideal share by more than the largest
    parameter.
    """
    if fragments > len(sizes):
        raise ValueError(f"fragments={fragments} exceeds the number of parameters "
                         f"({len(sizes)})")
    loads = [0] * fragments
    parts: list[list[int]] = [[] for _ in range(fragments)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        f = min(range(fragments), key=lambda f: (loads[f], f))
        parts[f].append(i)
        loads[f] += sizes[i]
    return [sorted(p) for p in parts]


def _batches(sizes: list[int], limit: int | None) -> list[list[int]]:
    """Consecutive positions of ``sizes`` in batches of at most ``limit`` values (a larger
    tensor alone; None: one batch)."""
    if limit is None:
        return [list(range(len(sizes)))] if sizes else []
    out: list[list[int]] = []
    total = 0
    for k, n in enumerate(sizes):
        if not out or total + n > limit:
            out.append([])
            total = 0
        out[-1].append(k)
        total += n
    return out


class _Sync:
    """One fragment's exchange in flight (or completed, when restored from a checkpoint)."""

    def __init__(self, apply_at: int, handle=None, result=None,
                 failed: list[int] | None = None) -> None:
        self.apply_at, self.handle, self.result = apply_at, handle, result
        self.failed = failed  # ranks whose input was non-finite: the sync is dropped


class DiLoCoReplicator(Replicator):
    """DiLoCo / Streaming DiLoCo: local inner steps, periodic outer steps on pseudo-gradients."""

    name = "diloco"
    state_tensor_keys: tuple[str, ...] = ("global",)  # the global copy: equal on every replica
    fault_tolerant = True

    def __init__(self, inner_steps: int = 100, *, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True,
                 outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
                 | None = None, exchange: str | Replicator = "full",
                 exchange_kwargs: dict | None = None, fragments: int = 1, tau: int = 0,
                 alpha: float = 0.0, offload: bool = False, keep_unsent: bool = False,
                 global_dtype: str = "fp32", pace: Pace | list[int] | str | None = None,
                 keep_overlap: bool = False, group=None) -> None:
        super().__init__(group=group)
        H = inner_steps
        if not isinstance(H, int) or isinstance(H, bool) or H < 1:
            raise ValueError(f"inner_steps (H) must be an integer >= 1, got {H!r}")
        if not isinstance(fragments, int) or fragments < 1:
            raise ValueError(f"fragments must be an integer >= 1, got {fragments!r}")
        if H % fragments:
            raise ValueError(f"fragments={fragments} does not divide inner_steps={H}: one "
                             f"fragment is synced every H/F steps; choose F among the divisors "
                             f"of {H}")
        if not isinstance(tau, int) or tau < 0 or tau >= H // fragments:
            raise ValueError(f"tau must be an integer in [0, H/F) = [0, {H // fragments}), got "
                             f"{tau!r}: a fragment's sync must be applied before the next one "
                             "is launched")
        if not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
        if not isinstance(outer_lr, (int, float)) or outer_lr < 0:
            raise ValueError(f"outer_lr must be a number >= 0, got {outer_lr!r}")
        if not isinstance(outer_momentum, (int, float)) or not 0.0 <= outer_momentum < 1.0:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
        check_state_dtype("global_dtype", global_dtype)
        if nesterov and outer_momentum == 0 and outer_optimizer is None:
            nesterov = False  # Nesterov needs momentum; with none it is plain SGD
        self.inner_steps, self.fragments, self.tau, self.alpha = H, fragments, tau, float(alpha)
        self.outer_lr, self.outer_momentum, self.nesterov = outer_lr, outer_momentum, nesterov
        self.outer_factory = outer_optimizer
        self.offload, self.global_dtype = offload, global_dtype
        self._template = make_exchange(exchange, **(exchange_kwargs or {}))
        self.keep_unsent = bool(keep_unsent)
        if self.keep_unsent:
            if tau or alpha:
                raise ValueError("keep_unsent=True needs tau=0 and alpha=0 (a replica restarts "
                                 "from the global parameters minus its own residual)")
            if not self._template.reports_sent:
                raise ValueError(f"keep_unsent=True needs an exchange that can tell what it "
                                 f"sent (\"demo\", \"topk\" or a quantised \"full\"), not "
                                 f"{self._template!r}")
            self.keeps_replica_state = True
            self.state_tensor_keys = ("global", "residual")
        self.keep_overlap = bool(keep_overlap)
        if self.keep_overlap and (not tau or alpha):
            raise ValueError(f"keep_overlap=True keeps the inner steps a replica takes while "
                             f"its sync is in flight: it needs tau > 0 and alpha=0, got "
                             f"tau={tau}, alpha={alpha}")
        self.pace = make_pace(pace, fragments=fragments, tau=tau, keep_unsent=self.keep_unsent,
                              keep_overlap=self.keep_overlap)

    def extra_repr(self) -> str:
        keep = ", keep_unsent=True" if self.keep_unsent else ""
        keep += f", global_dtype={self.global_dtype!r}" if self.global_dtype != "fp32" else ""
        keep += f", pace={self.pace!r}" if self.pace is not None else ""
        keep += ", keep_overlap=True" if self.keep_overlap else ""
        return (f"H={self.inner_steps}, fragments={self.fragments}, tau={self.tau}, "
                f"alpha={self.alpha}{keep}, exchange={self._template!r}")

    def __repr__(self) -> str:
        return f"DiLoCoReplicator({self.extra_repr()})"

    # ------------------------------------------------------------------ set-up
    def _setup_state(self) -> None:
        if self._params is None:
            raise RuntimeError("DiLoCo acts on parameters: use it through flexdemo's optimizer")
        self._locals = [p.detach() for p in self._params]  # views, built once
        store = torch.device("cpu") if self.offload else self.device
        dtype = STATE_DTYPES[self.global_dtype]
        self.global_params = [p.detach().to(store, dtype, copy=True) for p in self._params]
        # bf16: the outer optimizer steps fp32 stand-ins (4 bytes in all), given the fragment's
        # fp32 values for its step (_outer_step_low); its state stays fp32
        self._rounding = StochasticRounding(store) if dtype != torch.float32 else None
        self._stand_in = torch.zeros((), dtype=torch.float32, device=store)
        self._outer_params = (self.global_params if self._rounding is None else
                              [self._stand_in.expand(p.shape) for p in self.global_params])
        if self.outer_factory is not None:
            self.outer = self.outer_factory(self._outer_params)
        else:
            self.outer = torch.optim.SGD(self._outer_params, lr=self.outer_lr,
                                         momentum=self.outer_momentum, nesterov=self.nesterov,
                                         foreach=True)
        self.parts = balanced_fragments([p.numel() for p in self._params], self.fragments)
        group, self._template.group = self._template.group, None  # groups do not deep-copy
        self.exchanges = [copy.deepcopy(self._template) for _ in self.parts]
        self._template.group = group
        self.in_place = self._pseudo_in_place()
        for ex, part in zip(self.exchanges, self.parts):
            ex.group = group
            if not self.in_place and hasattr(ex, "bucket_numel"):
                ex.bucket_numel = None  # its flat buffer is the pseudo-gradients' home
            ex.memory_first = True  # its sync runs once every H steps
            ex.setup([self._local_shapes[i] for i in part], self.device, self.group,
                     nonfinite=self.nonfinite)
            ex.release_workspace()  # not held until the first sync, H steps away
        # the pseudo-gradients: formed in the replica's own parameters (which the restart
        # overwrites), else where the exchange copies its input, if it has such buffers (a
        # dense exchange's flat buffer), else their own
        built: dict[int, torch.Tensor] = {}
        if self.in_place:
            built.update(enumerate(self._locals))
        for ex, part in zip(self.exchanges, self.parts):
            views = None if self.in_place else ex.input_views()
            if views is not None and all(v.shape == self._params[i].shape for i, v in
                                         zip(part, views)):
                built.update(zip(part, views))
        self.pseudo = [built[i] if i in built else
                       torch.zeros(p.shape, dtype=torch.float32, device=self.device)
                       for i, p in enumerate(self._params)]
        # the default outer SGD steps a bucket of the exchange's size at a time (its
        # Nesterov step makes a temporary of what it steps; per value it is the same step)
        self._outer_batches = [_batches(
            [self._params[i].numel() for i in part],
            None if self.outer_factory is not None else resolve_group_numel(
                getattr(ex, "bucket_numel", "auto"), self.device, self._local_shapes))
            for ex, part in zip(self.exchanges, self.parts)]
        self.syncs = [0] * self.fragments
        self.pending: dict[int, _Sync] = {}
        # keep_unsent: the progress not sent yet (the replica restarted at global - residual)
        self.residual = [torch.zeros_like(p) for p in self.pseudo] if self.keep_unsent else []
        # keep_overlap: each parameter as it was when its fragment's sync was launched
        self.anchor = ([torch.zeros_like(p) for p in self.pseudo] if self.keep_overlap
                       else [])
        self._bad_inner: int | None = None  # first inner step withheld since the last launch
        if self.pace is not None:
            self.pace.setup(self.inner_steps, self.world, self.rank, self.device)
            check_group(self.pace, self.group)
            problem = self._template.scaled_input_problem()
            if problem is not None:
                raise ValueError(f"{self.name}: pace= weighs the replicas, but {problem}")

    def _pseudo_in_place(self) -> bool:
        """Whether a sync forms the pseudo-gradient in the replica's fp32 parameters and the
        exchange writes the mean there: they are overwritten by the restart right after
        (``tau=0``, ``alpha=0``, an fp32 global copy on the device, no ``keep_unsent``), so
        no copy of the model is held for it and a bucketed exchange (``bucket_numel``)
        bounds the sync's workspace."""
        return (self.tau == 0 and self.alpha == 0.0 and not self.keep_unsent
                and not self.offload and self.global_dtype == "fp32"
                and all(p.dtype == torch.float32 for p in self._locals))

    def payload_bytes(self) -> int:
        """Bytes this rank contributes to the syncs of all fragments (one period of H)."""
        return sum(ex.payload_bytes() for ex in self.exchanges)

    def exchange_bytes(self) -> int:
        """Bytes this rank sends over one period of H steps (every fragment synced once)."""
        return sum(ex.exchange_bytes() for ex in self.exchanges)

    def launch_fragment(self, step: int) -> int | None:
        """The fragment launched after ``step``, if any."""
        H, F = self.inner_steps, self.fragments
        r = (step + 1) % H
        for p in range(F):
            if r == ((p + 1) * H // F) % H:
                return p
        return None

    # ------------------------------------------------------------------ stepping
    def replicate(self, grads, lrs, step, communicate):
        if bool(nonfinite_flag(grads, self.device)):  # the step's one host read
            local = self.world > 1  # only this replica knows: it skips this inner step alone
            if local and self.nonfinite == "raise" and self._bad_inner is None:
                self._bad_inner = step  # reported to every replica by the next sync
            raise NonFiniteGradientError(self.name, [global_rank_of(self.transport, self.rank)],
                                         step, local=local)
        return grads  # inner steps are local

    def count_tokens(self, n: int | float | torch.Tensor) -> None:
        """Add ``n`` tokens to this replica's weight at the next sync (``pace=Pace(weights=
        "tokens")``; nothing otherwise): :meth:`.pace.Pace.count_tokens`."""
        if self.pace is not None:
            self.pace.count_tokens(n)

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        p = self.launch_fragment(step) if self.pace is None else (
            0 if self.pace.after_step(self.transport, self.stats) else None)
        if p is not None and p in self.pending:  # (not reached: every count exceeds its
            self._apply(p, step)  # delay; a guard that no sync is dropped unapplied)
        if p is not None:
            self._launch(p, step)
        for q, sync in list(self.pending.items()):
            if sync.apply_at == step:  # (a measured pace leaves its wait out of the steps')
                with nullcontext() if self.pace is None else self.pace.left_out():
                    self._apply(q, step)
        if p is not None and self.pace is not None:
            self.pace.start_period()  # (adaptive: the next period is timed from here)

    @torch.no_grad()
    def settle(self) -> None:
        """Apply every sync in flight now (``tau > 0``: waiting for its exchange), as if its
        ``tau`` steps were over: a run's last sync, so that it ends on the synced model."""
        for q, sync in sorted(self.pending.items()):
            self._apply(q, sync.apply_at)

    def _launch(self, p: int, step: int) -> None:
        part = self.parts[p]
        pseudo = [self.pseudo[i] for i in part]
        if self.keep_overlap:  # where the steps taken while the sync is in flight start
            torch._foreach_copy_([self.anchor[i] for i in part], [self._locals[i] for i in part])
        if self.in_place:  # global - local, in the parameters: -local + global, the same bits
            torch._foreach_neg_(pseudo)
            torch._foreach_add_(pseudo, [self.global_params[i] for i in part])
        else:
            torch._foreach_copy_(pseudo, [self.global_params[i] for i in part])
        if self._keeps():
            # the replica restarted at global - residual: its input is the progress since,
            # and the residual takes that progress in (what is sent leaves it at the apply)
            resid = [self.residual[i] for i in part]
            torch._foreach_sub_(pseudo, resid)
            torch._foreach_mul_(resid, self.exchanges[p].feedback_decay)
            torch._foreach_add_(resid, pseudo)
            torch._foreach_sub_(resid, [self._locals[i] for i in part])
        if not self.in_place:
            torch._foreach_sub_(pseudo, [self._locals[i] for i in part])
        if self._bad_inner is not None:
            mark_nonfinite(pseudo)  # in-band flag: the exchange's agreement tells everyone
            self._bad_inner = None
        ex = self.exchanges[p]
        try:
            if self.pace is not None:  # weighted: each replica's input scaled by its factor
                ex.peer_scales = self.pace.factors(self.transport, self.stats)
                if ex.peer_scales is not None:
                    torch._foreach_mul_(pseudo, ex.peer_scales[self.rank])
            # start() reads the list and writes into its tensors; it never stores None in it
            handle = ex.start(cast("list[torch.Tensor | None]", pseudo), [1.0] * len(part),
                              self.syncs[p])
        except NonFiniteGradientError as e:
            self.syncs[p] += 1
            self._drop(p, e, step)
        except BaseException:
            self._lost(p)
            raise
        self._record(ex)
        self.syncs[p] += 1
        delay = self.tau if self.pace is None else self.pace.delay  # (its own, under a pace)
        self.pending[p] = _Sync(step + delay, handle=handle)

    def _result(self, p: int) -> list[torch.Tensor]:
        sync = self.pending[p]
        if sync.failed is not None:
            raise NonFiniteGradientError(self.exchanges[p].name, sync.failed, sync.apply_at)
        if sync.result is None:
            ex = self.exchanges[p]
            before = ex.stats.bytes_sent, ex.stats.bytes_received, ex.stats.seconds
            handle, sync.handle = sync.handle, None
            try:
                sync.result = ex.finish(handle)
                ex.release_workspace()  # not held until the next sync, H steps away
            except NonFiniteGradientError as e:
                sync.failed = e.ranks or []
                raise
            finally:
                self.stats.record(ex.stats.bytes_sent - before[0],
                                  ex.stats.bytes_received - before[1],
                                  ex.stats.seconds - before[2], 0)
        return sync.result

    def _apply(self, p: int, step: int) -> None:
        part = self.parts[p]
        try:
            outs = self._result(p)
        except NonFiniteGradientError as e:
            self._drop(p, e, step)
        except BaseException:
            self._lost(p)
            raise
        del self.pending[p]
        glob = [self.global_params[i] for i in part]
        if self._rounding is not None:
            glob = self._outer_step_low(p, outs)  # the fp32 result
        else:
            for batch in self._outer_batches[p]:
                for k in batch:
                    avg = outs[k]
                    glob[k].grad = avg if avg.device == glob[k].device else avg.to(glob[k].device)
                self.outer.step()
                for k in batch:
                    glob[k].grad = None
        if self._keeps():  # what it sent leaves its residual (the mean is spent: pseudo is free)
            pseudo = [self.pseudo[i] for i in part]
            self.exchanges[p].sent_into(pseudo)
            torch._foreach_sub_([self.residual[i] for i in part], pseudo)
        self._restart(part, self.alpha, glob)

    def _outer_step_low(self, p: int, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The outer step of fragment ``p`` with a bf16 global copy: on fp32 values of the
        fragment (the replica's own parameters, which the restart overwrites anyway, or
        transient copies where it mixes them in, under ``alpha`` or ``keep_overlap``, or lives
        on the CPU), then
        rounded stochastically into the stored copy (random bits of the fragment, its sync
        count and the parameter: the same on every replica). Returns the fp32 result."""
        part, rounding = self.parts[p], self._rounding
        assert rounding is not None, "a bf16 global copy"
        glob = [self.global_params[i] for i in part]
        work = [self._locals[i] for i in part]
        if (self.offload or self.alpha != 0.0 or self.keep_overlap
                or any(w.dtype != torch.float32 for w in work)):
            work = [torch.empty(g.shape, dtype=torch.float32, device=g.device) for g in glob]
        torch._foreach_copy_(work, glob)
        stand_ins = [self._outer_params[i] for i in part]
        try:
            for h, w, avg in zip(stand_ins, work, outs):
                h.data, h.grad = w, avg if avg.device == w.device else avg.to(w.device)
            self.outer.step()
        finally:
            for h in stand_ins:
                h.data, h.grad = self._stand_in.expand(h.shape), None
        for i, w, g in zip(part, work, glob):
            rounding.round_into(w, g, p, self.syncs[p], i)
        return work

    def _keeps(self) -> bool:
        """Replicas keep their unsent progress (``keep_unsent`` over more than one)."""
        return self.keep_unsent and self.world > 1

    def _restart(self, part: list[int], alpha: float,
                 glob: list[torch.Tensor] | None = None) -> None:
        """Mix the fragment's replica parameters with the global ones (alpha 0: copy), or
        with ``glob`` (the fp32 result of an outer step onto a bf16 global copy); under
        ``keep_overlap`` the global ones plus the replica's steps since the sync's launch."""
        local = [self._locals[i] for i in part]
        glob = [self.global_params[i] for i in part] if glob is None else glob
        if self.offload:  # bring the global values to the replica's device first
            torch._foreach_copy_([self.pseudo[i] for i in part], glob)
            glob = [self.pseudo[i] for i in part]
        if self.keep_overlap:  # the steps since the launch, on top of the new global ones
            torch._foreach_sub_(local, [self.anchor[i] for i in part])
            torch._foreach_add_(local, glob)
        elif alpha == 0.0:
            if any(a is not b for a, b in zip(local, glob)):  # (not the outer step's own)
                torch._foreach_copy_(local, glob)
        else:
            torch._foreach_mul_(local, alpha)
            torch._foreach_add_(local, glob, alpha=1.0 - alpha)
        if self._keeps():  # its own unsent progress stays in the replica's parameters
            torch._foreach_sub_(local, [self.residual[i] for i in part])

    def _lost(self, p: int) -> None:
        """A sync of fragment ``p`` raised (a corrupt payload, a lost peer): with the
        pseudo-gradient in the parameters, the fragment restarts from the global ones (under
        fault tolerance the step is undone anyway)."""
        if self.in_place:
            self.pending.pop(p, None)
            self._restart(self.parts[p], 0.0)

    def _drop(self, p: int, e: NonFiniteGradientError, step: int) -> NoReturn:
        """A sync of fragment ``p`` failed on every replica alike: restart the fragment from
        the global parameters (no outer step) and raise."""
        self.pending.pop(p, None)
        if self._keeps():  # no telling what was kept: every replica drops its residual
            torch._foreach_zero_([self.residual[i] for i in self.parts[p]])
            self.exchanges[p].reset_replica_state()
        self._restart(self.parts[p], 0.0)
        raise NonFiniteGradientError(
            self.name, e.ranks, step,
            note=f" (found by the sync of fragment {p}: a NaN/Inf in an inner step since the "
                 "previous sync, or in the parameters; every replica restarts the fragment "
                 "from the global parameters)") from e

    def _record(self, ex: Replicator) -> None:
        s = ex.stats
        self.stats.record(s.last_bytes_sent, s.last_bytes_received, s.last_seconds,
                          s.last_collectives)

    # ------------------------------------------------------------------ contract
    @property
    def exchange(self) -> Replicator:
        """The exchange as configured (each fragment runs a set-up copy of it)."""
        return self._template

    def inner_replicators(self) -> tuple[Replicator, ...]:
        return tuple(getattr(self, "exchanges", ()))

    def fault_tolerance_problem(self) -> str | None:
        return _elastic_problem(self) or super().fault_tolerance_problem()

    def enter_fault_tolerance(self) -> None:
        """Before set-up, under fault tolerance: a pace becomes an
        :class:`~.elastic_pace.ElasticPace` (quorums at syncs only, counts from each quorum's
        own measurements)."""
        if self.pace is not None and not self.pace.elastic:
            self.pace = ElasticPace.from_pace(self.pace)

    def local_next_step(self) -> bool:
        """Under fault tolerance with a pace: whether the next step is an inner step before
        this replica's sync (the session runs it outside a quorum)."""
        return self.pace is not None and self.pace.local_next()

    def quorum_changed(self) -> None:
        """Syncs in flight (``tau > 0``) are dropped unapplied on every replica: the global
        copy and the outer optimizer stay as they were, and what the dropped syncs carried
        stays in each replica's parameters, so the fragment's next sync carries it."""
        self.pending.clear()
        super().quorum_changed()

    def shared_state(self) -> dict:
        """The global copy, outer optimizer and syncs, and the exchanges' shared state.
        Syncs still in flight are left out (never waited for here: a joiner's peer serves
        this while its exchange may be on its way; the new quorum drops them anyway)."""
        sd = self.state_dict(wait=False)
        sd.pop("stats", None)
        sd["exchanges"] = [ex.shared_state() for ex in self.exchanges]
        return copy.deepcopy(sd)

    def load_shared_state(self, state: dict) -> None:
        own = self.state_dict()
        own.update({k: v for k, v in state.items() if k != "exchanges"})
        self.load_state_dict(own)
        for ex, s in zip(self.exchanges, state["exchanges"]):
            ex.load_shared_state(s)
        self.reset_withheld()
        if self.pace is not None:  # healed into the peers' sync: this replica's next step
            self.pace.joined()

    # ------------------------------------------------------------------ state
    def state_dict(self, wait: bool = True) -> dict:
        """The state; a sync in flight is completed and stored, or left out when not
        ``wait``."""
        return self._state(wait, copy=True)

    def live_state(self) -> dict:
        """:meth:`state_dict` (a sync in flight completed) with the live tensors."""
        return self._state(True, copy=False)

    def _state(self, wait: bool, copy: bool) -> dict:
        keep = (lambda t: t.clone()) if copy else (lambda t: t)
        sd = super().state_dict()
        pending = {}
        for p in sorted(self.pending):
            sync = self.pending[p]
            if not wait and sync.result is None and sync.failed is None:
                continue
            try:  # a sync in flight is completed and stored (or stored as failed)
                pending[p] = {"apply_at": sync.apply_at,
                              "result": [keep(t) for t in self._result(p)]}
            except NonFiniteGradientError:
                pending[p] = {"apply_at": sync.apply_at, "failed": sync.failed}
            if self.keep_overlap:  # where its steps since the launch started
                pending[p]["anchor"] = [keep(self.anchor[i]) for i in self.parts[p]]
        sd.update({
            "global": [keep(g) for g in self.global_params],
            "outer": self.outer.state_dict(),
            "exchanges": [ex.state_dict() if copy else ex.live_state()
                          for ex in self.exchanges],
            "syncs": list(self.syncs),
            "pending": pending,
        })
        if self.keep_unsent:
            sd["residual"] = [keep(t) for t in self.residual]
        if self.pace is not None:
            sd["pace"] = self.pace.state_dict()
        return sd

    def state_tensors(self) -> list[torch.Tensor]:
        outer = [t for s in self.outer.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor)]
        inner = [t for ex in self.exchanges for t in ex.state_tensors()]
        return [*self.global_params, *outer, *inner, *(self.residual if self.keep_unsent else ())]

    def load_state_dict(self, state: dict) -> None:
        glob = state["global"]
        if len(glob) != len(self.global_params) or any(
                a.shape != b.shape for a, b in zip(self.global_params, glob)):
            raise ValueError(f"{self.name}: saved global parameters do not match this model")
        if len(state["exchanges"]) != len(self.exchanges):
            raise ValueError(f"{self.name}: saved state has {len(state['exchanges'])} "
                             f"fragments, this replicator {len(self.exchanges)}")
        super().load_state_dict(state)
        for a, b in zip(self.global_params, glob):
            a.copy_(b)
        self.outer.load_state_dict(state["outer"])
        for ex, s in zip(self.exchanges, state["exchanges"]):
            ex.load_state_dict(s)
        self.syncs = list(state["syncs"])
        if self.pace is not None:
            self.pace.load_state_dict(state.get("pace"))
        if self.keep_unsent:
            if "residual" not in state:
                raise ValueError(f"{self.name}: the state has no residual (saved without "
                                 "keep_unsent=True?)")
            torch._foreach_copy_(self.residual, list(state["residual"]))
        self.pending = {
            int(p): _Sync(int(v["apply_at"]), failed=v["failed"]) if "failed" in v else
            _Sync(int(v["apply_at"]), result=[t.to(self.device) for t in v["result"]])
            for p, v in state["pending"].items()}
        _restore_anchors(self, state["pending"])


def _elastic_problem(rep: DiLoCoReplicator) -> str | None:
    """Why ``rep``'s settings cannot run under fault tolerance (one line), or None."""
    pace = rep.pace
    if pace is not None and pace.fill:
        return ("under fault tolerance a pace cannot fill the slowest replica's period "
                "(replicas come and go, and the groups meet only in quorums): use "
                "pace='adaptive'")
    if pace is not None and not (pace.adaptive and pace.given is None):
        return (f"under fault tolerance a pace is measured at every sync (replicas come and "
                f"go, and counts name replicas by rank): use pace='adaptive' or 'timed', not "
                f"pace={pace!r}")
    if pace is not None and pace.bound and not pace.elastic:
        return ("a pace under fault tolerance is set up with the session: build the "
                "optimizer with fault_tolerance= (flexdemo.prepare does), not before it")
    if rep.keep_unsent:
        return ("fault tolerance does not support keep_unsent=True (a joiner would heal "
                "from a peer whose parameters hold that peer's unsent progress)")
    if rep.keep_overlap:
        return ("fault tolerance does not support keep_overlap=True yet (a joiner would "
                "heal from a peer whose parameters hold that peer's steps since its "
                "sync's launch): use tau=0, or keep_overlap=False")
    if rep.tau and rep.exchange.keeps_replica_state:
        return (f"fault tolerance does not support DiLoCo syncs that overlap later steps "
                f"(tau={rep.tau}) with an exchange that keeps per-replica state "
                f"({rep.exchange.name!r}); use tau=0 or a full exchange")
    return None


def _restore_anchors(rep: DiLoCoReplicator, pending: dict) -> None:
    """Where each replica stood when the saved syncs in flight were launched (``pending``,
    the state's), into ``rep.anchor`` (``keep_overlap``); refused when saved otherwise."""
    for p, v in pending.items():
        if rep.keep_overlap != ("anchor" in v):
            raise ValueError(f"{rep.name}: a sync in flight was saved "
                             f"{'with' if 'anchor' in v else 'without'} keep_overlap=True; "
                             "build the replicator as it was saved")
        if rep.keep_overlap:
            torch._foreach_copy_([rep.anchor[i] for i in rep.parts[int(p)]],
                                 [t.to(rep.device) for t in v["anchor"]])
