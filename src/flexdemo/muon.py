"""Muon for the hidden matrices, AdamW for every other parameter, under one learning rate.

``MuonAdamW`` is the base optimizer behind ``optimizer="muon"``. Its matrices follow
``torch.optim.Muon`` step for step (momentum, Nesterov look-ahead, torch's Newton-Schulz
orthogonalisation, the shape-dependent lr adjustment, decoupled weight decay): unsharded it is
bitwise ``torch.optim.Muon`` plus ``torch.optim.AdamW``. The Newton-Schulz iterations of
same-shape matrices run as one batched call (:mod:`flexdemo.newton_schulz`, ``ns_mode``),
bitwise torch's per-matrix call on CPU. Under FSDP2 a rank holds row shards
of each matrix, and orthogonalising a shard is not orthogonalising the matrix, so every matrix
is orthogonalised whole, once per shard group, by one owner rank: one all-to-all brings each
owner the rows of its matrices, a second returns each rank its rows of the result. Both carry
bf16, which is what the orthogonalisation computes in, so the result is bitwise the unsharded
one. Their bytes and seconds are counted in :attr:`MuonAdamW.stats` (intra-node traffic).

Which parameters get Muon (:func:`is_hidden_matrix`, overridable with ``muon_params``): the
2-D weights of the network's hidden layers. Embeddings, the output head, norms and biases stay
on AdamW, as the Muon authors advise.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import NamedTuple, cast

import torch
from torch import nn

from .decay import NoDecay, no_decay_flags
from .dtensor import local_tensor
from .memory import ReleasableStorages
from .newton_schulz import (
    NS_DTYPES,
    NS_MODES,
    default_batch_numel,
    newton_schulz_,
    ns_compute_dtype,
    orthogonalise,
    shape_groups,
)
from .transport import CommStats, all_to_all, group_rank, group_size

# name components of parameters that stay on AdamW although they are 2-D
HEAD_NAMES = frozenset({"head", "lm_head", "output", "classifier", "wte", "wpe", "tok", "pos"})

MuonRule = Callable[[str, torch.Tensor], bool]


class _Plan(NamedTuple):
    """How one list of Muon parameters is stepped: indices into it."""

    whole: list[int]  # matrices held whole by this rank
    batches: list[list[int]]  # those by shape, in batches of at most ns_batch_numel entries
    sharded: dict  # {process group: row-sharded matrices, in bounded chunks}


def require_muon() -> None:
    """Raise one line when this torch has no ``torch.optim.Muon`` (added in torch 2.9)."""
    if not hasattr(torch.optim, "Muon"):
        raise ValueError(f"optimizer 'muon' needs torch >= 2.9 (torch.optim.Muon); this is "
                         f"torch {torch.__version__}: upgrade torch or choose another optimizer")


def is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """The default rule: a 2-D parameter whose dotted name has no component that names an
    embedding (one containing ``emb``) or the output head (:data:`HEAD_NAMES`)."""
    if param.ndim != 2:
        return False
    parts = name.lower().split(".")
    return not any("emb" in part or part in HEAD_NAMES for part in parts)


def hidden_matrix_names(model: nn.Module) -> list[str]:
    """The parameters of ``model`` that get Muon by default: :func:`is_hidden_matrix`, and
    none of an ``nn.Embedding`` (whatever its name) nor any weight shared with one."""
    embedded = {id(p) for m in model.modules() if isinstance(m, nn.Embedding)
                for p in m.parameters(recurse=False)}
    return [n for n, p in model.named_parameters()
            if id(p) not in embedded and is_hidden_matrix(n, p)]


def with_model_rule(model: nn.Module, optimizer, kwargs: dict | None) -> dict | None:
    """``kwargs`` of base optimizer ``optimizer`` with ``muon_params`` from the model's module
    types (:func:`hidden_matrix_names`) when it is ``"muon"`` and the caller chose none."""
    if not (isinstance(optimizer, str) and optimizer.lower() == "muon") or (
            kwargs and "muon_params" in kwargs):
        return kwargs
    return {**(kwargs or {}), "muon_params": hidden_matrix_names(model)}


def _split(params: list, muon_params) -> tuple[list, list]:
    """(Muon parameters, AdamW parameters) of ``params`` (tensors or ``(name, tensor)``)."""
    named = all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) for x in params)
    pairs = params if named else [(None, p) for p in params]
    if muon_params is None:
        def rule(n, p):
            return p.ndim == 2 if n is None else is_hidden_matrix(n, p)
    elif callable(muon_params):
        if not named:
            raise ValueError("muon_params as a rule(name, param) needs named parameters: pass "
                             "model.named_parameters()")
        rule = muon_params
    elif isinstance(muon_params, Collection) and not isinstance(muon_params, str):
        chosen = set(muon_params)
        if not named:
            raise ValueError("muon_params as parameter names needs named parameters: pass "
                             "model.named_parameters()")
        unknown = sorted(chosen - {n for n, _ in pairs})
        if unknown:
            raise ValueError(f"muon_params names parameters the model does not have: "
                             f"{unknown[:4]}; use names from model.named_parameters()")

        def rule(n, p):
            return n in chosen
    else:
        raise TypeError(f"muon_params must be None, a rule(name, param) -> bool or a list of "
                        f"parameter names, got {type(muon_params).__name__}")
    muon: list[tuple[str | None, torch.Tensor]] = []
    other: list[tuple[str | None, torch.Tensor]] = []
    for n, p in pairs:
        (muon if rule(n, p) else other).append((n, p))
    bad = [n or f"#{i}" for i, (n, p) in enumerate(muon) if p.ndim != 2]
    if bad:
        raise ValueError(f"Muon takes 2-D parameters only, muon_params chose {bad[:4]}; leave "
                         "other parameters to AdamW")
    return muon, other


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the hidden matrices, AdamW on the rest, one ``lr`` for both.

    Args:
        params: parameters, or ``model.named_parameters()`` so that the default rule can keep
            embeddings and the head on AdamW (without names every 2-D parameter gets Muon).
        lr: the learning rate of both parts. With ``adjust_lr_fn="match_rms_adamw"`` (the
            default) Muon's step is scaled to AdamW's update size, so an AdamW lr is a sane
            start.
        weight_decay: decoupled weight decay of both parts (``p *= 1 - lr * wd``).
        momentum, nesterov, ns_steps, adjust_lr_fn: Muon's settings (``torch.optim.Muon``).
        betas, eps: AdamW's settings for the other parameters.
        muon_params: which parameters get Muon: ``None`` (:func:`is_hidden_matrix`), a rule
            ``(name, param) -> bool``, or a list of parameter names.
        ns_mode: ``"batched"`` (default) orthogonalises the matrices of one shape in one
            batched Newton-Schulz call (:func:`flexdemo.newton_schulz.orthogonalise`); on CPU
            (torch 2.13) bitwise the same as ``"per_matrix"``, torch's function called once per
            matrix. Not stored in the state dict.
        ns_batch_numel: the most entries a batch of whole matrices holds (per rank for
            sharded ones): each batch's update is written in bf16, orthogonalised in place and
            applied before the next, so the step's transient memory is about 3 bf16 copies
            of a batch, not the model. Default (None):
            :func:`~flexdemo.newton_schulz.default_batch_numel`, the largest Muon matrix's
            entries, at least 1M (4M on CUDA). A matrix larger than the bound is a batch of
            its own. The same bits whatever the bound.
        ns_dtype: the precision of the batched iterations: ``"bf16"`` (torch's bits),
            ``"fp32"`` (updates and results stay bf16, the iterations run in fp32 copies of
            a few matrices at a time, :func:`~flexdemo.newton_schulz.newton_schulz_`; on a
            CPU without bf16 matrix units, AVX2, 10-20x faster, on a GPU about 3x slower), or
            ``"auto"`` (default): fp32 for matrices on the CPU, bf16 on any other device.
            Under ``ns_mode="per_matrix"`` the iterations are torch's, in bf16 (``"fp32"`` is
            refused there). Not stored in the state dict.
        no_decay: parameters that get no weight decay in either part (:mod:`flexdemo.decay`):
            ``True`` (norms and biases: fewer than 2 dimensions, or named so), a rule
            ``(name, param) -> bool`` or a list of names. They form groups of their own
            with ``weight_decay`` 0.

    LR schedulers see ``momentum`` (Muon's) in :attr:`defaults`: a scheduler that cycles it
    (``OneCycleLR``, ``CyclicLR``) cycles Muon's momentum; AdamW's betas keep their values.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, *, weight_decay: float = 0.0,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 adjust_lr_fn: str | None = "match_rms_adamw",
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 muon_params: MuonRule | Collection[str] | None = None,
                 ns_mode: str = "batched", ns_batch_numel: int | None = None,
                 ns_dtype: str = "auto", no_decay: NoDecay = None) -> None:
        require_muon()
        from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS

        params = list(params)
        if any(isinstance(x, dict) for x in params):
            raise ValueError("optimizer 'muon' takes a flat list of parameters (best "
                             "model.named_parameters()), not parameter groups")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"muon momentum must be in [0, 1), got {momentum!r}")
        if ns_mode not in NS_MODES:
            raise ValueError(f"ns_mode must be one of {NS_MODES}, got {ns_mode!r}")
        if ns_dtype not in (*NS_DTYPES, "auto"):
            raise ValueError(f"ns_dtype must be one of {(*NS_DTYPES, 'auto')}, got "
                             f"{ns_dtype!r}")
        if ns_dtype == "fp32" and ns_mode != "batched":
            raise ValueError(f"ns_dtype={ns_dtype!r} runs in the batched mode; use "
                             "ns_mode='batched' (per_matrix is torch's bf16 function)")
        if ns_batch_numel is not None and (not isinstance(ns_batch_numel, int) or isinstance(
                ns_batch_numel, bool) or ns_batch_numel < 1):
            raise ValueError(f"ns_batch_numel must be an integer >= 1, got {ns_batch_numel!r}")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"adjust_lr_fn must be 'match_rms_adamw', 'original' or None, got "
                             f"{adjust_lr_fn!r}")
        muon, other = _split(params, muon_params)
        exempt = {id(p) for (_, p), off in zip(
            muon + other, no_decay_flags(no_decay, muon + other)) if off}
        if ns_batch_numel is None:
            ns_batch_numel = default_batch_numel(
                [p.shape for _, p in muon], muon[0][1].device if muon else torch.device("cpu"))

        def by_decay(pairs: list) -> list[tuple[list, float]]:  # (params, decay), non-empty
            on = [p for _, p in pairs if id(p) not in exempt]
            off = [p for _, p in pairs if id(p) in exempt]
            return [(ps, wd) for ps, wd in ((on, weight_decay), (off, 0.0)) if ps]

        groups = []
        for ps, wd in by_decay(muon):
            groups.append({"params": ps, "use_muon": True, "lr": lr,
                           "weight_decay": wd, "momentum": momentum,
                           "nesterov": nesterov, "ns_steps": ns_steps,
                           "ns_coefficients": (DEFAULT_A, DEFAULT_B, DEFAULT_C), "eps": EPS,
                           "adjust_lr_fn": adjust_lr_fn})
        adam = [{"params": ps, "use_muon": False, "weight_decay": wd}
                for ps, wd in by_decay(other)]
        self._adamw = torch.optim.AdamW(adam, lr=lr, betas=betas, eps=eps,
                                        weight_decay=weight_decay) if other else None
        groups += adam  # the same dicts: AdamW filled in its settings
        super().__init__(groups, {"lr": lr})
        # what LR schedulers look for (OneCycleLR, CyclicLR cycle it); not a default of the
        # groups, which have their own settings
        self.defaults["momentum" if muon else "betas"] = momentum if muon else tuple(betas)
        self.muon_names = [n for n, _ in muon]
        self.stats = CommStats()  # the intra-node all-to-alls of sharded matrices
        self.ns_mode, self.ns_batch_numel = ns_mode, ns_batch_numel
        self.ns_dtype = ns_dtype
        self._plans: dict[tuple[int, ...], _Plan] = {}  # by the ids of a group's params
        self._link()

    def _link(self) -> None:
        """Let the inner AdamW see this optimizer's groups and state (torch replaces both on
        ``load_state_dict``)."""
        if self._adamw is not None:
            self._adamw.param_groups = [g for g in self.param_groups if not g["use_muon"]]
            self._adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.stats.begin_step()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
        if self._adamw is not None:
            self._adamw.step()
        return loss

    def _muon_step(self, group: dict) -> None:
        from torch.optim._muon import _adjust_lr

        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        for p in params:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
        grads = [local_tensor(p.grad) for p in params]
        bufs = [local_tensor(self.state[p]["momentum_buffer"]) for p in params]
        mu = group["momentum"]
        torch._foreach_lerp_(bufs, grads, 1 - mu)
        plan = self._plan(params)
        lr, wd = group["lr"], group["weight_decay"]
        locals_ = [local_tensor(p) for p in params]
        if wd:
            torch._foreach_mul_(locals_, 1 - lr * wd)

        def write(idx: list[int], outs: Sequence[torch.Tensor]) -> None:
            write_updates(outs, [grads[i] for i in idx], [bufs[i] for i in idx], mu,
                          group["nesterov"])

        def apply(idx: list[int], ortho: Sequence[torch.Tensor]) -> None:
            scale = _adjust_lr(lr, group["adjust_lr_fn"], params[idx[0]].shape)
            torch._foreach_add_([locals_[i] for i in idx], list(ortho), alpha=-scale)

        for idx in plan.batches:  # whole matrices: one bounded batch of one shape at a time
            if self.ns_mode == "per_matrix":  # torch's function on each update, as torch's Muon
                g, b = [grads[i] for i in idx], [bufs[i] for i in idx]
                ups = list(torch._foreach_lerp(g, b, mu)) if group["nesterov"] else b
                apply(idx, orthogonalise(ups, group["ns_coefficients"], group["ns_steps"],
                                         group["eps"], "per_matrix"))
                continue
            stack = torch.empty((len(idx), *params[idx[0]].shape), dtype=torch.bfloat16,
                                device=locals_[idx[0]].device)
            write(idx, stack.unbind(0))
            apply(idx, self._ns(stack, group).unbind(0))
            del stack  # the batch's bytes are free before the next one's
        for pg, chunks in plan.sharded.items():  # bounded chunks: one exchange each way
            for idx in chunks:  # applied before the next chunk: its rows are freed
                def write_chunk(order: list[int], outs: Sequence[torch.Tensor],
                                idx: list[int] = idx) -> None:
                    write([idx[j] for j in order], outs)

                rows = orthogonalise_sharded(
                    [params[i].shape for i in idx], [grads[i] for i in idx], write_chunk,
                    pg, lambda stack: self._ns(stack, group), self.stats)
                for same in shape_groups([params[i].shape for i in idx]):
                    apply([idx[j] for j in same], [rows[j] for j in same])
                del rows

    def _plan(self, params: list) -> _Plan:
        """Which of ``params`` are whole or sharded, grouped by shape; cached for the last
        few lists of parameters (one per group; the same every step unless some have no
        gradient)."""
        key = tuple(map(id, params))
        plan = self._plans.get(key)
        if plan is None:
            whole: list[int] = []
            by_group: dict = {}
            for i, p in enumerate(params):
                layout = row_sharding(p)
                if layout is None:
                    whole.append(i)
                else:
                    by_group.setdefault(layout, []).append(i)
            # sharded matrices in chunks of at most ns_batch_numel entries per rank (by their
            # global shapes: every rank of a group cuts alike), one exchange each
            sharded: dict = {}
            for (pg, size), idx in by_group.items():
                chunks, total = sharded.setdefault(pg, [[]]), 0
                for i in idx:
                    if chunks[-1] and total + params[i].numel() > self.ns_batch_numel * size:
                        chunks.append([])
                        total = 0
                    chunks[-1].append(i)
                    total += params[i].numel()
            batches: list[list[int]] = []
            for same in shape_groups([params[i].shape for i in whole]):
                per = max(1, self.ns_batch_numel // max(1, params[whole[same[0]]].numel()))
                batches += [[whole[j] for j in same[k: k + per]]
                            for k in range(0, len(same), per)]
            if len(self._plans) >= 8:  # lists that change (gradients that come and go)
                self._plans.clear()
            plan = self._plans[key] = _Plan(whole, batches, sharded)
        return plan

    def _ns(self, stack: torch.Tensor, group: dict) -> torch.Tensor:
        """Newton-Schulz of a bf16 stack of one shape, which it consumes (``ns_mode``)."""
        coefficients, steps, eps = group["ns_coefficients"], group["ns_steps"], group["eps"]
        if self.ns_mode == "batched":
            return newton_schulz_(stack, coefficients, steps, eps,
                                  ns_compute_dtype(self.ns_dtype, stack.device))
        return torch.stack(orthogonalise(stack.unbind(0), coefficients, steps, eps,
                                         self.ns_mode))


def write_updates(outs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                  bufs: Sequence[torch.Tensor], momentum: float, nesterov: bool) -> None:
    """Muon's update of each matrix into ``outs`` (bf16, what Newton-Schulz computes in):
    Nesterov's look-ahead ``grad.lerp(buf, momentum)``, or the momentum buffer. The update
    is computed as torch does (in its dtype) and rounded once as it is stored: the same bits
    as forming it and then casting, without a copy of it in full precision."""
    if nesterov:
        for o, g, b in zip(outs, grads, bufs):
            torch.lerp(g, b, momentum, out=o)
    else:
        torch._foreach_copy_(list(outs), list(bufs))


def row_sharding(p: torch.Tensor):
    """``(process group, size)`` of a DTensor row-sharded over more than one rank, else
    ``None`` (a plain tensor, or one rank holding the whole matrix)."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is None or mesh.size() == 1:
        return None
    from torch.distributed.tensor import DTensor, Replicate, Shard

    placements = tuple(cast(DTensor, p).placements)  # a DTensor: it has a device mesh
    if all(isinstance(pl, Replicate) for pl in placements):
        return None
    if mesh.ndim != 1 or placements != (Shard(0),):
        raise ValueError(f"optimizer 'muon' supports matrices sharded by rows over one mesh "
                         f"dimension (FSDP2, Shard(0)); got placements {placements} on a "
                         f"{mesh.ndim}-D mesh")
    return mesh.get_group(), mesh.size()


