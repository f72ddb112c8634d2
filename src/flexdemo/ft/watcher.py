"""The thread that watches a replica group's quorum waits (owned by an
:class:`~flexdemo.ft.session.ElasticSession`).

While a group waits for a quorum, something must notice a lighthouse that stopped answering,
or a wait that is getting long, and say so while the main thread is blocked in torchft. One
thread does that for every wait of the session: started at the first, handed each wait's job
and kept for the next (a thread started for every wait cost rank 0 about 1.7 ms of CPU a step).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["QuorumWatcher"]


class QuorumWatcher:
    """One thread that runs the jobs :meth:`submit` hands it, one at a time, until
    :meth:`close`. A job is told by its submitter when to return (an event it waits on);
    :meth:`wait` then waits until it has. An exception a job raises goes to ``on_error`` and
    the thread lives on (the next wait must have a watcher)."""

    def __init__(self, on_error: Callable[[Exception], None],
                 name: str = "flexdemo-quorum-watch") -> None:
        self._on_error = on_error
        self._name = name
        self._thread: threading.Thread | None = None
        self._job: Callable[[], None] | None = None
        self._wake, self._idle = threading.Event(), threading.Event()
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (jobs are no longer run)."""
        return self._closed

    def submit(self, job: Callable[[], None]) -> bool:
        """Run ``job`` on the watcher thread (started at the first job). Returns whether it
        was handed over: not once closed. Submit again only after :meth:`wait`."""
        if self._closed:
            return False
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name=self._name)
            self._thread.start()
        self._idle.clear()
        self._job = job
        self._wake.set()
        return True

    def wait(self) -> None:
        """Until the job submitted last has returned (or the thread has ended, closed)."""
        self._idle.wait()

    def close(self) -> None:
        """End the thread once its job in progress returns; later jobs are not run."""
        self._closed, self._job = True, None
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            job = self._job
            try:
                if job is not None:
                    job()
            except Exception as e:
                self._on_error(e)
            finally:
                self._idle.set()
            if job is None:
                return
