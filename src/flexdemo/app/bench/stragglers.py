"""What ``flexdemo bench --preset stragglers`` found: replicas of different speeds (issue 55).

One node is slowed (``train.slowdown`` on its ranks: each step lasts ``factor`` times its
compute), and each strategy runs synchronously and with its remedy: a DiLoCo pace (each
replica syncs after its own inner steps, measured once: ``-paced``, or at every sync:
``-adaptive``; each replica's period ended on its own clock: ``-timed``, or the faster replicas
filling the slowest one's: ``-fill``; such a run lasts until it has trained on the synchronous
run's tokens, ``train.pace_budget = "tokens"``) or balanced batches (each replica's batch sized
to its speed, the exchange weighted by tokens, ``-balanced``). Per run
(:func:`run_figures`):

* **goodput**: the job's tokens per second (every rank's tokens over the job's training
  seconds, the longest rank's) divided by the sum of the replicas' own speeds (each rank's
  tokens per second of compute alone: its tokens per step over its compute seconds per
  step, which exclude the time it waits for the others). 1 means no rank ever waited; a
  synchronous run with one of four replicas three times slower is near ``4 / (3 x 3 + 1) =
  0.4``.
* against the synchronous run of the same strategy (:func:`comparison`): the **time to its
  final validation loss** (:func:`time_to_loss`, interpolated between evaluations) and the
  **validation loss at equal tokens** (:func:`value_at`, both curves interpolated at the
  smaller of the two runs' final token counts: a paced run ends at the first sync past the
  synchronous run's tokens).

Pure functions of the results (``curve`` holds the evaluations' ``val_seconds``,
``val_loss`` and ``val_tokens``; the summary's ``per_rank`` each rank's steps, tokens,
compute seconds per step and training seconds).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["REMEDIES", "comparison", "goodput", "partner", "replica_speeds",
           "run_figures", "slow_label", "straggler_lines", "straggler_table", "time_to_loss",
           "value_at"]

REMEDIES = ("-paced", "-adaptive", "-timed", "-fill", "-fill-overlap", "-balanced")
"""The suffixes of a strategy's variant for replicas of different speeds."""


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def partner(name: str) -> str | None:
    """The synchronous strategy a ``-paced``, ``-adaptive``, ``-timed``, ``-fill``,
    ``-fill-overlap`` or ``-balanced`` one is the variant of."""
    for suffix in REMEDIES:
        if name.endswith(suffix) and name[:-len(suffix)]:
            return name[:-len(suffix)]
    return None


def replica_speeds(run: dict) -> list[float] | None:
    """Each rank's tokens per second of compute alone (its tokens per step over its compute
    seconds per step), or None without per-rank figures."""
    per = run.get("per_rank") or {}
    steps, tokens, compute = per.get("steps_this_run"), per.get("tokens"), per.get(
        "compute_seconds")
    if not steps or not tokens or not compute or not (len(steps) == len(tokens) == len(compute)):
        return None
    out = []
    for n, t, c in zip(steps, tokens, compute):
        if not (n and _finite(c) and c > 0):
            return None
        out.append(t / n / c)
    return out


def goodput(run: dict) -> float | None:
    """The job's tokens per second over the sum of :func:`replica_speeds` (None when a
    figure is missing)."""
    speeds = replica_speeds(run)
    seconds = max((run.get("per_rank") or {}).get("train_seconds") or [0.0])
    if speeds is None or not seconds > 0:
        return None
    return sum(run["per_rank"]["tokens"]) / seconds / sum(speeds)


def run_figures(run: dict) -> dict[str, Any]:
    """A run's own figures: ``tokens`` (every rank's), ``job_seconds`` (the longest rank's
    training seconds), ``tokens_per_second``, ``replica_speeds`` and ``goodput``."""
    per = run.get("per_rank") or {}
    tokens = sum(per.get("tokens") or [0])
    seconds = max(per.get("train_seconds") or [0.0])
    return {"tokens": tokens, "job_seconds": seconds,
            "tokens_per_second": tokens / seconds if seconds > 0 else None,
            "replica_speeds": replica_speeds(run), "goodput": goodput(run)}


def time_to_loss(seconds: list[float], losses: list[float], target: float) -> float | None:
    """When a validation curve first reaches ``target`` (at or below), interpolated linearly
    between the evaluations around it; the first evaluation's time when that one is already
    there; None when it never is."""
    points = [(t, v) for t, v in zip(seconds, losses) if _finite(t) and _finite(v)]
    for i, (t, v) in enumerate(points):
        if v <= target:
            if i == 0:
                return t
            t0, v0 = points[i - 1]
            return t0 + (t - t0) * (v0 - target) / (v0 - v)
    return None


def value_at(xs: list[float], ys: list[float], x: float) -> float | None:
    """``ys`` interpolated linearly at ``x`` (None outside ``xs``' range, which rises)."""
    points = [(a, b) for a, b in zip(xs, ys) if _finite(a) and _finite(b)]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    if points and points[-1][0] == x:
        return points[-1][1]
    return None