def chunk_rows(rows: int, parts: int) -> list[int]:
    """Rows each rank holds when ``rows`` are split like ``torch.chunk`` (FSDP2's Shard(0))."""
    size = math.ceil(rows / parts)
    return [max(0, min(rows, (r + 1) * size) - r * size) for r in range(parts)]


def owners(shapes: list[torch.Size], parts: int) -> list[int]:
    """The rank that orthogonalises each matrix: the largest first, each to the least loaded
    rank (cost ~ rows x cols x min(rows, cols)); the same on every rank."""
    load = [0.0] * parts
    own = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-shapes[i][0] * shapes[i][1]
                                                       * min(shapes[i]), i)):
        r = min(range(parts), key=lambda r: (load[r], r))
        own[i] = r
        load[r] += shapes[i][0] * shapes[i][1] * min(shapes[i])
    return own


def _free_spent(buffer: torch.Tensor) -> None:
    """Free the bytes of a collective's spent ``buffer`` now (its views stay, empty). Dropping
    it is not enough: the process group's worker thread holds the collective's tensors until
    it drops its work, which gloo does a moment after the work completed and the collective
    returned (in 2-4% of all-to-alls on a loaded 2-core machine), and until then the bytes
    stay live beside the next buffer."""
    ReleasableStorages([buffer]).release()


