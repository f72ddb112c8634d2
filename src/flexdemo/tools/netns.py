"""Network namespaces through iproute2: running ``ip``/``tc``, listing, deleting, and removing
the leftovers of dead runs.

Names: namespaces are ``flexdemo-<pid>-<k>-sw`` and ``flexdemo-<pid>-<k>-n<i>`` (``pid`` of
the creating process, ``k`` a per-process counter), so parallel runs never collide and
:func:`cleanup_stale` can tell leftovers of dead runs apart.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence

__all__ = ["NAME_PREFIX", "ClusterError", "LatencyUnavailableError", "ShapingUnavailableError",
           "cleanup_stale"]

NAME_PREFIX = "flexdemo-"


class ClusterError(RuntimeError):
    """The emulated cluster could not be set up or torn down."""


class ShapingUnavailableError(ClusterError):
    """Shaping needs root and iproute2 (``ip``, ``tc``); run unshaped instead."""


class LatencyUnavailableError(ClusterError):
    """Latency emulation needs tc's netem qdisc (kernel module ``sch_netem``)."""


def find_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in ("/usr/sbin", "/sbin", "/usr/bin", "/bin"):
        p = os.path.join(d, name)
        if os.access(p, os.X_OK):
            return p
    return None


def shaping_problem() -> str | None:
    """Why shaping cannot work here, or None."""
    problems = []
    if os.geteuid() != 0:
        problems.append("this process is not root")
    missing = [t for t in ("ip", "tc") if find_tool(t) is None]
    if missing:
        problems.append(f"{' and '.join(missing)} not found (install iproute2)")
    return "; ".join(problems) or None


def run_tool(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    # a session of its own: a Ctrl-C at the terminal must not kill `ip netns del` half-way
    proc = subprocess.run(list(args), capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          start_new_session=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(args)}` failed (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def list_netns() -> list[str]:
    ip = find_tool("ip") or "ip"
    proc = run_tool([ip, "netns", "list"], check=False)
    if proc.returncode != 0:
        return []
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_netns_pids(ns: str) -> list[int]:
    """SIGKILL every process still inside namespace ``ns``; returns their pids."""
    ip = find_tool("ip") or "ip"
    proc = run_tool([ip, "netns", "pids", ns], check=False)
    pids = [int(p) for p in proc.stdout.split() if p.isdigit()] if proc.returncode == 0 else []
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def delete_netns(names: Sequence[str]) -> list[str]:
    """Kill what runs inside, then delete the namespaces; returns problems (empty if none)."""
    ip = find_tool("ip") or "ip"
    problems = []
    for ns in names:
        if _kill_netns_pids(ns):
            time.sleep(0.05)
        proc = run_tool([ip, "netns", "del", ns], check=False)
        if proc.returncode != 0 and ns in list_netns():
            problems.append(f"{ns}: {proc.stderr.strip()}")
    return problems


def cleanup_stale(prefix: str = NAME_PREFIX) -> list[str]:
    """Remove namespaces (and their links) left behind by dead flexdemo runs.

    Only names of the form ``<prefix><pid>-<k>-sw|n<i>`` whose creating ``pid`` is no longer
    alive are touched; processes still inside them are killed first. Returns the removed
    names. Without root (or without ``ip``), nothing can be listed and ``[]`` is returned.
    """
    if os.geteuid() != 0 or find_tool("ip") is None:
        return []
    pattern = re.compile(re.escape(prefix) + r"(\d+)-(\d+)-(sw|n\d+)$")
    stale = []
    for ns in list_netns():
        m = pattern.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            stale.append(ns)
    # node namespaces first, then switches (the order does not matter to the kernel)
    stale.sort(key=lambda n: n.endswith("-sw"))
    problems = delete_netns(stale)
    if problems:
        raise ClusterError("could not remove stale namespaces: " + "; ".join(problems))
    return stale
