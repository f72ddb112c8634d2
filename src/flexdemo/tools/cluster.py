"""An emulated multi-node cluster on one machine: network namespaces joined by shaped links.

Topology (shaped mode, needs root and iproute2)::

    node 0 netns                 switch netns                 node 1 netns
    fdlink0 10.213.0.1/24 <-veth-> fdport0 --+-- fdbr0 --+-- fdport1 <-veth-> fdlink1 10.213.0.2/24
                                             (Linux bridge)

Every node gets one network namespace holding one end of a veth pair (``fdlink<i>``, the
address ``<subnet>.<i+1>``) and ``lo``; the other end (``fdport<i>``) is a port of a Linux
bridge in a separate "switch" namespace. Both ends are shaped with ``tc ... tbf rate R``: the
node side limits what the node sends, the switch side limits what it receives. So each node
has a full-duplex link of rate ``R`` to a non-blocking switch, and traffic between two nodes
crosses two links of rate ``R`` (the sender's uplink, the receiver's downlink). Ranks of one
node reach each other through the node's own address, which the kernel delivers locally,
unshaped. Nothing is created in, or changed on, the host's own network namespace.

Names: one namespace per node and one for the switch, named by :mod:`flexdemo.tools.netns`
(which also removes them). Interface names are fixed, since they live inside those
namespaces. Rates and times are parsed by :mod:`flexdemo.tools.rates`; the ranks' output and
signals are handled by :mod:`flexdemo.tools.ranks`.

Supervision (:meth:`EmulatedCluster.run`): one process per rank, started in its node's
namespace with ``ip netns exec`` in a session of its own (Ctrl-C reaches only the
supervisor). Every line a rank writes is forwarded with a ``[rank r]`` prefix (stdout to
stdout, stderr to stderr). When a rank exits non-zero or dies, the others get SIGTERM, then
SIGKILL after ``grace`` seconds. SIGINT, SIGTERM and exceptions stop the ranks and remove
every namespace (and with it every link) that was created (SIGTERM and SIGHUP become
``SystemExit(128 + signal)`` while the cluster is entered, if they had no handler).
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import netns
from .netns import NAME_PREFIX, ClusterError, LatencyUnavailableError, ShapingUnavailableError
from .ranks import (
    DeferSignals,
    OutputPump,
    TextSink,
    describe_exit,
    free_port,
    raise_exit,
    signal_group,
)
from .rates import format_rate, parse_bandwidth, parse_latency

__all__ = ["EmulatedCluster", "NodeInfo", "RunResult"]

log = logging.getLogger(__name__)

DEFAULT_SUBNET = "10.213.0.0/24"
BRIDGE = "fdbr0"
NODE_IF = "fdlink{}"
SWITCH_IF = "fdport{}"
QUEUE_LATENCY = "50ms"        # tbf: longest a packet may wait in the shaper's queue
BURST_MIN_BYTES = 10 * 1514   # ten full Ethernet frames
BURST_SECONDS = 0.002         # or 2 ms worth of the rate, whichever is larger
#: the largest packet (a TCP segmentation-offload batch) a link hands its shaper. tbf sends a
#: packet only when its bucket holds the packet's size, so a packet queued at a high rate's
#: large burst and bigger than a lower rate's burst would wait forever after `set_bandwidth`
#: lowered the rate (seen: a run stalled for good right after 1 Gbit/s -> 10 Mbit/s). Capping
#: offload batches below the smallest burst keeps every queued packet sendable at any rate.
GSO_MAX_BYTES = 8192


_counter_lock = threading.Lock()
_counter = 0


@dataclass(frozen=True)
class NodeInfo:
    """One emulated node: its namespace, interface and address (``None`` when unshaped)."""

    index: int
    namespace: str | None
    interface: str
    address: str
    switch_interface: str | None


@dataclass
class RunResult:
    """What :meth:`EmulatedCluster.run` observed.

    ``returncodes`` per rank (negative: killed by that signal; ``None``: never finished);
    ``failed_rank`` is the first rank seen failing (``None`` if all exited 0), ``exit_code``
    its exit code (``128 + signal`` for a signal, 124 for a timeout, 0 on success).
    """

    returncodes: list[int | None]
    failed_rank: int | None
    exit_code: int
    message: str
    seconds: float
    timed_out: bool = False
    terminated: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every rank exited with code 0."""
        return self.failed_rank is None and not self.timed_out