def orthogonalise_sharded(shapes: list[torch.Size], local: list[torch.Tensor],
                          write: Callable[[list[int], list[torch.Tensor]], None], group,
                          ns: Callable[[torch.Tensor], torch.Tensor],
                          stats: CommStats) -> list[torch.Tensor]:
    """Orthogonalise row-sharded matrices whole: each on one owner rank of ``group``.

    ``local[i]`` has this rank's rows of a matrix of ``shapes[i]`` (its gradient: shape and
    device); ``write(indices, outs)`` writes the updates of those matrices' rows into ``outs``
    (bf16, the dtype the orthogonalisation computes in), here straight into the send buffer.
    One all-to-all sends every owner the rows of its matrices, the owner copies them into one
    stack per shape and runs ``ns`` on each (which may consume the stack), and a second
    all-to-all returns each rank its rows. Each buffer is freed once the next is made, so at
    most two of the chunk's size are live besides the Newton-Schulz workspace.
    """
    n, me = group_size(group), group_rank(group)
    rows = [chunk_rows(s[0], n) for s in shapes]
    for i, (t, s) in enumerate(zip(local, shapes)):
        if tuple(t.shape) != (rows[i][me], s[1]):
            raise ValueError(f"muon: a shard of a {tuple(s)} matrix has shape "
                             f"{tuple(t.shape)}, expected {(rows[i][me], s[1])} (torch.chunk "
                             "rows, as FSDP2 shards)")
    own = owners(shapes, n)
    mine = [i for i in range(len(shapes)) if own[i] == me]

    def size(r: int, owner: int) -> int:  # elements rank r holds of owner's matrices
        return sum(rows[i][r] * shapes[i][1] for i in range(len(shapes)) if own[i] == owner)

    def views(flat: torch.Tensor, idx: list[int], r: int) -> list[torch.Tensor]:
        """``flat`` cut into rank ``r``'s rows of matrices ``idx``, in order."""
        parts = flat.split([rows[i][r] * shapes[i][1] for i in idx])
        return [p.view(rows[i][r], shapes[i][1]) for i, p in zip(idx, parts)]

    to_owner = [size(me, o) for o in range(n)]
    from_ranks = [size(r, me) for r in range(n)]
    device = local[0].device
    order = sorted(range(len(shapes)), key=lambda i: own[i])  # grouped by owner, stable
    send = torch.empty(sum(to_owner), dtype=torch.bfloat16, device=device)
    write(order, views(send, order, me))
    recv = torch.empty(sum(from_ranks), dtype=torch.bfloat16, device=device)
    t0 = time.perf_counter()
    all_to_all(recv, send, from_ranks, to_owner, group)
    seconds = time.perf_counter() - t0
    _free_spent(send)
    del send
    # recv: for each source rank, its rows of each of my matrices, in matrix order
    groups = [[mine[j] for j in g] for g in shape_groups([shapes[i] for i in mine])]
    stacks = [torch.empty((len(g), *shapes[g[0]]), dtype=torch.bfloat16, device=device)
              for g in groups]
    dest = {i: stack[j] for g, stack in zip(groups, stacks) for j, i in enumerate(g)}
    starts = [[sum(rows[i][:r]) for r in range(n)] for i in range(len(shapes))]

    def rows_of(r: int, i: int, whole: torch.Tensor) -> torch.Tensor:  # rank r's rows of i
        return whole[starts[i][r]:starts[i][r] + rows[i][r]]

    pieces = recv.split(from_ranks)
    if mine:
        torch._foreach_copy_([rows_of(r, i, dest[i]) for r in range(n) for i in mine],
                             [v for r in range(n) for v in views(pieces[r], mine, r)])
    _free_spent(recv)
    del recv, pieces, dest
    done: dict[int, torch.Tensor] = {}
    for g in groups:  # each stack handed over: ns may work in its storage
        for i, r in zip(g, ns(stacks.pop(0)).unbind(0)):
            done[i] = r
    back = torch.empty(sum(from_ranks), dtype=torch.bfloat16, device=device)
    if mine:
        torch._foreach_copy_([v for r, part in enumerate(back.split(from_ranks))
                              for v in views(part, mine, r)],
                             [rows_of(r, i, done[i]) for r in range(n) for i in mine])
    del done
    result = torch.empty(sum(to_owner), dtype=torch.bfloat16, device=device)
    t0 = time.perf_counter()
    all_to_all(result, back, to_owner, from_ranks, group)
    seconds += time.perf_counter() - t0
    _free_spent(back)
    del back
    # bf16 (2 bytes) leaving and reaching this rank in both all-to-alls, not counting its own
    sent = 2 * (sum(to_owner) - to_owner[me] + sum(from_ranks) - from_ranks[me])
    stats.record(sent, sent, seconds, collectives=2)
    out: list = [None] * len(shapes)
    for i, v in zip(order, views(result, order, me)):
        out[i] = v
    return out
