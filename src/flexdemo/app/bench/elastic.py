"""``flexdemo bench --preset elastic``: a node killed and restarted in a fault-tolerant run.

Two runs of one strategy on one emulated cluster (:class:`~flexdemo.tools.cluster.EmulatedCluster`):

1. **plain**: ``flexdemo train`` on every rank as one job, without fault tolerance (the
   bench's usual run);
2. **elastic**: every node its own job and torchft replica group (``[fault_tolerance]``), with
   torchft's lighthouse in node 0's namespace. When node 0 reaches step ``kill_at`` with
   every node in its quorum (a node slow to start is waited for), the last node's ranks get
   SIGKILL; ``restart_at - kill_at`` steps later that node starts afresh, heals from a peer
   and trains on.

From the ``metrics.jsonl`` of both runs it reports the per-step cost of fault tolerance (the
quorum and the commit vote, steps 5 to ``kill_at``), the CPU that torchft's threads took on
node 0's rank 0 in the same steps of the same run (read from ``/proc``, Linux; unlike the
comparison of two runs, other jobs on the machine do not move it), how long the survivors
took to commit a step without the dead node, how long the restarted node took to train again
and which step it began at, and the final validation losses. It prints a table, writes
``elastic.json`` and draws ``elastic.png`` (loss and participating replicas against time).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...ft.config import TorchFTMissingError, require_torchft
from ...ft.lighthouse import launcher as lighthouse_launcher
from ...strategies import STRATEGIES
from ...tools.cluster import EmulatedCluster
from ...tools.netns import ClusterError, ShapingUnavailableError
from ...tools.ranks import OutputPump, free_port, signal_group
from ...tools.rates import format_rate, parse_bandwidth
from ..config.files import to_toml
from ..outputs import read_metrics, strict_json

__all__ = ["FT_THREADS", "LIGHTHOUSE_FLAGS", "PAIR_FIGURES", "elastic_problem", "pair_lines",
           "pair_spread", "report_pairs", "run_elastic", "thread_cpu"]

LIGHTHOUSE_FLAGS = ("--join_timeout_ms", "2000", "--heartbeat_timeout_ms", "3000",
                    "--quorum_tick_ms", "50")
"""The bench's lighthouse: a node counts as dead after 3 s without a heartbeat."""
WARM_STEPS = 5
"""Steps left out of the step-time means (start-up, first allocations)."""
FT_TIMEOUT = 30.0
"""``fault_tolerance.timeout`` of the elastic run: the bound on one collective."""
FT_THREADS = ("torchft", "TimeoutManager", "async_quorum", "flexdemo-quorum-watch")
"""Name prefixes of the threads fault tolerance adds to a rank: torchft's Manager server and
client (Rust), its quorum thread and future timeouts, flexdemo's quorum watcher."""


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds each thread of process ``pid`` has used so far, summed by thread name
    (trailing digits dropped); empty where ``/proc`` does not tell (not Linux, or ended)."""
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip().rstrip("0123456789").rstrip("-_ ") or "thread"
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
        out[name] = out.get(name, 0.0) + ns / 1e9
    return out


def elastic_problem(o: Any) -> str | None:
    """Why options ``o`` (a :class:`~flexdemo.app.bench.run.BenchOptions`) cannot run the
    elastic preset, in one line; None when they can."""
    try:
        require_torchft()
    except TorchFTMissingError as e:
        return str(e)
    if len(o.strategies) != 1 or len(o.bandwidths) != 1:
        return (f"the elastic preset runs one strategy at one bandwidth, got "
                f"{','.join(o.strategies)} at {','.join(o.bandwidths)}; give --strategies NAME "
                "--bandwidths RATE")
    spec = STRATEGIES[o.strategies[0]]
    if spec.layout == "dp" and o.ranks_per_node > 1:
        return (f"strategy {o.strategies[0]!r} replicates every rank, but under fault tolerance "
                "a node is one replica group whose ranks shard the model; use --ranks-per-node "
                "1 or a sharded strategy (e.g. flexdemo)")
    if o.nodes < 2:
        return "the elastic preset kills one node while the others go on: use --nodes 2 or more"
    if not 1 <= o.kill_at < o.restart_at < o.steps:
        return (f"need 1 <= --kill-at < --restart-at < --steps, got {o.kill_at}, "
                f"{o.restart_at}, {o.steps}")
    return None


class _Sink:
    """A node's log file; rank 0's step lines and errors are echoed."""

    def __init__(self, path: Path, echo: Callable[[str], None] | None) -> None:
        self.file = path.open("w")
        self.echo = echo

    def write(self, text: str) -> int:
        self.file.write(text)
        if self.echo is not None:
            for line in text.splitlines():
                if "rank 0] step " in line or "] flexdemo" in line or "error:" in line:
                    self.echo("    " + line)
        return len(text)

    def flush(self) -> None:
        self.file.flush()


class _Node:
    """The ranks of one node in the elastic run: one job, one replica group."""

    def __init__(self, cluster: EmulatedCluster, index: int, cfg_path: Path, out: Path,
                 echo: Callable[[str], None] | None) -> None:
        self.index, self.out = index, out
        info = cluster.node_info[index]
        port = free_port()
        self.sink = _Sink(out / "log.txt", echo)
        lock = threading.Lock()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pumps: list[OutputPump] = []
        n = cluster.ranks_per_node
        for local in range(n):
            env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                       PYTHONUNBUFFERED="1", RANK=str(local), LOCAL_RANK=str(local),
                       WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n), MASTER_ADDR=info.address,
                       MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=info.interface)
            cmd = cluster.node_command(index, [sys.executable, "-m", "flexdemo", "train",
                                               str(cfg_path)])
            p = subprocess.Popen(cmd, env=env, cwd=os.getcwd(), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            self.procs.append(p)
            assert p.stdout is not None
            self.pumps.append(OutputPump(p.stdout, f"[node {index} rank {local}] ", self.sink,
                                      lock))

    def failed(self) -> str | None:
        for local, p in enumerate(self.procs):
            code = p.poll()
            if code is not None and code != 0:
                return f"node {self.index} rank {local} exited with code {code}"
        return None

    def done(self) -> bool:
        return all(p.poll() is not None for p in self.procs)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        for p in self.procs:
            if p.poll() is None:
                signal_group(p, sig)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for pump in self.pumps:
            pump.thread.join(timeout=2.0)
        self.sink.file.close()


def _lighthouse(cluster: EmulatedCluster, out: Path) -> tuple[subprocess.Popen[bytes], str]:
    """torchft's lighthouse in node 0's namespace, on node 0's address; waits until it
    listens (at most 30 s)."""
    try:
        found = lighthouse_launcher()
    except TorchFTMissingError as e:
        raise ClusterError(str(e)) from None
    addr, port = cluster.node_info[0].address, free_port()
    with (out / "lighthouse.log").open("w") as log:  # the lighthouse keeps its own copy
        proc = subprocess.Popen(
            cluster.node_command(0, [*found, "--bind", f"{addr}:{port}", "--min_replicas", "1",
                                     *LIGHTHOUSE_FLAGS]),
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
    probe = ("import socket,sys,time\nt=time.monotonic()+30\nwhile True:\n try:\n"
             f"  socket.create_connection(({addr!r},{port}),1).close();break\n"
             " except OSError:\n  time.sleep(0.05)\n  if time.monotonic()>t: sys.exit(1)\n")
    ok = subprocess.run(cluster.node_command(0, [sys.executable, "-c", probe]),
                        timeout=60).returncode == 0
    if not ok or proc.poll() is not None:
        proc.kill()
        raise ClusterError(f"the lighthouse did not start; see {out / 'lighthouse.log'}")
    return proc, f"http://{addr}:{port}"


def _node_config(o: Any, base: dict, index: int, url: str, address: str, out: Path) -> Path:
    cfg = json.loads(json.dumps(base))
    cfg["mesh"] = {"replicate": 1, "shard": o.ranks_per_node}
    cfg["train"].update({"out": str(out), "overwrite": True, "progress": True,
                         "checkpoint_every": 0})
    cfg["fault_tolerance"] = {"enabled": True, "lighthouse": url, "replica_id": f"node{index}",
                              "min_replicas": 1, "timeout": FT_TIMEOUT, "quorum_timeout": 300.0,
                              "hostname": address}
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench_config.toml"
    path.write_text(to_toml(cfg))
    return path


def _elastic_run(o: Any, cluster: EmulatedCluster, base: dict, out: Path,
                 echo: Callable[[str], None]) -> dict:
    """The elastic run; returns the kill and restart times and every node's metrics."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    lighthouse, url = _lighthouse(cluster, out)
    last = o.nodes - 1
    nodes: dict[str, _Node] = {}
    events: dict[str, Any] = {"lighthouse": url}

    def start(name: str, index: int) -> None:
        d = out / name
        path = _node_config(o, base, index, url, cluster.node_info[index].address, d)
        nodes[name] = _Node(cluster, index, path, d, echo if index == 0 else None)

    t0 = time.time()
    deadline = time.monotonic() + (o.timeout or 3600.0)
    failure = None
    try:
        for i in range(o.nodes):
            start(f"node{i}", i)
        while True:
            time.sleep(0.05)
            rows = read_metrics(out / "node0" / "metrics.jsonl")
            step = rows[-1]["step"] if rows else 0
            together = bool(rows) and rows[-1].get("replicas", o.nodes) >= o.nodes
            # the kill waits for every node in the quorum: a node slow to start (a loaded
            # machine) must be there to be killed, or the run measures nothing
            # ... and for node 0 to have taken steps of its own past its warm-up (one that
            # started late heals to its peer's step): they are the per-step cost's window
            own_steps = len(rows) > WARM_STEPS + 2
            if "cpu_from" not in events and len(rows) > WARM_STEPS and together:
                events["cpu_from"] = {"step": step,
                                      "threads": thread_cpu(nodes["node0"].procs[0].pid)}
            # ... and past the step the CPU window opened at (on a loaded machine one poll
            # can see both thresholds crossed at once, which left the window empty)
            opened = "cpu_from" in events and step > events["cpu_from"]["step"]
            if "kill" not in events and step >= o.kill_at and together and own_steps \
                    and opened:
                events["cpu_to"] = {"step": step,
                                    "threads": thread_cpu(nodes["node0"].procs[0].pid)}
                events["kill"] = {"time": time.time(), "survivor_step": step}
                echo(f"  elastic: SIGKILL to node {last}'s ranks (node 0 at step {step})")
                nodes[f"node{last}"].kill()
            # a late kill (above) moves the restart as far: the survivors' time alone is kept
            restart_at = (events["kill"]["survivor_step"] + o.restart_at - o.kill_at
                          if "kill" in events else None)
            if restart_at is not None and "restart" not in events and step >= restart_at:
                events["restart"] = {"time": time.time(), "survivor_step": step}
                echo(f"  elastic: node {last} starts again (node 0 at step {step})")
                start(f"node{last}-restart", last)
            failure = next((f for name, n in nodes.items()
                            if name != f"node{last}" or "kill" not in events
                            for f in [n.failed()] if f), None)
            running = [n for name, n in nodes.items() if name != f"node{last}"]
            if failure or ("restart" in events and all(n.done() for n in running)):
                break
            if time.monotonic() > deadline:
                failure = f"timed out after {o.timeout or 3600.0:g}s"
                break
    finally:
        for n in nodes.values():
            if n.procs and not n.sink.file.closed:
                n.kill(signal.SIGTERM if failure is None else signal.SIGKILL)
        lighthouse.kill()
        lighthouse.wait(timeout=10)
    metrics = {name: read_metrics(out / name / "metrics.jsonl") for name in nodes}
    summaries = {}
    for name in nodes:
        p = out / name / "summary.json"
        if p.exists():
            summaries[name] = json.loads(p.read_text())
    return {"t0": t0, "events": events, "metrics": metrics, "summaries": summaries,
            "failure": failure, "out": str(out)}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def analyse(o: Any, plain: list[dict], run: dict) -> dict:
    """The figures of the elastic run against the plain one (see the module's docstring)."""
    last = o.nodes - 1
    m0 = run["metrics"].get("node0", [])
    kill = run["events"].get("kill")
    # node 0's own steps after its warm-up, up to the kill (it may have healed in late)
    first = m0[0]["step"] + WARM_STEPS if m0 else WARM_STEPS + 1
    window = range(max(WARM_STEPS + 1, first), kill["survivor_step"] if kill else o.kill_at)
    plain_s = _mean([r["step_seconds"] for r in plain if r["step"] in window])
    before = [r for r in m0 if r["step"] in window]
    ft_s = _mean([r["step_seconds"] for r in before])
    out: dict[str, Any] = {
        "plain_step_seconds": plain_s, "elastic_step_seconds": ft_s,
        "overhead": ft_s / plain_s - 1 if plain_s == plain_s and plain_s > 0 else None,
        # CPU time per step (rank 0, all its threads): what the step costs in work, which
        # other jobs on a shared machine do not inflate as they do the wall-clock step
        "plain_cpu_seconds": _mean([r["cpu_seconds"] for r in plain if r["step"] in window]),
        "elastic_cpu_seconds": _mean([r["cpu_seconds"] for r in before]),
        "quorum_seconds": _mean([r.get("quorum_seconds", 0.0) for r in before]),
        "commit_seconds": _mean([r.get("commit_seconds", 0.0) for r in before]),
        "snapshot_seconds": _mean([r.get("snapshot_seconds", 0.0) for r in before]),
        "steps_window": [window.start, window.stop - 1],
    }
    # what fault tolerance adds inside the elastic step itself (an upper bound: a quorum also
    # absorbs the skew between nodes that a plain step waits out in its collectives)
    own = out["quorum_seconds"] + out["commit_seconds"] + out["snapshot_seconds"]
    out["ft_share_of_step"] = own / ft_s if ft_s == ft_s and ft_s > 0 else None
    pc, ec = out["plain_cpu_seconds"], out["elastic_cpu_seconds"]
    out["cpu_overhead"] = ec / pc - 1 if pc == pc and ec == ec and pc > 0 else None
    a, b = run["events"].get("cpu_from"), run["events"].get("cpu_to")
    if a and b and b["step"] > a["step"] and b["threads"]:  # node 0's rank 0, these steps
        n = b["step"] - a["step"]
        per = {k: (v - a["threads"].get(k, 0.0)) / n for k, v in b["threads"].items()}
        ft = sum(v for k, v in per.items() if k.startswith(FT_THREADS))
        out["threads_cpu_seconds"] = per
        out["threads_steps"] = [a["step"] + 1, b["step"]]
        out["ft_threads_cpu_seconds"] = ft
        total = sum(per.values())
        out["ft_threads_share"] = ft / total if total > 0 else None
    restart = run["events"].get("restart")
    if kill:
        after = [r for r in m0 if r["time"] > kill["time"]]
        alone = next((r for r in after if r.get("replicas", o.nodes) < o.nodes), None)
        out["kill_survivor_step"] = kill["survivor_step"]
        out["undone_steps"] = (m0[-1]["failed_commits"] - before[-1]["failed_commits"]
                               if m0 and before else None)
        if alone is not None:
            out["survivors_resume_seconds"] = alone["time"] - kill["time"]
            out["survivors_resume_step"] = alone["step"]
    joiner = run["metrics"].get(f"node{last}-restart", [])
    if restart and joiner:
        out["restart_survivor_step"] = restart["survivor_step"]
        out["joiner_first_step"] = joiner[0]["step"]
        out["joiner_train_seconds"] = joiner[0]["time"] - restart["time"]
        out["joiner_first_step_seconds"] = joiner[0]["step_seconds"]
        times = [r["time"] for r in m0 if r["time"] >= restart["time"]]
        gaps = [b - a for a, b in zip(times, times[1:])]
        out["survivors_longest_step_after_restart"] = max(gaps) if gaps else None
        out["healed"] = joiner[0]["step"] > restart["survivor_step"]
    finals = {name: s.get("val_loss") for name, s in run["summaries"].items()}
    out["final_val_loss"] = finals
    vals = [v for k, v in finals.items() if k != f"node{last}"]
    out["replicas_identical"] = len(vals) >= 2 and len(set(vals)) == 1
    return out


