"""``flexdemo bench``: strategies x bandwidths on an emulated cluster, with a table and plots.

For every bandwidth, :func:`run_bench` builds one :class:`~flexdemo.tools.cluster.EmulatedCluster`
(``nodes`` network namespaces joined by links shaped to that rate) and runs
``python -m flexdemo train`` on it once per strategy, all with the same task, steps, batch and
seed. Each run's config, log, metrics and summary stay in ``out/runs/<strategy>@<rate>/``;
the sweep writes ``results.json`` (with the loss curves), ``results.csv`` (one row per run),
``loss_vs_time.png``, ``loss_vs_bytes.png`` and ``step_time.png`` to ``out`` and prints a
table. Without root (or with ``unshaped``) the runs happen on loopback with no shaping.
The table and the comparisons are :mod:`flexdemo.app.bench.report`'s, the plots
:mod:`flexdemo.app.bench.plots`'s.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from ...strategies import STRATEGIES, parse_strategy
from ...tools.cluster import EmulatedCluster
from ...tools.netns import ClusterError, ShapingUnavailableError, cleanup_stale
from ...tools.rates import format_rate, parse_bandwidth
from ..config.checks import config_from_dict, validate
from ..config.files import apply_overrides, read_config_file, to_toml
from ..config.schema import ConfigError
from ..device import BY_RANK_ENV, DEVICES
from ..outputs import read_metrics, strict_json
from .elastic import elastic_problem, run_elastic
from .link import StepWatch, dir_label, parse_link
from .plots import plot_all, plot_val_loss_vs_time
from .report import (
    comparison_lines,
    format_table,
    is_finite,
    retune_cost_lines,
    time_to_target_lines,
)
from .stragglers import (
    comparison,
    partner,
    run_figures,
    slow_label,
    straggler_lines,
    straggler_table,
)

__all__ = ["DEFAULT_BANDWIDTHS", "DEFAULT_STRATEGIES", "PRESETS", "STRATEGIES", "BenchError",
           "BenchOptions", "bench_options", "run_bench"]

UNSHAPED = "unshaped"

DEFAULT_STRATEGIES = ("flexdemo", "demo-dp", "hsdp-adamw", "no-sync")
DEFAULT_BANDWIDTHS = ("10mbit", "100mbit", "1gbit")

BASE_CONFIG: dict[str, Any] = {
    "task": {"name": "gpt", "model": "mini", "corpus_bytes": 2_000_000},
    "train": {"steps": 100, "batch": 8, "warmup": 10, "eval_every": 25, "eval_batches": 4,
              "log_every": 10, "tensorboard": False},
}

PRESETS: dict[str, dict[str, Any]] = {
    "main": {
        "about": "the headline demo: FlexDeMo and MuLoCo (the paper's exchange) vs "
                 "hybrid-sharded AdamW and Muon, GPT, 2 nodes x 2 ranks at 100 Mbit/s (a few "
                 "minutes on 2 cores)",
        "strategies": ("flexdemo", "muloco", "hsdp-muon", "hsdp-adamw"),
        "bandwidths": ("100mbit",),
        "nodes": 2, "ranks_per_node": 2, "steps": 150, "out": "runs/main",
        "overrides": ["task.model=mini", "train.batch=8", "train.warmup=15",
                      "train.eval_every=25", "train.eval_batches=8"]},
    "elastic": {
        "about": "fault tolerance on torchft: FlexDeMo as one job, then with every node its "
                 "own replica group, the last node killed at --kill-at and restarted at "
                 "--restart-at; step cost, recovery times, a plot of loss and replicas",
        "strategies": ("flexdemo",), "bandwidths": ("100mbit",), "nodes": 2,
        "ranks_per_node": 2, "steps": 120, "kill_at": 40, "restart_at": 70,
        "out": "runs/elastic",
        "overrides": ["task.model=mini", "train.batch=8", "train.warmup=12",
                      "train.eval_every=20", "train.eval_batches=8", "train.log_every=10"]},
    "auto": {
        "about": "\"auto\" against fixed strategies of its ranking (full-sync Muon, our "
                 "MuLoCo-style int4 H=20, our sparseloco-dct) at 10 Mbit/s, 100 Mbit/s and "
                 "1 Gbit/s and on a link that drops from 1 Gbit/s to 10 Mbit/s halfway; time to "
                 "a target loss",
        "strategies": ("auto", "hsdp-muon", "muloco-int4-h20", "sparseloco-dct"),
        "bandwidths": ("10mbit", "100mbit", "1gbit", "1gbit>10mbit"),
        "nodes": 2, "ranks_per_node": 1, "steps": 120, "out": "runs/auto",
        # batch 48: a CPU step long enough (about 0.25 s) that full sync fits 1 Gbit/s
        "overrides": ["task.model=tiny", "train.batch=48", "train.warmup=12",
                      "train.eval_every=10", "train.eval_batches=4", "train.log_every=5"]},
    "stragglers": {
        "about": "replicas of different speeds: 4 nodes x 1 rank at 100 Mbit/s, the last node "
                 "3x slower (--slow-factor, --slow-node); MuLoCo (our int4, the paper's) "
                 "synchronous vs each replica at its own pace (fixed, adaptive, timed, "
                 "fill, fill with the sync overlapped), FlexDeMo vs balanced batches; "
                 "goodput, time to the synchronous run's loss, loss at equal tokens",
        "strategies": ("muloco-int4", "muloco-int4-paced", "muloco-int4-adaptive",
                       "muloco-int4-timed", "muloco-int4-fill", "muloco-int4-fill-overlap",
                       "muloco", "muloco-paced", "flexdemo", "flexdemo-balanced"),
        "bandwidths": ("100mbit",),
        "nodes": 4, "ranks_per_node": 1, "steps": 240, "slow_factor": 3.0,
        "out": "runs/stragglers",
        # H=30 (both MuLoCo presets): 8 syncs, an evaluation at each; a paced run lasts
        # until it has trained on the synchronous run's tokens (train.pace_budget)
        "overrides": ["task.model=tiny", "train.batch=16", "train.warmup=15",
                      "train.eval_every=30", "train.eval_batches=4", "train.log_every=10"]},
}


class BenchError(RuntimeError):
    """The sweep cannot run as asked; the message is meant for the user."""


@dataclass
class BenchOptions:
    """Everything a sweep needs (see :func:`bench_options`)."""

    strategies: list[str] = field(default_factory=lambda: list(DEFAULT_STRATEGIES))
    bandwidths: list[str] = field(default_factory=lambda: list(DEFAULT_BANDWIDTHS))
    nodes: int = 2
    ranks_per_node: int = 2
    steps: int = 100
    base: dict = field(default_factory=lambda: json.loads(json.dumps(BASE_CONFIG)))
    out: str = "runs/bench"
    unshaped: bool = False
    timeout: float | None = None
    quiet: bool = False
    preset: str | None = None
    device: str = "cpu"
    """Where every run trains (``cpu`` or ``cuda``; ``auto`` is resolved by
    :func:`bench_options`)."""
    kill_at: int = 0
    """Elastic preset: the step of node 0 at which the last node is killed."""
    restart_at: int = 0
    """Elastic preset: the step of node 0 at which the killed node starts again."""
    repeat: int = 1
    """Elastic preset: how many times the plain and the elastic run alternate."""
    target: float | None = None
    """The validation loss whose time to reach every run reports (None: with ``auto``, the
    loosest loss every run within 5% of the best reached; otherwise no report)."""
    slow_factor: float = 1.0
    """Node ``slow_node``'s ranks make each step last this many times its compute
    (``train.slowdown``, an emulated slower GPU); 1: none slowed."""
    slow_node: int | None = None
    """The slowed node (default: the last), when ``slow_factor`` is above 1."""


def _split(text: str | None) -> list[str] | None:
    if text is None:
        return None
    items = [x.strip() for x in text.split(",") if x.strip()]
    return items or None


def bench_options(*, preset: str | None = None, strategies: str | list[str] | None = None,
                  bandwidths: str | list[str] | None = None, nodes: int | None = None,
                  ranks_per_node: int | None = None, steps: int | None = None,
                  config: str | None = None, out: str | None = None, unshaped: bool = False,
                  overrides: list[str] | None = None, timeout: float | None = None,
                  quiet: bool = False, device: str | None = None,
                  kill_at: int | None = None, restart_at: int | None = None,
                  repeat: int | None = None,
                  target: float | None = None, slow_factor: float | None = None,
                  slow_node: int | None = None) -> BenchOptions:
    """Resolve and check a sweep's options; raises :class:`BenchError` or
    :class:`~flexdemo.app.config.schema.ConfigError` with a one-line message."""
    p = PRESETS.get(preset or "", {})
    if preset and not p:
        raise BenchError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    o = BenchOptions(preset=preset)
    if isinstance(strategies, str):
        strategies = _split(strategies)
    if isinstance(bandwidths, str):
        bandwidths = _split(bandwidths)
    o.strategies = list(strategies or p.get("strategies") or DEFAULT_STRATEGIES)
    o.bandwidths = list(bandwidths or p.get("bandwidths") or DEFAULT_BANDWIDTHS)
    o.nodes = nodes or p.get("nodes", 2)
    o.ranks_per_node = ranks_per_node or p.get("ranks_per_node", 2)
    o.out = out or p.get("out", "runs/bench")
    o.unshaped, o.timeout, o.quiet = unshaped, timeout, quiet
    if target is not None and not (isinstance(target, (int, float)) and target > 0
                                   and math.isfinite(target)):
        raise BenchError(f"target must be a positive validation loss, got {target!r}")
    o.target = target
    for s in o.strategies:
        if s not in STRATEGIES:
            try:
                parse_strategy(s)
            except ValueError as e:
                raise BenchError(str(e)) from None
            raise BenchError(f"strategy {s!r}: the bench takes names only; add a strategy to "
                             "flexdemo.STRATEGIES for other settings")
    if len(set(o.strategies)) != len(o.strategies):
        raise BenchError(f"a strategy is listed twice: {','.join(o.strategies)}")
    for bw in o.bandwidths:
        if bw == UNSHAPED:
            continue
        try:
            parse_link(bw)
        except ValueError as e:
            raise BenchError(str(e)) from None
    if o.unshaped:
        o.bandwidths = [UNSHAPED]
    elif UNSHAPED in o.bandwidths and len(o.bandwidths) > 1:
        raise BenchError("'unshaped' cannot be mixed with rates; use --unshaped alone")
    elif o.bandwidths == [UNSHAPED]:
        o.unshaped = True
    file = read_config_file(config) if config else {}
    base = file if config else json.loads(json.dumps(BASE_CONFIG))
    base = apply_overrides(base, list(p.get("overrides", [])) + list(overrides or []))
    if not isinstance(base.get("train", {}), dict):
        raise ConfigError(f"[train] must be a table of keys, got {base['train']!r}")
    # what the user set: the --config file's [train], then the overrides' train keys
    given = apply_overrides({}, [x for x in overrides or [] if x.startswith("train.")])
    file_train = file.get("train")
    given_file = file_train if isinstance(file_train, dict) else {}
    o.steps = _bench_steps(steps, given.get("train", {}).get("steps"), given_file.get("steps"),
                           p.get("steps", 100))
    train = base.setdefault("train", {})
    train["steps"] = o.steps
    if ("warmup" not in {**given_file, **given.get("train", {})}
            and isinstance(train.get("warmup"), int)):
        train["warmup"] = min(train["warmup"], o.steps)  # the bench's own default: cut to fit
    if "strategy" in base or "mesh" in base:
        raise BenchError("the bench sets [strategy] and [mesh] per strategy; leave them out of "
                         "the base config and its overrides")
    if device is not None:
        train["device"] = device
    o.device = train["device"] = _bench_device(train.get("device", "auto"),
                                               o.nodes * o.ranks_per_node)
    o.base = base
    _slow_options(o, p, preset, slow_factor, slow_node)
    for name in o.strategies:  # every run's config must be valid before anything starts
        validate(config_from_dict(run_config(o, name, "check")), o.nodes * o.ranks_per_node)
    if (kill_at or restart_at or repeat) and preset != "elastic":
        raise BenchError("--kill-at, --restart-at and --repeat belong to the elastic preset: "
                         "add --preset elastic")
    if preset == "elastic":
        o.kill_at = kill_at or min(p["kill_at"], o.steps // 3)
        o.restart_at = restart_at or min(p["restart_at"], (o.steps * 7) // 12)
        o.repeat = repeat or 1
        problem = elastic_problem(o)
        if problem:
            raise BenchError(problem)
    return o


def _slow_options(o: BenchOptions, p: dict[str, Any], preset: str | None,
                  factor: float | None, node: int | None) -> None:
    """``--slow-factor`` (else the preset's, else 1) and ``--slow-node`` (default: the last
    node) into ``o``; one line for a value out of range."""
    value = p.get("slow_factor", 1.0) if factor is None else factor
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value < 1):
        raise BenchError(f"--slow-factor must be a number >= 1 (each step of the slowed node "
                         f"lasts that many times its compute; 1: none slowed), got {value!r}")
    o.slow_factor = float(value)
    if o.slow_factor == 1.0:
        if node is not None:
            raise BenchError("--slow-node names the node to slow: give --slow-factor above 1 "
                             "too (or --preset stragglers)")
        return
    if preset == "elastic":
        raise BenchError("--slow-factor and --slow-node are not for the elastic preset")
    o.slow_node = o.nodes - 1 if node is None else node
    if isinstance(o.slow_node, bool) or not 0 <= o.slow_node < o.nodes:
        raise BenchError(f"--slow-node {node}: the sweep has {o.nodes} nodes, numbered "
                         f"0..{o.nodes - 1}")


def _bench_steps(option: int | None, override: Any, in_file: Any, default: int) -> int:
    """Steps per run: ``--steps``, else a ``train.steps=N`` override, else ``train.steps`` of
    ``--config``, else the preset's (or 100). An override that differs from ``--steps`` is
    refused, as is a value that is no integer >= 1."""
    for where, value in (("train.steps", override), ("--config's train.steps", in_file)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise ConfigError(f"{where}: must be an integer >= 1, got {value!r}; give the "
                              "steps per run as --steps N (e.g. --steps 50)")
    if option is not None and override is not None and option != override:
        raise BenchError(f"--steps {option} and train.steps={override} disagree; give the "
                         "steps per run once (--steps N)")
    return option or override or in_file or default


def _bench_device(name: Any, world: int) -> str:
    """``cpu`` or ``cuda`` for a sweep of ``world`` ranks on this machine, one GPU per rank
    (``auto``: CUDA when there are that many GPUs)."""
    if name not in DEVICES:
        raise ConfigError(f"train.device: unknown device {name!r}; choose one of "
                          f"{', '.join(DEVICES)}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if name == "auto":
        return "cuda" if gpus >= world else "cpu"
    if name == "cuda" and gpus == 0:
        raise BenchError("device cuda: this machine shows no CUDA GPU; use --device cpu (or "
                         "auto: CUDA when there is a GPU per rank)")
    if name == "cuda" and gpus < world:
        raise BenchError(f"device cuda: the sweep runs {world} ranks on this machine, one GPU "
                         f"each, but it shows {gpus} GPU(s); use --device cpu or fewer "
                         "--nodes/--ranks-per-node")
    return name


def run_config(o: BenchOptions, strategy: str, run_dir: str) -> dict:
    """The training config of one run: the base, the strategy and its mesh layout."""
    spec = STRATEGIES[strategy]
    cfg = json.loads(json.dumps(o.base))
    cfg["strategy"] = spec.settings()
    world = o.nodes * o.ranks_per_node
    if spec.layout == "dp":
        cfg["mesh"] = {"replicate": world, "shard": 1}
    else:
        cfg["mesh"] = {"replicate": o.nodes, "shard": o.ranks_per_node}
    train = cfg.setdefault("train", {})
    train.update({"out": run_dir, "overwrite": True, "progress": True})
    if spec.batches != "equal":
        train["batches"] = spec.batches
    if "pace" in cfg["strategy"].get("replicator_kwargs", {}):
        train["pace_budget"] = "tokens"  # the synchronous run's data: compared at its end
    if o.slow_factor != 1.0 and o.slow_node is not None:  # the slowed node's ranks
        rpn = o.ranks_per_node
        train.update({"slowdown": o.slow_factor,
                      "slow_ranks": list(range(o.slow_node * rpn, (o.slow_node + 1) * rpn))})
    cfg["resume"] = False
    return cfg


class _Tee:
    """A text sink that writes everything to a log file and echoes rank 0's lines."""

    def __init__(self, log: IO[str], echo: Callable[[str], None] | None,
                 watch: StepWatch | None = None) -> None:
        self.log, self.echo, self.watch = log, echo, watch
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        if self.watch is not None:
            self.watch.feed(text)
        with self.lock:
            self.log.write(text)
            if self.echo is not None:
                for line in text.splitlines():
                    if (line.startswith(("[rank 0] step ", "[rank 0] auto: "))
                            or "error" in line.lower()):
                        self.echo("    " + line)
        return len(text)

    def flush(self) -> None:
        self.log.flush()