class EmulatedCluster:
    """``nodes`` x ``ranks_per_node`` ranks on one machine, nodes joined by links of rate
    ``bandwidth``.

    Use as a context manager; entering builds the network, leaving removes it::

        with EmulatedCluster(2, 2, "100mbit") as cluster:
            result = cluster.run(["python", "train.py"])

    ``latency`` (e.g. ``"10ms"``) is the one-way delay between two nodes (half on each of the
    two links a packet crosses); it needs the ``sch_netem`` kernel module. ``unshaped=True``
    runs the same ranks on loopback, without namespaces or root. ``subnet`` (a private IPv4
    network, default ``10.213.0.0/24``) gives node ``i`` its ``i+1``-th host address.
    ``port`` is ``MASTER_PORT`` (default 29500, or a free port when unshaped). ``grace`` is how
    long ranks get between SIGTERM and SIGKILL. ``log`` receives progress and facts (default:
    this module's logger at INFO).

    Raises ``ValueError`` for bad arguments and :class:`ShapingUnavailableError` when shaping
    is asked for without root or iproute2.
    """

    def __init__(self, nodes: int, ranks_per_node: int = 1,
                 bandwidth: str | int | float | None = None, latency: str | float | None = None,
                 *, unshaped: bool = False, subnet: str = DEFAULT_SUBNET,
                 port: int | None = None, grace: float = 3.0,
                 log: Callable[[str], None] | None = None) -> None:
        for name, v in (("nodes", nodes), ("ranks_per_node", ranks_per_node)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r} (e.g. {name}=2)")
        if port is not None and (not isinstance(port, int) or not 1 <= port <= 65535):
            raise ValueError(f"port must be an integer in 1..65535, got {port!r} (e.g. 29500)")
        if not grace >= 0:
            raise ValueError(f"grace must be >= 0 seconds, got {grace!r}")
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node
        self.world_size = nodes * ranks_per_node
        self.unshaped = bool(unshaped)
        self.grace = float(grace)
        self._log = log or _log_info
        self.rate_bps: int | None = None
        self.latency_s: float | None = None
        if not self.unshaped:
            if bandwidth is None:
                raise ValueError("bandwidth is required for a shaped cluster, e.g. "
                                 "bandwidth='100mbit' (or pass unshaped=True)")
            self.rate_bps = parse_bandwidth(bandwidth)
            if latency is not None:
                self.latency_s = parse_latency(latency)
        try:
            net = ipaddress.ip_network(subnet, strict=True)
        except ValueError as e:
            raise ValueError(f"subnet {subnet!r} is not a network ({e}); "
                             "e.g. '10.213.0.0/24'") from None
        if net.version != 4 or not net.is_private:
            raise ValueError(f"subnet {subnet!r} must be a private IPv4 network, "
                             "e.g. '10.213.0.0/24'")
        hosts = net.num_addresses - 2
        if not self.unshaped and nodes > hosts:
            raise ValueError(f"subnet {subnet} has {hosts} host addresses, too few for "
                             f"{nodes} nodes; use a larger one, e.g. '10.213.0.0/16'")
        self.subnet = net
        if not self.unshaped:
            problem = netns.shaping_problem()
            if problem:
                raise ShapingUnavailableError(
                    f"shaping the emulated network needs root and iproute2 (ip, tc): {problem}."
                    " Run as root, or use --unshaped (unshaped=True) to run the same ranks on "
                    "loopback without shaping.")
            self._ip = netns.find_tool("ip") or "ip"
            self._tc = netns.find_tool("tc") or "tc"
        self.port = port if port is not None else (None if self.unshaped else 29500)
        global _counter
        with _counter_lock:
            self.run_id = f"{os.getpid()}-{_counter}"
            _counter += 1
        self.base = f"{NAME_PREFIX}{self.run_id}"
        self.switch_namespace: str | None = None if self.unshaped else f"{self.base}-sw"
        addrs = list(net.hosts())
        self.node_info: list[NodeInfo] = []
        for i in range(nodes):
            if self.unshaped:
                self.node_info.append(NodeInfo(i, None, "lo", "127.0.0.1", None))
            else:
                self.node_info.append(NodeInfo(i, f"{self.base}-n{i}", NODE_IF.format(i),
                                               str(addrs[i]), SWITCH_IF.format(i)))
        self.facts: list[str] = []
        self._created: list[str] = []
        self._shaped: list[tuple[str, str]] = []  # (namespace, device) of every shaped link
        self._active = False
        self._old_handlers: dict[int, Any] = {}

    # ----------------------------------------------------------------- set-up and teardown

    @property
    def master_addr(self) -> str:
        """Node 0's address (``MASTER_ADDR``)."""
        return self.node_info[0].address

    @property
    def namespaces(self) -> list[str]:
        """The namespaces this cluster created and has not removed yet."""
        return list(self._created)

    def _fact(self, text: str) -> None:
        self.facts.append(text)
        self._log(text)

    def __enter__(self) -> EmulatedCluster:
        if self._active:
            raise ClusterError("this EmulatedCluster is already in use")
        self._install_signal_handlers()
        try:
            if self.port is None:
                self.port = free_port()
            if not self.unshaped:
                self._build()
            else:
                self._fact(f"unshaped: {self.world_size} ranks on loopback (127.0.0.1, lo), "
                           f"no namespaces, no shaping")
        except BaseException:
            self._teardown()
            self._restore_signal_handlers()
            raise
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._active = False
        try:
            self._teardown()
        finally:
            self._restore_signal_handlers()

    def _ipn(self, ns: str, *args: str) -> None:
        netns.run_tool([self._ip, "-n", ns, *args])

    def _cap_packets(self, ns: str, dev: str) -> None:
        """Offload batches on ``dev`` at most :data:`GSO_MAX_BYTES`, so that no queued packet
        outgrows a later, smaller burst (an iproute2 without the setting gets a fact line)."""
        proc = netns.run_tool([self._ip, "-n", ns, "link", "set", dev, "gso_max_size",
                               str(GSO_MAX_BYTES)], check=False)
        if proc.returncode != 0:
            self._fact(f"could not cap offload batches on {dev} in {ns} ({proc.stderr.strip()}"
                       "): a link lowered during a run may stall")

    def _tbf_args(self) -> list[str]:
        assert self.rate_bps is not None
        burst = max(BURST_MIN_BYTES, math.ceil(self.rate_bps / 8 * BURST_SECONDS))
        return ["tbf", "rate", f"{self.rate_bps}bit", "burst", f"{burst}b",
                "latency", QUEUE_LATENCY]

    def _shape(self, ns: str, dev: str, what: str) -> None:
        tbf = self._tbf_args()
        self._shaped.append((ns, dev))
        if self.latency_s is None:
            netns.run_tool([self._tc, "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf])
            self._fact(f"shaped {what}: {dev} in {ns}: tc qdisc {' '.join(tbf)}")
            return
        delay_us = max(1, round(self.latency_s / 2 * 1e6))
        proc = netns.run_tool([self._tc, "-n", ns, "qdisc", "add", "dev", dev, "root",
                                "handle", "1:", "netem", "delay", f"{delay_us}us"], check=False)
        if proc.returncode != 0:
            raise LatencyUnavailableError(
                "latency emulation needs tc's netem qdisc (kernel module sch_netem), which is "
                f"not available here (tc said: {proc.stderr.strip() or proc.returncode}). "
                "Run without --latency (bandwidth shaping with tbf still works).")
        netns.run_tool([self._tc, "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1",
                         "handle", "10:", *tbf])
        self._fact(f"shaped {what}: {dev} in {ns}: tc qdisc netem delay {delay_us}us + "
                   f"{' '.join(tbf)}")

    def set_bandwidth(self, bandwidth: str | int | float) -> None:
        """Shape every link to ``bandwidth`` now, while ranks may be running (``tc qdisc
        change``: the sockets stay open, packets in the queue keep their place)."""
        if self.unshaped or not self._active:
            raise ClusterError("set_bandwidth needs a shaped cluster that is running (inside "
                               "its `with` block)")
        self.rate_bps = parse_bandwidth(bandwidth)
        tbf = self._tbf_args()
        where = ["root"] if self.latency_s is None else ["parent", "1:1", "handle", "10:"]
        for ns, dev in self._shaped:
            netns.run_tool([self._tc, "-n", ns, "qdisc", "change", "dev", dev, *where, *tbf])
        self._fact(f"every link reshaped to {format_rate(self.rate_bps)}: tc qdisc change "
                   f"{' '.join(tbf)}")

    def _add_netns(self, ns: str) -> None:
        netns.run_tool([self._ip, "netns", "add", ns])
        self._created.append(ns)

    def _build(self) -> None:
        sw = self.switch_namespace
        assert sw is not None
        t0 = time.perf_counter()
        self._add_netns(sw)
        self._ipn(sw, "link", "add", BRIDGE, "type", "bridge")
        self._ipn(sw, "link", "set", BRIDGE, "addrgenmode", "none")
        self._ipn(sw, "link", "set", BRIDGE, "up")
        self._fact(f"created namespace {sw} with bridge {BRIDGE} (the switch)")
        for node in self.node_info:
            ns, dev, port = node.namespace, node.interface, node.switch_interface
            assert ns is not None and port is not None
            self._add_netns(ns)
            # the veth pair is created inside the switch namespace, its peer moved straight
            # into the node's: the host's own namespace never sees either end.
            self._ipn(sw, "link", "add", port, "type", "veth", "peer", "name", dev,
                      "netns", ns)
            self._ipn(sw, "link", "set", port, "addrgenmode", "none")
            self._ipn(sw, "link", "set", port, "master", BRIDGE, "up")
            self._ipn(ns, "link", "set", "lo", "up")
            # no IPv6 link-local address: gloo must see only the IPv4 address on `dev`
            self._ipn(ns, "link", "set", dev, "addrgenmode", "none")
            self._ipn(ns, "addr", "add", f"{node.address}/{self.subnet.prefixlen}", "dev", dev)
            self._ipn(ns, "link", "set", dev, "up")
            self._cap_packets(sw, port)
            self._cap_packets(ns, dev)
            self._fact(f"created namespace {ns}: lo up, veth {dev} {node.address}/"
                       f"{self.subnet.prefixlen} <-> {port} on {BRIDGE} in {sw}")
            self._shape(ns, dev, f"node {node.index} -> switch")
            self._shape(sw, port, f"switch -> node {node.index}")
        self._fact(f"{self.nodes} nodes x {self.ranks_per_node} ranks; each node's link "
                   f"shaped to {format_rate(self.rate_bps or 0)} in both directions"
                   + (f", {self.latency_s * 1e3:g} ms one-way node-to-node latency"
                      if self.latency_s else "")
                   + f"; MASTER_ADDR {self.master_addr}:{self.port}; set-up took "
                   f"{time.perf_counter() - t0:.2f}s")

    def _teardown(self) -> None:
        if not self._created:
            return
        with DeferSignals():
            names = sorted(self._created, key=lambda n: n.endswith("-sw"))
            problems = netns.delete_netns(names)
            left = [n for n in netns.list_netns() if n in set(names)]
            self._created = left
            self._shaped = []
            if problems or left:
                raise ClusterError(f"could not remove namespaces {left}: {'; '.join(problems)}"
                                   " (cleanup_stale() removes them once this process exits)")
            self._fact(f"removed namespaces {', '.join(names)} (and their veth links); "
                       f"none left")

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                # becomes SystemExit(128 + sig), so `finally` blocks and __exit__ still run
                self._old_handlers[sig] = signal.signal(sig, raise_exit)

    def _restore_signal_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

    # ----------------------------------------------------------------- running ranks

    def rank_env(self, rank: int) -> dict[str, str]:
        """The launcher variables rank ``rank`` gets (on top of the inherited environment)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in 0..{self.world_size - 1}, got {rank}")
        node = self.node_info[rank // self.ranks_per_node]
        return {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank % self.ranks_per_node),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.ranks_per_node),
            "NODE_RANK": str(node.index),
            "GROUP_RANK": str(node.index),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.port),
            "GLOO_SOCKET_IFNAME": node.interface,
            "NCCL_SOCKET_IFNAME": node.interface,  # NCCL's sockets use the emulated link too
        }

    def node_command(self, node: int, cmd: Sequence[str]) -> list[str]:
        """``cmd`` as run inside node ``node``'s namespace (``cmd`` itself when unshaped),
        for callers that start a node's processes themselves (``bench --preset elastic``)."""
        info = self.node_info[node]
        cmd = [str(c) for c in cmd]
        return cmd if info.namespace is None else [self._ip, "netns", "exec", info.namespace,
                                                   *cmd]

    def run(self, cmd: Sequence[str], *, env: Mapping[str, str] | None = None,
            stdout: TextSink | None = None, stderr: TextSink | None = None,
            timeout: float | None = None, cwd: str | None = None) -> RunResult:
        """Run ``cmd`` once per rank, each in its node's namespace, and supervise them.

        Each rank's environment is this process's, updated with ``env``, the launcher
        variables (:meth:`rank_env`), and ``OMP_NUM_THREADS=1`` and ``PYTHONUNBUFFERED=1``
        unless already set. Output lines go to ``stdout``/``stderr`` (default: this process's)
        prefixed ``[rank r] ``. When a rank fails, or after ``timeout`` seconds, the others
        are stopped (SIGTERM, then SIGKILL after ``grace``). Returns a :class:`RunResult`;
        raises only when the command cannot be started, or on interrupts (the ranks are
        stopped first).
        """
        if not self._active:
            raise ClusterError("enter the cluster first: `with EmulatedCluster(...) as c: "
                               "c.run(cmd)`")
        cmd = [str(c) for c in cmd]
        if not cmd:
            raise ValueError("cmd is empty; give the command to run, e.g. ['python', 'train.py']")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        out = stdout if stdout is not None else sys.stdout
        err = stderr if stderr is not None else sys.stderr
        base_env = dict(os.environ)
        base_env.update(env or {})
        base_env.setdefault("OMP_NUM_THREADS", "1")
        base_env.setdefault("PYTHONUNBUFFERED", "1")
        if shutil.which(cmd[0], path=base_env.get("PATH")) is None and not (
                cwd and os.sep in cmd[0] and os.access(os.path.join(cwd, cmd[0]), os.X_OK)):
            raise ClusterError(f"command not found: {cmd[0]!r}")
        lock = threading.Lock()
        procs: list[subprocess.Popen[bytes]] = []
        pumps: list[OutputPump] = []
        t0 = time.monotonic()
        failed: tuple[int | None, int, str, bool] | None = None
        try:
            for rank in range(self.world_size):
                node = self.node_info[rank // self.ranks_per_node]
                argv = self.node_command(node.index, cmd)
                renv = dict(base_env)
                renv.update(self.rank_env(rank))
                try:
                    p = subprocess.Popen(argv, env=renv, cwd=cwd, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         start_new_session=True)
                except OSError as e:
                    raise ClusterError(f"could not start rank {rank} ({cmd[0]!r}): {e}") from e
                procs.append(p)
                assert p.stdout is not None and p.stderr is not None
                pumps.append(OutputPump(p.stdout, f"[rank {rank}] ", out, lock))
                pumps.append(OutputPump(p.stderr, f"[rank {rank}] ", err, lock))
            where = ("on loopback" if self.unshaped
                     else f"in namespaces {self.base}-n0..n{self.nodes - 1}")
            self._fact(f"started {self.world_size} ranks {where}: {' '.join(cmd)}")
            failed = self._supervise(procs, t0, timeout)
        finally:
            with DeferSignals():
                terminated = self._stop(procs)
            for pump in pumps:
                pump.thread.join(timeout=2.0)
        seconds = time.monotonic() - t0
        codes = [p.poll() for p in procs]
        assert failed is not None
        failed_rank, exit_code, message, timed_out = failed
        stopped = (f"; stopped rank{'s' if len(terminated) > 1 else ''} "
                   f"{', '.join(map(str, terminated))}" if terminated else "")
        result = RunResult(codes, failed_rank, exit_code, f"{message}{stopped} ({seconds:.1f}s)",
                           seconds, timed_out, terminated)
        if result.ok:  # a failure is the caller's to report, once (flexdemo cluster: error:)
            self._log(result.message)
        return result

    def _supervise(self, procs: list[subprocess.Popen[bytes]], t0: float,
                   timeout: float | None) -> tuple[int | None, int, str, bool]:
        """Wait until all ranks exit 0, one fails, or the timeout passes."""
        while True:
            running = False
            for rank, p in enumerate(procs):
                code = p.poll()
                if code is None:
                    running = True
                elif code != 0:
                    node, local = divmod(rank, self.ranks_per_node)
                    exit_code = 128 - code if code < 0 else code
                    return (rank, exit_code, f"rank {rank} (node {node}, local rank {local}) "
                            f"{describe_exit(code)}", False)
            if not running:
                return None, 0, f"all {len(procs)} ranks exited with code 0", False
            if timeout is not None and time.monotonic() - t0 > timeout:
                return None, 124, f"timed out after {timeout:g}s", True
            time.sleep(0.05)

    def _stop(self, procs: list[subprocess.Popen[bytes]]) -> list[int]:
        """SIGTERM the ranks still running (their whole process group), SIGKILL after grace."""
        alive = [(r, p) for r, p in enumerate(procs) if p.poll() is None]
        for _, p in alive:
            signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        while any(p.poll() is None for _, p in alive) and time.monotonic() < deadline:
            time.sleep(0.02)
        for _, p in alive:
            if p.poll() is None:
                signal_group(p, signal.SIGKILL)
        for _, p in alive:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        return [r for r, _ in alive]


def _log_info(text: str) -> None:
    log.info("%s", text)
