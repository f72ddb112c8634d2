"""Command line: ``flexdemo train|bench|cluster|simulate|checkpoint ...`` (also
``python -m flexdemo ...``).

A thin user of the library: ``train`` reads a config and calls :func:`flexdemo.app.trainer.train`,
``bench`` calls :func:`flexdemo.app.bench.run_bench`, ``cluster`` runs
:class:`flexdemo.tools.cluster.EmulatedCluster`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..ft.lighthouse import add_parser as add_lighthouse_parser
from ..mesh import timeout_from_env
from ..strategies import STRATEGIES, check_strategy
from ..tools.cluster import DEFAULT_SUBNET, EmulatedCluster
from ..tools.netns import ClusterError, ShapingUnavailableError, cleanup_stale
from ..tools.rates import parse_bandwidth, parse_latency
from .bench import (
    DEFAULT_BANDWIDTHS,
    DEFAULT_STRATEGIES,
    PRESETS,
    BenchError,
    bench_options,
    run_bench,
)
from .checkpoints import add_checkpoint_parser
from .config import MIN_CORPUS_BYTES, ConfigError
from .config_files import load_config, to_toml
from .preempt import PREEMPTED_EXIT_CODE, Preempted
from .simulate import SimulateOptions, run_simulation, write_summary
from .trainer import PeerLostError, StartupError, TrainingError, UsageError, train

CLUSTER_DESCRIPTION = """\
Run a command on an emulated multi-node cluster on this machine.

Each node is a network namespace with its own address (10.213.0.1, .2, ...), joined to the
others through a bridge by a link shaped to --bandwidth in both directions (tc tbf), so
traffic between two nodes crosses links of that rate. Ranks of one node talk over the
node's own address, unshaped. The command is started once per rank, inside its node's
namespace, with the variables torchrun would set: RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, NODE_RANK, GROUP_RANK, MASTER_ADDR (node 0), MASTER_PORT, plus
GLOO_SOCKET_IFNAME (the node's link) and OMP_NUM_THREADS=1 unless set.

Every output line is prefixed with [rank r]. If a rank fails, the others are stopped and
the exit code is that rank's. Ctrl-C or SIGTERM stops the ranks; the namespaces and links
are always removed (leftovers of killed runs are removed at the next start).

Shaping needs root and iproute2 (ip, tc); --unshaped runs the same ranks on loopback.
"""

CLUSTER_EXAMPLES = """\
examples:
  # 2 nodes x 2 ranks, 100 Mbit/s between nodes
  flexdemo cluster --nodes 2 --ranks-per-node 2 --bandwidth 100mbit -- \\
      python examples/train_gpt.py --steps 20

  # the same without root: all ranks on loopback, no shaping
  flexdemo cluster --nodes 2 --ranks-per-node 2 --unshaped -- python train.py

rates use tc units: bit, kbit, mbit, gbit (and bps, kbps, mbps, gbps = bytes per second).
"""


def _checked(parse: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse type that keeps the text once ``parse`` accepts it (its error otherwise)."""
    def check(text: str) -> str:
        try:
            parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text

    return check


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r} (e.g. 2)")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``flexdemo`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="flexdemo",
        description="flexdemo: train one PyTorch model across nodes joined by slow links.",
        epilog="start here: flexdemo bench --preset main  (FlexDeMo against full-sync AdamW "
               "on 2 emulated nodes joined by a 100 Mbit/s link; a few minutes)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    c = sub.add_parser(
        "cluster", help="run a command on an emulated multi-node cluster (namespaces + tc)",
        description=CLUSTER_DESCRIPTION, epilog=CLUSTER_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s --nodes N --ranks-per-node M (--bandwidth RATE | --unshaped) "
              "[options] -- CMD [ARGS...]",
    )
    c.add_argument("--nodes", type=_positive_int, required=True, metavar="N",
                   help="number of emulated nodes")
    c.add_argument("--ranks-per-node", type=_positive_int, default=1, metavar="M",
                   help="processes per node (default 1)")
    c.add_argument("--bandwidth", type=_checked(parse_bandwidth), metavar="RATE",
                   help="rate of each node's link, both directions, e.g. 100mbit, 1gbit")
    c.add_argument("--latency", type=_checked(parse_latency), metavar="TIME",
                   help="one-way node-to-node delay, e.g. 10ms (needs the sch_netem module)")
    c.add_argument("--unshaped", action="store_true",
                   help="no namespaces, no shaping: all ranks on loopback (no root needed)")
    c.add_argument("--port", type=int, metavar="P",
                   help="MASTER_PORT (default 29500; a free port with --unshaped)")
    c.add_argument("--subnet", default=DEFAULT_SUBNET, metavar="NET",
                   help=f"private IPv4 network for the node addresses (default {DEFAULT_SUBNET})")
    c.add_argument("--timeout", type=_seconds, metavar="S",
                   help="stop all ranks after S seconds (exit code 124)")
    c.add_argument("--grace", type=_seconds, default=3.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when stopping ranks (default 3)")
    c.add_argument("-q", "--quiet", action="store_true",
                   help="do not print the set-up and teardown facts")
    c.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]",
                   help="the command each rank runs")
    c.set_defaults(func=_cmd_cluster, subparser=c)
    _add_train_parser(sub)
    _add_bench_parser(sub)
    _add_simulate_parser(sub)
    add_checkpoint_parser(sub)
    add_lighthouse_parser(sub)  # flexdemo.ft: torchft's lighthouse for elastic runs
    return parser


