"""Preemption: SIGTERM or SIGINT asks ``flexdemo train`` to stop after the step it is in.

A signal only sets a flag (:class:`StopRequest`); the loop asks :meth:`StopRequest.agreed`
after every step, a one-integer all-reduce (MAX) over every rank, so every rank stops after
the same step even when only one of them got the signal. The trainer then writes that step's
metrics line, saves a checkpoint (atomically, as always) and raises :class:`Preempted`; the
command line prints one line and exits with :data:`PREEMPTED_EXIT_CODE`. A second signal
while the first is being handled takes the signal's default action (the process ends at
once; a save it interrupts never gets its ``COMPLETE`` marker, so it is never resumed from).
"""

from __future__ import annotations

import os
import signal
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PREEMPTED_EXIT_CODE", "LighthouseLost", "Preempted", "StopRequest"]

PREEMPTED_EXIT_CODE = 3
"""``flexdemo train``'s exit code after a signal stopped it and its checkpoint was saved
(not 143/130: a shell reports those for a process the signal killed without saving too)."""

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):  # not an error: the run stopped as asked
    """The run stopped after ``step`` on a signal (``signal_name``: the strongest one any
    rank got) and saved ``checkpoint``."""

    def __init__(self, step: int, checkpoint: Path, signal_name: str) -> None:
        super().__init__(f"stopped by {signal_name} after step {step}; saved {checkpoint}")
        self.step, self.signal_name = step, signal_name
        self.checkpoint: Path | None = checkpoint


class LighthouseLost(Preempted):
    """Under fault tolerance the torchft lighthouse stopped answering and did not come back
    within ``quorum_timeout`` (``reason``): the run saved its last committed step, ``step``,
    to ``checkpoint`` (None when it committed none) and stops as a preempted one does."""

    def __init__(self, step: int, checkpoint: Path | None, reason: str) -> None:
        saved = (f"saved step {step} to {checkpoint}" if checkpoint is not None
                 else "no step was committed, nothing to save")
        Exception.__init__(self, f"{reason}; {saved}")
        self.step, self.checkpoint, self.reason = step, checkpoint, reason
        self.signal_name = "lighthouse lost"


class StopRequest:
    """The signal handlers (installed with ``handle_signals``, from the main thread only;
    :meth:`restore` puts the previous ones back) and the per-step agreement on stopping.

    Every rank of a job must call :meth:`agreed` once per step, whether or not it handles
    signals. On CPU the all-reduce runs over the default (gloo) group; on CUDA over a gloo
    group of its own, so that it costs no GPU synchronisation per step.
    """

    def __init__(self, world: int, device: torch.device, timeout: float,
                 handle_signals: bool) -> None:
        self.world = world
        self.signum = 0
        self._pending: tuple[torch.Tensor, Any] | None = None  # launch(): in flight
        self._previous: dict[int, object] = {}
        if handle_signals and threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        self.group = None
        if world > 1 and device.type != "cpu":
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))

    def _handle(self, signum: int, frame) -> None:
        if self.signum:  # a second signal: give up on a clean stop
            self.restore()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum

    @property
    def requested(self) -> bool:
        """Whether this rank got a signal."""
        return bool(self.signum)

    def agreed(self) -> str | None:
        """Collective: the name of the signal some rank got (SIGTERM before SIGINT), or
        None while no rank got one."""
        signum = self.signum
        if self.world > 1:
            t = torch.tensor([signum], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            signum = int(t.item())
        return signal.Signals(signum).name if signum else None

    def launch(self) -> None:
        """Start the agreement on this rank's signal without waiting for it (a paced run:
        each sync launches one and reads the one launched at the sync before,
        :meth:`landed`, so no sync is followed by a barrier that waits for the slowest
        replica's outer step)."""
        t = torch.tensor([self.signum], dtype=torch.int64)
        work = None
        if self.world > 1:
            work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._pending = (t, work)

    def landed(self) -> str | None:
        """What the last :meth:`launch` agreed on (None before the first): every rank
        launched it at the same sync, so it has landed (or lands now); the signal some rank
        got, SIGTERM before SIGINT, or None."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        t, work = pending
        if work is not None:
            work.wait()
        signum = int(t.item())
        return signal.Signals(signum).name if signum else None

    def restore(self) -> None:
        """Put the handlers back that were there before."""
        for sig, previous in self._previous.items():
            try:
                signal.signal(sig, previous)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                signal.signal(sig, signal.SIG_DFL)
        self._previous = {}
