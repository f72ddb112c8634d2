"""The replicator interface: what crosses the slow link, on which group, and how often.

A replicator takes the shard-local gradients of one step (a list with ``None`` for
parameters that received no gradient) and returns the tensors the next stage sees: the next
replicator of a chain, or finally the base optimizer. On a step its schedule skips, it runs
*locally*: it exchanges nothing and behaves as if its group had one member.

Schedules (steps count from 0): a replicator communicates on step ``t`` when
``t % replicate_every == 0`` and, if ``skip_every > 0``, ``(t + 1) % skip_every != 0``.

Non-finite gradients: every exchange carries a flag per rank, so all replicas of a group learn
at the same step that some input was NaN/Inf and raise :class:`NonFiniteGradientError` together
(no rank is left waiting in a collective). A rank whose own input is non-finite leaves its
state untouched; the others undo what they removed from their error-feedback buffers.
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod

import torch
import torch.distributed as dist

from ..comm import CommStats, gather_into, group_rank, group_size


class NonFiniteGradientError(FloatingPointError):
    """Raised on every replica of a group when some replica's input was NaN or Inf."""

    def __init__(self, replicator: str, ranks: list[int] | None, step: int) -> None:
        who = f"rank(s) {ranks} of the group" if ranks else "at least one replica"
        super().__init__(
            f"{replicator}: non-finite gradient (NaN or Inf) on {who} at step {step}; "
            "lower the learning rate, clip gradients, or construct the optimizer with "
            "nonfinite='skip' to skip such steps on all replicas"
        )
        self.ranks = ranks
        self.step = step


def _check_schedule(replicate_every: int, skip_every: int) -> None:
    if not isinstance(replicate_every, int) or replicate_every < 1:
        raise ValueError(f"replicate_every must be an integer >= 1, got {replicate_every!r}")
    if not isinstance(skip_every, int) or skip_every < 0 or skip_every == 1:
        raise ValueError(
            f"skip_every must be 0 (never skip) or an integer >= 2, got {skip_every!r} "
            "(skip_every=1 would never replicate; use NoReplication instead)"
        )


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """True when every tensor holds only finite values.

    Fast path: a sum is finite only if every summand is (NaN and Inf propagate); only when
    some sum is not finite (a bad value, or an overflow of huge finite values) are the
    tensors checked element by element.
    """
    if not tensors:
        return True
    if bool(torch.isfinite(torch.stack([t.sum().float() for t in tensors])).all()):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def presence_code(grads: list) -> int:
    """A 16-bit code of which parameters have a gradient (equal on replicas that agree)."""
    bits = bytes(0 if g is None else 1 for g in grads)
    return zlib.crc32(bits) & 0xFFFF


