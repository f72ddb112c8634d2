"""What the run secret costs: the work it adds per step, per new quorum and per heal.

With a secret (docs/security.md) an elastic run does three things it did not do before:

- **every quorum** (every step): each group checks every member's tag, one HMAC-SHA256 each
  (:func:`flexdemo.ft.membership.check_members`);
- **every new quorum** (a group joined or left): each member writes a MAC over the quorum's
  store prefix and reads and checks the others' (:func:`~flexdemo.ft.membership.prove_members`),
  here over a real TCPStore on loopback with one thread per member;
- **every heal**: the server hashes the payload it sends and the joiner hashes what it
  received (SHA-256 of the serialised state), beside ``torch.save`` / ``torch.load`` of it.

Start-up and liveness verdicts are signed once per run, not per step. Prints a table and
writes ``security.json``; the per-step figure is set against a step time (``--step-ms``,
default the main job's FlexDeMo step at 100 Mbit/s, 324 ms)::

    python benchmarks/bench_security.py
    python benchmarks/bench_security.py --members 2,4,16,64 --heal-mparams 11
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from flexdemo.ft.membership import check_members, prove_members, tag_replica_id
from flexdemo.secret import RunSecret

SECRET = RunSecret("bench-secret-of-32-characters-ok")


def per_step(members: int, repeat: int) -> float:
    """Microseconds of one quorum's membership check with ``members`` groups."""
    ids = [tag_replica_id(f"node{i}", SECRET) + ":uuid" for i in range(members)]
    check_members(ids, SECRET, "node0", "http://lh")
    t0 = time.perf_counter()
    for _ in range(repeat):
        check_members(ids, SECRET, "node0", "http://lh")
    return (time.perf_counter() - t0) / repeat * 1e6


def per_quorum(members: int, repeat: int) -> float:
    """Milliseconds of one new quorum's proofs: every member (a thread) writes its proof and
    checks the others' through one TCPStore on loopback."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    tagged = [tag_replica_id(f"node{i}", SECRET) for i in range(members)]
    ids = [t + ":uuid" for t in tagged]
    clients = [dist.TCPStore("127.0.0.1", server.port, is_master=False,
                             timeout=timedelta(seconds=30)) for _ in range(members)]
    times = []
    for q in range(repeat):
        scope = f"q{q}"
        stores = [dist.PrefixStore(scope, c) for c in clients]
        threads = [threading.Thread(target=prove_members,
                                    args=(stores[r], SECRET, tagged[r], scope, r, members, ids,
                                          f"node{r}")) for r in range(members)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def per_heal(mparams: float) -> dict:
    """Seconds to serialise, hash (both ends) and load a heal state of ``mparams`` million
    fp32 parameters with two AdamW moments (3 tensors of that size)."""
    n = int(mparams * 1e6)
    state = {"params": [torch.randn(n)], "base": {"exp_avg": torch.randn(n),
                                                 "exp_avg_sq": torch.rand(n)}}
    t0 = time.perf_counter()
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    save = time.perf_counter() - t0
    t0 = time.perf_counter()
    digest = hashlib.sha256(payload).hexdigest()
    SECRET.mac("heal-state", 1, "nonce", digest)
    mac = time.perf_counter() - t0
    t0 = time.perf_counter()
    torch.load(io.BytesIO(payload), weights_only=True)
    load = time.perf_counter() - t0
    return {"mparams": mparams, "megabytes": len(payload) / 1e6, "save_s": save, "load_s": load,
            "mac_s_each_end": mac, "mac_share": 2 * mac / (save + load + 2 * mac)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", default="2,4,16", help="replica groups per quorum")
    ap.add_argument("--heal-mparams", type=float, default=11.0,
                    help="million parameters of the healed model (default: the 10.9M GPT)")
    ap.add_argument("--step-ms", type=float, default=324.0,
                    help="the step time to set the per-step cost against (ms)")
    ap.add_argument("--repeat", type=int, default=2000)
    ap.add_argument("--out", default="runs/bench_security")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for m in [int(x) for x in a.members.split(",")]:
        step_us = per_step(m, a.repeat)
        quorum_ms = per_quorum(m, max(3, a.repeat // 200))
        rows.append({"members": m, "per_step_us": step_us,
                     "per_step_share": step_us / 1e3 / a.step_ms, "per_new_quorum_ms": quorum_ms})
    heal = per_heal(a.heal_mparams)
    share = f"of a {a.step_ms:g} ms step"
    print(f"{'groups':>6} {'per step (us)':>14} {share:>16} {'per new quorum (ms)':>20}")
    for r in rows:
        print(f"{r['members']:>6} {r['per_step_us']:>14.1f} {r['per_step_share']:>16.5%} "
              f"{r['per_new_quorum_ms']:>20.2f}")
    print(f"heal of {heal['mparams']:g}M parameters ({heal['megabytes']:.0f} MB): save "
          f"{heal['save_s']:.3f} s, load {heal['load_s']:.3f} s, MAC "
          f"{heal['mac_s_each_end']:.3f} s at each end ({heal['mac_share']:.0%} of the heal's "
          "CPU work; the transfer itself, 11 s at 100 Mbit/s, is not counted)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"step_ms": a.step_ms, "quorums": rows, "heal": heal,
              "torch": torch.__version__}
    (out / "security.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'security.json'}")
    return result


if __name__ == "__main__":
    main()
