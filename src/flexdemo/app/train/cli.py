"""``flexdemo train``: train as a config says, turning the errors into one line and an exit
code, and leaving a multi-rank run without the interpreter's finalisation."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

import torch.distributed as dist

from ...mesh import timeout_from_env
from ...transport import PeerLostError
from ..config.files import load_config, to_toml
from ..config.schema import ConfigError
from ..errors import StartupError, TrainingError, UsageError
from .preempt import PREEMPTED_EXIT_CODE, LighthouseLost, Preempted
from .trainer import train

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
checkpoints/step_NNNNNN. --resume (or resume=true) continues from the newest intact
checkpoint (a damaged one is set aside as step_NNNNNN.damaged); one already at train.steps
leaves the outputs as they are (nothing to train). A resume that finds no intact checkpoint
although the run got further is refused; train.overwrite=true starts afresh.
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
(including a checkpoint that does not exist, is damaged, may not be read or lies past
train.steps, and a train.out that cannot be a folder) or a job that could not assemble (a
rank never arrived or died during start-up; every survivor names it), 3 stopped by
SIGTERM/SIGINT after finishing its step and saving it (every rank; continue with resume=true),
or under fault tolerance its torchft lighthouse was lost (its last committed step saved).
environment: FLEXDEMO_TIMEOUT (seconds a collective waits for a dead peer; default 300,
the library's; train.timeout overrides it); FLEXDEMO_JOIN_TIMEOUT (seconds a rank waits at
start-up for a peer that has not arrived at all; default 30); FLEXDEMO_CUDA_BY_RANK=1
puts rank r on cuda:r instead of cuda:LOCAL_RANK (emulated nodes sharing one machine's
GPUs). The error that stops a run is the last line, after any log lines of torch's C++
side (TORCH_CPP_LOG_LEVEL=FATAL hides those; set it before starting Python).
"""


def add_train_parser(sub) -> None:
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
    t.set_defaults(func=cmd_train, subparser=t)


def _train_error(text: str, rank0_only: bool = True) -> None:
    if rank0_only and os.environ.get("RANK", "0") != "0":
        return
    print(f"flexdemo train: error: {text}", file=sys.stderr, flush=True)


def cmd_train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
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
LEAVE_AT_ONCE = threading.Event()


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
    except Exception:  # leaving anyway
        pass
    if several:
        LEAVE_AT_ONCE.set()


def _run_training(cfg) -> int:
    rank = os.environ.get("RANK", "0")
    try:
        train(cfg, exit_on_lost_peer=True, handle_signals=True)
    except LighthouseLost as e:  # this group saved its last committed step
        who = "" if rank == "0" else f"rank {rank}: "
        print(f"flexdemo train: {who}lighthouse lost: {e}; start the lighthouse again at its "
              f"address and continue with resume=true (exit code {PREEMPTED_EXIT_CODE})",
              file=sys.stderr, flush=True)
        _leave_cleanly()
        return PREEMPTED_EXIT_CODE
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