def comparison(run: dict, ref: dict) -> dict[str, Any]:
    """``run`` (a remedy) against ``ref`` (its synchronous run): the target (``ref``'s final
    validation loss) and each one's time to it; where ``run`` ended above it, also each one's
    time to ``run``'s own final loss (``own_final``); and the tokens both reached with each
    one's validation loss there."""
    c, r = run.get("curve") or {}, ref.get("curve") or {}

    def times(goal: Any) -> tuple[float | None, float | None]:
        if not _finite(goal):
            return None, None
        return (time_to_loss(c.get("val_seconds", []), c.get("val_loss", []), float(goal)),
                time_to_loss(r.get("val_seconds", []), r.get("val_loss", []), float(goal)))

    target: Any = ref.get("val_loss")
    final: Any = run.get("val_loss")
    out: dict[str, Any] = {"strategy": run["strategy"], "reference": ref["strategy"],
                           "target": target, "equal_tokens": None,
                           "val_loss_at_equal_tokens": None,
                           "reference_val_loss_at_equal_tokens": None}
    out["time_to_target"], out["reference_time_to_target"] = times(target)
    own = _finite(final) and _finite(target) and final > target
    out["own_final"] = final if own else None
    out["time_to_own_final"], out["reference_time_to_own_final"] = times(out["own_final"])
    ends = [curve["val_tokens"][-1] for curve in (c, r)
            if curve.get("val_tokens") and _finite(curve["val_tokens"][-1])]
    if len(ends) == 2:
        at = min(ends)
        out["equal_tokens"] = at
        out["val_loss_at_equal_tokens"] = value_at(c["val_tokens"], c["val_loss"], at)
        out["reference_val_loss_at_equal_tokens"] = value_at(r["val_tokens"], r["val_loss"],
                                                             at)
    return out


def _fmt(v: Any, spec: str, none: str = "-") -> str:
    return format(v, spec) if _finite(v) else none


def straggler_table(results: list[dict]) -> str:
    """One row per run: validation loss, tokens, the job's seconds, tokens per second,
    goodput, and each rank's steps and batch."""
    w = max([12, *(len(r["strategy"]) for r in results)])
    head = (f"{'strategy':<{w}} {'link':>9} {'val loss':>9} {'tokens':>10} {'job s':>7} "
            f"{'tok/s':>8} {'goodput':>8}  steps per rank / batch")
    lines = [head, "-" * len(head)]
    for r in results:
        f = run_figures(r)
        per = r.get("per_rank") or {}
        ok = r.get("status") == "ok"
        ranks = (f"{'/'.join(map(str, per.get('steps', [])))} / "
                 f"{'/'.join(map(str, per.get('batch', [])))}" if ok and per else "failed")
        lines.append(
            f"{r['strategy']:<{w}} {r['bandwidth']:>9} {_fmt(r.get('val_loss'), '9.4f'):>9} "
            f"{f['tokens'] if ok else '-':>10} {_fmt(f['job_seconds'] if ok else None, '7.1f'):>7} "
            f"{_fmt(f['tokens_per_second'], '8.0f'):>8} {_fmt(f['goodput'], '8.2f'):>8}  {ranks}")
    return "\n".join(lines)


def _secs(v: Any, none: str = "not reached") -> str:
    return f"{v:.1f} s" if _finite(v) else none


def _sooner(t: Any, tr: Any) -> str:
    """`` (2.00x sooner)`` / `` (1.50x later)`` for time ``t`` against ``tr``."""
    if not (_finite(t) and _finite(tr) and t > 0 and tr > 0) or t == tr:
        return ""
    return f" ({tr / t:.2f}x sooner)" if tr > t else f" ({t / tr:.2f}x later)"


def straggler_lines(results: list[dict], slow: str = "") -> list[str]:
    """Each remedy against its synchronous run, per bandwidth (``slow``: what was slowed, for
    the headings)."""
    lines: list[str] = []
    ok = [r for r in results if r.get("status") == "ok"]
    for run in ok:
        base = partner(run["strategy"])
        ref = next((r for r in ok if r["strategy"] == base
                    and r["bandwidth"] == run["bandwidth"]), None)
        if ref is None:
            continue
        c = comparison(run, ref)
        lines.append(f"{run['strategy']} vs {ref['strategy']} @ {run['bandwidth']}"
                     + (f" ({slow})" if slow else "") + ":")
        lines.append(f"  goodput:          {_fmt(goodput(run), '.2f')} vs "
                     f"{_fmt(goodput(ref), '.2f')} (the job's tokens per second over the sum "
                     "of the replicas' own)")
        if _finite(c["target"]):
            t, tr = c["time_to_target"], c["reference_time_to_target"]
            never = "not reached" + (f" (final {c['own_final']:.4f})" if c["own_final"] else "")
            lines.append(f"  time to {c['target']:.4f}:  {_secs(t, never)} vs {_secs(tr)}"
                         f"{_sooner(t, tr)} ({ref['strategy']}'s final validation loss)")
        if c["own_final"] is not None:
            t, tr = c["time_to_own_final"], c["reference_time_to_own_final"]
            lines.append(f"  time to {c['own_final']:.4f}:  {_secs(t)} vs {_secs(tr)}"
                         f"{_sooner(t, tr)} ({run['strategy']}'s final validation loss)")
        a, b = c["val_loss_at_equal_tokens"], c["reference_val_loss_at_equal_tokens"]
        if c["equal_tokens"] is not None and _finite(a) and _finite(b):
            lines.append(f"  at equal tokens:  val loss {a:.4f} vs {b:.4f} "
                         f"({100 * (a - b) / b:+.1f}%) at {int(c['equal_tokens']):,} tokens")
        else:
            lines.append("  at equal tokens:  - (the curves share no token count)")
    return lines


def slow_label(factor: float, node: int | None) -> str:
    """``node 3 slowed 3x`` (empty when nothing is slowed)."""
    if factor == 1.0 or node is None:
        return ""
    return f"node {node} slowed {factor:g}x"
