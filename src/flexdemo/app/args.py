"""Argument checks for scripts launched by ``torchrun`` (the benchmarks): one-line errors that
rank 0 prints once, exit code 2 on every rank, and ``argparse`` types with ranges; also the
``argparse`` types of the ``flexdemo`` command's options."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist

__all__ = ["Parser", "check_out_file", "float_in", "int_at_least", "launch_rank", "launch_world",
           "usage_exit"]


def launch_rank() -> int:
    """This process's global rank (before the process group starts: torchrun's ``RANK``)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def launch_world() -> int:
    """The number of ranks (before the process group starts: torchrun's ``WORLD_SIZE``)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def usage_exit(prog: str, message: str) -> NoReturn:
    """Print ``prog: error: message`` (one line, rank 0 only) and exit 2 on every rank.

    The other ranks wait a moment first: torchrun stops every rank once one has exited, and
    rank 0 should have said why by then."""
    if launch_rank() == 0:
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    else:
        time.sleep(3)
    sys.exit(2)


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage block), said once by rank 0."""

    def error(self, message: str) -> NoReturn:
        usage_exit(self.prog, f"{message} (see --help)")


def int_at_least(low: int, high: int | None = None):
    """An ``argparse`` type: an integer ``>= low`` (and ``< high`` when given)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value >= high):
            bound = f"at least {low}" if high is None else f"from {low} to {high - 1}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value
    return parse


def float_in(low: float, high: float | None = None, *, open_low: bool = False):
    """An ``argparse`` type: a finite number ``>= low`` (``> low`` with ``open_low``), and
    ``<= high`` when given."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if (not math.isfinite(value) or value < low or (open_low and value == low)
                or (high is not None and value > high)):
            bound = (f"greater than {low:g}" if open_low else f"at least {low:g}") \
                if high is None else f"from {low:g} to {high:g}"
            raise argparse.ArgumentTypeError(f"must be a number {bound}, got {text}")
        return value
    return parse


def check_out_file(parser: argparse.ArgumentParser, out: str, option: str = "--out") -> None:
    """``out`` must name a file this process can write: not a directory, in a folder that
    exists (it is made) and is writable; else ``parser.error`` (checked before any work)."""
    path = Path(out)
    if path.is_dir():
        parser.error(f"argument {option}: {out!r} is a directory; give a file name such as "
                     f"{str(path / 'results.json')!r}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parser.error(f"argument {option}: cannot create {str(path.parent)!r} "
                     f"({e.strerror or e}); choose another path")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        parser.error(f"argument {option}: {str(path.parent)!r} is not a writable directory; "
                     "choose another path")


def checked(parse: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse type that keeps the text once ``parse`` accepts it (its error otherwise)."""
    def check(text: str) -> str:
        try:
            parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text

    return check


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r} (e.g. 2)")
    return value


def _float_arg(text: str, ok: Callable[[float], bool], need: str) -> float:
    """``text`` as a float that ``ok`` accepts, else argparse's error: "must be ``need``"."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan  # accepted by no check
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {need}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    return _float_arg(text, lambda v: 0 < v < math.inf, "a positive number")


def seconds_arg(text: str) -> float:
    return _float_arg(text, lambda v: v >= 0, "a number of seconds >= 0")