def _say(text: str) -> None:
    print(f"flexdemo cluster: {text}", file=sys.stderr, flush=True)


def _cmd_cluster(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        parser.error("cluster: give the command to run after --, e.g. "
                     "flexdemo cluster --nodes 2 --bandwidth 100mbit -- python train.py")
    if not args.unshaped and args.bandwidth is None:
        parser.error("cluster: --bandwidth is required (e.g. --bandwidth 100mbit), "
                     "or pass --unshaped")
    say = (lambda text: None) if args.quiet else _say
    if args.unshaped and (args.bandwidth or args.latency):
        say("--unshaped: ignoring --bandwidth/--latency")
    try:
        cluster = EmulatedCluster(
            args.nodes, args.ranks_per_node, args.bandwidth, args.latency,
            unshaped=args.unshaped, subnet=args.subnet, port=args.port, grace=args.grace,
            log=say)
    except ValueError as e:
        parser.error(f"cluster: {e}")
    except ShapingUnavailableError as e:
        _say(f"error: {e}")
        return 1
    try:
        if not args.unshaped:
            removed = cleanup_stale()
            if removed:
                say(f"removed leftovers of dead runs: {', '.join(removed)}")
        with cluster:
            result = cluster.run(cmd, timeout=args.timeout)
    except ClusterError as e:
        _say(f"error: {e}")
        return 1
    except KeyboardInterrupt:
        _say("interrupted (SIGINT); ranks stopped" + ("" if args.unshaped else
                                                       ", namespaces removed"))
        return 130
    except SystemExit as e:  # SIGTERM, turned into SystemExit(143) by the cluster
        _say(f"terminated (exit {e.code}); ranks stopped" + ("" if args.unshaped else
                                                              ", namespaces removed"))
        raise
    if not result.ok:
        _say(f"error: {result.message}")
    return result.exit_code


# ---------------------------------------------------------------------- train
TRAIN_DESCRIPTION = """\
Train one model as a config file says: task and model size, strategy (replicator, base
optimizer, learning rate), mesh (replicate x shard), steps, batch, schedule, evaluation,
checkpoints, output folder. Run it as one process, under torchrun, or on an emulated cluster:

  flexdemo train configs/gpt.toml
  torchrun --nproc-per-node 4 -m flexdemo train configs/gpt.toml mesh.shard=2
  flexdemo cluster --nodes 2 --ranks-per-node 2 --bandwidth 100mbit -- \\
      flexdemo train configs/gpt.toml

The config is TOML (YAML with pyyaml, or JSON) with the sections [task], [strategy], [mesh],
[train] and a top-level resume; every key has a default, so an empty file (or no file) is a
valid config. Overrides after the file replace single keys, e.g. strategy.replicator=full
train.steps=50 'strategy.replicator_kwargs={topk=16}'. Values are TOML; bare words are
strings. Switching strategy.replicator (or .optimizer) drops the file's replicator_kwargs
(optimizer_kwargs) unless the overrides set them too.

Outputs in train.out: config.toml (resolved), metrics.jsonl (one line per step: loss, lr,
bytes sent/received, compute and communication seconds), summary.json, tensorboard/ and
checkpoints/step_NNNNNN. --resume (or resume=true) continues from the newest checkpoint;
one already at train.steps leaves the outputs as they are (nothing to train).
"""

TRAIN_EXAMPLES = """\
examples:
  flexdemo train configs/gpt.toml train.steps=50 strategy.replicator=full \\
      strategy.optimizer=adamw strategy.lr=1e-3
  flexdemo train configs/vit.toml --resume                 # continue after a stop or crash
  flexdemo train configs/gpt.toml --print-config           # show the resolved config
  torchrun --nproc-per-node 4 -m flexdemo train configs/gpt.toml mesh.replicate=2 \\
      train.device=cuda train.precision=bf16         # 4 GPUs as 2 replicas x 2 shards

exit codes: 0 done, 1 training failed (e.g. a rank was lost), 2 bad config or arguments
(including a checkpoint that does not exist or lies past train.steps, and a train.out that
cannot be a folder) or a job that could not assemble (a rank never arrived or died during
start-up; every survivor names it), 3 stopped by SIGTERM/SIGINT after finishing its step and
saving it (every rank; continue with resume=true).
environment: FLEXDEMO_TIMEOUT (seconds a collective waits for a dead peer; default 300,
the library's; train.timeout overrides it); FLEXDEMO_JOIN_TIMEOUT (seconds a rank waits at
start-up for a peer that has not arrived at all; default 30); FLEXDEMO_CUDA_BY_RANK=1
puts rank r on cuda:r instead of cuda:LOCAL_RANK (emulated nodes sharing one machine's
GPUs). The error that stops a run is the last line, after any log lines of torch's C++
side (TORCH_CPP_LOG_LEVEL=FATAL hides those; set it before starting Python).
"""


def _add_train_parser(sub) -> None:
    t = sub.add_parser("train", help="train a model from a config (TOML/YAML) on this rank",
                       description=TRAIN_DESCRIPTION, epilog=TRAIN_EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       usage="%(prog)s [CONFIG] [section.key=value ...] [--resume [PATH]]")
    t.add_argument("args", nargs="*", metavar="CONFIG|KEY=VALUE",
                   help="a config file, then overrides section.key=value")
    t.add_argument("--resume", nargs="?", const=True, default=None, metavar="PATH",
                   help="continue from the newest checkpoint in train.out (or from PATH)")
    t.add_argument("--print-config", action="store_true",
                   help="print the resolved config as TOML and exit")
    t.set_defaults(func=_cmd_train, subparser=t)


def _train_error(text: str, rank0_only: bool = True) -> None:
    if rank0_only and os.environ.get("RANK", "0") != "0":
        return
    print(f"flexdemo train: error: {text}", file=sys.stderr, flush=True)


def _cmd_train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    items = list(args.args)
    if isinstance(args.resume, str) and "=" in args.resume and not os.path.exists(args.resume):
        items.append(args.resume)  # `--resume key=value`: an override, not a path
        args.resume = True
    path = None
    if items and "=" not in items[0]:
        path = items.pop(0)
    bad = [x for x in items if "=" not in x]
    if bad:
        _train_error(f"{bad[0]!r} is not an override; write section.key=value after the config "
                     "file (one config file only)")
        return 2
    if args.resume is not None:
        items.append(f"resume={'true' if args.resume is True else _toml_string(args.resume)}")
    try:
        cfg = load_config(path, items)
    except ConfigError as e:
        _train_error(str(e))
        return 2
    if args.print_config:
        print(to_toml(cfg), end="")
        return 0
    if not cfg.train.timeout:
        try:
            timeout_from_env()
        except ValueError as e:
            _train_error(str(e))
            return 2
    return _run_training(cfg)


def _toml_string(text: str) -> str:
    return json.dumps(text)


# Set once a multi-rank run has torn its process group down: the process then leaves without
# the interpreter's finalisation (see :func:`entry`).
_LEAVE_AT_ONCE = threading.Event()


def _leave_cleanly() -> None:
    """Tear a multi-rank process group down and have :func:`entry` leave through
    ``os._exit`` (after flushing), on the error paths as on the success path: interpreter
    finalisation with the group alive can abort ("terminate called without an active
    exception", exit 134) instead of giving the exit code."""
    if not dist.is_initialized():
        return
    several = dist.get_world_size() > 1
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - leaving anyway
        pass
    if several:
        _LEAVE_AT_ONCE.set()


def _run_training(cfg) -> int:
    rank = os.environ.get("RANK", "0")
    try:
        train(cfg, exit_on_lost_peer=True, handle_signals=True)
    except Preempted as e:  # every rank stopped after the same step and saved it
        who = "" if rank == "0" else f"rank {rank}: "
        print(f"flexdemo train: {who}preempted: {e.signal_name}: stopped after step {e.step} "
              f"and saved {e.checkpoint}; continue with resume=true (exit code "
              f"{PREEMPTED_EXIT_CODE})", flush=True)
        _leave_cleanly()
        return PREEMPTED_EXIT_CODE
    except StartupError as e:  # every survivor names the missing peers (rank 0 may be one)
        _train_error(str(e), rank0_only=False)
        # a process group with a dead peer: leave without tearing it down (that could block)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)
    except PeerLostError as e:
        _train_error(str(e), rank0_only=False)
        # the process group is broken: leave without tearing it down (that could block)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    except UsageError as e:  # the same on every rank: one line, from rank 0
        _train_error(str(e))
        _leave_cleanly()
        return 2
    except TrainingError as e:
        text = str(e)
        if rank != "0" and not text.startswith(f"rank {rank}"):
            text = f"rank {rank}: {text}"
        _train_error(text, rank0_only=False)
        _leave_cleanly()
        return 1
    except KeyboardInterrupt:
        _train_error("interrupted", rank0_only=False)
        return 130
    _leave_cleanly()
    return 0


# ---------------------------------------------------------------------- bench
BENCH_DESCRIPTION = """\
Sweep strategies x bandwidths on an emulated cluster (flexdemo cluster): for every pair, run
`flexdemo train` on --nodes x --ranks-per-node ranks whose nodes are joined by links of that
rate, then write results.json, results.csv and plots (loss vs wall-clock time, loss vs bytes
sent, step time split into compute and communication) to --out and print a table.

Shaping needs root and iproute2; without them (or with --unshaped) the ranks run on loopback
with no bandwidth limit, and the bench says so.
"""


def _add_bench_parser(sub) -> None:
    width = max(map(len, STRATEGIES)) + 1
    strategies = "\n".join(f"  {name:<{width}} {spec.about}" for name, spec in STRATEGIES.items())
    presets = "\n".join(f"  {name:<12} {spec['about']}" for name, spec in PRESETS.items())
    b = sub.add_parser(
        "bench", help="sweep strategies x bandwidths on an emulated cluster; table + plots",
        description=BENCH_DESCRIPTION,
        epilog=f"strategies:\n{strategies}\n\npresets:\n{presets}\n\nexamples:\n"
               "  flexdemo bench --preset main\n"
               "  flexdemo bench --strategies flexdemo,hsdp-adamw --bandwidths 10mbit,1gbit "
               "--steps 100\n"
               "  flexdemo bench --unshaped --steps 20 task.model=tiny\n",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides for every run, e.g. task.model=tiny")
    b.add_argument("--preset", choices=sorted(PRESETS),
                   help="a ready-made sweep (its settings apply first; other options refine)")
    b.add_argument("--strategies", metavar="LIST",
                   help=f"comma-separated (default {','.join(DEFAULT_STRATEGIES)})")
    b.add_argument("--bandwidths", metavar="LIST",
                   help=f"comma-separated rates (default {','.join(DEFAULT_BANDWIDTHS)})")
    b.add_argument("--nodes", type=_positive_int, metavar="N", help="emulated nodes (default 2)")
    b.add_argument("--ranks-per-node", type=_positive_int, metavar="M",
                   help="ranks per node (default 2)")
    b.add_argument("--steps", type=_positive_int, metavar="N",
                   help="training steps per run (default: a train.steps=N override, else "
                        "train.steps of --config, else the preset's, else 100; an override "
                        "that differs from --steps is an error)")
    b.add_argument("--config", metavar="FILE",
                   help="base training config for every run (default: the GPT task)")
    b.add_argument("--out", metavar="DIR", help="output folder (default runs/bench)")
    b.add_argument("--unshaped", action="store_true",
                   help="no shaping, no root needed: all ranks on loopback")
    b.add_argument("--timeout", type=_seconds, metavar="S",
                   help="stop a run that takes longer than S seconds")
    b.add_argument("--device", choices=("auto", "cpu", "cuda"),
                   help="where every rank trains (default: train.device of --config, else "
                        "auto: CUDA when this machine has a GPU per rank, else CPU)")
    b.add_argument("-q", "--quiet", action="store_true",
                   help="do not echo the ranks' progress (it still goes to each run's log.txt)")
    b.set_defaults(func=_cmd_bench, subparser=b)


def _cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        options = bench_options(
            preset=args.preset, strategies=args.strategies, bandwidths=args.bandwidths,
            nodes=args.nodes, ranks_per_node=args.ranks_per_node, steps=args.steps,
            config=args.config, out=args.out, unshaped=args.unshaped,
            overrides=args.overrides, timeout=args.timeout, quiet=args.quiet,
            device=args.device)
    except (BenchError, ConfigError) as e:
        print(f"flexdemo bench: error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        results = run_bench(options)
    except BenchError as e:
        print(f"flexdemo bench: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("flexdemo bench: interrupted; runs stopped", file=sys.stderr, flush=True)
        return 130
    return 0 if all(r["status"] == "ok" for r in results) else 1


def _add_simulate_parser(sub) -> None:
    d = SimulateOptions()
    s = sub.add_parser(
        "simulate", help="train N replicas of the GPT task in one process (CPU or one GPU)",
        description="Train N replicas of the byte-level GPT in one process: each replica its "
                    "own data, the strategy's replicators exchanging through memory with the "
                    "same codecs and byte counts as over a network (bitwise the weights N gloo "
                    "processes reach).",
        epilog="examples:\n  flexdemo simulate --replicas 4 --steps 300\n"
               "  flexdemo simulate --strategy hsdp-adamw --replicas 8 --model small "
               "--device cuda\n  flexdemo simulate --strategy flexdemo:topk=16:values=int2 "
               "--lr 3e-3",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--strategy", default=d.strategy, metavar="NAME",
                   help=f"a named strategy, optionally with settings (default {d.strategy}; "
                        f"see flexdemo bench --help)")
    s.add_argument("--replicas", type=_positive_int, default=d.replicas, metavar="N",
                   help=f"replicas trained side by side (default {d.replicas})")
    s.add_argument("--model", default=d.model, choices=("tiny", "mini", "small"),
                   help=f"GPT preset (default {d.model})")
    s.add_argument("--steps", type=_positive_int, default=d.steps, metavar="N",
                   help=f"training steps (default {d.steps})")
    s.add_argument("--batch", type=_positive_int, default=d.batch, metavar="B",
                   help=f"sequences per replica per step (default {d.batch})")
    s.add_argument("--lr", type=float, metavar="LR", help="default: the strategy's")
    s.add_argument("--warmup", type=int, default=d.warmup, metavar="N",
                   help=f"linear warm-up steps (default {d.warmup})")
    s.add_argument("--schedule", default=d.schedule, choices=("cosine", "constant"),
                   help=f"lr schedule after the warm-up (default {d.schedule})")
    s.add_argument("--device", default=d.device, choices=("cpu", "cuda"),
                   help=f"every replica on this one device (default {d.device})")
    s.add_argument("--seed", type=int, default=d.seed,
                   help=f"initial weights and data order (default {d.seed})")
    s.add_argument("--corpus-bytes", type=_positive_int, default=d.corpus_bytes, metavar="N",
                   help=f"bytes of standard-library sources to read (default "
                        f"{d.corpus_bytes:,})")
    s.add_argument("--log-every", type=_positive_int, default=d.log_every, metavar="N",
                   help=f"print progress every N steps (default {d.log_every})")
    s.add_argument("--out", metavar="FILE", help="write the summary as JSON")
    s.set_defaults(func=_cmd_simulate, subparser=s)


def _simulate_error(text: str) -> int:
    print(f"flexdemo simulate: error: {text}", file=sys.stderr, flush=True)
    return 2


def _cmd_simulate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:  # the replicator is built once here, so that no replica raises a traceback later
        check_strategy(args.strategy)
    except ValueError as e:
        return _simulate_error(str(e))
    if args.device == "cuda" and not torch.cuda.is_available():
        return _simulate_error("--device cuda: no CUDA device here; use --device cpu")
    if args.lr is not None and not args.lr > 0:
        return _simulate_error(f"--lr must be > 0, got {args.lr}")
    if not 0 <= args.warmup < args.steps:
        return _simulate_error(f"--warmup must be in 0..{args.steps - 1} (fewer than --steps), "
                               f"got {args.warmup}")
    if args.corpus_bytes < MIN_CORPUS_BYTES:
        return _simulate_error(f"--corpus-bytes must be at least {MIN_CORPUS_BYTES} (the "
                               f"training and validation text), got {args.corpus_bytes}")
    opts = SimulateOptions(strategy=args.strategy, replicas=args.replicas, model=args.model,
                           steps=args.steps, batch=args.batch, lr=args.lr, warmup=args.warmup,
                           schedule=args.schedule, device=args.device, seed=args.seed,
                           corpus_bytes=args.corpus_bytes, log_every=args.log_every)
    summary = run_simulation(opts)
    if args.out:
        print(f"wrote {write_summary(summary, args.out)}")
    return 0


# options whose value may look like a negative number (a bad one, which their own check names)
VALUE_OPTIONS = ("--bandwidth", "--bandwidths", "--latency", "--timeout", "--grace", "--port",
                 "--nodes", "--ranks-per-node", "--steps")
NEGATIVE = re.compile(r"-\.?\d")


def join_negative_values(argv: list[str]) -> list[str]:
    """``--bandwidth -5mbit`` -> ``--bandwidth=-5mbit``: argparse takes a value that starts
    with ``-`` for an option and says only "expected one argument"; joined, the option's own
    check says what is wrong with the value. The command after ``--`` is left alone."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return out + argv[i:]
        if token in VALUE_OPTIONS and i + 1 < len(argv) and NEGATIVE.match(argv[i + 1]):
            out.append(f"{token}={argv[i + 1]}")
            i += 2
            continue
        out.append(token)
        i += 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """The ``flexdemo`` command on ``argv`` (default: ``sys.argv``); returns the exit code."""
    parser = build_parser()
    args, extra = parser.parse_known_args(join_negative_values(list(sys.argv[1:] if argv is None
                                                                    else argv)))
    if extra:  # train's overrides may follow its options (`CONFIG --resume key=value ...`)
        if getattr(args, "func", None) is _cmd_train and not any(x.startswith("-")
                                                                 for x in extra):
            args.args = [*args.args, *extra]
        else:
            (getattr(args, "subparser", None) or parser).error(
                f"unrecognized arguments: {' '.join(extra)}")
    return int(args.func(args, args.subparser))


def entry() -> None:
    """The ``flexdemo`` executable (and ``python -m flexdemo``): :func:`main`, then exit.

    After a multi-rank ``train`` that finished and tore its process group down, the process
    leaves with ``os._exit`` once its output is flushed: at interpreter finalisation, C++
    threads of the communication backend and the rendezvous store can still be unwinding,
    and a rare abort there ("terminate called without an active exception") would turn a
    finished run into a failed exit code.
    """
    code = main()
    if _LEAVE_AT_ONCE.is_set():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
