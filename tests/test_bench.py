"""``flexdemo bench``: options, table, plots, and a tiny sweep that writes its files."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest

import flexdemo.tools.netns as netns
from flexdemo.app.bench.report import comparison_lines, format_table
from flexdemo.app.bench.run import (
    PRESETS,
    STRATEGIES,
    BenchError,
    bench_options,
    run_bench,
    run_config,
)
from flexdemo.app.config.checks import config_from_dict, validate
from flexdemo.app.config.schema import ConfigError

pytest.importorskip("matplotlib", reason="the bench's plots need matplotlib")

PNG = b"\x89PNG\r\n\x1a\n"
ROOT = Path(__file__).parent.parent


def test_options_defaults_and_preset():
    o = bench_options()
    assert o.strategies == ["flexdemo", "demo-dp", "hsdp-adamw", "no-sync"]
    assert o.bandwidths == ["10mbit", "100mbit", "1gbit"] and o.nodes * o.ranks_per_node == 4
    main = bench_options(preset="main")
    assert main.strategies == ["flexdemo", "muloco", "hsdp-muon", "hsdp-adamw"]
    assert STRATEGIES["muloco"].replicator == "muloco"  # the paper's exchange
    assert main.bandwidths == ["100mbit"]
    assert main.base["task"]["name"] == "gpt" and main.out == "runs/main"
    assert bench_options(preset="main", steps=7).steps == 7
    assert bench_options(unshaped=True).bandwidths == ["unshaped"]
    assert set(PRESETS["main"]["strategies"]) <= set(STRATEGIES)


def test_every_strategy_makes_a_valid_config():
    o = bench_options(strategies=",".join(STRATEGIES))
    for name in STRATEGIES:
        cfg = validate(config_from_dict(run_config(o, name, "runs/x")), 4)
        assert (cfg.mesh.replicate, cfg.mesh.shard) == ((4, 1) if name == "demo-dp" else (2, 2))
        assert cfg.train.steps == o.steps and cfg.train.out == "runs/x"
        assert cfg.strategy.optimizer_kwargs == STRATEGIES[name].optimizer_kwargs
    # a strategy's base optimizer settings reach the config (Muon without momentum)
    assert STRATEGIES["flexdemo-muon"].settings()["optimizer_kwargs"] == {"momentum": 0.0}


@pytest.mark.parametrize("kwargs, message", [
    ({"strategies": "flexdemo,hsdp-adam"}, "unknown strategy 'hsdp-adam' (did you mean "
                                           "'hsdp-adamw'?)"),
    ({"strategies": "flexdemo,flexdemo"}, "listed twice"),
    ({"bandwidths": "100mbps,fast"}, "bandwidth 'fast'"),
    ({"bandwidths": "100mbit,unshaped"}, "cannot be mixed"),
    ({"preset": "huge"}, "unknown preset 'huge'"),
    ({"overrides": ["strategy.lr=1"]}, "leave them out"),
])
def test_bad_options(kwargs, message):
    with pytest.raises(BenchError) as e:
        bench_options(**kwargs)
    assert message in str(e.value)


def test_device_option_and_config(monkeypatch, tmp_path):
    """--device (or train.device of the base config) reaches every run; auto is CUDA only
    with a GPU per rank; cuda with too few GPUs, or a bad name, is one line."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert bench_options().device == "cpu"
    o = bench_options(device="cpu")
    assert o.device == "cpu" and run_config(o, "flexdemo", "x")["train"]["device"] == "cpu"
    base = tmp_path / "base.toml"
    base.write_text('[task]\nname = "gpt"\nmodel = "tiny"\n[train]\ndevice = "cuda"\n')
    with pytest.raises(BenchError, match="shows no CUDA GPU; use --device cpu"):
        bench_options(config=str(base))
    with pytest.raises(ConfigError, match="train.device: unknown device 'tpu'"):
        bench_options(device="tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert bench_options().device == "cpu"  # 4 ranks, 2 GPUs: auto stays on the CPU
    assert bench_options(nodes=2, ranks_per_node=1).device == "cuda"
    with pytest.raises(BenchError, match=r"runs 4 ranks on this machine, one GPU each, but it "
                                         r"shows 2 GPU\(s\); use --device cpu"):
        bench_options(device="cuda")


def test_bad_overrides_are_config_errors():
    with pytest.raises(ConfigError, match="did you mean 'train.steps'"):
        bench_options(overrides=["train.stpes=3"])
    with pytest.raises(ConfigError, match="task.model: unknown value 'huge'"):
        bench_options(overrides=["task.model=huge"])


def _fake(strategy: str, bw: str, val: float, step_s: float, comm_s: float,
          sent: float) -> dict:
    steps = list(range(1, 21))
    return {
        "strategy": strategy, "bandwidth": bw, "status": "ok", "task": "gpt", "model": "tiny",
        "params": 190_000, "steps": 20, "nodes": 2, "ranks_per_node": 2,
        "val_loss": val, "train_loss": val + 0.1, "train_seconds": 20 * step_s,
        "step_seconds": step_s, "compute_seconds": step_s - comm_s, "comm_seconds": comm_s,
        "bytes_sent_per_step": sent, "mb_sent_total": 20 * sent / 1e6,
        "curve": {"step": steps, "loss": [5 - 0.1 * s for s in steps],
                  "train_seconds": [s * step_s for s in steps],
                  "bytes_sent_total": [s * sent for s in steps],
                  "val_step": [10, 20], "val_loss": [val + 0.5, val],
                  "val_seconds": [10 * step_s, 20 * step_s],
                  "val_bytes": [10 * sent, 20 * sent]},
    }


def _fake_results() -> list[dict]:
    out = []
    for bw, slow in (("10mbit", 1.0), ("1gbit", 0.1)):
        out += [_fake("flexdemo", bw, 3.02, 0.2, 0.02, 2e3),
                _fake("hsdp-adamw", bw, 3.0, 0.2 + slow, slow, 1e6),
                _fake("no-sync", bw, 3.3, 0.19, 0.0, 0.0)]
    out.append({"strategy": "demo-dp", "bandwidth": "10mbit", "status": "failed",
                "message": "rank 2 exited with code 1", "curve": {"step": []}})
    return out


def test_table_and_comparison():
    results = _fake_results()
    table = format_table(results)
    assert table.splitlines()[0].split()[:3] == ["strategy", "link", "val"]
    assert "failed" in table and "hsdp-adamw" in table
    lines = comparison_lines(results)
    i = lines.index("flexdemo vs hsdp-adamw @ 10mbit:")
    assert lines[i + 1] == ("  no full sync with sgd in this run: against the best full sync, "
                            "hsdp-adamw")
    assert lines[i + 2] == "  at equal steps: val loss 3.0200 vs 3.0000 (+0.7%)"
    assert lines[i + 3] == "  step time:      200 ms vs 1200 ms (6.00x faster)"
    assert lines[i + 4].startswith("  at equal time:  train loss 3.1500 vs 4.7333 after 4 s")
    # validation at equal time: no-sync's last evaluation (3.8 s) bounds it; flexdemo's is
    # interpolated between its evaluations at 2 s and 4 s; AdamW's first is at 12 s
    assert lines[i + 5] == ("                  val loss 3.0700 vs - (no evaluation yet) after "
                            "4 s (between evaluations)")


def test_step_time_says_slower_when_slower():
    slow = [_fake("flexdemo", "1gbit", 3.02, 0.030, 0.01, 2e3),
            _fake("hsdp-adamw", "1gbit", 3.0, 0.021, 0.005, 1e6),
            _fake("no-sync", "1gbit", 3.3, 0.021, 0.0, 0.0)]
    lines = comparison_lines(slow)
    i = lines.index("flexdemo vs hsdp-adamw @ 1gbit:")
    assert lines[i + 3] == "  step time:      30 ms vs 21 ms (1.43x slower)"
    j = lines.index("no-sync vs hsdp-adamw @ 1gbit:")
    assert lines[j + 2].endswith("21 ms vs 21 ms (the same)")
    # a run whose summary holds no validation loss (null in strict JSON) is left out
    slow[0]["val_loss"] = None
    assert "flexdemo vs hsdp-adamw @ 1gbit:" not in comparison_lines(slow)


def test_plots_from_results(tmp_path):
    from flexdemo.app.bench.plots import plot_all

    paths = plot_all(_fake_results(), tmp_path)
    assert [p.name for p in paths] == ["loss_vs_time.png", "loss_vs_bytes.png",
                                       "step_time.png"]
    for p in paths:
        assert p.read_bytes()[:8] == PNG and p.stat().st_size > 10_000


@pytest.mark.multiprocess
def test_tiny_sweep_without_root_falls_back_to_loopback(tmp_path, monkeypatch, capsys):
    """Not root: the bench says shaping needs root and runs unshaped; it writes JSON, CSV and
    three PNGs and prints a table."""
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    o = bench_options(strategies="flexdemo,hsdp-adamw", bandwidths="100mbit", nodes=2,
                      ranks_per_node=1, out=str(tmp_path), timeout=240,
                      overrides=["train.steps=4", "task.model=tiny", "task.corpus_bytes=100000",
                                 "train.batch=2", "train.eval_every=2", "train.eval_batches=1",
                                 "train.warmup=1"])
    results = run_bench(o)
    printed = capsys.readouterr().out
    assert "shaping the emulated network needs root" in printed and "unshaped loopback" in printed
    assert printed.count("Run as root") == 0 and "rerun as root" in printed  # said once
    assert [r["status"] for r in results] == ["ok", "ok"], [r.get("message") for r in results]
    assert all(r["bandwidth"] == "unshaped" for r in results)
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["shaped"] is False and len(data["runs"]) == 2
    assert data["runs"][0]["curve"]["step"] == [1, 2, 3, 4]
    flex, adamw = data["runs"]
    assert 0 < flex["bytes_sent_per_step"] < adamw["bytes_sent_per_step"]
    with (tmp_path / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["strategy"] for r in rows] == ["flexdemo", "hsdp-adamw"]
    assert float(rows[0]["val_loss"]) > 0
    for name in ("loss_vs_time.png", "loss_vs_bytes.png", "step_time.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG
    assert "flexdemo" in printed and "MB/step" in printed
    assert (tmp_path / "runs" / "flexdemo@unshaped" / "log.txt").stat().st_size > 0


@pytest.mark.multiprocess
def test_root_without_network_namespaces_falls_back(tmp_path, monkeypatch, capsys):
    """Root, but namespaces cannot be made (a container): the same fallback, with the reason."""
    import flexdemo.app.bench.run as bench

    enter = bench.EmulatedCluster.__enter__

    def no_netns(self):
        if not self.unshaped:
            raise netns.ClusterError("`ip netns add x` failed (exit 1): Operation not "
                                       "permitted")
        return enter(self)

    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(bench, "cleanup_stale", lambda: [])
    monkeypatch.setattr(bench.EmulatedCluster, "__enter__", no_netns)
    monkeypatch.setattr(netns, "find_tool", lambda name: f"/usr/sbin/{name}")
    o = bench_options(strategies="no-sync", bandwidths="10mbit", nodes=2, ranks_per_node=1,
                      steps=2, out=str(tmp_path), quiet=True, timeout=240,
                      overrides=["task.model=tiny", "task.corpus_bytes=100000",
                                 "train.batch=2", "train.eval_batches=1"])
    results = run_bench(o)
    printed = capsys.readouterr().out
    assert "Operation not permitted" in printed and "unshaped loopback" in printed
    assert [(r["status"], r["bandwidth"]) for r in results] == [("ok", "unshaped")]


def test_a_run_too_short_to_sync_is_flagged():
    results = _fake_results()
    short = _fake("diloco", "10mbit", 2.9, 0.15, 0.0, 0.0)  # faster and better: never synced
    results.insert(2, short)
    lines = comparison_lines(results)
    i = lines.index("diloco vs hsdp-adamw @ 10mbit:")
    assert "never synchronised across nodes in its 20 steps" in lines[i + 1], lines[i + 1]
    assert "train.steps > 20" in lines[i + 1] and "x faster" in lines[i + 3]
    assert "never synchronised" in format_table(results)
    assert not any("never" in line for line in comparison_lines(_fake_results()))


def _load_script(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_strategy_table_for_bench_example_and_wire_benchmark():
    import flexdemo.strategies
    from flexdemo import STRATEGIES as TABLE
    from flexdemo import parse_strategy

    assert STRATEGIES is TABLE is flexdemo.strategies.STRATEGIES  # the library's table
    s = parse_strategy("demo-defaults:topk=16:values=int2")
    assert (s.replicator, s.optimizer, s.replicator_kwargs) == (
        "demo", "sgd", {"topk": 16, "values": "int2"})
    assert TABLE["demo-defaults"].replicator_kwargs == {}  # the entry itself is untouched
    with pytest.raises(ValueError, match="did you mean 'flexdemo'"):
        parse_strategy("flexdem")
    example = _load_script(ROOT / "examples" / "train_gpt.py")
    # every strategy but those of replicas at their own pace or batch (refused there in one
    # line: test_examples.py), which its fixed step loop does not run
    steady = [n for n, s in TABLE.items()
              if s.replicator_kwargs.get("pace") is None and s.batches == "equal"]
    assert len(steady) == len(TABLE) - 7
    args = example.parse_args(["--strategies", ",".join(steady)])
    assert args.strategies == steady
    wire = _load_script(ROOT / "benchmarks" / "bench_wire.py")
    for token in wire.CODECS + [t.format(default=wire.DEMO) for t in wire.TIMING]:
        parse_strategy(token)
    # the bench's configs follow the table
    o = bench_options(strategies="flexdemo,diloco")
    assert run_config(o, "diloco", "x")["strategy"] == TABLE["diloco"].settings()


def _headings(lines: list[str]) -> list[str]:
    return [line for line in lines if not line.startswith(" ")]


def test_each_strategy_against_full_sync_with_its_optimizer_then_the_best():
    """The main job's summary: each run first against the full sync with its own inner
    optimizer, then against the best full sync of the run where that is another one; sign-SGD
    has no full sync of its own (the best only, said so); a full sync against the best unless
    it is the best."""
    rows = [_fake("flexdemo", "100mbit", 2.9, 0.3, 0.01, 1e4),
            _fake("muloco", "100mbit", 2.6, 0.3, 0.01, 1e4),
            _fake("hsdp-muon", "100mbit", 2.5, 0.5, 0.2, 1e6),
            _fake("hsdp-adamw", "100mbit", 3.0, 0.5, 0.2, 1e6),
            _fake("diloco", "100mbit", 3.1, 0.3, 0.01, 1e4)]
    lines = comparison_lines(rows)
    assert _headings(lines) == ["flexdemo vs hsdp-muon @ 100mbit:",
                                "muloco vs hsdp-muon @ 100mbit:",
                                "hsdp-adamw vs hsdp-muon @ 100mbit:",
                                "diloco vs hsdp-adamw @ 100mbit:",
                                "diloco vs hsdp-muon @ 100mbit:"]
    assert lines[1] == ("  no full sync with sgd in this run: against the best full sync, "
                        "hsdp-muon")
    assert lines[2] == "  at equal steps: val loss 2.9000 vs 2.5000 (+16.0%)"
    i = lines.index("muloco vs hsdp-muon @ 100mbit:")
    assert lines[i + 1] == "  at equal steps: val loss 2.6000 vs 2.5000 (+4.0%)"
    i = lines.index("hsdp-adamw vs hsdp-muon @ 100mbit:")
    assert lines[i + 1] == "  against the best full sync in this run, hsdp-muon"
    assert lines[i + 2] == "  at equal steps: val loss 3.0000 vs 2.5000 (+20.0%)"
    i = lines.index("diloco vs hsdp-adamw @ 100mbit:")
    assert lines[i + 1] == "  at equal steps: val loss 3.1000 vs 3.0000 (+3.3%)"
    i = lines.index("diloco vs hsdp-muon @ 100mbit:")
    assert lines[i + 1] == "  against the best full sync in this run, hsdp-muon"
    assert lines[i + 2] == "  at equal steps: val loss 3.1000 vs 2.5000 (+24.0%)"

    # full-sync AdamW the best: the Muon family against hsdp-muon first, then hsdp-adamw
    rows[3] = _fake("hsdp-adamw", "100mbit", 2.4, 0.5, 0.2, 1e6)
    lines = comparison_lines(rows)
    assert _headings(lines) == ["flexdemo vs hsdp-adamw @ 100mbit:",
                                "muloco vs hsdp-muon @ 100mbit:",
                                "muloco vs hsdp-adamw @ 100mbit:",
                                "hsdp-muon vs hsdp-adamw @ 100mbit:",
                                "diloco vs hsdp-adamw @ 100mbit:"]
    assert lines[1].endswith("against the best full sync, hsdp-adamw")
    i = lines.index("muloco vs hsdp-adamw @ 100mbit:")
    assert lines[i + 1] == "  against the best full sync in this run, hsdp-adamw"

    # no full sync with AdamW in the sweep: AdamW's runs against the best, said so
    only_muon = [r for r in rows if r["strategy"] != "hsdp-adamw"]
    lines = comparison_lines(only_muon)
    i = lines.index("diloco vs hsdp-muon @ 100mbit:")
    assert lines[i + 1] == ("  no full sync with adamw in this run: against the best full "
                            "sync, hsdp-muon")
    assert "muloco vs hsdp-muon @ 100mbit:" in lines
    # no full sync at all: nothing to compare against
    assert comparison_lines([r for r in only_muon if r["strategy"] != "hsdp-muon"]) == []


def test_comparisons_against_a_reference_given():
    rows = [_fake("hsdp-adamw", "100mbit", 3.0, 0.5, 0.2, 1e6),
            _fake("hsdp-muon", "100mbit", 2.5, 0.5, 0.2, 1e6),
            _fake("muloco", "100mbit", 2.6, 0.3, 0.01, 1e4),
            _fake("flexdemo", "100mbit", 2.9, 0.3, 0.01, 1e4)]
    lines = comparison_lines(rows, "hsdp-muon", {"muloco"})
    assert lines[0] == "muloco vs hsdp-muon @ 100mbit:"
    assert not any(line.startswith("flexdemo vs") for line in lines)
    assert "(+4.0%)" in lines[1]


def test_app_strategies_named_like_a_replicator_run_it():
    """A strategy named like a paper (or like one of our library presets) runs the library's
    replicator of that name; the variants that run plain averaging say so in their names."""
    for name in ("diloco", "diloco-avg", "muloco", "muloco-int4", "sparseloco",
                 "sparseloco-dct"):
        assert STRATEGIES[name].replicator == name, name
    assert STRATEGIES["diloco"].replicator_kwargs == {"inner_steps": 20}
    assert STRATEGIES["muloco"].optimizer == STRATEGIES["sparseloco"].optimizer == "muon"
    for name, spec in STRATEGIES.items():
        if spec.replicator == "diloco-avg":
            assert "avg" in name or name == "muloco-int4-h20", name
    colors = [spec.color for spec in STRATEGIES.values()]
    assert len(set(colors)) == len(colors)
