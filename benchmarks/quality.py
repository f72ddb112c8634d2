"""Quality against AdamW: strategies x learning rates x seeds on the byte-level GPT task.

Every configuration trains N replicas in one process with :class:`flexdemo.SimulatedReplicas`
(bitwise the weights N gloo processes would reach); each replica draws its own batches, as a
rank would. Every strategy is compared at its own best learning rate from a small grid (the
lowest mean final validation loss over the seeds), against the best-lr AdamW with a full
gradient all-reduce and against no synchronisation at all. Usage::

    python benchmarks/quality.py --quick                       # tiny GPT, ~20 min on 2 cores
    python benchmarks/quality.py --device cuda --workers 1     # 10.9M GPT, 1000 steps, 2 and 4
    python benchmarks/quality.py --quick --strategies adamw,demo --schedule constant --warmup 0

Writes ``quality.json`` (every run with its validation curve, and the summary), ``quality.csv``
(one row per replicas x strategy x lr), ``quality.png`` (validation loss against steps of
every strategy at its best lr, mean over seeds with the min-max band) and ``frontier.png``
(each strategy's loss against full sync with its own inner optimizer, against bytes per
parameter per step, log scale) to ``--out``, and prints the table. ``--long`` is the field's
horizon: the mini GPT at 5,000 steps on 2, 4 and 8 replicas. All strategies use the same
batch per replica, so equal steps are equal tokens. ``--ns-dtype fp32`` runs Muon's
Newton-Schulz iterations in fp32 in every strategy with Muon (10-20x cheaper on a CPU without
bf16 matrix units; not torch's bits, so runs merge only with runs of the same precision).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import torch

from flexdemo import SimulatedReplicas
from flexdemo.app.args import Parser, usage_exit
from flexdemo.app.schedule import SCHEDULES, lr_at
from flexdemo.app.tasks import (
    GPT,
    PRESETS,
    ByteWindows,
    ShardSampler,
    eval_indices,
    get_batch,
    gpt_config,
    load_corpus,
)


def beside(name: str) -> ModuleType:
    """The script ``name``.py beside this one, loaded from its file (benchmarks/ is not a
    package, and this script edits no ``sys.path``); registered under ``name`` so that its
    dataclasses, and spawned workers unpickling its classes, find it."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent
                                                  / f"{name}.py")
    assert spec is not None and spec.loader is not None, name
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# the prototypes that did not help (benchmarks/prototypes.py), to run their rows again
prototypes = beside("prototypes")
KeepDiLoCo, LookaheadDeMo, ResidualDiLoCo = (
    prototypes.KeepDiLoCo, prototypes.LookaheadDeMo, prototypes.ResidualDiLoCo)


@dataclass(frozen=True)
class Setting:
    """One strategy of the benchmark: a replicator, a base optimizer, and the lowest lr of its
    grid (``--lr-grid`` multiplies it)."""

    about: str
    replicator: str
    optimizer: str
    lr: float
    replicator_kwargs: dict[str, Any] = field(default_factory=dict)
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)


# The bench's tuned DeMo (flexdemo.strategies "flexdemo") and DiLoCo H=20 are here with the
# library defaults; the variants measure the hypotheses (momentum decay, no lr scaling
# of the momentum, DiLoCo's outer step).
# the dense 1-bit exchange: stat1 values (blocks of 256), error feedback 0.9, gathered; its
# variants below change one setting each
STAT1_GATHER = {"values": "stat1", "block": 256, "error_feedback": 0.9, "reduce": "gather"}
# the replicator each family of frontier settings below runs: our variants, which the names
# "muloco" and "sparseloco" meant when these settings were measured (before issue 57)
VARIANT = {"muloco": "muloco-int4", "sparseloco": "sparseloco-dct"}
# AdamW as the field tunes it: betas (0.9, 0.95), decoupled weight decay 0.1
TUNED_ADAMW = {"weight_decay": 0.1, "base_kwargs": {"betas": (0.9, 0.95)}}