class Replicator(ABC):
    """Base class of all replication schemes."""

    name = "replicator"

    def __init__(self, *, group: dist.ProcessGroup | None = None, replicate_every: int = 1,
                 skip_every: int = 0) -> None:
        _check_schedule(replicate_every, skip_every)
        self.group = group
        self.replicate_every = replicate_every
        self.skip_every = skip_every
        self.stats = CommStats()
        self._shapes: list[torch.Size] | None = None

    # ------------------------------------------------------------------ setup
    def setup(self, shapes: list[torch.Size], device: torch.device,
              default_group: dist.ProcessGroup | None,
              params: list[torch.Tensor] | None = None) -> None:
        """Bind to the local parameter shapes; allocate state. Called once by the optimizer.

        ``params`` are the rank-local parameter tensors, for replicators that act on
        parameters (DiLoCo) rather than only on gradients.
        """
        if self.group is None:
            self.group = default_group
        self._shapes = [torch.Size(s) for s in shapes]
        self._params = params
        self.device = torch.device(device)
        self.world = group_size(self.group)
        self.rank = group_rank(self.group)
        self._check_group_shapes()
        self._setup_state()

    def _setup_state(self) -> None:  # noqa: B027 - optional hook
        """Allocate per-parameter state (override)."""

    def _check_group_shapes(self) -> None:
        """All ranks of the group must hold the same local shapes (one tiny collective)."""
        if self.world <= 1:
            return
        code = zlib.crc32(repr([tuple(s) for s in self._shapes]).encode())
        mine = torch.tensor([code], dtype=torch.int64, device=self.device)
        out = torch.empty(self.world, dtype=torch.int64, device=self.device)
        gather_into(out, mine, self.group)
        bad = [r for r, c in enumerate(out.tolist()) if c != code]
        if bad:
            ranks = dist.get_process_group_ranks(self.group)
            raise ValueError(
                f"{self.name}: the replication group {ranks} does not match the mesh: "
                f"ranks {[ranks[r] for r in bad]} hold parameter shards of other shapes than "
                f"rank {dist.get_rank()}. A replication group must join ranks that hold the "
                "same shard, i.e. lie along the mesh's 'replicate' dimension"
            )

    # ------------------------------------------------------------------ schedule
    def communicates(self, step: int) -> bool:
        """Whether this replicator exchanges data on ``step`` (0-based)."""
        if step % self.replicate_every:
            return False
        return not (self.skip_every and (step + 1) % self.skip_every == 0)

    # ------------------------------------------------------------------ running
    def __call__(self, grads: list[torch.Tensor | None], lrs: list[float],
                 step: int) -> list[torch.Tensor | None]:
        if self._shapes is None:
            raise RuntimeError(f"{self.name} is not set up; use it through flexdemo's optimizer")
        if len(grads) != len(self._shapes):
            raise ValueError(f"{self.name}: expected {len(self._shapes)} gradients, "
                             f"got {len(grads)}")
        self.stats.begin_step()
        comm = self.communicates(step) and self.world > 1
        out = self.replicate(grads, lrs, step, comm)
        if comm:
            self.stats.steps_replicated += 1
        return out

    @abstractmethod
    def replicate(self, grads: list[torch.Tensor | None], lrs: list[float], step: int,
                  communicate: bool) -> list[torch.Tensor | None]:
        """Return the replicated tensors (inputs may be overwritten and returned)."""

    # ------------------------------------------------------------------ two-phase use
    def start(self, grads: list[torch.Tensor | None], lrs: list[float], step: int):
        """Begin an exchange and return a handle for :meth:`finish`.

        Replicators that support it launch their collective asynchronously, so computation can
        go on until :meth:`finish`; the default runs the whole exchange here.
        """
        return self(grads, lrs, step)

    def finish(self, pending) -> list[torch.Tensor | None]:
        """Complete an exchange begun by :meth:`start`; returns the replicated tensors."""
        return pending

    def after_step(self, step: int) -> None:  # noqa: B027 - optional hook
        """Called by the optimizer after the base optimizer's step ``step`` (override)."""

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"stats": self.stats.as_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stats.load(state.get("stats", {}))

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        sched = f"replicate_every={self.replicate_every}, skip_every={self.skip_every}"
        extra = self.extra_repr()
        return f"{type(self).__name__}({extra + ', ' if extra else ''}{sched})"


MAGIC = 0x0DE70001
HEADER_BYTES = 32


def write_header(buf: torch.Tensor, step: int, bad: bool, code: int) -> None:
    """The 32-byte header of a gathered payload: magic, step, non-finite flag, presence."""
    buf[:HEADER_BYTES].view(torch.int64).copy_(
        torch.tensor([MAGIC, step, int(bad), code], dtype=torch.int64))


def check_headers(name: str, gathered: torch.Tensor, step: int, code: int) -> None:
    """Validate the headers of ``gathered`` payloads ``(ranks, bytes)``; raise on any problem."""
    n = gathered.shape[0]
    headers = gathered[:, :HEADER_BYTES].contiguous().view(torch.int64).view(n, 4).tolist()
    for r, (magic, st, _, _) in enumerate(headers):
        if magic != MAGIC or st != step:
            raise RuntimeError(
                f"{name}: malformed payload from rank {r} of the group at step {step} "
                f"(magic {magic:#x}, step {st}); replicas must run the same flexdemo version "
                "and take steps together")
    check_flags(name, [h[2] for h in headers], [h[3] for h in headers], code, step)


def check_flags(name: str, flags: list[float], present: list[float], code: int,
                step: int) -> None:
    """Raise if any replica flagged a non-finite input or disagrees on parameter presence."""
    bad = [r for r, f in enumerate(flags) if f != 0]
    if bad:
        raise NonFiniteGradientError(name, bad, step)
    odd = [r for r, c in enumerate(present) if int(c) != code]
    if odd:
        raise RuntimeError(
            f"{name}: replicas disagree on which parameters received a gradient at step {step} "
            f"(ranks {odd} of the group differ from this rank); every replica must run the "
            "same model code so that the same parameters are used"
        )
