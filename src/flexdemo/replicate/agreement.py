"""The non-finite agreement and the payload header every exchange carries.

**Agreement.** Every exchange carries each rank's non-finite flag and a code of which
parameters received a gradient, so all replicas of a group learn in the same step that some
input was NaN/Inf (and raise :class:`NonFiniteGradientError` together, or skip together) or
that they disagree on the parameters in use. :class:`Agreement` is that one helper: it computes
the flag on the device (no host synchronisation), writes flag and code into the payload — the
trailer of an all-reduce bucket (``2 n`` values: rank ``r``'s flag at ``r``, its code at
``n + r``) or the 32-byte header of a gathered payload (magic, step, flag, code) — and checks
what came back with one host read per step. A rank whose own input is non-finite leaves its
state untouched; the others undo what they removed from their error-feedback buffers.

A non-finite input on a step that exchanges nothing (a local step of a schedule, DiLoCo's inner
steps) cannot be told to the peers at once. The rank then skips that step on its own (the
optimizer counts it in ``skipped_steps``); with ``nonfinite="raise"`` it also marks its input
of the next exchange as non-finite, so that every rank raises there, in the same step.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import torch

from ..transport import global_rank

# on a CPU, tensors below this many entries get their non-finite flag from an fp64 2-norm
_FP64_NORM_NUMEL = 1 << 20


class NonFiniteGradientError(FloatingPointError):
    """Raised on every replica of a group when some replica's input was NaN or Inf.

    ``step`` is the optimizer's step index (``opt.steps`` when the step began: the first step
    is step 0), as in every message of the library. ``local`` is True when only this rank
    knows of it (a step without exchange): the optimizer then skips the step on this rank and
    the flag travels with the next exchange.
    """

    def __init__(self, replicator: str, ranks: list[int] | None, step: int, *,
                 local: bool = False, note: str = "") -> None:
        who = f"rank(s) {ranks}" if ranks else "at least one replica"
        super().__init__(
            f"{replicator}: non-finite gradient (NaN or Inf) on {who} at step {step}"
            f"{note}; lower the learning rate, clip gradients, or construct the optimizer with "
            "nonfinite='skip' to skip such steps on all replicas"
        )
        self.ranks = ranks
        self.step = step
        self.local = local
        self.replicator, self.note = replicator, note


class CorruptPayloadError(RuntimeError):
    """A peer sent a payload that does not decode to a valid update."""

    def __init__(self, name: str, rank: int, global_rank: int, step: int, reason: str) -> None:
        super().__init__(
            f"{name}: corrupt payload from rank {global_rank} (rank {rank} of the group) at "
            f"step {step}: {reason}. A faulty peer or a version mismatch; construct the "
            "replicator with on_bad_peer='drop' to leave such payloads out")
        self.rank, self.global_rank, self.step, self.reason = rank, global_rank, step, reason
        self.name = name



def nonfinite_flag(tensors: Sequence[torch.Tensor | None],
                   device: torch.device | None = None) -> torch.Tensor:
    """A 0-d bool tensor, True when some value of ``tensors`` is NaN or Inf.

    Computed on the tensors' device without a host synchronisation and with a fixed number of
    ops: of one tensor its least and largest entry; of several, a norm of every tensor at once
    (NaN and Inf propagate; neither norm can overflow): the largest magnitude, and on a CPU for
    tensors below :data:`_FP64_NORM_NUMEL` entries the 2-norm accumulated in fp64 (there about
    2-5x faster than the largest magnitude, which takes about 2.6 ns per entry on one thread;
    its conversion to fp64 costs more on larger tensors).
    """
    ts = [t for t in tensors if t is not None and t.numel()]
    if not ts:
        return torch.zeros((), dtype=torch.bool, device=device)
    if len(ts) == 1:
        return ~torch.isfinite(torch.stack(torch.aminmax(ts[0]))).all()
    small = [t for t in ts if t.numel() < _FP64_NORM_NUMEL] if ts[0].device.type == "cpu" else []
    large = [t for t in ts if t.numel() >= _FP64_NORM_NUMEL] if small else ts
    flags = []
    if small:
        flags.append(~torch.isfinite(torch.stack(
            torch._foreach_norm(small, 2, dtype=torch.float64))).all())
    if large:
        flags.append(~torch.isfinite(torch.stack(
            torch._foreach_norm(large, math.inf, dtype=torch.float32))).all())
    return flags[0] if len(flags) == 1 else flags[0] | flags[1]


def zero_where(buf: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """``buf`` zeroed in place where the 0-d flag ``bad`` is set, else left as it is (no host
    read). On a CPU as a product with ``not bad`` and NaN and Inf replaced by zeros: two
    vectorised passes that take about two thirds of the time of ``masked_fill_`` with a 0-d
    mask there, with the same values (a finite ``buf`` times one is itself)."""
    if buf.device.type != "cpu":
        return buf.masked_fill_(bad, 0.0)
    return buf.mul_(~bad).nan_to_num_(0.0, 0.0, 0.0)


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """True when every tensor holds only finite values (one host read)."""
    return not bool(nonfinite_flag(tensors))


def presence_code(grads: Sequence) -> int:
    """A 16-bit code of which parameters have a gradient (equal on replicas that agree)."""
    bits = bytes(0 if g is None else 1 for g in grads)
    return zlib.crc32(bits) & 0xFFFF


def mark_nonfinite(tensors: Sequence[torch.Tensor | None]) -> None:
    """Write a NaN into the first non-empty tensor: the in-band non-finite flag of an input
    whose own values are finite (a step withheld earlier must be reported)."""
    for t in tensors:
        if t is not None and t.numel():
            if t.is_contiguous():
                t.view(-1)[:1].fill_(float("nan"))
            else:
                t.fill_(float("nan"))
            return


def global_rank_of(group, r: int) -> int:
    """The global rank of rank ``r`` of ``group`` (``r`` itself without a process group)."""
    return global_rank(group, r)


class Agreement:
    """One rank's non-finite flag and presence code, carried by an exchange and checked.

    Use per step: :meth:`local` (flag on the device, presence code), then
    :meth:`write_trailer` (all-reduce buckets) or :func:`write_header` (gathered payloads).
    After the exchange, :meth:`read_trailer` reads the device once and raises on every rank
    alike; gathered headers are read in the same host read as the payload checks and judged
    by :func:`header_problems` and :func:`check_flags` (see ``FullReplicator``). On a step
    without exchange, :meth:`check_local` reads the flag once.
    """

    def __init__(self, name: str, rank: int, world: int, device: torch.device,
                 group=None) -> None:
        self.name, self.rank, self.world, self.device = name, rank, world, device
        self.group = group
        self._codes: dict[tuple, int] = {}

    def local(self, tensors: Sequence[torch.Tensor | None],
              grads: Sequence | None = None) -> tuple[torch.Tensor, int]:
        """This rank's flag (0-d bool device tensor) for ``tensors`` and the presence code
        of ``grads`` (default: ``tensors``)."""
        which = tensors if grads is None else grads
        key = tuple(g is None for g in which)
        code = self._codes.get(key)
        if code is None:
            code = self._codes[key] = presence_code(which)
        return nonfinite_flag(tensors, self.device), code

    @staticmethod
    def trailer_size(world: int) -> int:
        """Values of the all-reduce trailer: a flag and a code per rank."""
        return 2 * world

    def write_trailer(self, trailer: torch.Tensor, flag: torch.Tensor, code: int) -> None:
        """Zero the trailer and write this rank's slots (the group's sum holds everyone's)."""
        trailer.zero_()
        trailer[self.rank: self.rank + 1].copy_(flag)
        slot = self.world + self.rank
        trailer[slot: slot + 1].fill_(float(code))  # a fill: no host-to-device copy

    def read_trailer(self, trailer: torch.Tensor, code: int, step: int) -> None:
        """Check a summed trailer (one host read); raise on every rank alike."""
        n = self.world
        values = trailer.tolist()
        check_flags(self.name, values[:n], values[n: 2 * n], code, step, self.group)

    def check_local(self, flag: torch.Tensor, step: int, *, local: bool = False) -> None:
        """Raise if this rank's own flag is set (one host read); ``local`` marks an error
        that only this rank knows of (see :class:`NonFiniteGradientError`)."""
        if bool(flag):
            raise NonFiniteGradientError(self.name, [global_rank_of(self.group, self.rank)],
                                         step, local=local)