SETTINGS: dict[str, Setting] = {
    "adamw": Setting("AdamW, full fp32 gradient all-reduce every step", "full", "adamw", 1e-3),
    "no-sync": Setting("AdamW, no replication (every replica trains alone)", "none", "adamw",
                       1e-3),
    "demo": Setting("DeMo at the library defaults (topk 16, int2, decay 0.999), sign-SGD",
                    "demo", "sgd", 1e-3),
    "demo-d0.9-k64": Setting("DeMo decay 0.9, topk 64 (the bench's tuned setting), sign-SGD",
                             "demo", "sgd", 1e-3, {"decay": 0.9, "topk": 64}),
    "demo-d0.99": Setting("DeMo decay 0.99 (topk 16, int2), sign-SGD", "demo", "sgd", 1e-3,
                          {"decay": 0.99}),
    "demo-d0.9": Setting("DeMo decay 0.9 (topk 16, int2), sign-SGD", "demo", "sgd", 1e-3,
                         {"decay": 0.9}),
    "demo-k32-fp32": Setting("DeMo as the reference implementation: topk 32, fp32 values, "
                             "decay 0.999, sign-SGD", "demo", "sgd", 1e-3,
                             {"topk": 32, "values": "fp32"}),
    "demo-bf16-dct": Setting("DeMo defaults with the forward transform's products in bf16 "
                             "(transform_dtype='bf16')", "demo", "sgd", 1e-3,
                             {"transform_dtype": "bf16"}),
    "demo-bf16-momentum": Setting("DeMo defaults with the momentum (its error feedback) kept "
                                  "in bf16, rounded stochastically (momentum_dtype='bf16')",
                                  "demo", "sgd", 1e-3, {"momentum_dtype": "bf16"}),
    "demo-fp32": Setting("DeMo defaults with fp32 values (topk 16, decay 0.999), sign-SGD",
                         "demo", "sgd", 1e-3, {"values": "fp32"}),
    "demo-noscale": Setting("DeMo defaults, momentum without the lr factor "
                            "(scale_by_lr=False)", "demo", "sgd", 1e-3,
                            {"scale_by_lr": False}),
    # the outer Nesterov step (lr 0.7, momentum 0.9) amplifies the inner steps: its best inner
    # lr is lower (3e-4 on the 10.9M GPT), inside the default grids
    "diloco": Setting("DiLoCo H=20, outer Nesterov lr 0.7 momentum 0.9 (the paper's)",
                      "diloco", "adamw", 1e-3, {"inner_steps": 20, "outer_lr": 0.7,
                                                "outer_momentum": 0.9}),
    "diloco-avg": Setting("DiLoCo H=20, plain averaging (outer lr 1.0, momentum 0: the "
                          "library's default until issue 57)", "diloco",
                          "adamw", 1e-3, {"inner_steps": 20, "outer_lr": 1.0,
                                          "outer_momentum": 0.0}),
    "diloco-0.5": Setting("DiLoCo H=20, outer lr 0.5 momentum 0.5", "diloco", "adamw", 1e-3,
                          {"inner_steps": 20, "outer_lr": 0.5, "outer_momentum": 0.5}),
    # the compression-free limit of DeMo: every coefficient sent, so nothing stays in the
    # momentum and the step is sign-SGD of the mean gradient
    "demo-dense": Setting("DeMo sending all 4096 coefficients of a block in fp32 (no "
                          "compression): sign-SGD of the mean gradient", "demo", "sgd", 1e-3,
                          {"topk": 4096, "values": "fp32"}),
    # an average of the signed updates over about 10 steps (SGD momentum 0.9 with dampening
    # 0.9: an EMA, so a step moves a parameter by at most lr, as sign-SGD does)
    "demo-ema": Setting("DeMo defaults, sign-SGD through an EMA (momentum 0.9, dampening 0.9) "
                        "of the signed updates", "demo", "sgd", 1e-3, {},
                        {"base_kwargs": {"momentum": 0.9, "dampening": 0.9}}),
    # the decoded mean as AdamW's gradient instead of its sign
    "demo-adamw": Setting("DeMo defaults (topk 16, int2, decay 0.999) without sign or lr "
                          "scaling; the decoded mean drives AdamW", "demo", "adamw", 1e-3,
                          {"sign": False, "scale_by_lr": False}),
    # SparseLoCo: DiLoCo whose pseudo-gradient is sent as top-k of each 64 x 64 block (64 of
    # 4096) with 2-bit values and an error-feedback buffer (decay 0.95), plain outer averaging
    "sparseloco": Setting("DiLoCo H=20, pseudo-gradient top-64/4096 int2 with error feedback "
                          "(decay 0.95), outer lr 1.0 momentum 0", "diloco", "adamw", 1e-3,
                          {"inner_steps": 20, "outer_lr": 1.0, "outer_momentum": 0.0,
                           "exchange": "topk",
                           "exchange_kwargs": {"topk": 64, "values": "int2", "decay": 0.95}}),
    # the sign step with nothing compressed: Lion on the exact mean gradient
    "lion": Setting("Lion (betas 0.9 / 0.99) on the full fp32 mean gradient: a sign step "
                    "with nothing compressed", "full", "lion", 3e-4),
    # DeMo's decoded mean as Lion's gradient: its momentum gathers the coefficients sent over
    # several steps before the sign (betas 0 / 0 would be sign-SGD DeMo)
    "demo-lion": Setting("DeMo defaults without sign or lr scaling; the decoded mean drives "
                         "Lion (betas 0.9 / 0.99)", "demo", "lion", 3e-4,
                         {"sign": False, "scale_by_lr": False}),
    # plain averaging at other sync intervals: H sets the bytes (0.2 B/param/step at H=20)
    **{f"diloco-h{h}": Setting(f"DiLoCo H={h}, plain averaging (outer lr 1.0, momentum 0)",
                               "diloco", "adamw", 1e-3, {"inner_steps": h, "outer_lr": 1.0,
                                                         "outer_momentum": 0.0})
       for h in (5, 10, 50, 100)},
    # about the defaults' bytes (0.008 B/param/step) in other splits of index and value bits
    "demo-k17-sign": Setting("DeMo topk 17, sign values with a magnitude per block (about "
                             "the defaults' bytes)", "demo", "sgd", 1e-3,
                             {"topk": 17, "values": "sign"}),
    "demo-k8-int8": Setting("DeMo topk 8, int8 values (fewer bytes than the defaults)",
                            "demo", "sgd", 1e-3, {"topk": 8, "values": "int8"}),
    "demo-k6-bf16": Setting("DeMo topk 6, bf16 values (fewer bytes than the defaults)",
                            "demo", "sgd", 1e-3, {"topk": 6, "values": "bf16"}),
    "demo-k64": Setting("DeMo topk 64 (decay 0.999, int2), sign-SGD", "demo", "sgd", 1e-3,
                        {"topk": 64}),
    # a denser start: topk 64 for the first N steps, then the defaults' 16 (demo-warmup)
    **{f"demo-warm{n}": Setting(f"DeMo topk 64 for {n} steps, then the defaults (topk 16, "
                                "int2, decay 0.999), sign-SGD", "demo-warmup", "sgd", 1e-3,
                                {"warmup_topk": 64, "warmup_steps": n})
       for n in (30, 60, 120, 200)},
    # Nesterov-style DeMo (the prototype below): select and send the look-ahead
    **{f"demo-nesterov{tag}": Setting(f"DeMo{about}, selecting and sending the look-ahead "
                                      "decay * m + s * DCT(g) (a prototype), sign-SGD",
                                      "demo-lookahead", "sgd", 1e-3, kw)
       for tag, about, kw in (("", " defaults", {}), ("-k64", " topk 64", {"topk": 64}),
                              ("-d0.9-k64", " decay 0.9, topk 64", {"decay": 0.9, "topk": 64}))},
    # overlapped syncs: the exchange launched after step t is applied after step t + tau (the
    # tau local steps in between are replaced by the global parameters unless alpha > 0);
    # streaming: 4 fragments, one synced every 5 steps
    **{f"diloco{f}-tau{tau}{a}": Setting(
        f"DiLoCo H=20{' in 4 fragments' if f else ''}, applied {tau} steps after launch"
        f"{', local mixed in at alpha 0.5' if a else ''}, plain averaging", "diloco", "adamw",
        1e-3, {"inner_steps": 20, "outer_lr": 1.0, "outer_momentum": 0.0, "tau": tau,
               "fragments": 4 if f else 1, "alpha": 0.5 if a else 0.0})
       for f, tau, a in (("", 1, ""), ("", 4, ""), ("", 4, "-a0.5"), ("", 10, ""),
                         ("-f4", 0, ""), ("-f4", 1, ""), ("-f4", 4, ""),
                         ("-f4", 4, "-a0.5"))},
    # eager-style overlap (the prototype below): a replica keeps the tau local steps it took
    # while its sync was in flight, on top of the new global parameters
    **{f"diloco{f}-tau{tau}-keep": Setting(
        f"DiLoCo H=20{' in 4 fragments' if f else ''}, applied {tau} steps after launch, the "
        "local steps taken meanwhile kept (a prototype), plain averaging", "diloco-keep",
        "adamw", 1e-3, {"inner_steps": 20, "outer_lr": 1.0, "outer_momentum": 0.0, "tau": tau,
                        "fragments": 4 if f else 1})
       for f, tau in (("", 1), ("", 4), ("", 10), ("-f4", 4))},
    # the Muon family: Muon on the hidden matrices, AdamW on embeddings, head, norms and biases
    # (optimizer "muon", match_rms_adamw scaling: one lr for both parts)
    "muon": Setting("Muon + AdamW, full fp32 gradient all-reduce every step", "full", "muon",
                    1e-2),
    "muon-no-sync": Setting("Muon + AdamW, no replication (every replica trains alone)",
                            "none", "muon", 1e-2),
    # MuLoCo: DiLoCo with Muon inner steps and plain averaging of the pseudo-gradient
    **{f"muloco-h{h}{tag}": Setting(
        f"MuLoCo: DiLoCo H={h}{' in 4 fragments' if f > 1 else ''}, Muon inner steps, plain "
        f"averaging, {about} exchange", "diloco", "muon", 1e-2,
        {"inner_steps": h, "outer_lr": 1.0, "outer_momentum": 0.0, "fragments": f,
         **({"exchange_kwargs": {"values": v}} if v != "fp32" else {})})
       for h, f, v, tag, about in ((20, 1, "fp32", "", "fp32"), (20, 1, "int4", "-int4", "int4"),
                                   (50, 1, "int4", "-int4", "int4"),
                                   (60, 1, "int4", "-int4", "int4"),
                                   (100, 1, "int4", "-int4", "int4"),
                                   (20, 4, "int4", "-f4-int4", "int4"))},
    # the int4 mean by reduce-scatter, re-quantisation and all-gather: bytes flat in the group
    **{f"muloco-h{h}-int4-rs": Setting(
        f"MuLoCo: DiLoCo H={h}, Muon inner steps, plain averaging, int4 exchange by "
        "reduce-scatter (the mean re-quantised; bytes flat in the number of replicas)",
        "diloco", "muon", 1e-2,
        {"inner_steps": h, "outer_lr": 1.0, "outer_momentum": 0.0,
         "exchange_kwargs": {"values": "int4", "reduce": "scatter"}})
       for h in (20, 30, 40)},
    "muloco-h20-int4-bf16-global": Setting(
        "MuLoCo: DiLoCo H=20, Muon inner steps, plain averaging, int4 exchange, the global copy "
        "in bf16, rounded stochastically (global_dtype='bf16')", "diloco", "muon", 1e-2,
        {"inner_steps": 20, "outer_lr": 1.0, "outer_momentum": 0.0, "global_dtype": "bf16",
         "exchange_kwargs": {"values": "int4"}}),
    "muloco-h20-int4-outer": Setting("MuLoCo H=20, int4 exchange, outer Nesterov lr 0.7 "
                                     "momentum 0.9 (the DiLoCo paper's outer step)", "diloco",
                                     "muon", 1e-2, {"inner_steps": 20, "outer_lr": 0.7,
                                                    "outer_momentum": 0.9,
                                                    "exchange_kwargs": {"values": "int4"}}),
    "muloco-h20-int4-outer-bf16-global": Setting(
        "MuLoCo H=20, int4 exchange, outer Nesterov lr 0.7 momentum 0.9, the global copy in "
        "bf16 (global_dtype='bf16': its rounding enters the outer step)", "diloco", "muon",
        1e-2, {"inner_steps": 20, "outer_lr": 0.7, "outer_momentum": 0.9,
               "global_dtype": "bf16", "exchange_kwargs": {"values": "int4"}}),
    "muloco-h20-topk": Setting("MuLoCo H=20 with a top-64/4096 int2 pseudo-gradient and error "
                               "feedback (decay 0.95)", "diloco", "muon", 1e-2,
                               {"inner_steps": 20, "outer_lr": 1.0, "outer_momentum": 0.0,
                                "exchange": "topk",
                                "exchange_kwargs": {"topk": 64, "values": "int2",
                                                    "decay": 0.95}}),
    # DeMo whose decoded mean is orthogonalised (Muon with momentum 0) instead of sign()d, or
    # drives a whole local Muon step (momentum 0.95, Nesterov)
    **{f"demo-{kind}{tag}": Setting(
        f"DeMo topk {k} (int2, decay {d}), decoded mean "
        + ("orthogonalised (Muon momentum 0)" if kind == "ortho" else
           "as the gradient of a local Muon step (momentum 0.95)"),
        "demo", "muon", 1e-2, {"topk": k, "decay": d, "sign": False, "scale_by_lr": False},
        {"base_kwargs": {"momentum": 0.0}} if kind == "ortho" else {})
       for kind in ("ortho", "muon")
       for k, d, tag in ((16, 0.999, ""), (16, 0.9, "-d0.9"), (64, 0.999, "-k64"),
                         (64, 0.9, "-k64-d0.9"))},
    # the residual prototype (benchmarks/prototypes.py): SparseLoCo's compression in the
    # parameters' layout, replicas restarting from the global parameters (keep=False) or
    # keeping their own unsent progress (keep=True)
    **{f"residual{tag}": Setting(f"prototype: sparse DiLoCo H={h}, top-{k} of 4096 stat2, error "
                                 f"feedback {d}, {'keeping' if keep else 'dropping'} the unsent "
                                 "progress", "diloco-residual", "muon", 1e-2,
                                 {"inner_steps": h, "outer_lr": 1.0, "outer_momentum": 0.0,
                                  "topk": k, "decay": d, "keep": keep})
       for tag, h, k, d, keep in (("-drop", 30, 64, 0.95, False), ("-keep", 30, 64, 0.95, True),
                                  ("-keep-d1", 30, 64, 1.0, True),
                                  ("-keep-h10-k16", 10, 16, 1.0, True),
                                  ("-keep-k256", 30, 256, 1.0, True))},
    # the low-rank prototype (benchmarks/prototypes.py): each matrix's pseudo-gradient (with
    # error feedback) as rank-r bf16 factors, replicas restarting from the global parameters;
    # AdamW inner steps tuned as the field tunes them (betas 0.9/0.95, weight decay 0.1), or Muon
    **{f"lowrank{tag}{itag}": Setting(
        f"prototype: DiLoCo H={h}, pseudo-gradient as rank-{r} bf16 factors (error feedback "
        f"{d}; other tensors stat2), outer lr 1.0, {inner} inner steps", "diloco-lowrank",
        opt, lr,
        {"inner_steps": h, "outer_lr": 1.0, "outer_momentum": 0.0, "approx_rank": r, "decay": d},
        okw)
       for itag, opt, lr, inner, okw in (
           ("-adamw", "adamw", 1e-3, "AdamW (0.9, 0.95, weight decay 0.1)",
            {"weight_decay": 0.1, "base_kwargs": {"betas": (0.9, 0.95)}}),
           ("", "muon", 1e-2, "Muon", {}))
       for tag, h, r, d in (("-r1", 30, 1, 0.95), ("-r2-h60", 60, 2, 0.95),
                            ("-r4-h100", 100, 4, 0.95), ("-r1-d1", 30, 1, 1.0))},
    "sparseloco-adamw-b95-wd": Setting(
        "the 'sparseloco-dct' preset (named 'sparseloco' before issue 57), AdamW inner steps "
        "(0.9, 0.95, weight decay 0.1)", "sparseloco-dct",
        "adamw", 1e-3, {}, {"weight_decay": 0.1, "base_kwargs": {"betas": (0.9, 0.95)}}),
    "no-sync-b95-wd": Setting("AdamW betas (0.9, 0.95), weight decay 0.1, no replication",
                              "none", "adamw", 1e-3, {},
                              {"weight_decay": 0.1, "base_kwargs": {"betas": (0.9, 0.95)}}),
    # full-sync baselines tuned as the field tunes them: AdamW betas (0.9, 0.95) or
    # (0.9, 0.999), decoupled weight decay 0 or 0.1; Muon with weight decay 0.1
    **{f"adamw{tag}": Setting(f"AdamW betas (0.9, {b2}), weight decay {wd}, full fp32 gradient "
                              "all-reduce every step", "full", "adamw", 1e-3, {},
                              {"weight_decay": wd, "base_kwargs": {"betas": (0.9, b2)}})
       for tag, b2, wd in (("-b95", 0.95, 0.0), ("-b95-wd", 0.95, 0.1), ("-wd", 0.999, 0.1))},
    "muon-wd": Setting("Muon + AdamW, weight decay 0.1, full fp32 gradient all-reduce every "
                       "step", "full", "muon", 1e-2, {}, {"weight_decay": 0.1}),
    "no-sync-b95": Setting("AdamW betas (0.9, 0.95), no replication", "none", "adamw", 1e-3,
                           {}, {"base_kwargs": {"betas": (0.9, 0.95)}}),
    # the papers' presets (flexdemo.replicate.frontier, issue 57), Muon or AdamW inner steps
    **{f"{preset}-paper{tag}": Setting(f"the {preset!r} preset (the paper's algorithm), {inner} "
                                       "inner steps", preset, inner,
                                       1e-2 if inner == "muon" else 1e-3, {})
       for inner, tag in (("muon", ""), ("adamw", "-adamw"))
       for preset in ("muloco", "sparseloco")},
    # our variants of them (flexdemo.replicate.frontier) with Muon or AdamW inner steps, and
    # their variants: one setting changed at a time. The settings keep the names they were
    # measured under (benchmarks/archive/): "muloco..." runs the "muloco-int4" preset and
    # "sparseloco..." the "sparseloco-dct" preset, which the names "muloco" and "sparseloco"
    # meant before issue 57
    **{f"{preset}{tag}": Setting(f"the {VARIANT[preset.split('-')[0]]!r} preset (named "
                                 f"{preset.split('-')[0]!r} before issue 57), {inner} inner "
                                 f"steps{about}", VARIANT[preset.split("-")[0]], inner,
                                 1e-2 if inner == "muon" else 1e-3, kw)
       for inner, tag0 in (("muon", ""), ("adamw", "-adamw"))
       for preset, tag1, about, kw in (
           ("muloco", "", "", {}),
           ("muloco", "-avg", ", outer lr 1.0 without momentum", {"outer_lr": 1.0,
                                                                  "outer_momentum": 0.0}),
           ("muloco", "-h20", ", H=20", {"inner_steps": 20}),
           ("muloco", "-h50", ", H=50", {"inner_steps": 50}),
           ("muloco", "-int2", ", int2 values", {"exchange_kwargs": {"values": "int2"}}),
           ("muloco", "-stat2", ", 2-bit codebook values",
            {"exchange_kwargs": {"values": "stat2"}}),
           ("muloco", "-stat3", ", 3-bit codebook values",
            {"exchange_kwargs": {"values": "stat3"}}),
           *((f"muloco{h}", f"-{v}-ef", f"{', H=' + h[2:] if h else ''}, {v} values with error "
              "feedback (decay 0.9)",
              {**({"inner_steps": int(h[2:])} if h else {}),
               "exchange_kwargs": {"values": v, "error_feedback": 0.9}})
             for h in ("", "-h60", "-h64") for v in ("int2", "stat2", "int3")),
           # 1-bit codebook values (two bins split at the block mean) with error feedback:
           # 4 bytes + 1 bit per block of 256 at H=30, or per block of 128 at H=40
           ("muloco", "-stat1-ef", ", stat1 values (block 256) with error feedback (decay 0.9)",
            {"exchange_kwargs": {"values": "stat1", "block": 256, "error_feedback": 0.9}}),
           ("muloco", "-stat1-ef-h40", ", H=40, stat1 values (block 128) with error feedback "
            "(decay 0.9)", {"inner_steps": 40, "exchange_kwargs": {
                "values": "stat1", "error_feedback": 0.9}}),
           ("muloco", "-stat1-ef-gather", ", stat1 values (block 256) with error feedback (decay "
            "0.9), gathered: no second rounding of the mean by its owner (the same bytes at 2 "
            "replicas)", {"exchange_kwargs": {**STAT1_GATHER}}),
           ("muloco", "-stat1-ef-gather-m0.9", ", stat1 values (block 256) with error "
            "feedback (decay 0.9), gathered, outer Nesterov lr 0.7 with momentum 0.9",
            {"outer_lr": 0.7, "outer_momentum": 0.9, "exchange_kwargs": {**STAT1_GATHER}}),
           ("muloco", "-stat1-ef1-gather", ", stat1 values (block 256) with error feedback "
            "(decay 1.0), gathered", {"exchange_kwargs": {**STAT1_GATHER, "error_feedback": 1.0}}),
           ("muloco", "-stat1-ef-gather-avg", ", stat1 values (block 256) with error feedback "
            "(decay 0.9), gathered, outer lr 1.0 without momentum (plain averaging)",
            {"outer_lr": 1.0, "outer_momentum": 0.0, "exchange_kwargs": {**STAT1_GATHER}}),
           # a dense low-bit exchange at a long period, at the sparse preset's bytes (about
           # 0.001 B/param/step): fewer, fuller syncs instead of frequent sparse ones
           *(("muloco", f"-h{h}-{v}-ef-gather", f", H={h}, {v} values (block 256) with error "
              "feedback (decay 0.9), gathered",
              {"inner_steps": h, "exchange_kwargs": {"values": v, "block": 256,
                                                     "error_feedback": 0.9, "reduce": "gather"}})
             for h, v in ((150, "stat1"), (300, "stat2"))),
           # the owner's second coding of the mean (reduce-scatter) with and without its own
           # error feedback (owner_error_feedback: the replicas' decay, 0.9, or 0.5); the same bytes
           *(("muloco", f"-{v}-ef-{tag}", f", {v} values{about} with error feedback (decay 0.9), "
              + (f"the owner's error feedback (decay {0.9 if on is True else on})" if on else
                 "without the owner's error feedback"),
              {"exchange_kwargs": {"values": v, **extra, "error_feedback": 0.9,
                                   "owner_error_feedback": on}})
             for v, about, extra in (("stat1", " (block 256)", {"block": 256}), ("int2", "", {}))
             for tag, on in (("oef", True), ("nooef", None), ("oef-d0.5", 0.5))),
           ("sparseloco", "", "", {}),
           ("sparseloco", "-int2", ", int2 values (lo/hi per block)",
            {"exchange_kwargs": {"values": "int2"}}),
           ("sparseloco", "-senders", ", each coordinate over the replicas that sent it",
            {"exchange_kwargs": {"mean": "senders"}}),
           ("sparseloco", "-clip", ", peers clipped to the median norm",
            {"exchange_kwargs": {"clip": "median"}}),
           ("sparseloco", "-nodct", ", plain blocks (no DCT)", {"exchange": "topk",
                                                                  "exchange_kwargs": {
               "topk": 64, "values": "stat2", "decay": 0.95}}),
           ("sparseloco", "-templar", ", SparseLoCo's own: plain blocks, each coordinate "
            "over its senders", {"exchange": "topk", "exchange_kwargs": {
                "topk": 64, "values": "stat2", "decay": 0.95, "mean": "senders"}}),
           ("sparseloco", "-h20", ", H=20", {"inner_steps": 20}),
           ("sparseloco", "-k128", ", top-128", {"exchange_kwargs": {"topk": 128}}),
           ("sparseloco", "-k256", ", top-256", {"exchange_kwargs": {"topk": 256}}),
           ("sparseloco", "-d0.9", ", error-feedback decay 0.9",
            {"exchange_kwargs": {"decay": 0.9}}),
           ("sparseloco", "-d1", ", error-feedback decay 1.0", {"exchange_kwargs": {"decay": 1.0}}),
           ("sparseloco", "-nest", ", outer Nesterov 0.7 / 0.6 over error feedback 0.95",
            {"outer_lr": 0.7, "outer_momentum": 0.6}),
           ("sparseloco", "-rs", ", the mean by reduce-scatter over block owners",
            {"exchange_kwargs": {"reduce": "scatter"}}),
           ("sparseloco", "-shared", ", one shared index set (each replica's top ceil(k/n)), "
            "values averaged by block owners", {"exchange_kwargs": {"reduce": "shared"}}),
           ("sparseloco", "-shared-keep", ", one shared index set, replicas keep their unsent "
            "progress", {"keep_unsent": True, "exchange_kwargs": {"reduce": "shared"}}),
           ("sparseloco", "-shared-k112", ", one shared index set of 112 per block (the "
            "gather's bytes at 2 replicas)", {"exchange_kwargs": {"reduce": "shared",
                                                                 "topk": 112}}),
           ("sparseloco", "-shared-k112-keep", ", one shared index set of 112 per block, "
            "replicas keep their unsent progress", {"keep_unsent": True, "exchange_kwargs": {
                "reduce": "shared", "topk": 112}}),
           # replicas that keep their own unsent progress (keep_unsent)
           ("sparseloco", "-keep", ", replicas keep their unsent progress",
            {"keep_unsent": True}),
           ("sparseloco", "-keep-d1", ", replicas keep their unsent progress, error feedback 1.0",
            {"keep_unsent": True, "exchange_kwargs": {"decay": 1.0}}),
           ("sparseloco", "-keep-k256", ", replicas keep their unsent progress, top-256",
            {"keep_unsent": True, "exchange_kwargs": {"topk": 256}}),
           ("sparseloco", "-keep-h10-k16", ", replicas keep their unsent progress, H=10, top-16",
            {"keep_unsent": True, "inner_steps": 10, "exchange_kwargs": {"topk": 16}}),
           ("muloco", "-stat2-ef-keep", ", stat2 values with error feedback (decay 0.9), replicas "
            "keep their unsent progress", {"keep_unsent": True, "exchange_kwargs": {
                "values": "stat2", "error_feedback": 0.9}}),
           # the same bytes split differently: sparser and more often
           *(("sparseloco", f"-h{h}-k{k}", f", H={h}, top-{k}",
              {"inner_steps": h, "exchange_kwargs": {"topk": k}})
             for h, k in ((5, 8), (10, 16), (15, 32), (5, 32), (10, 64), (15, 128),
                          (10, 128), (5, 64))),
       )
       for tag in (tag1 + tag0,)},
    # issue 57's harness (benchmarks/presets.py): every replicator by the name prepare() takes,
    # with its defaults, and one inner optimizer: "<replicator>/<optimizer>"
    **{f"{rep}/{inner}": Setting(f"{rep!r} with {about} inner steps", rep, inner, lr, {}, okw)
       for inner, lr, about, okw in (
           ("muon", 1e-2, "Muon (+ AdamW on embeddings, head, norms and biases)", {}),
           ("adamw", 1e-3, "AdamW (0.9, 0.95, weight decay 0.1)", TUNED_ADAMW))
       for rep in ("full", "none", "diloco", "diloco-avg", "muloco", "muloco-int4",
                   "sparseloco", "sparseloco-dct")},
    "demo/sgd": Setting("'demo' at the library defaults (topk 16, int2, decay 0.999), sign-SGD",
                        "demo", "sgd", 1e-3),
    # the int4 exchange at the sparse presets' budget: a sync every 150 steps
    "muloco-int4-h150/muon": Setting("'muloco-int4' with inner_steps=150, Muon inner steps",
                                     "muloco-int4", "muon", 1e-2, {"inner_steps": 150}),
}


