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

from .dtensor import local_tensor
from .newton_schulz import NS_BATCH_NUMEL, NS_MODES, orthogonalise, shape_groups
from .transport import CommStats, all_to_all, group_rank, group_size

# name components of parameters that stay on AdamW although they are 2-D
HEAD_NAMES = frozenset({"head", "lm_head", "output", "classifier", "wte", "wpe", "tok", "pos"})

MuonRule = Callable[[str, torch.Tensor], bool]


class _Plan(NamedTuple):
    """How one list of Muon parameters is stepped: indices into it."""

    whole: list[int]  # matrices held whole by this rank
    batches: list[list[int]]  # those by shape, in batches of at most ns_batch_numel entries
    sharded: dict  # {process group: row-sharded matrices, in bounded chunks}
    by_shape: list[list[int]]  # every matrix by (global) shape: one lr adjustment each


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
        ns_batch_numel: the most entries a batch of whole matrices holds (default
            :data:`NS_BATCH_NUMEL`, 4M: 16 MiB in fp32): each batch's update is formed,
            orthogonalised and applied before the next, so the step's transient memory is
            bounded by a batch, not the model (None: every matrix of a shape at once). A
            matrix larger than the bound is a batch of its own. The same bits either way.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, *, weight_decay: float = 0.0,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 adjust_lr_fn: str | None = "match_rms_adamw",
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 muon_params: MuonRule | Collection[str] | None = None,
                 ns_mode: str = "batched", ns_batch_numel: int | None = None) -> None:
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
        if ns_batch_numel is None:
            ns_batch_numel = NS_BATCH_NUMEL
        if not isinstance(ns_batch_numel, int) or isinstance(ns_batch_numel, bool) \
                or ns_batch_numel < 1:
            raise ValueError(f"ns_batch_numel must be an integer >= 1, got {ns_batch_numel!r}")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"adjust_lr_fn must be 'match_rms_adamw', 'original' or None, got "
                             f"{adjust_lr_fn!r}")
        muon, other = _split(params, muon_params)
        groups = []
        if muon:
            groups.append({"params": [p for _, p in muon], "use_muon": True, "lr": lr,
                           "weight_decay": weight_decay, "momentum": momentum,
                           "nesterov": nesterov, "ns_steps": ns_steps,
                           "ns_coefficients": (DEFAULT_A, DEFAULT_B, DEFAULT_C), "eps": EPS,
                           "adjust_lr_fn": adjust_lr_fn})
        adam = {"params": [p for _, p in other], "use_muon": False}
        self._adamw = torch.optim.AdamW([adam], lr=lr, betas=betas, eps=eps,
                                        weight_decay=weight_decay) if other else None
        if other:
            groups.append(adam)  # the same dict: AdamW filled in its settings
        super().__init__(groups, {"lr": lr})
        self.muon_names = [n for n, _ in muon]
        self.stats = CommStats()  # the intra-node all-to-alls of sharded matrices
        self.ns_mode, self.ns_batch_numel = ns_mode, ns_batch_numel
        self._plan_key: tuple[int, ...] = ()
        self._plan_value = _Plan([], [], {}, [])
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

        def update(idx: list[int]) -> list[torch.Tensor]:  # Nesterov's look-ahead, or the buffer
            g, b = [grads[i] for i in idx], [bufs[i] for i in idx]
            return list(torch._foreach_lerp(g, b, mu)) if group["nesterov"] else b

        def apply(idx: list[int], ortho: Sequence[torch.Tensor]) -> None:
            scale = _adjust_lr(lr, group["adjust_lr_fn"], params[idx[0]].shape)
            torch._foreach_add_([locals_[i] for i in idx], list(ortho), alpha=-scale)

        for idx in plan.batches:  # whole matrices: one bounded batch of one shape at a time
            apply(idx, self._ns(update(idx), group, [list(range(len(idx)))]))
        if plan.sharded:
            out = self._orthogonalise_sharded(params, update, group, plan)
            for idx in plan.by_shape:
                idx = [i for i in idx if out[i] is not None]
                if idx:
                    apply(idx, [out[i] for i in idx])

    def _plan(self, params: list) -> _Plan:
        """Which of ``params`` are whole or sharded, grouped by shape; cached for the last
        list of parameters (the same every step unless some have no gradient)."""
        key = tuple(map(id, params))
        if key != self._plan_key:
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
            self._plan_key = key
            batches: list[list[int]] = []
            for same in shape_groups([params[i].shape for i in whole]):
                per = max(1, self.ns_batch_numel // max(1, params[whole[same[0]]].numel()))
                batches += [[whole[j] for j in same[k: k + per]]
                            for k in range(0, len(same), per)]
            self._plan_value = _Plan(whole, batches, sharded,
                                     shape_groups([p.shape for p in params]))
        return self._plan_value

    def _ns(self, mats: Sequence[torch.Tensor], group: dict,
            groups: list[list[int]] | None = None) -> list[torch.Tensor]:
        """Newton-Schulz of ``mats`` (``ns_mode``; ``groups``: which share a batch)."""
        return orthogonalise(mats, group["ns_coefficients"], group["ns_steps"], group["eps"],
                             self.ns_mode, groups)

    def _orthogonalise_sharded(self, params: list, update, group: dict, plan: _Plan) -> list:
        """Newton-Schulz of the row-sharded matrices (``update(indices)``: their updates),
        each whole on one owner; each rank gets its rows back (None for the others)."""
        def ns(mats: Sequence[torch.Tensor],
               groups: list[list[int]] | None = None) -> list[torch.Tensor]:
            return self._ns(mats, group, groups)

        out: list = [None] * len(params)
        for group_pg, chunks in plan.sharded.items():
            for idx in chunks:  # bounded chunks: one all-to-all there and back each
                results = orthogonalise_sharded([params[i].shape for i in idx], update(idx),
                                                group_pg, ns, self.stats)
                for i, r in zip(idx, results):
                    out[i] = r
        return out


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


def orthogonalise_sharded(shapes: list[torch.Size], local: list[torch.Tensor], group,
                          ns: Callable[[list[torch.Tensor]], list[torch.Tensor]],
                          stats: CommStats) -> list[torch.Tensor]:
    """Orthogonalise row-sharded matrices whole: each on one owner rank of ``group``.

    ``local[i]`` are this rank's rows of a matrix of ``shapes[i]``. One all-to-all sends every
    owner the rows of its matrices (as bf16, the dtype the orthogonalisation computes in), the
    owner runs ``ns`` on the list of its whole matrices (one batched call per shape in
    :class:`MuonAdamW`'s default mode), and a second all-to-all returns each rank its rows.
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

    to_owner = [size(me, o) for o in range(n)]
    from_ranks = [size(r, me) for r in range(n)]
    device = local[0].device
    order = sorted(range(len(shapes)), key=lambda i: own[i])  # grouped by owner, stable
    send = torch.cat([local[i].reshape(-1).to(torch.bfloat16) for i in order])
    recv = torch.empty(sum(from_ranks), dtype=torch.bfloat16, device=device)
    t0 = time.perf_counter()
    all_to_all(recv, send, from_ranks, to_owner, group)
    seconds = time.perf_counter() - t0
    # recv: for each source rank, its rows of each of my matrices, in matrix order
    pieces = list(recv.split(from_ranks))
    whole: dict[int, list[torch.Tensor]] = {}
    for r in range(n):
        parts = pieces[r].split([rows[i][r] * shapes[i][1] for i in mine])
        for i, part in zip(mine, parts):
            whole.setdefault(i, []).append(part.view(rows[i][r], shapes[i][1]))
    done = {i: r.to(torch.bfloat16) for i, r in zip(mine, ns([torch.cat(whole[i]) for i in mine]))}
    back = torch.cat([done[i][sum(rows[i][:r]):sum(rows[i][:r + 1])].reshape(-1)
                      for r in range(n) for i in mine]) if mine else recv.new_empty(0)
    result = torch.empty(sum(to_owner), dtype=torch.bfloat16, device=device)
    t0 = time.perf_counter()
    all_to_all(result, back, to_owner, from_ranks, group)
    seconds += time.perf_counter() - t0
    # bf16 (2 bytes) leaving and reaching this rank in both all-to-alls, not counting its own
    sent = 2 * (send.numel() - to_owner[me] + back.numel() - from_ranks[me])
    received = 2 * (recv.numel() - from_ranks[me] + result.numel() - to_owner[me])
    stats.record(sent, received, seconds, collectives=2)
    out: list = [None] * len(shapes)
    chunks = result.split([rows[i][me] * shapes[i][1] for i in order])
    for i, c in zip(order, chunks):
        out[i] = c.view(rows[i][me], shapes[i][1])
    return out
