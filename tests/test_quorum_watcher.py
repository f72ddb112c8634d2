"""The quorum watcher (``flexdemo.ft.watcher.QuorumWatcher``): one thread for every job, a
job that raises is reported and the thread lives on, nothing runs once closed. (The session
using it, with a real lighthouse lost and back: test_lighthouse.py.)"""

from __future__ import annotations

import threading

from flexdemo.ft.watcher import QuorumWatcher

BOUND = 60  # seconds any wait here may take (a bound, not a timing)


def test_one_thread_runs_every_job_and_wait_returns_after_it():
    errors: list[Exception] = []
    w = QuorumWatcher(errors.append)
    threads, done = [], threading.Event()

    def job() -> None:
        threads.append(threading.current_thread())
        assert done.wait(BOUND)  # returns when its submitter tells it

    for _ in range(3):
        done.clear()
        assert w.submit(job)
        done.set()
        w.wait()
    assert len(threads) == 3 and len(set(threads)) == 1
    assert threads[0] is not threading.current_thread() and threads[0].daemon
    assert not errors
    w.close()
    threads[0].join(BOUND)
    assert not threads[0].is_alive()


def test_a_job_that_raises_is_reported_and_the_next_one_runs():
    errors: list[Exception] = []
    w = QuorumWatcher(errors.append)
    ran = []

    def bad() -> None:
        raise RuntimeError("no lighthouse")

    assert w.submit(bad)
    w.wait()
    assert w.submit(lambda: ran.append(1))
    w.wait()
    assert [str(e) for e in errors] == ["no lighthouse"] and ran == [1]
    w.close()


def test_nothing_runs_once_closed():
    w = QuorumWatcher(lambda e: None)
    w.close()
    ran: list[int] = []
    assert w.closed and not w.submit(lambda: ran.append(1))
    w.close()  # twice: harmless
    assert not ran
