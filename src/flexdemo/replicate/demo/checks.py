"""Checks of received DeMo payloads: on the device, one small verdict per step (header,
index range, repeated indices, finite values); on the host, the judgement of that verdict
(raise, or count and warn, per bad peer). In ``overlap="delayed"`` mode the peers to keep are
decided on the device and the verdict is copied to the host without waiting, to be judged
one step later."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ...compress.bits import unpack_bits
from ...compress.blocks import BlockValueCodec
from ..agreement import HEADER_BYTES, MAGIC, check_flags, header_problems
from .layout import Group
from .staging import StepPlan

# reasons a payload body is bad, in the order they are checked (0: good)
RANGE, REPEAT, NONFINITE = 1, 2, 3
# a verdict row: magic, step, non-finite flag, presence code (the header), then the body's
# reason, the group it was found in and the largest index there
VERDICT_COLUMNS = ("magic", "step", "flag", "code", "reason", "group", "top")


def unpack_group(gathered: torch.Tensor, g: Group,
                 codec: BlockValueCodec) -> tuple[torch.Tensor, torch.Tensor]:
    """Group ``g``'s ``(peers, blocks, k)`` indices (int64) and values in the payloads
    ``gathered`` ``(peers, bytes)``."""
    idx = unpack_bits(gathered[:, g.idx_off: g.val_off], g.bits, g.n_sel)
    return (idx.view(gathered.shape[0], g.blocks, g.k),
            codec.decode(gathered[:, g.val_off: g.end], g.blocks, g.k))


class GroupPayloads(Sequence):
    """The decoded payloads per group, as :func:`check_payloads` returns them, unpacked from
    ``gathered`` when a group is asked for and not held: a step then keeps one group's
    indices and values at a time instead of every group's (unpacked twice: for the check
    and for the decode, the same bits)."""

    def __init__(self, gathered: torch.Tensor, groups: list[Group], codec: BlockValueCodec,
                 plan: StepPlan) -> None:
        self.gathered, self.groups, self.codec, self.plan = gathered, groups, codec, plan

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, gi):
        if not self.plan.group_on[gi]:
            return None
        return unpack_group(self.gathered, self.groups[gi], self.codec)


def check_payloads(gathered: torch.Tensor, groups: list[Group], codec: BlockValueCodec,
                   plan: StepPlan, keep: bool = True, norms: bool = False):
    """Every peer's payload checked on the device: the verdict, ``(peers, 7)`` int64 rows
    (:data:`VERDICT_COLUMNS`), and per group with gradients the decoded
    ``(peers, blocks, k)`` indices and values (``keep=False``: a :class:`GroupPayloads`
    that unpacks them again when asked, so that no more than one group's are live);
    ``norms``: also each peer's norm over all its values ``(peers,)`` fp32 (the bound on a
    peer's part, :mod:`~flexdemo.replicate.bound`; the transform is orthonormal, so it is the
    norm of the peer's update in the parameters' domain)."""
    n = gathered.shape[0]
    heads = gathered[:, :HEADER_BYTES].contiguous().view(torch.int64)
    reason = which = top = torch.zeros(n, dtype=torch.int64, device=gathered.device)
    decoded: list | GroupPayloads = (
        [None] * len(groups) if keep else GroupPayloads(gathered, groups, codec, plan))
    found = []
    squares = torch.zeros(n, dtype=torch.float32, device=gathered.device)
    for gi, g in enumerate(groups):
        if not plan.group_on[gi]:
            continue
        idx, vals = unpack_group(gathered, g, codec)
        if keep:
            assert isinstance(decoded, list)
            decoded[gi] = (idx, vals)
        if norms:
            squares += vals.square().flatten(1).sum(1)
        why = torch.where(torch.isfinite(vals).flatten(1).all(1), 0, NONFINITE)
        if g.k > 1:
            srt = idx.sort(dim=2).values
            why = torch.where((srt[..., 1:] == srt[..., :-1]).flatten(1).any(1), REPEAT, why)
        big = reason
        if (1 << g.bits) > g.block_numel:  # a packed index can exceed the block
            big = idx.flatten(1).amax(1)
            why = torch.where(big >= g.block_numel, RANGE, why)
        found.append((gi, why, big))
    for gi, why, big in reversed(found):  # the first bad group names the reason
        hit = why != 0
        reason = torch.where(hit, why, reason)
        which = torch.where(hit, gi, which)
        top = torch.where(hit, big, top)
    verdict = torch.cat([heads, torch.stack([reason, which, top], 1)], 1)
    if norms:
        return verdict, decoded, squares.sqrt()
    return verdict, decoded


def kept_peers(verdict: torch.Tensor, expected_step: torch.Tensor, code: int):
    """Which peers' payloads enter the mean, decided on the device (delayed mode): ``keep``
    ``(peers,)`` holds the peers whose header is sound (magic, ``expected_step`` (a device
    scalar), this rank's presence ``code``) and whose body passed; all of them are left out
    when a sound header carries the non-finite flag (as a raised step would apply nothing).
    ``count``: how many are kept (0-d int64)."""
    sound = ((verdict[:, 0] == MAGIC) & (verdict[:, 1] == expected_step)
             & (verdict[:, 3] == code))
    flagged = (sound & (verdict[:, 2] != 0)).any()
    keep = sound & (verdict[:, 4] == 0) & ~flagged
    return keep, keep.sum()


def describe_problem(why: int, gi: int, top: int, groups: list[Group]) -> str:
    """The words for a bad body: reason ``why`` found in group ``gi`` (largest index ``top``)."""
    if why == RANGE:
        return f"index {top} out of range for blocks of {groups[gi].block_numel} entries"
    return "repeated index within a block" if why == REPEAT else "non-finite value"


def good_peers(rows: list[list[int]], step: int, code: int, *, name: str, group,
               groups: list[Group], bad_peer: Callable[[int, int, str], None]) -> list[int]:
    """The host's side of the check, on the verdict's ``rows`` (see :func:`check_payloads`):
    ``bad_peer(rank, step, reason)`` (raises, or counts and warns) for every bad payload, and
    the good peers."""
    peers = []
    for r, problem in enumerate(header_problems([row[:4] for row in rows], step)):
        if problem is None:
            peers.append(r)
        else:
            bad_peer(r, step, problem)
    ok = set(peers)
    check_flags(name, [row[2] if r in ok else 0 for r, row in enumerate(rows)],
                [row[3] if r in ok else code for r, row in enumerate(rows)], code, step, group)
    good = []
    for r in peers:
        why, gi, top = rows[r][4:]
        if why:
            bad_peer(r, step, describe_problem(why, gi, top, groups))
        else:
            good.append(r)
    return good


class VerdictToHost:
    """Delayed mode: a verdict copied into host memory without waiting (pinned memory and an
    event on CUDA), to be read one step later. One host buffer per number of peers."""

    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}

    def start(self, verdict: torch.Tensor, step: int, code: int) -> tuple:
        """Start the copy; returns the pending verdict ``(step, code, host rows, CUDA event or
        None)``."""
        n = verdict.shape[0]
        host = self.buffers.get(n)
        if host is None:
            cuda = verdict.is_cuda
            host = self.buffers[n] = torch.empty(verdict.shape, dtype=verdict.dtype,
                                                 pin_memory=cuda)
            # read a step later: not a read of the device (a marker the tests look for)
            host._flexdemo_host_copy = True  # type: ignore[attr-defined]
        host.copy_(verdict, non_blocking=True)
        event = None
        if verdict.is_cuda:
            event = torch.cuda.Event()
            event.record()
        return step, code, host, event


def arrived(pending: tuple) -> tuple[int, int, torch.Tensor]:
    """A pending verdict's ``(step, code, host rows)`` once its copy has finished (it
    finished long ago: this waits on nothing in flight)."""
    step, code, host, event = pending
    if event is not None:
        event.synchronize()
    return step, code, host
