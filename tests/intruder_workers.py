"""A process outside the run that poses as a replica group (tests/test_security.py).

``python -m intruder_workers --lighthouse URL --replica-id X --marker FILE --seconds S``
joins the lighthouse's quorums as a group would, with flexdemo's own protocol (an attacker
knows the code: the same Manager set-up, store prefixes and heal server), but without the run
secret. It claims step 100000 and serves a heal state whose parameters are all 7.0 and which
carries a pickled object that, when unpickled, creates ``FILE`` (standing for code run
inside the victim). It takes part in quorums until ``S`` seconds have passed, then exits 0.

``--copy NAME --copied F --after G``: replay an honest group's id. It reads group NAME's
tagged replica id from the lighthouse's public ``/status`` page (as anyone can), writes
``F``, waits until file ``G`` exists (that group has left) and for the lighthouse to forget
the group, then joins with the copied id; ``--up F`` is written once it is up.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import urllib.request
from pathlib import Path

import torch

from flexdemo.ft.heal import HealServer
from flexdemo.ft.torchft_api import new_manager

STEP = 100_000


class Payload:
    """Unpickling this creates ``marker``: code run inside whoever loads it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def copy_id(lighthouse: str, name: str, seconds: float = 60.0) -> str:
    """Group ``name``'s tagged replica id as the lighthouse's status page shows it."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        page = urllib.request.urlopen(f"{lighthouse}/status", timeout=5).read().decode()
        found = re.findall(rf"\b{re.escape(name)}:[0-9a-f]{{16}}\.[0-9a-f]{{32}}", page)
        if found:
            return found[0]
        time.sleep(0.1)
    raise SystemExit(f"no tagged id of {name} on the lighthouse's page")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--replica-id", default="X")
    ap.add_argument("--marker", required=True)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--params", type=int, default=6, help="parameter tensors to serve")
    ap.add_argument("--copy", default="", help="the honest group whose tagged id to replay")
    ap.add_argument("--copied", default="", help="written once the id is copied")
    ap.add_argument("--after", default="", help="join once this file exists")
    ap.add_argument("--up", default="", help="written once this intruder is up")
    a = ap.parse_args(argv)
    replica_id = a.replica_id
    if a.copy:
        replica_id = copy_id(a.lighthouse, a.copy)
        Path(a.copied).write_text(replica_id)
        while not os.path.exists(a.after):
            time.sleep(0.05)
        time.sleep(4.0)  # the lighthouse forgets the group that left (3 s without heartbeats)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    poisoned = {"params": [torch.full((4,), 7.0) for _ in range(a.params)], "base": {},
                "steps": STEP, "skipped_steps": 0, "replicators": [],
                "code": Payload(a.marker)}
    manager, _, _ = new_manager(
        lighthouse=a.lighthouse, replica_id=replica_id, hostname="127.0.0.1",
        min_replicas=1, timeout=10.0, quorum_timeout=10.0, rank=0, world=1,
        store_addr="127.0.0.1", store_port=store.port, max_failed_commits=None,
        verbose=False, heal_server=HealServer("127.0.0.1", "127.0.0.1", None, 10.0))
    manager.register_state_dict_fn("flexdemo", lambda s: None, lambda: poisoned)
    manager.load_state_dict({"step": STEP, "batches_committed": 0})
    print("intruder up", flush=True)
    if a.up:
        Path(a.up).write_text("up")
    deadline = time.monotonic() + a.seconds
    while time.monotonic() < deadline:
        try:
            manager.start_quorum(allow_heal=True)
            time.sleep(3.0)  # its heal state stays served (until its vote) while a peer reads
            manager.should_commit()
            manager.load_state_dict({"step": STEP, "batches_committed": 0})  # the same claim
        except Exception as e:  # the honest groups went away: try again until the deadline
            print(f"intruder: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
                  flush=True)
        time.sleep(0.1)
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