def report_lines(o: Any, plain_summary: dict, figures: dict) -> list[str]:
    """The table and the findings, as printed."""
    f, last = figures, o.nodes - 1
    ms = lambda s: "-" if s is None or s != s else f"{s * 1e3:.0f} ms"  # noqa: E731
    over = f.get("overhead")
    lines = [
        f"{'run':<22} {'step':>9} {'quorum':>9} {'vote':>9} {'undo copy':>10} {'val loss':>9}",
        f"{'plain (one job)':<22} {ms(f['plain_step_seconds']):>9} {'-':>9} {'-':>9} {'-':>10} "
        f"{plain_summary.get('val_loss', float('nan')):>9.4f}",
        f"{'elastic (torchft)':<22} {ms(f['elastic_step_seconds']):>9} "
        f"{ms(f['quorum_seconds']):>9} {ms(f['commit_seconds']):>9} "
        f"{ms(f['snapshot_seconds']):>10} "
        f"{f['final_val_loss'].get('node0', float('nan')):>9.4f}",
        f"- fault tolerance costs {over * 100:+.1f}% per step (steps "
        f"{f['steps_window'][0]}-{f['steps_window'][1]}, before the kill)" if over is not None
        else "- no step-time comparison (a run has too few steps)",
    ]
    cpu = f.get("cpu_overhead")
    if cpu is not None:
        lines.append(f"- in CPU time (rank 0, all its threads) it costs {cpu * 100:+.1f}% per "
                     f"step ({ms(f['plain_cpu_seconds'])} -> {ms(f['elastic_cpu_seconds'])}), "
                     "a figure other jobs on the machine do not inflate")
    threads = f.get("ft_threads_share")
    if threads is not None:
        lines.append(f"- torchft's threads and the quorum watcher used "
                     f"{f['ft_threads_cpu_seconds'] * 1e3:.1f} ms of CPU per step on node 0's "
                     f"rank 0, {threads * 100:.1f}% of its CPU (steps {f['threads_steps'][0]}-"
                     f"{f['threads_steps'][1]}, in the run itself)")
    share = f.get("ft_share_of_step")
    if share is not None:
        lines.append(f"- the quorum, the vote and the undo copy take {share * 100:.1f}% of the "
                     "elastic step (at most what fault tolerance adds: a quorum also waits out "
                     "the skew between nodes that a plain step waits out in its collectives)")
    if "survivors_resume_seconds" in f:
        lines.append(
            f"- node {last} killed at node 0's step {f['kill_survivor_step']}: the survivors "
            f"committed step {f['survivors_resume_step']} without it "
            f"{f['survivors_resume_seconds']:.1f} s later; {f['undone_steps']} step(s) undone "
            "and run again")
    if "joiner_first_step" in f and not f["healed"]:
        lines.append(
            f"- node {last} restarted at node 0's step {f['restart_survivor_step']} but began "
            f"at step {f['joiner_first_step']}: node 0 had finished before it joined, so it "
            "had no peer to heal from; raise --steps or lower --restart-at")
    elif "joiner_first_step" in f:
        lines.append(
            f"- node {last} restarted at node 0's step {f['restart_survivor_step']}: "
            f"{f['joiner_train_seconds']:.1f} s after its start it committed step "
            f"{f['joiner_first_step']} with the survivors (that step, after the heal, took "
            f"{f['joiner_first_step_seconds']:.1f} s); the survivors' longest step meanwhile "
            f"took {f['survivors_longest_step_after_restart']:.1f} s")
    if f.get("replicas_identical"):
        lines.append("- at the end the surviving and the restarted node have the same "
                     "validation loss, to the bit")
    else:
        lines.append(f"- final validation losses: {f['final_val_loss']}")
    return lines