MAIN = ["adamw", "no-sync", "demo", "demo-d0.9-k64", "diloco", "diloco-avg"]

QUICK = {"model": "tiny", "steps": 300, "batch": 8, "replicas": "2", "seeds": 2,
         "lr_grid": "0.3,1,3,10", "eval_every": 20, "eval_batches": 8,
         "corpus_bytes": 2_000_000}
# evaluations fall on multiples of DiLoCo's H=20, where its replicas are identical
# the field's horizon on the mini GPT: 5,000 steps (about 12 tokens per parameter at 2
# replicas), 2, 4 and 8 replicas
LONG = {"model": "mini", "steps": 5000, "batch": 8, "replicas": "2,4,8", "seeds": 2,
        "lr_grid": "0.3,1,3", "eval_every": 250, "eval_batches": 16,
        "corpus_bytes": 8_000_000}
FULL = {"model": "small", "steps": 1000, "batch": 8, "replicas": "2,4", "seeds": 2,
        "lr_grid": "0.1,0.3,1,3", "eval_every": 40, "eval_batches": 16,
        "corpus_bytes": 8_000_000}


PROG = "quality.py"


def fail(message: str) -> NoReturn:
    """Bad input: ``quality.py: error: message`` on one line, exit code 2."""
    usage_exit(PROG, message)


