"""What a sweep of ``flexdemo bench`` found, in words: the table of runs, each strategy
against full sync with its own inner optimizer and against the best full sync, at equal steps
and at equal wall-clock time, and each run's time to a target validation loss (per
bandwidth)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ...strategies import STRATEGIES
from .plots import smooth

__all__ = ["comparison_lines", "default_target", "equal_time_losses", "equal_time_val_losses",
           "format_table", "never_synced_note", "time_to_target", "time_to_target_lines"]


def _fmt(v: Any, spec: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)) or v == "":
        width = int(spec.split(".")[0] or 0)
        return "-".rjust(width)
    return format(v, spec)


def format_table(results: list[dict]) -> str:
    """The printed table: one row per run (the first column as wide as the longest name)."""
    w = max([12, *(len(r["strategy"]) for r in results)])
    head = (f"{'strategy':<{w}} {'link':>9} {'val loss':>9} {'train':>7} {'time s':>7} "
            f"{'step ms':>8} {'compute':>8} {'comm':>7} {'MB/step':>9} {'status':>7}")
    lines = [head, "-" * len(head)]
    def ms(r: dict, key: str) -> float | None:
        return r[key] * 1e3 if isinstance(r.get(key), (int, float)) else None

    for r in results:
        mb = r.get("bytes_sent_per_step")
        lines.append(
            f"{r['strategy']:<{w}} {r['bandwidth']:>9} {_fmt(r.get('val_loss'), '9.4f')} "
            f"{_fmt(r.get('train_loss'), '7.4f')} {_fmt(r.get('train_seconds'), '7.1f')} "
            f"{_fmt(ms(r, 'step_seconds'), '8.0f')} {_fmt(ms(r, 'compute_seconds'), '8.0f')} "
            f"{_fmt(ms(r, 'comm_seconds'), '7.0f')} "
            f"{_fmt(mb / 1e6 if mb is not None else None, '9.4f')} {r['status']:>7}")
    lines.append("val loss: mean over all ranks after the last step; time s: training time "
                 "(evaluation excluded)\nstep ms = compute + comm (per rank, mean); MB/step: "
                 "what a rank sends across nodes per step")
    lines += [note for note in map(never_synced_note, results) if note]
    return "\n".join(lines)


def _interp(x: list[float], y: list[float], at: float) -> float:
    if not x:
        return float("nan")
    if at <= x[0]:
        return y[0]
    for i in range(1, len(x)):
        if x[i] >= at:
            f = (at - x[i - 1]) / max(x[i] - x[i - 1], 1e-12)
            return y[i - 1] + f * (y[i] - y[i - 1])
    return y[-1]


def _at_equal_time(results: list[dict], bandwidth: str, times: str,
                   values: Callable[[dict], list[float]],
                   unseen: float | None = None) -> tuple[float, dict[str, float]]:
    """At one bandwidth: the time every run's curve ``times`` reached (the shortest run's last
    point) and each strategy's ``values(curve)`` then, interpolated linearly; ``unseen`` (when
    given) for a run whose first point comes later."""
    runs = [r for r in results if r["bandwidth"] == bandwidth and r["status"] == "ok"
            and r["curve"].get(times)]
    if not runs:
        return float("nan"), {}
    t = min(r["curve"][times][-1] for r in runs)
    out = {}
    for r in runs:
        c = r["curve"]
        out[r["strategy"]] = (unseen if unseen is not None and c[times][0] > t
                              else _interp(c[times], values(c), t))
    return t, out


def equal_time_losses(results: list[dict], bandwidth: str) -> tuple[float, dict[str, float]]:
    """At one bandwidth: the time all runs reached (the shortest run's training seconds) and
    each strategy's smoothed training loss at that time."""
    return _at_equal_time(results, bandwidth, "train_seconds",
                          lambda c: smooth(c["loss"], max(1, len(c["loss"]) // 10)))


def equal_time_val_losses(results: list[dict], bandwidth: str) -> tuple[float, dict[str, float]]:
    """At one bandwidth: the training time every run's evaluations reached (the shortest run's
    last evaluation) and each strategy's validation loss then, interpolated linearly between
    its evaluations; NaN for a run not evaluated by then."""
    return _at_equal_time(results, bandwidth, "val_seconds", lambda c: c["val_loss"],
                          unseen=float("nan"))


def is_finite(v: Any) -> bool:
    """Whether ``v`` is a finite number (a summary's loss may be null: not finite)."""
    return isinstance(v, (int, float)) and math.isfinite(v)


def _loss(v: float | None) -> str:
    """A loss for the comparison lines; '-' for a run not evaluated by then."""
    return f"{v:.4f}" if v is not None and math.isfinite(v) else "- (no evaluation yet)"


def never_synced_note(r: dict) -> str | None:
    """A note for a run whose strategy synchronises across nodes but sent nothing: a run
    shorter than DiLoCo's ``inner_steps``. Its replicas trained apart, and its step time holds
    no communication, so neither its loss nor its speed compares with a synced run."""
    spec = STRATEGIES.get(r.get("strategy", ""))
    if (spec is None or r.get("status") != "ok" or spec.replicator == "none"
            or r.get("mb_sent_total", 1.0) != 0):
        return None
    every = spec.replicator_kwargs.get("inner_steps")
    why = (f" (it syncs every {every} steps; give train.steps > {every})" if every else "")
    return (f"note: {r['strategy']} @ {r['bandwidth']} never synchronised across nodes in its "
            f"{r.get('steps', '?')} steps{why}: its replicas trained apart and its step time "
            "includes no communication, so its speed and loss do not compare with synced runs")


def _speed(seconds: float | None, reference: float | None) -> str:
    """`` (1.43x faster)``, `` (1.43x slower)``, `` (the same)``, or nothing when a time is
    missing."""
    if not seconds or not reference:
        return ""
    ratio = reference / seconds
    if f"{max(ratio, 1 / ratio):.2f}" == "1.00":
        return " (the same)"
    return f" ({ratio:.2f}x faster)" if ratio > 1 else f" ({1 / ratio:.2f}x slower)"


def _is_full_sync(name: str) -> bool:
    spec = STRATEGIES.get(name)
    return spec is not None and spec.replicator == "full"


def _comparison(r: dict, ref: dict, bw: str, equal_time: tuple[float, dict[str, float]],
                equal_val: tuple[float, dict[str, float]], why: str | None = None) -> list[str]:
    """One run ``r`` against the run ``ref``: validation loss at equal steps, step time, and
    the losses at equal wall-clock time; ``why`` (a line under the heading) says why that
    reference."""
    (t, at_t), (tv, val_t) = equal_time, equal_val
    name, reference = r["strategy"], ref["strategy"]
    rel = 100 * (r["val_loss"] - ref["val_loss"]) / ref["val_loss"]
    speed = _speed(r.get("step_seconds"), ref.get("step_seconds"))
    lines = [f"{name} vs {reference} @ {bw}:"]
    lines += [f"  {note}" for note in (why, never_synced_note(r)) if note]
    return lines + [
        f"  at equal steps: val loss {r['val_loss']:.4f} vs {ref['val_loss']:.4f} "
        f"({rel:+.1f}%)",
        f"  step time:      {r['step_seconds'] * 1e3:.0f} ms vs "
        f"{ref['step_seconds'] * 1e3:.0f} ms{speed}",
        f"  at equal time:  train loss {at_t.get(name, float('nan')):.4f} vs "
        f"{at_t.get(reference, float('nan')):.4f} after {t:.0f} s (smoothed)",
        f"                  val loss {_loss(val_t.get(name))} vs "
        f"{_loss(val_t.get(reference))} after {tv:.0f} s (between evaluations)"]


def comparison_lines(results: list[dict], reference: str | None = None,
                     only: set[str] | None = None) -> list[str]:
    """Each finished run (or those in ``only``) against full sync, per bandwidth: validation
    loss at equal steps and training loss at equal wall-clock time.

    Without ``reference``, a run is compared first against the full-sync run (replicator
    ``"full"``) whose inner optimizer is its own (``hsdp-muon`` for a Muon strategy,
    ``hsdp-adamw`` for an AdamW one), then against the best full sync of that bandwidth (the
    lowest final validation loss) where that is another; a run whose optimizer has no
    full-sync run there only against the best, with a line that says so; a full-sync run
    against the best unless it is the best. With ``reference``: every run against that
    strategy's run alone."""
    lines: list[str] = []
    for bw in dict.fromkeys(r["bandwidth"] for r in results):
        ok = [r for r in results if r["bandwidth"] == bw and r["status"] == "ok"
              and is_finite(r.get("val_loss"))]
        shown = [r for r in ok if only is None or r["strategy"] in only]
        if reference is not None:
            refs = [r for r in ok if r["strategy"] == reference]
            full = refs[:1]
        else:
            full = [r for r in ok if _is_full_sync(r["strategy"])]
        if not full:
            continue
        times = equal_time_losses(results, bw), equal_time_val_losses(results, bw)
        best = min(full, key=lambda r: r["val_loss"])  # ties: the first that ran
        for r in shown:
            if r is best:
                continue
            if reference is not None:
                lines += _comparison(r, best, bw, *times)
                continue
            also = f"against the best full sync in this run, {best['strategy']}"
            if _is_full_sync(r["strategy"]):  # another full sync: against the best only
                lines += _comparison(r, best, bw, *times, why=also)
                continue
            spec = STRATEGIES.get(r["strategy"])
            optimizer = spec.optimizer if spec is not None else None
            own = next((f for f in full if STRATEGIES[f["strategy"]].optimizer == optimizer),
                       None)
            if own is None:
                lines += _comparison(
                    r, best, bw, *times,
                    why=f"no full sync with {optimizer or 'its optimizer'} in this run: "
                        f"against the best full sync, {best['strategy']}")
                continue
            lines += _comparison(r, own, bw, *times)
            if own is not best:
                lines += _comparison(r, best, bw, *times, why=also)
    return lines


def time_to_target(curve: dict, target: float) -> float | None:
    """Training seconds at which the validation loss first reached ``target`` (linear between
    the evaluation before and the one that reached it), or None when none did."""
    seconds, losses = curve.get("val_seconds", []), curve.get("val_loss", [])
    prev: tuple[float, float] | None = None
    for t, v in zip(seconds, losses):
        if not math.isfinite(v):
            prev = None
            continue
        if v <= target:
            if prev is None or prev[1] == v:
                return float(t)
            t0, v0 = prev
            return float(t0 + (t - t0) * (v0 - target) / (v0 - v))
        prev = (t, v)
    return None


def _best(r: dict) -> float:
    vals = [v for v in r.get("curve", {}).get("val_loss", []) if math.isfinite(v)]
    return min(vals) if vals else math.inf


def default_target(runs: list[dict], within: float = 0.05) -> float | None:
    """The loosest loss every competitive run reached: the highest of the lowest validation
    losses of the runs whose lowest is within ``within`` (5%) of the best run's (a run far
    behind would make the target one that every run reaches in its first steps). None
    without a finished run with an evaluation."""
    best = [_best(r) for r in runs if r.get("status") == "ok"]
    best = [b for b in best if math.isfinite(b)]
    if not best:
        return None
    return max(b for b in best if b <= min(best) * (1 + within))


def time_to_target_lines(results: list[dict], reference: str = "auto",
                         target: float | None = None) -> list[str]:
    """Per bandwidth: the target (``target``, else :func:`default_target`), every finished
    run's time to reach it, and ``reference`` against the fastest other run."""
    lines: list[str] = []
    for bw in dict.fromkeys(r["bandwidth"] for r in results):
        runs = [r for r in results if r["bandwidth"] == bw and r.get("status") == "ok"]
        goal = target if target is not None else default_target(runs)
        if goal is None:
            continue
        times = {r["strategy"]: time_to_target(r["curve"], goal) for r in runs}
        cells = ", ".join(f"{name} {'never' if t is None else f'{t:.1f} s'}"
                          for name, t in times.items())
        lines.append(f"time to val loss {goal:.4f} @ {bw}: {cells}")
        mine = times.get(reference)
        others = {n: t for n, t in times.items() if n != reference and t is not None}
        if reference in times and others:
            name, best = min(others.items(), key=lambda kv: kv[1])
            if mine is None:
                lines.append(f"  {reference}: did not reach it; {name} did in {best:.1f} s")
            else:
                lines.append(f"  {reference} {mine:.1f} s vs the fastest fixed strategy ({name}) "
                             f"{best:.1f} s: {100 * (mine - best) / best:+.1f}% time")
    return lines


def retune_cost_lines(results: list[dict], reference: str = "auto") -> list[str]:
    """Per run of ``reference``: each retune's own time (the agreed check, the new choice and
    the hand-over, as that run's rank 0 measured it) against the run's mean step time (the
    target: at most one step)."""
    lines = []
    for r in results:
        if r.get("strategy") != reference or r.get("status") != "ok":
            continue
        step = r.get("step_seconds") or 0.0
        for h in r.get("auto_retune_seconds", []):
            share = (f"{h['seconds'] / step:.2f} of a step of {step * 1e3:.0f} ms" if step > 0
                     else "no step time")
            lines.append(f"{reference} @ {r['bandwidth']}: the retune at step {h.get('step')} "
                         f"took {h['seconds'] * 1e3:.1f} ms ({share})")
    return lines
