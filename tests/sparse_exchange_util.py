"""In-process replicas of DeMo's sparse exchange for its reduce-scatter and shared-index tests:
the tensors, the inputs, one step on ``world`` replicas and the blocks of a tensor."""

from __future__ import annotations

import torch

from flexdemo.replicate import CorruptPayloadError, DeMoReplicator, NonFiniteGradientError
from flexdemo.simulate import run_replicas
from flexdemo.transport import InProcessHub

K = 5
# tiling tensors in blocks of 8 x 8 (4 + 3 blocks), 4 x 8 (5 blocks) and 6 x 8 (4 blocks): no
# block count divisible by 3 or 8, and 48-entry blocks whose 6-bit indices can leave the block
EXACT = [torch.Size(s) for s in [(16, 16), (8, 24), (4, 40), (12, 16)]]
# and tensors that are padded or batched as small ones
MIXED = EXACT + [torch.Size(s) for s in [(100,), (30, 7), (5,)]]
PLAIN = {"topk": K, "chunk": 8, "decay": 0.0, "sign": False, "scale_by_lr": False,
         "values": "fp32", "transform": "none"}  # the input itself is selected


def grads_of(r: int, shapes: list[torch.Size]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11 + r)
    return [torch.randn(s, generator=g) for s in shapes]


def exchange(world: int, shapes=EXACT, before=None, *, reduce: str, **kw) -> list:
    """One step of ``grads_of(r)`` on ``world`` in-process replicas: per replica its output
    (or the exception it raised) and its replicator. ``before(r, rep, grads)`` may return the
    step to pass."""
    hub = InProcessHub(world, timeout=30)

    def work(r):
        rep = DeMoReplicator(reduce=reduce, **kw)
        rep.setup(shapes, torch.device("cpu"), hub.transport(r))
        grads = grads_of(r, shapes)
        step = before(r, rep, grads) if before is not None else None
        try:
            return rep(grads, [1.0] * len(shapes), step or 0), rep
        except (NonFiniteGradientError, CorruptPayloadError) as e:
            return e, rep

    return run_replicas(hub, work)


def outcome(out) -> list:
    """Per replica of ``exchange``'s result: the error's type, rank and ranks."""
    return [(type(e).__name__, getattr(e, "rank", None), getattr(e, "ranks", None))
            for e, _ in out]


def blocks(t: torch.Tensor, cr: int, cc: int) -> torch.Tensor:
    """``t`` as its ``cr x cc`` blocks, ``(blocks, cr * cc)``, row-major over the block grid."""
    r, c = t.shape
    return t.reshape(r // cr, cr, c // cc, cc).permute(0, 2, 1, 3).reshape(-1, cr * cc)


def unblocks(b: torch.Tensor, shape: torch.Size, cr: int, cc: int) -> torch.Tensor:
    r, c = shape
    return b.reshape(r // cr, c // cc, cr, cc).permute(0, 2, 1, 3).reshape(r, c)
