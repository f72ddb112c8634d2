"""Worker processes for tests/test_elastic.py: one process is one torchft replica group.

``python -m elastic_workers --lighthouse URL --replica-id A --steps N --out DIR ...`` trains a
small MLP on data fixed by (step, replica id) until the group has committed N steps, writing
``progress<rank>`` (one line per attempted step: step, replica groups, committed, wall time,
quorum seconds, commit-vote seconds) and at the end ``final<rank>.pt`` (this rank's parameter
shards, DeMo momentum, DiLoCo's global copy, step). Under torchrun's variables (RANK,
WORLD_SIZE, MASTER_ADDR/PORT of the group) a group has several ranks, and FSDP2 shards the model
over them. Choreography options for the tests:
``--die-at K`` kills this process (SIGKILL) in its step K, once in its quorum;
``--hold M:F[,G...]`` (repeatable) waits, bounded, before step M until the files exist;
``--fail-commit K`` (repeatable) makes step K's commit vote fail (a real Manager error) on its
first attempt; ``--optimizer`` is the base optimizer (default SGD, stateless);
``--verbose`` keeps torchft's own logs in full; ``--delay S`` sleeps S seconds in each step
(a slower replica); ``--syncs N`` trains until the DiLoCo pace has taken N syncs (instead of
``--steps``);
``--heal-late`` forms this group's first quorum behind its forward pass (the fallback a group
that torchft heals late takes: it sends zeros and votes no); ``--ready-file F`` is written once
the Manager is up (by rank 0; rank r > 0 writes ``F.r<r>``); ``--save D`` / ``--resume D``:
a checkpoint at the end / to start from. ``--order`` is the loop's order (:data:`ORDERS`);
each step's data comes from ``opt.steps`` where the loop reads it (after ``zero_grad()`` when
that comes first, else before the forward pass), and ``progress`` records the step ``step()``
runs.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

import flexdemo
from flexdemo.dtensor import local_tensor

ORDERS = {
    "zero-first": "zero_grad, forward, backward, step (the default)",
    "forward-zero": "forward, zero_grad, backward, step",
    "zero-last": "forward, backward, step, zero_grad",
    "forward-keep": "forward, zero_grad(set_to_none=False), backward, step",
    "none": "forward, backward, step, p.grad = None by hand (no zero_grad)",
}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 4))


def batch(step: int, replica: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + sum(map(ord, replica)))
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--replica-id", required=True)
    ap.add_argument("--replicator", default="demo")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--min-replicas", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--die-at", type=int, default=-1)
    ap.add_argument("--hold", action="append", default=[])
    ap.add_argument("--fail-commit", type=int, action="append", default=[])
    ap.add_argument("--optimizer", default="sgd")
    ap.add_argument("--heal-late", action="store_true")
    ap.add_argument("--order", default="zero-first", choices=sorted(ORDERS))
    ap.add_argument("--ready-file", default="")
    ap.add_argument("--save", default="", help="save a checkpoint here at the end")
    ap.add_argument("--resume", default="", help="load this checkpoint first")
    ap.add_argument("--verbose", action="store_true", help="torchft's logs in full")
    ap.add_argument("--delay", type=float, default=0.0, help="seconds slept in each step")
    ap.add_argument("--syncs", type=int, default=0, help="train until the pace's Nth sync")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    kwargs = {"demo": {"topk": 4, "chunk": 16}, "full": {},
              "demo-delayed": {"topk": 4, "chunk": 16, "overlap": "delayed"},
              "diloco": {"inner_steps": 3}, "random": {"rate": 1 / 8},
              # replicas of different speeds: quorums at syncs only, counts measured
              "diloco-paced": {"inner_steps": 6, "pace": "adaptive"},
              # streaming: 2 fragments, each sync applied one step after its launch
              "diloco-streaming": {"inner_steps": 4, "fragments": 2, "tau": 1},
              # the int4 mean by reduce-scatter: an all-to-all over the Manager's group
              "diloco-int4-rs": {"inner_steps": 3, "exchange_kwargs": {
                  "values": "int4", "block": 16, "reduce": "scatter"}}}[a.replicator]
    ft = flexdemo.FaultTolerance(lighthouse=a.lighthouse, replica_id=a.replica_id,
                                 min_replicas=a.min_replicas, timeout=a.timeout,
                                 hostname="127.0.0.1", verbose=a.verbose)
    name = a.replicator.split("-")[0]  # demo-delayed: demo; diloco-int4-rs: diloco
    net, opt = flexdemo.prepare(model(), replicator=name, replicator_kwargs=kwargs,
                                optimizer=a.optimizer, lr=0.05, device="cpu",
                                fault_tolerance=ft)
    session = opt.fault_tolerance
    if a.resume:
        flexdemo.load_checkpoint(a.resume, net, opt)
    if a.ready_file:  # rank 0: the file; rank r > 0: the file + ".r<r>" (its quorum waits
        r = int(os.environ.get("RANK", "0"))  # for every rank: hold on all of them)
        Path(a.ready_file + (f".r{r}" if r else "")).write_text("ready\n")
    if a.heal_late:  # its first quorum runs behind the forward pass (as if this group had
        session.begin(heal_now=False)  # started before), so torchft heals it after that pass
    fail_at = set(a.fail_commit)  # each step's vote fails once, at its first attempt
    rank = int(os.environ.get("RANK", "0"))  # several ranks per group: FSDP2 shards
    progress = open(out / f"progress{rank}", "a", buffering=1)
    holds = {int(h.split(":", 1)[0]): h.split(":", 1)[1].split(",") for h in a.hold}
    pace = getattr(opt.replicators[0], "pace", None)

    def more() -> bool:
        return pace.synced < a.syncs if a.syncs else opt.steps < a.steps

    while more():
        hold = holds.pop(opt.steps, [])
        deadline = time.monotonic() + 4 * a.timeout
        while not all(os.path.exists(f) for f in hold):
            if time.monotonic() > deadline:
                print(f"gave up waiting for {hold}", file=sys.stderr)
                return 3
            time.sleep(0.05)
        if hold:
            time.sleep(0.5)  # the other group's heartbeats reach the lighthouse (every 0.1 s)
        if a.order == "zero-first":
            opt.zero_grad()  # the quorum: a joiner heals here, before its forward pass
        step = opt.steps
        if step == a.die_at:
            session.join_quorum()  # in step K's quorum: the others' step K meets it dying
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(step, a.replica_id)
        loss = nn.functional.mse_loss(net(x), y)  # (other orders: a joiner heals before it)
        if a.order in ("forward-zero", "forward-keep"):
            opt.zero_grad(set_to_none=a.order == "forward-zero")
        loss.backward()
        if a.delay:
            time.sleep(a.delay)
        hook = None
        if step in fail_at:
            fail_at.discard(step)  # a real Manager error after the exchange, before the vote
            hook = opt.register_step_post_hook(lambda *_: session.manager.report_error(
                RuntimeError("injected failure")))
        ran = opt.steps  # the step that step() runs (a joiner healed to its peers' step)
        opt.step()
        if hook is not None:
            hook.remove()
        s = opt.last_step_stats()
        progress.write(f"{ran} {s['replicas']} {int(s['committed'])} {time.time():.3f} "
                       f"{s['quorum_seconds']:.4f} {s['commit_seconds']:.4f} "
                       f"{int(s['local'])} {-1 if pace is None else pace.synced}\n")
        if a.order == "zero-last":
            opt.zero_grad()
        elif a.order == "none":
            for p in net.parameters():
                p.grad = None
    state = {"step": opt.steps,  # this rank's shards
             "params": [local_tensor(p).detach().clone()
                        for p in net.parameters()]}
    rep = opt.replicators[0]
    if hasattr(rep, "delta"):
        state["delta"] = [d.clone() for d in rep.delta]
    if hasattr(rep, "buffers"):  # Random, Striding, Slicing: their momenta
        state["buffers"] = [b.clone() for b in rep.buffers]
    state["moments"] = [local_tensor(t).detach().clone()  # the base's state
                        for st in opt.state.values()
                        for t in st.values() if isinstance(t, torch.Tensor)]
    if hasattr(rep, "global_params"):
        state["global"] = [g.clone() for g in rep.global_params]
    if pace is not None:
        state["changes"] = list(pace.changes)
        state["synced"] = pace.synced
    torch.save(state, out / f"final{rank}.pt")
    if a.save:
        flexdemo.save_checkpoint(a.save, net, opt, step=opt.steps)
    session.shutdown()
    return 0


def entry() -> int:
    """``main()``, with flexdemo's one-line errors printed as one line (exit status 2)."""
    from flexdemo.ft import ElasticSession  # noqa: F401 - the session's errors below
    from flexdemo.ft.session import (
        DuplicateReplicaIdError,
        LighthouseUnreachableError,
        QuorumTimeoutError,
        UntrustedPeerError,
    )

    try:
        return main()
    except (LighthouseUnreachableError, QuorumTimeoutError, DuplicateReplicaIdError,
            UntrustedPeerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(entry())
