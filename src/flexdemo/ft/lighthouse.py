"""``flexdemo lighthouse``: start torchft's lighthouse (the quorum server of elastic runs);
:func:`lighthouse_answers`: whether it is there."""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import shutil
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit

from .config import TorchFTMissingError, require_torchft

DESCRIPTION = """\
Start torchft's lighthouse, the server that forms the quorum of replica groups at every step
of an elastic run (flexdemo.FaultTolerance, docs/elastic.md). Its options are torchft's own,
passed through to torchft's lighthouse; it runs until interrupted."""
EXAMPLES = """\
examples:
  flexdemo lighthouse --min_replicas 1
  flexdemo lighthouse --min_replicas 2 --bind 10.0.0.1:29510 --join_timeout_ms 5000
then on every node: TORCHFT_LIGHTHOUSE=http://10.0.0.1:29510 FLEXDEMO_REPLICA_ID=<node> ..."""
OPTIONS = (("--bind", "127.0.0.1:29510", "address to listen on, host:port (default: loopback, "
                                         "one machine; give the replica network's address "
                                         "for several)"),
           ("--min_replicas", None, "the fewest replica groups that form a quorum"),
           ("--join_timeout_ms", None, "how long to wait for heartbeating stragglers to join "
                                       "before issuing a quorum (torchft: 60000)"),
           ("--heartbeat_timeout_ms", None, "how long without a heartbeat before a replica "
                                            "group counts as dead (torchft: 5000)"),
           ("--quorum_tick_ms", None, "how often to check for a quorum (torchft: 100)"))


def add_parser(sub) -> None:
    """Add the ``lighthouse`` subcommand to ``flexdemo``'s subparsers ``sub``."""
    p = sub.add_parser("lighthouse", help="start torchft's lighthouse for elastic runs",
                       description=DESCRIPTION, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default, text in OPTIONS:
        names = dict.fromkeys((name, name.replace("_", "-")))  # --min_replicas, --min-replicas
        p.add_argument(*names, dest=name.lstrip("-"), default=default, metavar="VALUE",
                       required=name == "--min_replicas", help=text)
    p.set_defaults(func=run, subparser=p)


def binary() -> str:
    """The path of torchft's ``torchft_lighthouse`` binary (beside this Python, else on the
    PATH); :class:`TorchFTMissingError` (one line naming the extra) without it."""
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    found = str(beside) if beside.exists() else shutil.which("torchft_lighthouse")
    if not found:
        raise TorchFTMissingError('the torchft_lighthouse binary is not installed: '
                                  'pip install "flexdemo[ft]"')
    return found


#: runs torchft's lighthouse without the torch import of torchft's own script
SCRIPT = Path(__file__).with_name("lighthouse_script.py")


def launcher() -> list[str]:
    """The start of a command line that runs torchft's lighthouse: this Python on
    :data:`SCRIPT` where torchft's extension module is installed for it (no torch import:
    about 1.5 s of CPU less before it listens), else the ``torchft_lighthouse`` binary
    (:func:`binary`)."""
    spec = importlib.util.find_spec("torchft")  # found, not imported
    where = spec.submodule_search_locations if spec is not None else None
    if where and glob.glob(os.path.join(list(where)[0], "_torchft*.so")):
        return [sys.executable, str(SCRIPT)]
    return [binary()]


def command(args: argparse.Namespace) -> list[str]:
    """The lighthouse's command line for ``args``."""
    out = launcher()
    for name, _, _ in OPTIONS:
        value = getattr(args, name.lstrip("-"))
        if value is not None:
            out += [name, str(value)]
    return out


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Replace this process by the lighthouse (signals reach it directly)."""
    try:
        require_torchft()
        cmd = command(args)
    except TorchFTMissingError as e:
        print(f"flexdemo lighthouse: error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"flexdemo lighthouse: {exposure(args.bind)}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(cmd[0], cmd)
    return 0  # not reached


def exposure(bind: str) -> str:
    """The start-up line: where the lighthouse listens and what anyone reaching it can do."""
    host = bind.rpartition(":")[0].strip("[]")
    where = ("loopback only" if host in ("127.0.0.1", "::1", "localhost")
             else "every interface" if host in ("", "::", "0.0.0.0") else host)
    return (f"listening on {bind} ({where}); torchft's lighthouse has no authentication: "
            "anyone who reaches it sees every group's address on its dashboard and can stop a "
            "group (POST /replica/<id>/kill); keep it on a private network (VPN, firewall) and "
            "give every node the run secret, FLEXDEMO_SECRET (docs/security.md)")


def lighthouse_answers(url: str, timeout: float = 1.0) -> bool:
    """Whether something accepts connections at the lighthouse's address ``url``."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return False
    if not host or not port:
        return False
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError:
        return False
    return True
