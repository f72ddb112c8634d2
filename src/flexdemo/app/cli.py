"""Command line: ``flexdemo train|bench|cluster|simulate|checkpoint ...`` (also
``python -m flexdemo ...``).

A thin user of the library: ``train`` reads a config and calls
:func:`flexdemo.app.train.trainer.train`, ``bench`` calls :func:`flexdemo.app.bench.run.run_bench`,
``cluster`` runs :class:`flexdemo.tools.cluster.EmulatedCluster`. Each command (its sub-parser
and handler) is a module of its own: ``train.cli``, ``bench.cli``, ``simulate.cli``, ``cluster``
and ``checkpoints``; this one puts the parser together and runs it.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

from ..ft.lighthouse import add_parser as add_lighthouse_parser
from .bench.cli import add_bench_parser
from .checkpoints import add_checkpoint_parser
from .cluster import add_cluster_parser
from .simulate.cli import add_simulate_parser
from .train import cli as train_cli
from .train.cli import add_train_parser, cmd_train


def build_parser() -> argparse.ArgumentParser:
    """The ``flexdemo`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="flexdemo",
        description="flexdemo: train one PyTorch model across nodes joined by slow links.",
        epilog="start here: flexdemo bench --preset main  (FlexDeMo and MuLoCo against "
               "full-sync Muon and AdamW on 2 emulated nodes joined by a 100 Mbit/s link; a "
               "few minutes)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_cluster_parser(sub)
    add_train_parser(sub)
    add_bench_parser(sub)
    add_simulate_parser(sub)
    add_checkpoint_parser(sub)
    add_lighthouse_parser(sub)  # flexdemo.ft: torchft's lighthouse for elastic runs
    return parser


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
        if getattr(args, "func", None) is cmd_train and not any(x.startswith("-")
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
    if train_cli.LEAVE_AT_ONCE.is_set():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
