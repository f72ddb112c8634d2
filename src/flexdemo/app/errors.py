"""The errors of ``flexdemo train`` (what the command line turns into exit codes) and the
library errors it retells in its own words (steps counted from 1, advice in config keys).
A lost peer is the library's :class:`~flexdemo.transport.PeerLostError` (not a
:class:`TrainingError`: the library cannot derive from the application's errors);
:class:`StartupError` is both."""

from __future__ import annotations

from ..replicate import NonFiniteGradientError
from ..transport import PeerLostError

__all__ = ["PeerLostError", "StartupError", "TrainingError", "UsageError"]

class TrainingError(RuntimeError):
    """Training cannot start or go on; the message is meant for the user."""


class UsageError(TrainingError):
    """Training cannot start as configured: a config value or an argument is wrong (a
    checkpoint path that does not exist, an output folder that is a file, a checkpoint past
    ``train.steps``); the command line exits with code 2."""


class StartupError(PeerLostError, TrainingError):
    """Peers missing when the job assembles (never arrived, or died during start-up); every
    survivor names them, and the command line exits with code 2."""


# ---------------------------------------------------------------------- messages
# The trainer counts steps from 1 (metrics, progress, checkpoints step_NNNNNN); the library
# names the optimizer's step index (from 0). Library errors that carry a step are retold here
# in the trainer's count, with advice in config keys.
def nonfinite_message(step: int, e: NonFiniteGradientError) -> str:
    who = (f"global rank(s) {', '.join(map(str, e.ranks))}" if e.ranks
           else "at least one replica")
    found = e.step + 1
    when = "" if found == step else f" (in step {found})"
    return (f"step {step}: {e.replicator}: non-finite gradient (NaN or Inf) on {who}{when}"
            f"{e.note}; lower strategy.lr or clip gradients, or set strategy.nonfinite='skip' "
            "to skip such steps on all replicas")