def _count(items: list, one: str, many: str) -> str:
    return f"{len(items)} {one if len(items) == 1 else many}"


def _label(bw: str) -> str:
    return UNSHAPED if bw == UNSHAPED else bw


def _first_rate(bw: str) -> str | None:
    return None if bw == UNSHAPED else parse_link(bw).first


def run_bench(o: BenchOptions, echo: Callable[[str], None] | None = None) -> list[dict]:
    """Run the sweep; returns one result per run (``status`` ``"ok"`` or ``"failed"``)."""
    echo = echo or (lambda text: print(text, flush=True))
    if o.preset == "elastic":
        try:
            return run_elastic(o, _one_run, echo)
        except ClusterError as e:
            raise BenchError(f"the emulated cluster failed: {e}") from None
    out = Path(o.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    shaped = not o.unshaped
    bandwidths = list(o.bandwidths)
    if shaped:
        try:
            EmulatedCluster(o.nodes, o.ranks_per_node, _first_rate(bandwidths[0]),
                            log=lambda s: None)
        except ShapingUnavailableError as e:
            reason = str(e).split(". Run as root")[0]  # the fix is said below
            echo(f"note: {reason}.\n"
                 "note: running the unshaped loopback version instead: all ranks on 127.0.0.1, "
                 "no bandwidth limit, so communication costs little; rerun as root for the "
                 "shaped comparison.")
            shaped, bandwidths = False, [UNSHAPED]
    world = o.nodes * o.ranks_per_node
    echo(f"bench: {_count(o.strategies, 'strategy', 'strategies')} x "
         f"{_count(bandwidths, 'bandwidth', 'bandwidths')} on "
         f"{o.nodes} nodes x {o.ranks_per_node} ranks ({world} ranks, {o.device}), "
         f"{o.steps} steps each; "
         f"task {o.base.get('task', {}).get('name', 'gpt')}/"
         f"{o.base.get('task', {}).get('model', '?')}; out {out}")
    if shaped:
        removed = cleanup_stale()
        if removed:
            echo(f"bench: removed leftovers of dead runs: {', '.join(removed)}")
    results: list[dict] = []
    t0 = time.perf_counter()
    queue = list(bandwidths)
    while queue:
        bw = queue.pop(0)
        cluster = EmulatedCluster(o.nodes, o.ranks_per_node, _first_rate(bw),
                                  unshaped=bw == UNSHAPED, log=lambda s: None)
        try:
            cluster.__enter__()
        except ClusterError as e:
            if results or bw == UNSHAPED:
                raise BenchError(f"the emulated cluster failed: {e}") from None
            echo(f"note: could not build the emulated network here ({e}).\n"
                 "note: running the unshaped loopback version instead (no bandwidth limit).")
            shaped, queue = False, [UNSHAPED]
            continue
        try:
            for name in o.strategies:
                results.append(_one_run(o, cluster, name, bw, out, echo))
        except ClusterError as e:
            raise BenchError(f"the emulated cluster failed: {e}") from None
        finally:
            cluster.__exit__(None, None, None)
    write_results(o, results, out, shaped, time.perf_counter() - t0)
    echo("\n" + format_table(results))
    # each strategy against full sync with its own inner optimizer, then the best full sync
    for line in comparison_lines(results):
        echo(line)
    stragglers = o.slow_factor != 1.0 or any(partner(n) for n in o.strategies)
    if stragglers:  # replicas of different speeds: goodput, time to loss, equal tokens
        echo("\n" + straggler_table(results))
        for line in straggler_lines(results, slow_label(o.slow_factor, o.slow_node)):
            echo(line)
    if "auto" in o.strategies or o.target is not None:
        for line in (time_to_target_lines(results, "auto", o.target)
                     + retune_cost_lines(results)):
            echo(line)
    try:
        paths = plot_all(results, out)
        if stragglers and paths:
            paths.append(plot_val_loss_vs_time(results, out / "val_loss_vs_time.png"))
        echo("plots: " + ", ".join(str(p) for p in paths) if paths
             else "plots skipped: no run finished")
    except ModuleNotFoundError:
        echo("note: plots skipped: matplotlib is not installed (pip install matplotlib)")
    echo(f"results: {out / 'results.json'}, {out / 'results.csv'}")
    return results


def _one_run(o: BenchOptions, cluster: EmulatedCluster, name: str, bw: str, out: Path,
             echo: Callable[[str], None]) -> dict:
    run_dir = out / "runs" / f"{name}@{dir_label(_label(bw))}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    cfg = run_config(o, name, str(run_dir))
    cfg_path = run_dir / "bench_config.toml"
    cfg_path.write_text(to_toml(cfg))
    link = None if bw == UNSHAPED else parse_link(bw)
    then = None if link is None else link.then  # the rate after the change, if it changes
    watch = None
    if link is None:
        where = "loopback, unshaped"
    else:
        where = f"links of {format_rate(parse_bandwidth(link.first))}" + (
            f", {format_rate(parse_bandwidth(then))} from step {o.steps // 2}" if then else "")
    slow = slow_label(o.slow_factor, o.slow_node)
    where += f"; {slow}" if slow else ""
    if link is not None and then is not None:
        cluster.set_bandwidth(link.first)  # the run before may have left the second rate

        def change(step: int) -> None:
            cluster.set_bandwidth(then)
            echo(f"    link changed to {then} at step {step}")

        watch = StepWatch(o.steps // 2, change)
    echo(f"\n== {name} @ {_label(bw)}: {STRATEGIES[name].about} ({where})")
    cmd = [sys.executable, "-m", "flexdemo", "train", str(cfg_path)]
    env = {"PYTHONUNBUFFERED": "1"}
    if o.device == "cuda":
        # the emulated nodes share this machine's GPUs: rank r takes cuda:r; NCCL sends over
        # sockets (no shared memory or peer-to-peer copies), so its traffic crosses the links
        env.update({BY_RANK_ENV: "1", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1",
                    "NCCL_IB_DISABLE": "1"})
    with (run_dir / "log.txt").open("w") as log:
        tee = _Tee(log, None if o.quiet else echo, watch)
        result = cluster.run(cmd, env=env, stdout=tee, stderr=tee, timeout=o.timeout,
                             cwd=os.getcwd())
    record: dict[str, Any] = {"strategy": name, "bandwidth": _label(bw),
                              "about": STRATEGIES[name].about, "run_dir": str(run_dir),
                              "nodes": o.nodes, "ranks_per_node": o.ranks_per_node,
                              "status": "ok" if result.ok else "failed",
                              "message": result.message, "wall_seconds": result.seconds}
    summary_path = run_dir / "summary.json"
    if result.ok and summary_path.exists():
        summary = json.loads(summary_path.read_text())
        summary.pop("config", None)
        record.update({k: v for k, v in summary.items() if k not in record})
    elif result.ok:
        record.update(status="failed", message="the run wrote no summary.json")
    rows = read_metrics(run_dir / "metrics.jsonl")
    record["curve"] = {
        "step": [r["step"] for r in rows], "loss": [r["loss"] for r in rows],
        "train_seconds": [r["train_seconds"] for r in rows],
        "bytes_sent_total": [r["bytes_sent_total"] for r in rows],
        "val_step": [r["step"] for r in rows if "val_loss" in r],
        "val_loss": [r["val_loss"] for r in rows if "val_loss" in r],
        "val_seconds": [r["train_seconds"] for r in rows if "val_loss" in r],
        "val_bytes": [r["bytes_sent_total"] for r in rows if "val_loss" in r],
        "val_tokens": [r.get("job_tokens_total") for r in rows if "val_loss" in r],
    }
    if watch is not None and watch.fired_at is not None:
        c = record["curve"]
        at = next((t for st, t in zip(c["step"], c["train_seconds"]) if st >= watch.fired_at),
                  None)
        record["link_change"] = {"step": watch.fired_at, "to": then, "train_seconds": at}
    if record["status"] != "ok":
        echo(f"   {name} @ {_label(bw)} failed: {result.message} (log: {run_dir / 'log.txt'})")
    else:
        val = record.get("val_loss")
        echo(f"   done in {result.seconds:.0f}s: val loss "
             f"{format(val, '.4f') if is_finite(val) else '-'}"
             f", step {record['step_seconds'] * 1e3:.0f} ms (compute "
             f"{record['compute_seconds'] * 1e3:.0f} + comm {record['comm_seconds'] * 1e3:.0f})"
             f", {record['bytes_sent_per_step'] / 1e6:.4f} MB sent per rank per step")
    return record


CSV_FIELDS = ["strategy", "bandwidth", "status", "nodes", "ranks_per_node", "steps",
              "params", "train_loss", "val_loss", "val_accuracy", "train_seconds",
              "wall_seconds", "step_seconds", "compute_seconds", "comm_seconds",
              "bytes_sent_per_step", "mb_sent_total", "message"]


def write_results(o: BenchOptions, results: list[dict], out: Path, shaped: bool,
                  seconds: float) -> None:
    """``results.json`` (everything, curves included) and ``results.csv`` (one row per run)."""
    payload: dict[str, Any] = {"options": asdict(o), "shaped": shaped, "seconds": seconds,
                               "runs": results}
    if o.slow_factor != 1.0 or any(partner(r["strategy"]) for r in results):
        ok = {(r["strategy"], r["bandwidth"]): r for r in results if r["status"] == "ok"}
        payload["stragglers"] = {
            "slowed": slow_label(o.slow_factor, o.slow_node) or None,
            "runs": [{"strategy": r["strategy"], "bandwidth": r["bandwidth"],
                      **run_figures(r)} for r in ok.values()],
            "comparisons": [comparison(r, ok[(partner(n), bw)])
                            for (n, bw), r in ok.items() if (partner(n), bw) in ok]}
    (out / "results.json").write_text(strict_json(payload, indent=1) + "\n")
    with (out / "results.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in results:
            w.writerow({k: r.get(k, "") for k in CSV_FIELDS})

