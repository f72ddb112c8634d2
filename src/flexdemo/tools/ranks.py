"""The ranks' processes: a free port for their rendezvous, forwarding their output line by
line, signalling their process groups, and holding signals while the supervisor cleans up."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import threading
from typing import IO, Any, Protocol

__all__ = ["OutputPump", "TextSink", "free_port", "signal_group"]


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous or a server).

    It is drawn below the kernel's ephemeral range, so that the outgoing connections of other
    processes (which take their local ports from that range) cannot take it in the moment
    between this call and the server's bind; the kernel's choice is the fallback.
    """
    lo, _ = _ephemeral_range()
    first = 20000 if lo > 21000 else 1024
    draw = random.SystemRandom()
    for _ in range(64):
        port = draw.randrange(first, max(first + 1, lo))
        if _bindable(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} ({-code})"
    return f"exited with code {code}"


class TextSink(Protocol):
    """Where the ranks' output lines go: a text file, or anything that writes and flushes."""

    def write(self, text: str, /) -> object: ...

    def flush(self) -> None: ...


class OutputPump:
    """Forwards a rank's pipe line by line with a prefix, under a shared lock."""

    def __init__(self, pipe: IO[bytes], prefix: str, sink: TextSink, lock: threading.Lock):
        self.thread = threading.Thread(target=self._pump, args=(pipe, prefix, sink, lock),
                                       daemon=True)
        self.thread.start()

    @staticmethod
    def _pump(pipe: IO[bytes], prefix: str, sink: TextSink, lock: threading.Lock) -> None:
        broken = False
        with pipe:
            for raw in iter(pipe.readline, b""):
                if broken:
                    continue  # keep draining so the rank never blocks on a full pipe
                line = raw.decode("utf-8", errors="replace")
                if not line.endswith("\n"):
                    line += "\n"
                try:
                    with lock:
                        sink.write(prefix + line)
                        sink.flush()
                except (OSError, ValueError):
                    broken = True


def signal_group(p: subprocess.Popen[bytes], sig: int) -> None:
    """Send ``sig`` to the process group ``p`` leads (to ``p`` alone if it leads none)."""
    try:
        os.killpg(p.pid, sig)  # start_new_session: the rank leads its own group
    except (ProcessLookupError, PermissionError):
        try:
            p.send_signal(sig)
        except ProcessLookupError:
            pass


def raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


class DeferSignals:
    """Hold SIGINT/SIGTERM while cleaning up; re-deliver the first one afterwards."""

    def __init__(self) -> None:
        self.pending: int | None = None
        self.old: dict[int, Any] = {}

    def _record(self, signum: int, frame: object) -> None:
        if self.pending is None:
            self.pending = signum

    def __enter__(self) -> DeferSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.old[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self.old.items():
            signal.signal(sig, old)
        if self.pending is not None:
            signal.raise_signal(self.pending)