MAGIC = 0x0DE70002  # wire format 2: tiling units before padded ones in a group
HEADER_BYTES = 32


def align8(n: int) -> int:
    """``n`` rounded up to a multiple of 8 (every payload segment, and every row of a
    gathered uint8 tensor, is 8-byte aligned)."""
    return (n + 7) // 8 * 8


def write_header(buf: torch.Tensor, step: int | torch.Tensor, bad: bool | torch.Tensor,
                 code: int) -> None:
    """The 32-byte header of a gathered payload: magic, step, non-finite flag, presence.

    ``bad`` may be a device tensor (no host synchronisation), and so may ``step`` (an int64
    scalar that changes between replays of a CUDA graph)."""
    head = buf[:HEADER_BYTES].view(torch.int64)
    if isinstance(step, torch.Tensor):
        head[1:2].copy_(step.reshape(1))
    for i, v in ((0, MAGIC), (1, step), (3, code)):  # fills: no host-to-device copy
        if not isinstance(v, torch.Tensor):
            head[i].fill_(v)
    if isinstance(bad, torch.Tensor):
        head[2:3].copy_(bad.reshape(1))
    else:
        head[2].fill_(int(bad))


def header_fault(head: Sequence[int], step: int) -> str | None:
    """What is wrong with one header ``(magic, step, flag, code)``: ``"magic"`` (another
    format or version), ``"step"`` (a payload for another step) or None."""
    if head[0] != MAGIC:
        return "magic"
    return "step" if head[1] != step else None


