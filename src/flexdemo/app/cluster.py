"""``flexdemo cluster``: run a command once per rank on an emulated multi-node cluster
(:class:`flexdemo.tools.cluster.EmulatedCluster`)."""

from __future__ import annotations

import argparse
import sys

from ..tools.cluster import DEFAULT_SUBNET, EmulatedCluster
from ..tools.netns import ClusterError, ShapingUnavailableError, cleanup_stale
from ..tools.rates import parse_bandwidth, parse_latency
from .args import checked, positive_int, seconds_arg

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


def add_cluster_parser(sub) -> None:
    c = sub.add_parser(
        "cluster", help="run a command on an emulated multi-node cluster (namespaces + tc)",
        description=CLUSTER_DESCRIPTION, epilog=CLUSTER_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s --nodes N --ranks-per-node M (--bandwidth RATE | --unshaped) "
              "[options] -- CMD [ARGS...]",
    )
    c.add_argument("--nodes", type=positive_int, required=True, metavar="N",
                   help="number of emulated nodes")
    c.add_argument("--ranks-per-node", type=positive_int, default=1, metavar="M",
                   help="processes per node (default 1)")
    c.add_argument("--bandwidth", type=checked(parse_bandwidth), metavar="RATE",
                   help="rate of each node's link, both directions, e.g. 100mbit, 1gbit")
    c.add_argument("--latency", type=checked(parse_latency), metavar="TIME",
                   help="one-way node-to-node delay, e.g. 10ms (needs the sch_netem module)")
    c.add_argument("--unshaped", action="store_true",
                   help="no namespaces, no shaping: all ranks on loopback (no root needed)")
    c.add_argument("--port", type=int, metavar="P",
                   help="MASTER_PORT (default 29500; a free port with --unshaped)")
    c.add_argument("--subnet", default=DEFAULT_SUBNET, metavar="NET",
                   help=f"private IPv4 network for the node addresses (default {DEFAULT_SUBNET})")
    c.add_argument("--timeout", type=seconds_arg, metavar="S",
                   help="stop all ranks after S seconds (exit code 124)")
    c.add_argument("--grace", type=seconds_arg, default=3.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when stopping ranks (default 3)")
    c.add_argument("-q", "--quiet", action="store_true",
                   help="do not print the set-up and teardown facts")
    c.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]",
                   help="the command each rank runs")
    c.set_defaults(func=_cmd_cluster, subparser=c)


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
