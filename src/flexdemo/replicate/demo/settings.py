"""DeMo's named presets and the checks of its settings."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...compress.blocks import BLOCK_CODECS
from ...compress.chunking import CHUNK_RULES
from ..bound import PEER_BOUND
from ..rounding import check_state_dtype

PRESETS: dict[str, dict] = {
    "default": {},
    "aggressive": {"topk": 4, "values": "sign"},   # about 0.002 bytes per parameter per step
    "original": {"topk": 32, "values": "fp32"},     # DeMo's defaults, full-precision values
}

TRANSFORM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

#: the most coefficients in one group of blocks (16 MiB in fp32): the transform, selection
#: and decode of a group run on buffers of its size, so this bounds the step's workspace
#: (large tensors are split by block rows to fit; benchmarks/bench_memory.py)
GROUP_NUMEL = 1 << 22
#: on CUDA, "auto" makes about this many groups of a model (of at least GROUP_NUMEL each):
#: each group's work is about 120 kernels, so a GPU step is bound by the group count (a
#: whole 124M model in groups of 4M coefficients: 45 groups, 5,581 operations per graphed
#: step; in 8ths: 10 groups, 1,276, for half a P more at the step's peak)
CUDA_GROUPS = 8
#: for an exchange run once every many steps (a DiLoCo sync, ``memory_first``) "auto" makes
#: DeMo's groups at most this fraction of the model: the sync's scratch (a few buffers of a
#: group) comes on top of all the state and gradients, and its speed matters once every H
#: steps; more groups cost no more collectives (85M GPT: groups of 0.67M coefficients, the
#: sync's scratch about 0.03 P instead of 0.18 P)
RARE_GROUPS = 128
#: ... and a dense exchange's buckets (each bucket is a collective of its own, so fewer:
#: 85M GPT, buckets of 2.7M values, 33 collectives per sync instead of 21)
RARE_BUCKETS = 32
#: ... but groups and buckets of at least this many values (4 blocks of 64 x 64)
RARE_GROUP_NUMEL = 1 << 14


def check_settings(*, topk, chunk, decay, values, transform, transform_dtype, small,
                   small_numel, bucket, overlap, on_bad_peer, compile, graphs, staging,
                   mean="replicas", clip="none", reduce="gather", group_numel="auto",
                   offload=False, momentum_dtype="fp32", chunking="near",
                   every_step: bool) -> bool | str:
    """Raise ValueError for a bad setting (``every_step``: the schedule communicates every
    step); returns ``graphs`` resolved (``"auto"`` is off when the selection is compiled)."""
    if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
        raise ValueError(f"topk must be an integer >= 1, got {topk!r}")
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 2:
        raise ValueError(f"chunk must be an integer >= 2 (a block edge), got {chunk!r}")
    if topk > chunk * chunk:
        raise ValueError(f"topk={topk} exceeds the {chunk}x{chunk}={chunk * chunk} "
                         "coefficients of a block; lower topk or raise chunk")
    if not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0:
        raise ValueError(f"decay must be a number in [0, 1], got {decay!r}")
    if values not in BLOCK_CODECS:
        raise ValueError(f"values must be one of {tuple(BLOCK_CODECS)}, got {values!r}")
    if chunking not in CHUNK_RULES:
        raise ValueError(f"chunking must be 'near' (the divisor of a side nearest chunk, else "
                         f"padded) or 'divisor' (its largest divisor up to chunk, k scaled to "
                         f"the block: SparseLoCo's), got {chunking!r}")
    if transform not in ("dct", "none"):
        raise ValueError(f"transform must be 'dct' or 'none' (plain top-k per block), "
                         f"got {transform!r}")
    if transform_dtype not in TRANSFORM_DTYPES:
        raise ValueError(f"transform_dtype must be one of {sorted(TRANSFORM_DTYPES)}, "
                         f"got {transform_dtype!r}")
    if small not in ("batch", "separate"):
        raise ValueError(f"small must be 'batch' or 'separate', got {small!r}")
    if small_numel is not None and (not isinstance(small_numel, int) or small_numel < 0):
        raise ValueError(f"small_numel must be an integer >= 0, got {small_numel!r}")
    if group_numel not in (None, "auto") and (not isinstance(group_numel, int)
                                              or isinstance(group_numel, bool)
                                              or group_numel < 1):
        raise ValueError(f"group_numel must be an integer >= 1 (coefficients per group of "
                         f"blocks), 'auto' ({GROUP_NUMEL} off CUDA; on it 1/{CUDA_GROUPS} of the "
                         f"model if larger) or None (one group per block shape), got "
                         f"{group_numel!r}")
    if overlap not in ("none", "delayed"):
        raise ValueError(f"overlap must be 'none' or 'delayed', got {overlap!r}")
    if overlap == "delayed" and (not bucket or not every_step):
        raise ValueError("overlap='delayed' needs bucket=True and a replicator that "
                         "communicates every step (replicate_every=1, skip_every=0)")
    if on_bad_peer not in ("raise", "drop"):
        raise ValueError(f"on_bad_peer must be 'raise' or 'drop', got {on_bad_peer!r}")
    if not isinstance(graphs, bool) and graphs != "auto":
        raise ValueError(f"graphs must be True, False or 'auto', got {graphs!r}")
    if staging not in ("auto", "direct", "image"):
        raise ValueError(f"staging must be 'auto', 'direct' or 'image', got {staging!r}")
    if mean not in ("replicas", "senders"):
        raise ValueError(f"mean must be 'replicas' (the sum over the peers divided by their "
                         f"number) or 'senders' (each coefficient over the peers that sent "
                         f"it), got {mean!r}")
    if clip not in ("none", "median"):
        raise ValueError(f"clip must be 'none' or 'median' (each peer's contribution clipped "
                         f"to the median of the peers' norms), got {clip!r}")
    _check_reduce(reduce, bucket=bucket, overlap=overlap, on_bad_peer=on_bad_peer, clip=clip,
                  mean=mean)
    if not isinstance(offload, bool):
        raise ValueError(f"offload must be True or False, got {offload!r}")
    if offload and graphs is True:
        raise ValueError("offload=True and graphs=True do not combine: a graph replays fixed "
                         "buffers, the offloaded momentum moves; choose one")
    check_state_dtype("momentum_dtype", momentum_dtype)
    if momentum_dtype != "fp32" and graphs is True:
        raise ValueError(f"momentum_dtype={momentum_dtype!r} and graphs=True do not combine: "
                         "its rounding draws random bits per step on the host's generator; "
                         "choose one")
    if graphs == "auto":  # on CUDA, unless the selection is compiled or the momentum moves
        graphs = "auto" if not (compile or offload or momentum_dtype != "fp32") else False
    if graphs is True and compile:
        raise ValueError("graphs=True and compile=True do not combine: the CUDA graphs "
                         "replay the eager selection; choose one")
    return graphs


def resolve_group_numel(group_numel: int | str | None, device: torch.device | None,
                        shapes: Sequence[torch.Size] = (),
                        parts: int | None = None) -> int | None:
    """``group_numel`` with ``"auto"`` resolved for ``device`` and a model of local
    ``shapes``: ``GROUP_NUMEL``, or on CUDA a ``CUDA_GROUPS``-th of the model if larger;
    ``parts`` (an exchange run once every many steps, :data:`RARE_GROUPS`): at most a
    ``parts``-th of the model, and at least ``RARE_GROUP_NUMEL``."""
    if group_numel != "auto":
        return None if group_numel is None else int(group_numel)
    total = sum(s.numel() for s in shapes)
    n = GROUP_NUMEL
    if device is not None and device.type == "cuda":
        n = max(GROUP_NUMEL, -(-total // CUDA_GROUPS))
    if parts is not None:
        n = min(n, max(RARE_GROUP_NUMEL, -(-total // parts)))
    return n


def rare_groups(rep) -> int | None:
    """The ``parts`` of :func:`resolve_group_numel` for DeMo replicator ``rep``: where
    ``rep.memory_first`` is set (by DiLoCo, before the set-up: it runs once every H steps, on
    top of all the state) and smaller groups give the same bits (the gathered mean without
    ``clip``, whose norm adds the groups' sums in order), :data:`RARE_GROUPS`; else None.
    ``memory_first`` also has its step unpack each group's payloads again as it decodes
    them, rather than holding every group's from the check."""
    same = rep.reduce == "gather" and rep.clip == "none"
    return RARE_GROUPS if rep.memory_first and same else None


def describe(rep) -> str:
    """The ``repr`` of a DeMo replicator's settings: the main ones, and the others where
    they differ from their defaults."""
    extra = "".join(f", {k}={v!r}" for k, v, d in (
        ("transform", rep.transform, "dct"), ("transform_dtype", rep.transform_dtype, "fp32"),
        ("small", rep.small, "batch"), ("bucket", rep.bucket, True),
        ("group_numel", rep.group_numel, "auto"), ("offload", rep.offload, False),
        ("momentum_dtype", rep.momentum_dtype, "fp32"),
        ("overlap", rep.overlap, "none"), ("compile", rep.compile, False),
        ("graphs", rep.graphs, "auto"), ("staging", rep.staging, "auto"),
        ("mean", rep.mean, "replicas"), ("clip", rep.clip, "none"),
        ("reduce", rep.reduce, "gather"), ("peer_bound", rep.peer_bound, PEER_BOUND),
        ("chunking", rep.chunking, "near"), ("weights", rep.weights, "equal"))
        if v != d)
    return (f"topk={rep.topk}, chunk={rep.chunk}, decay={rep.decay}, "
            f"values={rep.values!r}, sign={rep.sign}{extra}")


def _check_reduce(reduce, *, bucket, overlap, on_bad_peer, clip, mean="replicas") -> None:
    """``reduce``: ``"gather"``, or ``"scatter"`` / ``"shared"`` where the other settings
    allow it."""
    if reduce not in ("gather", "scatter", "shared"):
        raise ValueError(f"reduce must be 'gather' (all-gather of the payloads), 'scatter' "
                         f"(reduce-scatter by block owners) or 'shared' (one index set, the "
                         f"values reduced by block owners), got {reduce!r}")
    if reduce == "gather":
        return
    if overlap == "delayed":
        raise ValueError(f"reduce={reduce!r} does not run with overlap='delayed'; use "
                         "overlap='none' or reduce='gather'")
    if not bucket:
        raise ValueError(f"reduce={reduce!r} needs bucket=True (one exchange of all groups)")
    if on_bad_peer == "drop":
        raise ValueError(f"on_bad_peer='drop' needs reduce='gather' (with reduce={reduce!r} "
                         "an owner could drop a peer from its blocks only); use "
                         "on_bad_peer='raise'")
    if clip != "none":
        raise ValueError(f"clip='median' needs reduce='gather' (an owner sees only its blocks "
                         f"of each peer, not the peer's norm); use clip='none' with "
                         f"reduce={reduce!r}")
    if reduce == "shared" and mean != "replicas":
        raise ValueError("mean='senders' needs reduce='gather' or 'scatter' (with "
                         "reduce='shared' every replica sends every shared coefficient); use "
                         "mean='replicas'")