def parse_args(argv=None) -> argparse.Namespace:
    """The options, checked (a bad one: one line, exit code 2), with the mode's defaults."""
    p = Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="tiny GPT, 300 steps, 2 replicas (defaults of the options below)")
    p.add_argument("--long", action="store_true",
                   help="mini GPT, 5,000 steps, 2, 4 and 8 replicas (the field's horizon)")
    p.add_argument("--strategies", default=",".join(MAIN),
                   help=f"comma list from: {', '.join(SETTINGS)}")
    p.add_argument("--model", choices=sorted(PRESETS), help="GPT preset")
    p.add_argument("--steps", type=int)
    p.add_argument("--batch", type=int, help="sequences per replica per step")
    p.add_argument("--replicas", help="comma list of replica counts, e.g. 2,4")
    p.add_argument("--seeds", type=int, help="seeds per configuration (>= 1)")
    p.add_argument("--first-seed", type=int, default=0,
                   help="seeds run: first-seed .. first-seed + seeds - 1 (more seeds for an "
                        "earlier result with --merge)")
    p.add_argument("--lr-grid", help="multipliers of each strategy's base lr, e.g. 1,3,10")
    p.add_argument("--lrs", help="absolute lrs for every strategy instead of --lr-grid")
    p.add_argument("--schedule", default="cosine", choices=SCHEDULES)
    p.add_argument("--warmup", type=float, default=0.05, help="warm-up fraction of the steps")
    p.add_argument("--min-lr", type=float, default=0.1, help="cosine end, fraction of the lr")
    p.add_argument("--data", default="random", choices=("random", "slice", "shard"),
                   help="random: every replica draws random windows of the whole corpus; "
                        "slice: of its own contiguous 1/N of it; shard: the trainer's "
                        "ShardSampler (disjoint windows, shuffled per epoch)")
    p.add_argument("--eval-every", type=int)
    p.add_argument("--eval-batches", type=int)
    p.add_argument("--corpus-bytes", type=int)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--ns-dtype", default="bf16", choices=("bf16", "fp32"),
                   help="Muon's Newton-Schulz iterations (MuonAdamW's ns_dtype) in every "
                        "strategy with Muon: bf16 as torch (default here, as every stored "
                        "run), or fp32, 10-20x faster on a CPU without bf16 matrix units (the "
                        "library's default on CPU)")
    p.add_argument("--workers", type=int, default=1, help="configurations run in parallel")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per worker (0: cores / workers)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop after this many seconds and report the runs finished by then "
                        "(runs go in order: replicas, strategy, lr, seed)")
    p.add_argument("--out", default="benchmarks/results/quality")
    p.add_argument("--merge-only", action="store_true",
                   help="run nothing: the table, CSV and plot of the --merge files")
    p.add_argument("--merge", action="append", default=[], metavar="JSON",
                   help="add the runs of an earlier quality.json with the same settings "
                        "(extends a grid without running it again)")
    args = p.parse_args(argv)
    if args.quick and args.long:
        p.error("--quick and --long are two modes: choose one")
    for key, value in (QUICK if args.quick else LONG if args.long else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    names = [s for s in args.strategies.split(",") if s]
    unknown = [s for s in names if s not in SETTINGS]
    if unknown or not names:
        p.error(f"unknown strategy {unknown}; choose from {', '.join(SETTINGS)}")
    args.strategies = names
    try:
        args.replicas = [int(x) for x in str(args.replicas).split(",")]
        grid = args.lrs or args.lr_grid
        args.grid = [float(x) for x in grid.split(",")]
    except ValueError as e:
        p.error(f"--replicas, --lr-grid and --lrs take comma lists of numbers ({e})")
    if args.seeds < 1 or args.steps < 1 or min(args.replicas) < 1 or args.workers < 1:
        p.error("--seeds, --steps, --replicas and --workers must be >= 1")
    if args.first_seed < 0:
        p.error("--first-seed must be >= 0")
    if args.eval_every < 1:
        p.error("--eval-every must be >= 1")
    if min(args.batch, args.eval_batches, args.corpus_bytes) < 1 or args.threads < 0:
        p.error("--batch, --eval-batches and --corpus-bytes must be >= 1, --threads >= 0")
    if not all(math.isfinite(x) and x > 0 for x in args.grid):
        p.error(f"--lr-grid and --lrs take positive numbers, got {args.grid}")
    if args.device == "cuda" and not torch.cuda.is_available():
        why = ("no CUDA device is visible" if torch.version.cuda else
               f"torch {torch.__version__} is built without CUDA")
        p.error(f"--device cuda: {why}; use --device cpu")
    if args.budget_s is not None and not (math.isfinite(args.budget_s) and args.budget_s > 0):
        p.error(f"--budget-s takes a positive number of seconds, got {args.budget_s}")
    if args.merge_only and not args.merge:
        p.error("--merge-only needs --merge files (one --merge per quality.json)")
    return args


# ---------------------------------------------------------------------- one run
_CORPUS: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def corpus(nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    if nbytes not in _CORPUS:
        _CORPUS[nbytes] = load_corpus(nbytes)
    return _CORPUS[nbytes]


def batch_sources(kind: str, train: torch.Tensor, n: int, seq_len: int, seed: int):
    """One callable per replica returning its next ``batch`` of ``(x, y)``."""
    if kind == "shard":
        windows = ByteWindows(train, seq_len + 1)
        samplers = [ShardSampler(len(windows), r, n, seed) for r in range(n)]

        def shard(r: int, batch: int):
            w = windows.get(samplers[r].next(batch))
            return w[:, :-1].contiguous(), w[:, 1:].contiguous()
        return [lambda b, r=r: shard(r, b) for r in range(n)]
    gens = [torch.Generator().manual_seed(seed * 1000 + r) for r in range(n)]
    if kind == "slice":
        size = train.numel() // n
        parts = [train[r * size:(r + 1) * size] for r in range(n)]
    else:
        parts = [train] * n
    return [lambda b, r=r: get_batch(parts[r], b, seq_len, gens[r]) for r in range(n)]


@torch.no_grad()
def evaluate(model: torch.nn.Module, val_x: torch.Tensor, val_y: torch.Tensor,
             batch: int) -> float:
    """Mean loss over the fixed validation windows (the same for every run)."""
    was = model.training
    model.eval()
    losses = [model(val_x[i:i + batch], val_y[i:i + batch]) for i in range(0, len(val_x), batch)]
    model.train(was)
    return float(torch.stack(losses).mean())


def run_one(cfg: dict) -> dict:
    """Train one configuration; its validation curve, bytes and seconds."""
    device = torch.device(cfg["device"])
    if cfg.get("threads"):
        torch.set_num_threads(cfg["threads"])
    train, val = corpus(cfg["corpus_bytes"])
    gcfg = gpt_config(cfg["model"])
    s = SETTINGS[cfg["strategy"]]
    n, seed, steps = cfg["replicas"], cfg["seed"], cfg["steps"]
    vwin = ByteWindows(val, gcfg.seq_len + 1)
    vw = vwin.get(eval_indices(len(vwin), 0, 1, cfg["eval_batches"] * cfg["batch"]))
    val_x, val_y = vw[:, :-1].to(device), vw[:, 1:].to(device)
    sources = batch_sources(cfg["data"], train, n, gcfg.seq_len, seed)

    def loss_fn(model, b):
        return model(b[0].to(device), b[1].to(device))

    torch.manual_seed(seed)
    optimizer_kwargs = dict(s.optimizer_kwargs)
    if s.optimizer == "muon":  # always named: the library's default ("auto") is fp32 on CPU
        optimizer_kwargs["base_kwargs"] = {**optimizer_kwargs.get("base_kwargs", {}),
                                           "ns_dtype": cfg.get("ns_dtype", "bf16")}
    sim = SimulatedReplicas(lambda: GPT(gcfg), loss_fn, replicas=n, replicator=s.replicator,
                            optimizer=s.optimizer, lr=cfg["lr"],
                            replicator_kwargs=dict(s.replicator_kwargs) or None,
                            device=device, seed=seed, **optimizer_kwargs)
    nparams = sum(p.numel() for p in sim.models[0].parameters())
    warmup = int(cfg["warmup"] * steps)
    curve: list[list[float]] = []
    t0 = time.perf_counter()

    def lr_of(step: int) -> float:
        return lr_at(step, steps, cfg["lr"], warmup, cfg["schedule"], cfg["min_lr"])

    def evaluate_every(done: int, losses) -> bool:
        """The validation curve; a non-finite loss ends the run (diverged)."""
        if done % cfg["eval_every"] and done != steps:
            return False
        # replicas that differ (no sync, DiLoCo between syncs) are each evaluated
        models = sim.models[:1] if sim.identical() else sim.models
        v = statistics.fmean(evaluate(m, val_x, val_y, cfg["batch"]) for m in models)
        curve.append([done, v])
        return not math.isfinite(v)

    sim.train(steps, lambda step: [src(cfg["batch"]) for src in sources], lr_of,
              evaluate_every)
    diverged = not math.isfinite(curve[-1][1])
    seconds = time.perf_counter() - t0
    sent, received = max(sim.bytes_sent), max(sim.bytes_received)  # the busiest rank
    tokens = steps * cfg["batch"] * gcfg.seq_len
    return {**cfg, "params": nparams, "curve": curve, "final_val": curve[-1][1],
            "diverged": diverged, "identical": sim.identical(), "seconds": seconds,
            "tokens_per_replica": tokens, "tokens_per_param": tokens * n / nparams,
            "bytes_per_param_step": sent / nparams / steps,
            "received_per_param_step": received / nparams / steps}


# ---------------------------------------------------------------------- summary
def configurations(args: argparse.Namespace) -> list[dict]:
    """Every (replicas, strategy, lr, seed) to run, as plain dicts (sent to workers)."""
    out = []
    for n in args.replicas:
        for name in args.strategies:
            lrs = args.grid if args.lrs else [SETTINGS[name].lr * m for m in args.grid]
            for lr in lrs:
                for seed in range(args.first_seed, args.first_seed + args.seeds):
                    out.append({"replicas": n, "strategy": name, "lr": float(f"{lr:.2g}"),
                                "seed": seed, "model": args.model, "steps": args.steps,
                                "batch": args.batch, "schedule": args.schedule,
                                "warmup": args.warmup, "min_lr": args.min_lr,
                                "data": args.data, "eval_every": args.eval_every,
                                "eval_batches": args.eval_batches,
                                "corpus_bytes": args.corpus_bytes, "device": args.device,
                                "threads": args.threads, "ns_dtype": args.ns_dtype})
    return out


def _finite(x: float) -> float:
    return x if math.isfinite(x) else float("inf")


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (replicas, strategy, lr): mean, spread, best-lr flag, ratios.

    The best lr of a strategy is the one with the lowest mean final validation loss over its
    seeds (a diverged run counts as infinite); ``vs_adamw``, ``vs_muon`` and ``vs_no_sync``
    divide a row's mean by the best-lr mean of ``adamw`` / ``muon`` (full-sync Muon) /
    ``no-sync`` at the same replica count (``None`` where that baseline was not run).
    """
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["replicas"], r["strategy"], r["lr"]), []).append(r)
    rows = []
    for (n, name, lr), rs in sorted(groups.items()):
        finals = [_finite(r["final_val"]) for r in rs]
        mean = statistics.fmean(finals) if all(math.isfinite(f) for f in finals) else math.inf
        rows.append({"replicas": n, "strategy": name, "lr": lr, "seeds": len(rs),
                     "val_mean": mean, "val_std": statistics.pstdev(finals)
                     if math.isfinite(mean) else math.inf,
                     "val_min": min(finals), "val_max": max(finals),
                     "bytes_per_param_step": statistics.fmean(r["bytes_per_param_step"]
                                                              for r in rs),
                     "received_per_param_step": statistics.fmean(
                         r.get("received_per_param_step", math.nan) for r in rs),
                     "tokens_per_param": rs[0].get("tokens_per_param", math.nan),
                     "tokens_per_replica": rs[0]["tokens_per_replica"],
                     "seconds": statistics.fmean(r["seconds"] for r in rs)})
    best: dict[tuple, dict] = {}
    for row in rows:
        key = (row["replicas"], row["strategy"])
        if key not in best or row["val_mean"] < best[key]["val_mean"]:
            best[key] = row
    for row in rows:
        key = (row["replicas"], row["strategy"])
        row["best_lr"] = best[key] is row
        lrs = sorted(r["lr"] for r in rows if (r["replicas"], r["strategy"]) == key)
        row["lr_at_grid_edge"] = row["best_lr"] and len(lrs) > 1 and row["lr"] in (lrs[0],
                                                                                   lrs[-1])
        for ref, col in (("adamw", "vs_adamw"), ("muon", "vs_muon"), ("no-sync", "vs_no_sync")):
            b = best.get((row["replicas"], ref))
            row[col] = row["val_mean"] / b["val_mean"] if b and math.isfinite(
                b["val_mean"]) else None
        # against the best full sync with the same inner optimizer, and the best of all
        fulls = [b for (m, name), b in best.items() if m == row["replicas"]
                 and _full_sync(name) and math.isfinite(b["val_mean"])]
        same = [b for b in fulls if _inner(b["strategy"]) == _inner(row["strategy"])]
        for col, pool in (("vs_same", same), ("vs_best_full", fulls)):
            ref_row = min(pool, key=lambda b: b["val_mean"]) if pool else None
            row[col] = row["val_mean"] / ref_row["val_mean"] if ref_row else None
            row[col.replace("vs_", "ref_")] = ref_row["strategy"] if ref_row else None
    return rows


def _full_sync(name: str) -> bool:
    """A full-sync baseline: the full fp32 gradient every step (unknown names: by name)."""
    s = SETTINGS.get(name)
    return s.replicator == "full" and not s.replicator_kwargs if s else name in ("adamw",
                                                                                 "muon")


def _inner(name: str) -> str:
    """A strategy's inner (base) optimizer."""
    s = SETTINGS.get(name)
    return s.optimizer if s else ("muon" if "muon" in name else "adamw")


def best_curves(runs: list[dict], rows: list[dict]) -> dict[tuple, list[list[float]]]:
    """Per (replicas, strategy) at its best lr: ``[step, mean, min, max]`` over the seeds."""
    out = {}
    for row in rows:
        if not row["best_lr"]:
            continue
        curves = [r["curve"] for r in runs if (r["replicas"], r["strategy"], r["lr"])
                  == (row["replicas"], row["strategy"], row["lr"])]
        length = min(len(c) for c in curves)
        out[(row["replicas"], row["strategy"])] = [
            [curves[0][i][0], statistics.fmean(c[i][1] for c in curves),
             min(c[i][1] for c in curves), max(c[i][1] for c in curves)] for i in range(length)]
    return out


def plot(curves: dict, lrs: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({n for n, _ in curves})
    fig, axes = plt.subplots(1, len(counts), figsize=(6.5 * len(counts), 4.8), squeeze=False)
    for ax, n in zip(axes[0], counts):
        for (m, name), c in sorted(curves.items()):
            if m != n:
                continue
            steps = [p[0] for p in c]
            line, = ax.plot(steps, [p[1] for p in c], label=f"{name} (lr {lrs[(m, name)]:.2g})",
                            linestyle="--" if name in ("adamw", "no-sync") else "-")
            ax.fill_between(steps, [p[2] for p in c], [p[3] for p in c], alpha=0.15,
                            color=line.get_color())
        finals = [c[-1][1] for (m, _), c in curves.items() if m == n]
        ax.set_ylim(min(finals) - 0.1, min(finals) + 1.2)
        ax.set_xlabel("step (equal tokens: same batch for every strategy)")
        ax.set_ylabel("validation loss (mean over seeds, min-max band)")
        ax.set_title(f"{n} replicas: every strategy at its best lr")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def frontier_plot(rows: list[dict], path: Path, title: str) -> None:
    """Validation loss relative to full sync with the same inner optimizer against bytes per
    parameter per step sent (log scale): every strategy at its best lr, one panel per replica
    count; no-sync rows (nothing sent) as dotted lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = [r for r in rows if r["best_lr"] and r.get("vs_same") is not None
            and math.isfinite(r["val_mean"])]
    counts = sorted({r["replicas"] for r in best})
    if not counts:
        return
    fig, axes = plt.subplots(1, len(counts), figsize=(6.5 * len(counts), 4.8), squeeze=False)
    for ax, n in zip(axes[0], counts):
        here = [r for r in best if r["replicas"] == n]
        for r in here:
            gap = 100 * (r["vs_same"] - 1)
            if r["bytes_per_param_step"] <= 0:
                ax.axhline(gap, linestyle=":", color="grey")
                ax.annotate(f"{r['strategy']} (nothing sent)", (0.01, gap), fontsize=7,
                            color="grey", xycoords=("axes fraction", "data"),
                            xytext=(0, 3), textcoords="offset points")
                continue
            inner = _inner(r["strategy"])
            ax.scatter(r["bytes_per_param_step"], gap, marker="o" if inner == "muon" else "s",
                       color="#31a354" if inner == "muon" else "#d62728")
            ax.annotate(r["strategy"], (r["bytes_per_param_step"], gap), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("bytes per parameter per step sent (busiest rank)")
        ax.set_ylabel("val loss vs full sync, same inner optimizer (%)")
        grids = {len({r["lr"] for r in rows if (r["replicas"], r["strategy"])
                      == (n, b["strategy"])}) for b in here}
        which = "one lr each" if grids == {1} else "best lr of each"
        ax.set_title(f"{n} replicas, {which} (circles: Muon inner, squares: AdamW)")
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ratio(x: float | None) -> str:
    return f"{x:9.3f}" if x is not None else f"{'-':>9}"


def table(rows: list[dict]) -> str:
    """The summary rows as a printable table."""
    head = (f"{'N':>2} {'strategy':<24} {'lr':>8} {'val (mean±std)':>16} {'vs same':>9} "
            f"{'vs best':>9} {'vs adamw':>9} {'vs muon':>9} {'vs nosync':>9} {'sent B/p/s':>10} "
            f"{'recv B/p/s':>10} {'tok/p':>6} {'s/run':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        mark = "*" if r["best_lr"] else " "
        edge = "!" if r["lr_at_grid_edge"] else " "
        lines.append(f"{r['replicas']:>2} {r['strategy']:<24} {r['lr']:>8.2g}{mark}{edge}"
                     f"{r['val_mean']:>8.4f}±{r['val_std']:.4f} {_ratio(r.get('vs_same'))} "
                     f"{_ratio(r.get('vs_best_full'))} {_ratio(r['vs_adamw'])} "
                     f"{_ratio(r['vs_muon'])} {_ratio(r['vs_no_sync'])} "
                     f"{r['bytes_per_param_step']:>10.5f} "
                     f"{r.get('received_per_param_step', math.nan):>10.5f} "
                     f"{r.get('tokens_per_param', math.nan):>6.1f} {r['seconds']:>6.0f}")
    lines.append("* best lr of the strategy (lowest mean final val loss); ! best lr at the "
                 "edge of the grid; ratios: mean / best-lr mean of the best full sync with the "
                 "same inner optimizer (vs same), of the best full sync (vs best), of adamw, muon "
                 "and no-sync; bytes per parameter per step sent and received by the busiest rank; "
                 "tok/p: tokens per parameter over all replicas")
    return "\n".join(lines)


def run_all(cfgs: list[dict], workers: int, say=print, into: list | None = None,
            budget_s: float | None = None, saved=None) -> list[dict]:
    """Run every configuration in the given order; each finished run is appended to ``into``
    (and handed to ``saved``) as it arrives. With ``budget_s``, no run starts (one worker) or
    goes on (several) after that many seconds: the runs not finished are left out."""
    runs = [] if into is None else into
    t0 = time.perf_counter()
    deadline = math.inf if budget_s is None else t0 + budget_s

    def report(res: dict) -> None:
        runs.append(res)
        say(f"[{len(runs)}/{len(cfgs)} {time.perf_counter() - t0:6.0f}s] N={res['replicas']} "
            f"{res['strategy']:<14} lr {res['lr']:.3g} seed {res['seed']}: val "
            f"{res['final_val']:.4f} ({res['seconds']:.0f}s)")
        if saved is not None:
            saved(runs)
    if workers == 1:
        for c in cfgs:
            if time.perf_counter() >= deadline:
                break
            report(run_one(c))
    else:
        with mp.get_context("spawn").Pool(workers) as pool:
            it = pool.imap_unordered(run_one, cfgs)
            for _ in cfgs:
                left = deadline - time.perf_counter()
                try:
                    res = it.next(timeout=None if left == math.inf else max(left, 0.0))
                except mp.TimeoutError:
                    pool.terminate()
                    break
                report(res)
    if len(runs) < len(cfgs):
        say(f"--budget-s {budget_s:g}: {len(cfgs) - len(runs)} of {len(cfgs)} runs did not "
            "finish in time and are left out")
    return runs


SAME = ("model", "steps", "batch", "schedule", "warmup", "min_lr", "data", "eval_every",
        "eval_batches", "corpus_bytes")
# settings that change a result too, which runs of older versions lack: their value there
DEFAULTED = {"ns_dtype": "bf16"}
# what the summary, table and plot read of a run
NEEDED = ("replicas", "strategy", "lr", "seed", "final_val", "curve", "seconds",
          "bytes_per_param_step", "tokens_per_replica") + SAME


def load_runs(paths: list[str]) -> list[tuple[str, list[dict]]]:
    """The runs of each ``--merge`` file, read and checked before anything runs."""
    out = []
    for path in paths:
        try:
            runs = json.loads(Path(path).read_text())["runs"]
        except OSError as e:
            fail(f"--merge {path}: cannot read it ({e.strerror or e}); give the path of a "
                 "quality.json this script wrote")
        except ValueError as e:
            fail(f"--merge {path}: not JSON ({e}); give a quality.json this script wrote")
        except (KeyError, TypeError):
            runs = None
        if not isinstance(runs, list):
            fail(f"--merge {path}: no 'runs' list in it; give a quality.json this script "
                 "wrote")
        for i, r in enumerate(runs):
            missing = [k for k in NEEDED if not isinstance(r, dict) or k not in r]
            if missing:
                fail(f"--merge {path}: run {i} lacks {', '.join(missing)}; give a "
                     "quality.json this script wrote")
        out.append((path, runs))
    return out


def check_same(stored: list[tuple[str, list[dict]]], here: dict) -> None:
    """Every stored run must share the settings that change a result (:data:`SAME`) with
    ``here``; otherwise one line naming the file and the settings that differ."""
    here = {**DEFAULTED, **here}
    for path, runs in stored:
        for r in runs:
            there = {**DEFAULTED, **r}
            differ = [k for k in (*SAME, *DEFAULTED) if there[k] != here[k]]
            if differ:
                what = ", ".join(f"{k} ({there[k]} there, {here[k]} here)" for k in differ)
                fail(f"--merge {path}: its runs differ in {what}; merge only runs made with "
                     "the same settings")


def merged(runs: list[dict], stored: list[tuple[str, list[dict]]]) -> list[dict]:
    """``runs`` plus the stored ones (:func:`load_runs`); a run measured here wins over a
    stored one of the same (replicas, strategy, lr, seed)."""
    have = {(r["replicas"], r["strategy"], r["lr"], r["seed"]) for r in runs}
    out = list(runs)
    for _, old in stored:
        for r in old:
            key = (r["replicas"], r["strategy"], r["lr"], r["seed"])
            if key not in have:
                have.add(key)
                out.append(r)
    return out


def adopt(args: argparse.Namespace, runs: list[dict]) -> None:
    """``--merge-only``: take the merged runs' settings, replica counts, strategies and
    seeds (for the header, the plot's title and the saved settings)."""
    for k in SAME:
        setattr(args, k, runs[0][k])
    for k, default in DEFAULTED.items():
        setattr(args, k, runs[0].get(k, default))
    args.replicas = sorted({r["replicas"] for r in runs})
    args.strategies = list(dict.fromkeys(r["strategy"] for r in runs))
    seeds = {r["seed"] for r in runs}
    args.seeds, args.first_seed = len(seeds), min(seeds)


def describe(args: argparse.Namespace) -> str:
    """The settings of a table, for its header."""
    return (f"{args.model} GPT, {args.steps} steps, batch {args.batch} per replica, replicas "
            f"{args.replicas}, {args.schedule} lr (warm-up {args.warmup:.0%}), data {args.data}"
            + (f", Newton-Schulz in {args.ns_dtype}" if args.ns_dtype != "bf16" else ""))


def write_json(out: Path, args: argparse.Namespace, command: str, runs: list[dict],
               rows: list[dict] | None = None, curves: dict | None = None) -> dict:
    """``quality.json``: the settings, the runs and (once computed) the summary."""
    result = {"command": command,
              "settings": {k: v for k, v in vars(args).items() if k != "grid"},
              "strategies": {k: asdict(SETTINGS[k]) for k in dict.fromkeys(
                  r["strategy"] for r in runs) if k in SETTINGS},
              "summary": rows or [], "runs": runs,
              "best_curves": [{"replicas": n, "strategy": s, "curve": c}
                              for (n, s), c in (curves or {}).items()]}
    (out / "quality.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv=None) -> dict:
    """Check everything (the --merge files included), run the grid, write and print."""
    args = parse_args(argv)
    command = " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:]))
    stored = load_runs(args.merge)
    if args.merge_only:  # the table's settings are those of the merged runs
        every = [r for _, rs in stored for r in rs]
        if not every:
            fail("--merge-only: the --merge files hold no runs; give files with runs")
        adopt(args, every)
    check_same(stored, {k: getattr(args, k) for k in (*SAME, *DEFAULTED)})
    if args.threads == 0 and args.device == "cpu":
        args.threads = max(1, (os.cpu_count() or 1) // args.workers)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(f"--out {out}: cannot create the folder ({e.strerror or e}); give a writable "
             "folder")
    cfgs = [] if args.merge_only else configurations(args)
    if args.merge_only:
        print(f"merging {sum(len(rs) for _, rs in stored)} stored runs of "
              f"{len(stored)} file(s), running none: {describe(args)}", flush=True)
    else:
        print(f"{len(cfgs)} runs: {describe(args)}, {args.workers} worker(s), {args.device}"
              + (f"; merging {len(stored)} file(s)" if stored else ""), flush=True)
    here: list[dict] = []
    try:
        run_all(cfgs, args.workers, say=lambda s: print(s, flush=True), into=here,
                budget_s=args.budget_s,
                saved=lambda rs: write_json(out, args, command, merged(rs, stored)))
    except BaseException:
        if here:  # what finished is on disk already (saved): a later run can --merge it
            print(f"stopped after {len(here)} of {len(cfgs)} runs; the finished ones are in "
                  f"{out / 'quality.json'} (--merge it into a later run)", file=sys.stderr,
                  flush=True)
        raise
    runs = merged(here, stored)
    if not runs:
        fail(f"--budget-s {args.budget_s:g}: no run finished in time; give a larger budget, "
             "or fewer steps")
    if not here:  # (runs made here are on disk already) the runs first: kept if a later
        write_json(out, args, command, runs)  # step fails
    rows = summarize(runs)
    curves = best_curves(runs, rows)
    result = write_json(out, args, command, runs, rows, curves)
    with open(out / "quality.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    best_lrs = {(r["replicas"], r["strategy"]): r["lr"] for r in rows if r["best_lr"]}
    plot(curves, best_lrs, out / "quality.png",
         f"{args.model} GPT, {args.steps} steps, batch {args.batch}/replica, {args.schedule} "
         f"lr, warm-up {args.warmup:.0%}, data {args.data}, {args.seeds} seed(s)")
    frontier_plot(rows, out / "frontier.png",
                  f"{args.model} GPT, {args.steps} steps, batch {args.batch}/replica, "
                  f"{args.seeds} seed(s): the byte frontier")
    print(table(rows))
    print(f"wrote {out / 'quality.json'}, {out / 'quality.csv'}, {out / 'quality.png'}, "
          f"{out / 'frontier.png'}")
    return result


if __name__ == "__main__":
    main()