def header_problems(heads: list[list[int]], step: int) -> list[str | None]:
    """Per rank: why its header ``(magic, step, flag, code)`` is malformed, or None."""
    out: list[str | None] = []
    for head in heads:
        fault = header_fault(head, step)
        if fault == "magic":
            out.append(f"bad magic/version {head[0]:#x} (expected {MAGIC:#x})")
        elif fault == "step":
            out.append(f"payload for step {head[1]}")
        else:
            out.append(None)
    return out


def check_headers(name: str, gathered: torch.Tensor, step: int, code: int) -> None:
    """Validate the headers of ``gathered`` payloads ``(ranks, bytes)``; raise on any problem."""
    n = gathered.shape[0]
    headers = gathered[:, :HEADER_BYTES].contiguous().view(torch.int64).view(n, 4).tolist()
    for r, problem in enumerate(header_problems(headers, step)):
        if problem is not None:
            raise RuntimeError(
                f"{name}: malformed payload from rank {r} of the group at step {step} "
                f"({problem}); replicas must run the same flexdemo version and take steps "
                "together")
    check_flags(name, [h[2] for h in headers], [h[3] for h in headers], code, step)


def check_flags(name: str, flags: Sequence[float], present: Sequence[float], code: int,
                step: int, group=None) -> None:
    """Raise if any replica flagged a non-finite input or disagrees on parameter presence
    (naming global ranks: the group ranks of ``group`` translated)."""
    bad = [global_rank_of(group, r) for r, f in enumerate(flags) if f != 0]
    if bad:
        raise NonFiniteGradientError(name, bad, step)
    odd = [r for r, c in enumerate(present) if int(c) != code]
    if odd:
        raise RuntimeError(
            f"{name}: replicas disagree on which parameters received a gradient at step {step} "
            f"(ranks {odd} of the group differ from this rank); every replica must run the "
            "same model code so that the same parameters are used"
        )
