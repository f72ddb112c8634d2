"""Per-step exchanges weighted by each replica's tokens (balanced batches, issue 55).

When replicas of different speeds train on batches of different sizes (sized to their speed,
:func:`flexdemo.balanced_batches`), the plain mean of their gradients weighs a replica's
small batch as much as another's large one. ``FullReplicator(weights="tokens")`` and
``DeMoReplicator(weights="tokens")`` weigh each replica's contribution by the tokens it
reported for the step (``opt.count_tokens(n)`` before ``opt.step()``): the mean becomes
``sum_i w_i g_i / sum_i w_i``, the gradient of the mean loss over every token of the step.

**How.** At each exchanging step every rank all-gathers its token count (one float64: ``8 (n
- 1)`` bytes sent per rank and step, counted in ``bytes_sent``; one more small collective,
a round trip of latency, before the exchange) and scales its own input by ``c_i = w_i n /
W`` (:func:`weight_factors`: float64 from the same numbers on every rank, rounded to fp32
once), so the exchange's own mean over the ``n`` replicas (the fp32 all-reduce, the gathered
or reduce-scattered quantised means, DeMo's decoded mean) is the weighted one. Quantised
formats quantise the scaled input; error feedback keeps it. A mean over the senders (DeMo's
``mean="senders"``) divides each coordinate by the sum of its senders' factors
(:attr:`~.base.Replicator.peer_scales`).

**DeMo.** DeMo sends components of a momentum, not the gradient; the input scaled is the
gradient that enters the momentum (``delta = decay * delta + s * c_i * grad``), so the
weight travels with the gradient of the step it came from, as error feedback carries it to
later steps: with every coefficient sent and no decay it is exactly the token-weighted mean of
the gradients. A replica with more tokens has a less noisy gradient; weighing its momentum's
contribution by its tokens is the analogue of the token-weighted mean (its components are
also more likely among the largest of the mean).

**Equal reports keep today's bits.** Equal token counts (or none reported by any replica)
give factors of exactly 1.0, and a product by 1 keeps the bits. A replica that reports none
while others do weighs nothing. A step the schedule skips (``replicate_every``,
``skip_every``) runs locally: its tokens are dropped and nothing is gathered.

Not supported: fault tolerance (the group changes under the gathered counts), DiLoCo's
exchange (weigh DiLoCo's replicas with ``pace=Pace(weights="tokens")``), DeMo's mean over the
senders with ``reduce`` other than ``"gather"`` or with ``overlap="delayed"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..transport import all_gather
from .base import Replicator

if TYPE_CHECKING:  # the checker reads the replicator's attributes; at run time a mixin
    _Base = Replicator
else:
    _Base = object

__all__ = ["WEIGHTINGS", "TokenWeighted", "weight_factors"]

#: what a per-step replicator weighs each replica's contribution by
WEIGHTINGS = ("equal", "tokens")


def weight_factors(weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Each rank's factor ``c_i = w_i n / W`` (fp32, ``(n,)``) from its float64 weight
    (``fallback`` where no rank has a weight > 0), exactly 1.0 where every weight is equal;
    computed on the device (no host read), the same on every rank from the same numbers."""
    w = torch.where(weights.sum() > 0, weights, fallback)
    equal = (w == w[0]).all()
    return torch.where(equal, torch.ones_like(w), w * w.numel() / w.sum()).float()


class TokenWeighted(_Base):
    """The ``weights=`` setting of a per-step replicator (a mixin of :class:`FullReplicator`
    and :class:`DeMoReplicator`; see the module)."""

    #: ``"equal"`` (default) or ``"tokens"``
    weights: str = "equal"
    _tokens: torch.Tensor | None = None

    def _init_weights(self, weights: str, refused: str | None = None) -> None:
        """Check and keep ``weights``; ``refused``: why these settings cannot weigh."""
        if weights not in WEIGHTINGS:
            raise ValueError(f"weights must be one of {WEIGHTINGS}, got {weights!r}")
        if weights == "tokens" and refused:
            raise ValueError(f"weights='tokens' cannot weigh {refused}")
        self.weights = weights

    def count_tokens(self, n: int | float | torch.Tensor) -> None:
        """Add ``n`` tokens (an int, or a tensor on the replicator's device: no host read) to
        this replica's weight in the next exchange; nothing unless ``weights="tokens"``."""
        if self.weights != "tokens":
            return
        if self._tokens is None:
            self._tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        self._tokens.add_(n)

    def _weigh_inputs(self, grads: Sequence[torch.Tensor | None], communicate: bool) -> None:
        """Before an exchange (``weights="tokens"``): all-gather the tokens, scale this
        rank's input by its factor and set :attr:`peer_scales`; the count starts again."""
        if self.weights != "tokens":
            return
        tokens = self._tokens
        if tokens is None:
            tokens = self._tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        if not communicate or self.world <= 1:
            tokens.zero_()
            return
        gathered = all_gather(tokens.reshape(1), self.transport, self.stats).reshape(-1)
        tokens.zero_()
        factors = weight_factors(gathered, torch.ones_like(gathered))
        self.peer_scales = factors
        present = [g for g in grads if g is not None]
        if present:
            torch._foreach_mul_(present, factors[self.rank])

    def fault_tolerance_problem(self) -> str | None:
        if self.weights == "tokens":
            return (f"fault tolerance does not support {self.name} with weights='tokens' "
                    "(the group changes under the gathered token counts)")
        return super().fault_tolerance_problem()
