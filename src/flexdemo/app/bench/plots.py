"""Plots of a bench sweep (matplotlib, Agg backend: no display needed).

* ``loss_vs_time.png``: training loss (smoothed) against training seconds, one panel per
  bandwidth; dots mark the validation loss at the evaluation steps;
* ``loss_vs_bytes.png``: the same losses against the megabytes a rank has sent across nodes
  (log scale; a strategy that sends nothing is named in the title);
* ``step_time.png``: mean step time per run, split into compute and communication;
* ``val_loss_vs_time.png`` (replicas of different speeds, :func:`plot_val_loss_vs_time`): the
  validation loss against training seconds, each remedy dashed next to its synchronous run,
  whose final loss is a dotted line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...strategies import STRATEGIES
from .stragglers import partner

__all__ = ["plot_all", "plot_loss_vs_bytes", "plot_loss_vs_time", "plot_step_time",
           "plot_val_loss_vs_time", "smooth"]

FALLBACK = ["#8c564b", "#e377c2", "#bcbd22", "#17becf", "#ff7f0e"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _color(name: str, order: list[str]) -> str:
    spec = STRATEGIES.get(name)
    if spec is not None and spec.color:
        return spec.color
    return FALLBACK[order.index(name) % len(FALLBACK)]


def _ok(results: list[dict]) -> list[dict]:
    return [r for r in results if r.get("status") == "ok" and r["curve"]["step"]]


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` points."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _smooth(values: list[float]) -> list[float]:
    return smooth(values, max(1, len(values) // 15))


def _title(results: list[dict]) -> str:
    r = results[0]
    mesh = f"{r.get('nodes', '?')} nodes x {r.get('ranks_per_node', '?')} ranks"
    return (f"{r.get('task', '?')}/{r.get('model', '?')} ({r.get('params', 0) / 1e6:.2f}M "
            f"params), {mesh}, {r.get('steps', '?')} steps")


def _bandwidths(results: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["bandwidth"] for r in results))


def plot_loss_vs_time(results: list[dict], path: str | Path) -> Path:
    """Training loss against training seconds, one panel per bandwidth."""
    plt = _pyplot()
    runs = _ok(results)
    bws = _bandwidths(runs)
    order = list(dict.fromkeys(r["strategy"] for r in runs))
    fig, axes = plt.subplots(1, len(bws), figsize=(max(7.0, 5.2 * len(bws) + 0.6), 4.6),
                             sharey=True, squeeze=False)
    for ax, bw in zip(axes[0], bws):
        for r in (r for r in runs if r["bandwidth"] == bw):
            c, col = r["curve"], _color(r["strategy"], order)
            ax.plot(c["train_seconds"], _smooth(c["loss"]), color=col, lw=1.8,
                    label=r["strategy"])
            if c["val_loss"]:
                ax.plot(c["val_seconds"], c["val_loss"], "o", color=col, ms=5,
                        markeredgecolor="white")
            change = r.get("link_change") or {}
            if change.get("train_seconds") is not None:  # a link that changed during the run
                ax.axvline(change["train_seconds"], color=col, ls=":", lw=1)
        ax.set_title("loopback, no shaping" if bw == "unshaped" else f"links of {bw}",
                     fontsize=11)
        ax.set_xlabel("training time (s, evaluation excluded)")
        ax.grid(alpha=0.3)
        ax.set_xlim(left=0)
    axes[0][0].set_ylabel("loss")
    _zoom(axes[0][0], runs)
    _legend(axes[0][0])
    fig.suptitle(f"Loss vs wall-clock time: {_title(runs)}", fontsize=11)
    fig.tight_layout()
    return _save(fig, path, plt)


def plot_loss_vs_bytes(results: list[dict], path: str | Path) -> Path:
    """Training loss against cumulative megabytes sent per rank (the first bandwidth's runs;
    bytes do not depend on the bandwidth)."""
    plt = _pyplot()
    runs = _ok(results)
    bws = _bandwidths(runs)
    runs = [r for r in runs if r["bandwidth"] == bws[0]] if bws else []
    order = list(dict.fromkeys(r["strategy"] for r in runs))
    fig, ax = plt.subplots(figsize=(8.2, 4.4))
    silent = []
    for r in runs:
        c, col = r["curve"], _color(r["strategy"], order)
        pts = [(b / 1e6, v) for b, v in zip(c["bytes_sent_total"], _smooth(c["loss"])) if b > 0]
        if not pts:
            silent.append(r["strategy"])
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=col, lw=1.8,
                label=r["strategy"])
        vals = [(b / 1e6, v) for b, v in zip(c["val_bytes"], c["val_loss"]) if b > 0]
        if vals:
            ax.plot([p[0] for p in vals], [p[1] for p in vals], "o", color=col, ms=5,
                    markeredgecolor="white")
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    lo, hi = ax.get_xlim()
    subs = (1.0, 2.0, 5.0) if hi / max(lo, 1e-12) < 300 else (1.0,)
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("MB sent per rank across nodes (cumulative, log scale)")
    ax.set_ylabel("loss")
    _zoom(ax, runs)
    ax.grid(alpha=0.3, which="both")
    from matplotlib.lines import Line2D

    _legend(ax, [Line2D([], [], color=_color(n, order), lw=1.8, ls=":",
                        label=f"{n}: sends nothing") for n in silent], outside=True)
    ax.set_title(f"Loss vs bytes sent: {_title(runs)}" if runs else "Loss vs bytes sent",
                 fontsize=10)
    fig.tight_layout()
    return _save(fig, path, plt)


def plot_step_time(results: list[dict], path: str | Path) -> Path:
    """Mean step time of every run as a stacked bar (compute below, communication above), one
    panel per bandwidth, each with its own scale."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    runs = [r for r in results if r.get("status") == "ok" and "step_seconds" in r]
    bws = _bandwidths(runs) or ["-"]
    order = list(dict.fromkeys(r["strategy"] for r in runs))
    width = max(7.0, len(bws) * (0.75 * len(order) + 1.6))
    fig, axes = plt.subplots(1, len(bws), figsize=(width, 4.6), squeeze=False)
    for ax, bw in zip(axes[0], bws):
        these = [r for r in runs if r["bandwidth"] == bw]
        top = max((r["step_seconds"] * 1e3 for r in these), default=1.0)
        for x, r in enumerate(these):
            compute, comm = r["compute_seconds"] * 1e3, r["comm_seconds"] * 1e3
            col = _color(r["strategy"], order)
            ax.bar(x, compute, 0.75, color=col, alpha=0.35, edgecolor=col)
            ax.bar(x, comm, 0.75, bottom=compute, color=col, edgecolor=col)
            ax.text(x, compute + comm + top * 0.01, f"{compute + comm:.0f}", ha="center",
                    va="bottom", fontsize=8)
        ax.set_xticks(range(len(these)), [r["strategy"] for r in these], rotation=20,
                      ha="right", fontsize=8)
        ax.set_xlim(-0.6, max(len(these), 1) - 0.4)
        ax.set_ylim(0, top * 1.3)
        ax.grid(alpha=0.3, axis="y")
        ax.set_title("loopback, no shaping" if bw == "unshaped" else f"links of {bw}",
                     fontsize=11)
    axes[0][0].set_ylabel("mean step time per rank (ms)")
    fig.legend(handles=[Patch(facecolor="#999999", alpha=0.35, edgecolor="#555555",
                              label="compute (light; incl. FSDP inside a node)"),
                        Patch(facecolor="#555555", edgecolor="#555555",
                              label="communication across nodes (solid)")],
               fontsize=8, frameon=False, loc="lower center", ncol=2)
    fig.suptitle(f"Step time: {_title(runs)}" if runs else "Step time", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return _save(fig, path, plt)


def plot_val_loss_vs_time(results: list[dict], path: str | Path) -> Path:
    """Validation loss against training seconds (the job's, at each evaluation), one panel
    per bandwidth: a synchronous run solid, its ``-paced``, ``-adaptive`` or ``-balanced``
    remedy dashed in its own colour, and a dotted line at each synchronous run's final loss."""
    plt = _pyplot()
    runs = [r for r in _ok(results) if r["curve"].get("val_loss")]
    bws = _bandwidths(runs) or ["-"]
    order = list(dict.fromkeys(r["strategy"] for r in runs))
    fig, axes = plt.subplots(1, len(bws), figsize=(max(7.0, 5.6 * len(bws) + 1.8), 4.6),
                             sharey=True, squeeze=False)
    for ax, bw in zip(axes[0], bws):
        these = [r for r in runs if r["bandwidth"] == bw]
        names = {r["strategy"] for r in these}
        for r in these:
            c, col = r["curve"], _color(r["strategy"], order)
            remedy = partner(r["strategy"]) is not None
            ax.plot(c["val_seconds"], c["val_loss"], "--" if remedy else "-", color=col,
                    lw=1.8, marker="o", ms=4, label=r["strategy"])
            if not remedy and any(partner(n) == r["strategy"] for n in names):
                ax.axhline(c["val_loss"][-1], color=col, ls=":", lw=1)
        ax.set_title("loopback, no shaping" if bw == "unshaped" else f"links of {bw}",
                     fontsize=11)
        ax.set_xlabel("training time (s, evaluation excluded)")
        ax.grid(alpha=0.3)
        ax.set_xlim(left=0)
    axes[0][0].set_ylabel("validation loss")
    axes[0][-1].legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    title = f"Validation loss vs time: {_title(runs)}" if runs else "Validation loss vs time"
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return _save(fig, path, plt)


def _zoom(ax: Any, runs: list[dict]) -> None:
    """Show the loss from a tenth of the way in: the first steps' drop from log(vocabulary)
    would squeeze the part where the strategies differ."""
    tops, lows = [], []
    for r in runs:
        smooth = _smooth(r["curve"]["loss"])
        if len(smooth) >= 20:
            tops.append(smooth[len(smooth) // 10])
        lows.append(min(smooth + list(r["curve"]["val_loss"])))
    if tops and lows:
        top, low = max(tops), min(lows)
        pad = 0.05 * (top - low) if top > low else 0.1
        ax.set_ylim(low - pad, top + pad)
        ax.set_ylabel("loss (the first tenth of the run is above the top)")


def _legend(ax: Any, extra: list | None = None, outside: bool = False) -> None:
    """One entry per strategy, then what lines and dots mean."""
    from matplotlib.lines import Line2D

    handles, _ = ax.get_legend_handles_labels()
    handles += list(extra or [])
    handles += [Line2D([], [], color="#444444", lw=1.8, label="training loss (smoothed)"),
                Line2D([], [], color="#444444", marker="o", ls="", ms=5,
                       markeredgecolor="white", label="validation loss")]
    where = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0)} if outside else {}
    ax.legend(handles=handles, fontsize=8, frameon=False, **where)


def _save(fig: Any, path: str | Path, plt: Any) -> Path:
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_all(results: list[dict], out: str | Path) -> list[Path]:
    """All three plots into folder ``out``; returns their paths."""
    out = Path(out)
    if not _ok(results):
        return []
    out.mkdir(parents=True, exist_ok=True)
    return [plot_loss_vs_time(results, out / "loss_vs_time.png"),
            plot_loss_vs_bytes(results, out / "loss_vs_bytes.png"),
            plot_step_time(results, out / "step_time.png")]