def plot_elastic(o: Any, plain: list[dict], run: dict, path: Path) -> Path:
    """Loss (top) and participating replicas (bottom) against seconds since the start."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    last = o.nodes - 1
    m0 = run["metrics"].get("node0", [])
    # both runs from the start of their first step (start-up times differ)
    t0 = m0[0]["time"] - m0[0]["step_seconds"] if m0 else run["t0"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1]})
    if plain:
        p0 = plain[0]["time"] - plain[0]["step_seconds"]
        top.plot([r["time"] - p0 for r in plain], [r["loss"] for r in plain], color="#bbbbbb",
                 lw=1, label="plain run (one job, no fault tolerance)")
    colors = {"node0": "#1f77b4", f"node{last}": "#d62728", f"node{last}-restart": "#ff7f0e"}
    for name, rows in sorted(run["metrics"].items(), key=lambda kv: kv[0] == "node0"):
        if not rows:  # node 0 last, on top
            continue
        c = colors.get(name, "#2ca02c")
        top.plot([r["time"] - t0 for r in rows], [r["loss"] for r in rows], color=c,
                 lw=1.4 if name == "node0" else 1, label=name.replace("-restart", " (restarted)"))
        vals = [r for r in rows if "val_loss" in r]
        top.plot([r["time"] - t0 for r in vals], [r["val_loss"] for r in vals], "o", color=c,
                 ms=4)
    bottom.step([r["time"] - t0 for r in m0], [r.get("replicas", 0) for r in m0], where="post",
                color="#1f77b4")
    bottom.set_ylim(0, o.nodes + 0.5)
    bottom.set_ylabel("replicas in step")
    bottom.set_xlabel("seconds since the first step began")
    top.set_ylabel("training loss (dots: validation)")
    for key, label in (("kill", f"node {last} killed"), ("restart", f"node {last} restarted")):
        e = run["events"].get(key)
        if e:
            for ax in (top, bottom):
                ax.axvline(e["time"] - t0, color="#444444", ls="--", lw=0.8)
            top.text(e["time"] - t0, top.get_ylim()[1], " " + label, va="top", fontsize=8)
    top.legend(fontsize=8, frameon=False)
    top.set_title(f"{o.strategies[0]}, {o.nodes} nodes x {o.ranks_per_node} ranks, "
                  f"{o.bandwidths[0]}: a node killed and restarted (torchft)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_elastic(o: Any, one_run: Callable[..., dict],
                echo: Callable[[str], None] | None = None) -> list[dict]:
    """The elastic preset; ``one_run`` is the bench's run of one strategy as one job
    (:func:`flexdemo.app.bench.run._one_run`). With ``o.repeat`` above 1 the plain and the
    elastic run alternate that many times (in ``pair1/``, ``pair2/``, ...) and the overheads
    are reported per pair, with their median and range. Returns every run's record, as the
    bench does."""
    echo = echo or (lambda text: print(text, flush=True))
    out = Path(o.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    name, bw = o.strategies[0], o.bandwidths[0]
    unshaped = o.unshaped
    if not unshaped:
        try:
            EmulatedCluster(o.nodes, o.ranks_per_node, bw, log=lambda s: None)
        except ShapingUnavailableError as e:
            echo(f"note: {str(e).split('. Run as root')[0]}; running unshaped on loopback")
            unshaped, bw = True, "unshaped"
    cluster = EmulatedCluster(o.nodes, o.ranks_per_node, None if unshaped else bw,
                              unshaped=unshaped, log=lambda s: None)
    where = "loopback" if unshaped else f"links of {format_rate(parse_bandwidth(bw))}"
    repeat = o.repeat
    echo(f"bench elastic: {name} on {o.nodes} nodes x {o.ranks_per_node} ranks ({where}), "
         f"{o.steps} steps; node {o.nodes - 1} is killed at step {o.kill_at} and restarted at "
         f"step {o.restart_at}"
         + (f"; {repeat} pairs of runs, plain and elastic alternately" if repeat > 1 else "")
         + f"; out {out}")
    pairs: list[tuple[dict, dict]] = []
    with cluster:
        for i in range(repeat):
            here = out if repeat == 1 else out / f"pair{i + 1}"
            if repeat > 1:
                echo(f"\n=== pair {i + 1} of {repeat}: the plain run, then the elastic one")
            plain = one_run(o, cluster, name, bw, here, echo)
            echo(f"\n== {name} @ {bw}, elastic: every node its own job and torchft replica "
                 "group")
            base = json.loads(json.dumps(o.base))
            base["strategy"] = STRATEGIES[name].settings()
            base["resume"] = False
            pairs.append((plain, _elastic_run(o, cluster, base, here / "elastic", echo)))
    records: list[dict] = []
    analysed: list[dict] = []
    plain_rows: list[list[dict]] = []  # each plain run's metrics, read once
    for plain, run in pairs:
        record: dict[str, Any] = {"strategy": f"{name} (elastic)", "bandwidth": bw,
                                  "status": "failed" if run["failure"] else "ok",
                                  "message": run["failure"] or "", "run_dir": run["out"]}
        plain_rows.append(read_metrics(Path(plain["run_dir"]) / "metrics.jsonl"))
        figures = analyse(o, plain_rows[-1], run) if not run["failure"] else {}
        record["figures"] = figures
        records += [plain, record]
        analysed.append({"plain_run_dir": plain["run_dir"], "elastic_run_dir": run["out"],
                         "failure": run["failure"], "figures": figures})
    report_pairs(o, out, pairs, analysed, plain_rows, echo)
    return records


def report_pairs(o: Any, out: Path, pairs: list[tuple[dict, dict]], analysed: list[dict],
                 plain_rows: list[list[dict]], echo: Callable[[str], None]) -> None:
    """Write ``elastic.json`` and print the report: the first pair whose elastic run
    succeeded in full (figures, plot), every failure, and with several pairs their table
    (a failed pair is a row of it, left out of the medians)."""
    repeat = len(pairs)
    ok = [i for i, a in enumerate(analysed) if not a["failure"]]
    first = ok[0] if ok else 0
    plain, run = pairs[first]
    figures = analysed[first]["figures"]
    spread = pair_spread([a["figures"] for a in analysed])
    (out / "elastic.json").write_text(strict_json(
        {"options": {k: v for k, v in vars(o).items() if k != "base"}, "plain": plain,
         "elastic": {**run, "figures": figures}, "pairs": analysed, "spread": spread},
        indent=1) + "\n")
    for i, a in enumerate(analysed, 1):
        if a["failure"]:
            echo(f"   elastic run{f' of pair {i}' if repeat > 1 else ''} failed: "
                 f"{a['failure']} (logs: {a['elastic_run_dir']})")
    if ok:
        echo("")
        if first:
            echo(f"pair {first + 1}, the first whose elastic run succeeded:")
        for line in report_lines(o, plain, figures):
            echo(line)
    if repeat > 1:
        echo("")
        for line in pair_lines(analysed, spread):
            echo(line)
    if not ok:
        return
    try:
        echo(f"plot: {plot_elastic(o, plain_rows[first], run, out / 'elastic.png')}")
    except ModuleNotFoundError:
        echo("note: plot skipped: matplotlib is not installed (pip install matplotlib)")
    echo(f"results: {out / 'elastic.json'}")


PAIR_FIGURES = ("overhead", "cpu_overhead", "ft_threads_share", "ft_share_of_step")
"""The per-pair figures whose median and range :func:`pair_spread` gives."""


def pair_spread(figures: list[dict]) -> dict[str, dict[str, float]]:
    """The median, smallest and largest of each of :data:`PAIR_FIGURES` over the pairs that
    have it (a failed elastic run has none)."""
    spread: dict[str, dict[str, float]] = {}
    for key in PAIR_FIGURES:
        values = [f[key] for f in figures if f.get(key) is not None]
        if values:
            spread[key] = {"median": statistics.median(values), "min": min(values),
                           "max": max(values), "pairs": len(values)}
    return spread


def pair_lines(analysed: list[dict], spread: dict[str, dict[str, float]]) -> list[str]:
    """The table of the pairs and the medians, as printed."""
    pct = lambda v, sign="+": "-" if v is None else f"{v * 100:{sign}.1f}%"  # noqa: E731
    ms = lambda s: "-" if s is None or s != s else f"{s * 1e3:.0f} ms"  # noqa: E731
    lines = [f"{'pair':<6} {'plain step':>10} {'elastic step':>12} {'overhead':>9} "
             f"{'CPU':>8} {'torchft threads':>15} {'quorum+vote+undo':>16}"]
    for i, a in enumerate(analysed, 1):
        f = a["figures"]
        if not f:
            lines.append(f"{i:<6} failed: {a['failure']}")
            continue
        lines.append(f"{i:<6} {ms(f['plain_step_seconds']):>10} "
                     f"{ms(f['elastic_step_seconds']):>12} {pct(f.get('overhead')):>9} "
                     f"{pct(f.get('cpu_overhead')):>8} "
                     f"{pct(f.get('ft_threads_share'), ''):>15} "
                     f"{pct(f.get('ft_share_of_step'), ''):>16}")
    med = {k: v["median"] for k, v in spread.items()}
    lines.append(f"{'median':<6} {'':>10} {'':>12} {pct(med.get('overhead')):>9} "
                 f"{pct(med.get('cpu_overhead')):>8} {pct(med.get('ft_threads_share'), ''):>15} "
                 f"{pct(med.get('ft_share_of_step'), ''):>16}")
    if "overhead" in spread:
        s = spread["overhead"]
        lines.append(f"- over {s['pairs']} pairs, run alternately, fault tolerance costs "
                     f"{pct(s['median'])} per step at the median ({pct(s['min'])} to "
                     f"{pct(s['max'])}); in CPU time "
                     + (f"{pct(spread['cpu_overhead']['median'])}"
                        if "cpu_overhead" in spread else "-"))
    return lines
