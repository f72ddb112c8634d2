"""Tables and plots of ``gpu_evidence.py``, from its result alone (``evidence.json``): the
step-cost and memory tables, the quality table, and ``step_cost.png``, ``memory.png`` and
``quality_loss.png`` (skipped, in one line, without matplotlib)."""

from __future__ import annotations

import math
from pathlib import Path


def md_table(head: list[str], rows: list[list[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _cell(rows: list[dict], model: str, layout: str, key: str) -> dict | None:
    """The row of one model, layout and strategy (None: not reached)."""
    return next((r for r in rows if (r["model"], r["layout"], r["strategy"])
                 == (model, layout, key)), None)


def step_tables(part: dict, env: str) -> tuple[str, str]:
    """The step-cost and the memory tables (markdown) of the result's ``step_cost`` part."""
    strategies, layouts = part["strategies"], part["layouts"]
    step, mem = [f"# Step cost\n\n{env}. One process is one replica: nothing is sent; the step "
                 "is the optimizer's own compute (replicator + base optimizer). ms: median "
                 "step; mean: over the timed steps (a DiLoCo strategy's include one sync). On "
                 "1/8 rows Muon orthogonalises each row slice (FSDP2's Muon gathers whole "
                 "matrices over the fast link instead).\n"], \
        [f"# Peak memory\n\n{env}. P = fp32 bytes of the layout's parameters. state and ws: "
         "the optimizer's persistent state and the buffers its replicators keep besides it "
         "(`memory_stats()`, exact on any device); held: what the optimizer keeps after its "
         "steps (state, replicator buffers, graph pools); peak: the most allocated during the "
         "steps, both above the parameters and gradients (CUDA allocator).\n"]
    for m in part["models"]:
        fb = (f"forward+backward {m['fwd_bwd_ms']:.1f} ms (batch {m['batch']} x "
              f"{m['seq_len']})")
        head = [f"{m['model']} ({m['params'] / 1e6:.1f}M), 1 replica"]
        srows, mrows = [], []
        for key, token in strategies.items():
            sr, mr = [f"{key} (`{token}`)"], [f"{key} (`{token}`)"]
            for layout in layouts:
                r = _cell(part["rows"], m["model"], layout, key)
                if r is None or "error" in r:
                    why = "not reached" if r is None else f"error: {r['error'][:60]}"
                    sr += [why, "", ""]
                    mr += [why, "", "", ""]
                    continue
                sr += [f"{r['ms_median']:.2f}", f"{r['pct_fwd_bwd']:.1f}%",
                       f"{r['ms_mean']:.2f} ({r['steps_timed']})"]
                mr += [f"{r['state_P']:.2f}", f"{r['workspace_P']:.2f}"]
                mr += ([f"{r['held_P']:.2f}", f"{r['peak_P']:.2f}"] if "peak_P" in r
                       else ["n/a (CPU)", "n/a (CPU)"])
            srows.append(sr)
            mrows.append(mr)
        shead = head + [x for lay in layouts for x in (f"{lay} ms", "% f+b", "mean ms (n steps)")]
        mhead = head + [x for lay in layouts
                        for x in (f"{lay} state P", "ws P", "held P", "peak P")]
        step.append(f"\n## {m['model']}: {fb}\n\n" + md_table(shead, srows))
        peak = (f"; forward+backward {m['fwd_bwd_peak_P']:.2f} P above the parameters "
                "(gradients included)" if m["fwd_bwd_peak_P"] is not None else "")
        mem.append(f"\n## {m['model']}{peak}\n\n" + md_table(mhead, mrows))
    for name in part["models_planned"][len(part["models"]):]:
        for lines in (step, mem):
            lines.append(f"\n## {name}: not reached (the time box was spent)")
    return "\n".join(step) + "\n", "\n".join(mem) + "\n"


def quality_table(part: dict, env: str) -> str:
    """The quality table (markdown) of the result's ``quality`` part."""
    cfg = part["model"]
    base = next((r.get("final_val") for r in part["rows"] if r["strategy"] == "adamw"), None)
    rows = []
    for r in part["rows"]:
        if "final_val" not in r:
            rows.append([r["strategy"], f"`{r['token']}`", "", r.get("error") or r["stopped"],
                         "", "", "", "", ""])
            continue
        vs = f"{r['final_val'] / base:.3f}" if base and math.isfinite(base) else "-"
        rows.append([r["strategy"], f"`{r['token']}`", f"{r['lr']:g} ({r['lr_source']})",
                     f"{r['steps_reached']} / {r['steps_planned']} ({r['stopped']})",
                     f"{r['final_val']:.4f}", vs, f"{r['ms_per_step']:.1f}",
                     f"{r['bytes_per_param_step']:.4f}", f"{r['params'] / 1e6:.1f}M"])
    return (f"# Quality\n\n{env}. Byte-level GPT (d{cfg['d_model']}, {cfg['n_layer']} layers, "
            f"seq {cfg['seq_len']}) on the standard library's sources, {part['replicas']} "
            f"replicas simulated in one process, batch {part['batch']} per replica, cosine lr "
            "(5% warm-up) over the planned steps, one seed; each strategy stops at its share "
            "of the time box.\n\n"
            + md_table(["strategy", "preset", "lr (from)", "steps reached", "final val loss",
                        "vs adamw", "ms/step", "B/param/step", "params"], rows) + "\n")


def plots(out: Path, result: dict) -> list[str]:
    """step_cost.png, memory.png (CUDA) and quality_loss.png; none without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed")
        return []
    written = []
    step = result["step_cost"]
    keys, layouts = list(step["strategies"]), step["layouts"]
    for name, col, label in (("step_cost.png", "pct_fwd_bwd", "optimizer step, % of fwd+bwd"),
                             ("memory.png", "peak_P", "peak memory above params+grads (P)")):
        series = {(m["model"], lay): [(_cell(step["rows"], m["model"], lay, k) or {}).get(col)
                                      for k in keys] for m in step["models"] for lay in layouts}
        series = {k: v for k, v in series.items() if any(x is not None for x in v)}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(10, 4.5))
        width = 0.8 / len(series)
        for j, ((model, lay), vals) in enumerate(series.items()):
            ax.bar([i + j * width for i in range(len(keys))],
                   [v if v is not None else 0 for v in vals], width, label=f"{model}, {lay}")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))], keys, fontsize=8)
        ax.set_ylabel(label)
        ax.set_title(f"{result['device_name']}: one replica, {label}", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)
    runs = [r for r in result["quality"]["rows"] if r.get("curve")]
    if runs:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in runs:
            ax.plot([p[0] for p in r["curve"]], [p[1] for p in r["curve"]], marker=".",
                    label=f"{r['strategy']} (lr {r['lr']:g})")
        ax.set_xlabel("step (2 replicas, same batch per replica for every strategy)")
        ax.set_ylabel("validation loss")
        ax.set_title(f"{result['device_name']}: quality", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "quality_loss.png", dpi=110)
        plt.close(fig)
        written.append("quality_loss.png")
    return written
