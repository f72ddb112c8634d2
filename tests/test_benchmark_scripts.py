"""benchmarks/bench_replicators.py, bench_wire.py and gpu_check.py: options, table, JSON."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parent.parent
BENCH = ROOT / "benchmarks"


def _load(name: str):
    path = BENCH / f"{name}.py"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _one_line_exit(capsys, fn, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as e:
        fn(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert len(err.strip().splitlines()) == 1 and message in err, err


@pytest.mark.parametrize("argv, message", [
    (["--cases", "nope"], "unknown 'nope'; choose from diloco-inner"),
    (["--cases"], "name at least one"),
    (["--steps", "0"], "--steps: must be at least 1"),
    (["--peers", "0"], "--peers: must be at least 1"),
])
def test_replicators_bad_options(capsys, tmp_path, argv, message):
    rep = _load("bench_replicators")
    _one_line_exit(capsys, rep.main, argv + ["--out", str(tmp_path / "r.json")], message)
    assert not (tmp_path / "r.json").exists()


def test_replicators_cuda_without_gpu(capsys, monkeypatch):
    rep = _load("bench_replicators")
    monkeypatch.setattr(rep.torch.cuda, "is_available", lambda: False)
    _one_line_exit(capsys, rep.main, ["--device", "cuda"], "no CUDA device is available")


def test_replicators_table_and_json(capsys, monkeypatch, tmp_path):
    """Two simulated peers: the replicators exchange (bytes counted, checks passed) through
    the bench's mirror transport; DiLoCo between syncs sends nothing."""
    rep = _load("bench_replicators")
    out = tmp_path / "sub" / "r.json"
    rep.main(["--device", "cpu", "--steps", "1", "--cases", "full-fp32", "random",
              "diloco-inner", "--out", str(out)])
    text = capsys.readouterr().out
    assert "ms median" in text and "host syncs" in text and f"wrote {out}" in text
    data = json.loads(out.read_text())
    assert (data["model"], data["device"], data["steps"], data["peers"]) == ("small", "cpu", 1, 2)
    assert [r["case"] for r in data["cases"]] == ["full-fp32", "random", "diloco-inner"]
    assert all(r["ms_median"] > 0 and r["syncs_per_step"] is None for r in data["cases"])
    sent = [r["bytes_sent_per_step"] for r in data["cases"]]
    assert sent[0] >= 4 * data["params"] and 0 < sent[1] < sent[0] and sent[2] == 0, sent


@pytest.mark.parametrize("argv, message", [
    (["--parts", "codec"], "--parts: unknown 'codec'; choose from codecs, timing"),
    (["--parts", ","], "--parts: name at least one"),
    (["--model", "huge"], "invalid choice: 'huge'"),
    (["--parts", "codecs", "--codecs", "demo-defaults:values=int3"], "--codecs: strategy"),
    (["--parts", "timing", "--default", "nope"], "--default: unknown strategy 'nope'"),
    (["--parts", "timing", "--bandwidths", "fast"], "--bandwidths: bandwidth 'fast'"),
])
def test_wire_bad_options_write_nothing(capsys, monkeypatch, tmp_path, argv, message):
    wire = _load("bench_wire")
    monkeypatch.setattr(wire, "run_train", lambda *a: pytest.fail("the cluster started"))
    _one_line_exit(capsys, wire.main, argv + ["--out", str(tmp_path)], message)
    assert not (tmp_path / "wire.json").exists()


def test_wire_codecs_header_names_the_models_sequence(capsys, monkeypatch, tmp_path):
    wire = _load("bench_wire")
    row = {"strategy": wire.DEMO, "bytes_per_param_per_step": 0.5, "val_loss": 1.0,
           "train_loss": 1.0}
    monkeypatch.setattr(wire, "run_train", lambda *a: [row])
    wire.main(["--parts", "codecs", "--model", "tiny", "--codecs", wire.DEMO,
               "--out", str(tmp_path)])
    assert "batch 4 x 64" in capsys.readouterr().out
    assert json.loads((tmp_path / "wire.json").read_text())["codecs"] == [row]


def test_gpu_check_help_is_a_whole_sentence(capsys):
    gpu = _load("gpu_check")
    with pytest.raises(SystemExit):
        gpu.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "meta-device model, checkpoints (DCP's own helpers and flexdemo's), the HF example." \
        in text


def test_gpu_check_steps_must_be_positive(capsys):
    gpu = _load("gpu_check")
    _one_line_exit(capsys, gpu.main, ["--steps", "0"], "--steps: must be at least 1")


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "must be >= 1"),
    (["--model", "huge"], "invalid choice: 'huge'"),
    (["--ns", "--ns-model", "d64x3,huge"], "--ns-model huge: choose from"),
])
def test_muon_bad_options(capsys, argv, message):
    _one_line_exit(capsys, _load("bench_muon").main, argv, message)


@pytest.mark.multiprocess
def test_muon_table_and_json(capsys, tmp_path, monkeypatch):
    """Two ranks of a 1 x 2 mesh: both optimizers step; Muon's shard traffic is counted."""
    monkeypatch.syspath_prepend(str(BENCH))  # the spawned ranks import the script by name
    module = _load("bench_muon")
    monkeypatch.setitem(sys.modules, "bench_muon", module)
    out = tmp_path / "muon.json"
    res = module.main(["--model", "tiny", "--replicate", "1", "--shard", "2",
                                    "--steps", "1", "--warmup", "0", "--batch", "2",
                                    "--out", str(out)])
    text = capsys.readouterr().out
    assert "Muon's extra work" in text and "adamw" in text
    assert json.loads(out.read_text())["shard_bytes_per_step"] == res["shard_bytes_per_step"] > 0
    assert res["per_optimizer"]["adamw"]["shard_b"] == 0


def test_muon_ns_table_and_json(capsys, tmp_path):
    """--ns: one process, both Newton-Schulz modes and the fp32 iterations; fewer matmuls
    batched, bitwise the same."""
    out = tmp_path / "ns.json"
    res = _load("bench_muon").main(["--ns", "--ns-model", "d64x3", "--steps", "1",
                                    "--warmup", "0", "--out", str(out)])
    assert "per_matrix" in capsys.readouterr().out
    r = json.loads(out.read_text())["ns"]["d64x3"]
    assert r == res["ns"]["d64x3"] and r["bitwise"]
    assert (r["batched"]["matmuls"], r["per_matrix"]["matmuls"]) == (60, 180)
    # fp32: each non-square matrix's new iterate in blocks of r columns (3 or 4 a step)
    assert r["fp32"]["matmuls"] == 100 and 0 < r["fp32_rel_diff"] < 0.05  # near, not torch's
    assert r["batched"]["kernels"] is None  # counted on CUDA only


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a CPU-only host gets")
def test_muon_ns_cuda_without_a_gpu_is_one_line(capsys, tmp_path):
    _one_line_exit(capsys, _load("bench_muon").main,
                   ["--ns", "--device", "cuda", "--out", str(tmp_path / "ns.json")],
                   "--device cuda needs --ns and a CUDA device")


# ------------------------------------------------------------------- documented modules only
def _documented_script_modules() -> set[str]:
    """The modules docs/extending.md lets the benchmarks import (its table's first column)."""
    text = (ROOT / "docs" / "extending.md").read_text()
    section = text.split("## Scripts and benchmarks: the modules they may import", 1)[1]
    return {line.split("`")[1] for line in section.splitlines()
            if line.startswith("| `flexdemo")}


def _flexdemo_imports(path: Path) -> list[tuple[int, str, str]]:
    """Every ``(line, module, name)`` that ``path`` imports from flexdemo (``name`` empty for
    ``import flexdemo.x``)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, "") for a in node.names
                      if a.name.partition(".")[0] == "flexdemo"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flexdemo"):
            found += [(node.lineno, node.module, a.name) for a in node.names]
    return found


@pytest.mark.parametrize("path", sorted(p for p in BENCH.glob("*.py") if p.name != "prototypes.py"),
                         ids=lambda p: p.name)
def test_benchmarks_import_documented_modules_only(path):
    """A benchmark imports ``flexdemo`` or a module of docs/extending.md's table, and from it
    only names of its ``__all__`` (benchmarks/prototypes.py alone hooks private stages; the
    docs say why)."""
    import importlib

    allowed = _documented_script_modules()
    assert {"flexdemo.app.args", "flexdemo.app.tasks", "flexdemo.transport"} <= allowed
    for line, module, name in _flexdemo_imports(path):
        assert module == "flexdemo" or module in allowed, \
            f"{path.name}:{line} imports {module}, which docs/extending.md does not list"
        if name:
            public = importlib.import_module(module).__all__
            assert name in public, f"{path.name}:{line} imports {module}.{name}, not public"



# transformers' per-module init hook, which train_hf.py's meta-device init_fn calls (not
# ours); the mark DeMo puts on its verdict's host copy, read a step later (bench_core counts
# reads of the device without it)
ALLOWED_PRIVATE = {"_init_weights", "_flexdemo_host_copy"}


def _path_edits_and_private_names(path: Path) -> list[str]:
    """``line: text`` for every ``sys.path`` use and every ``x._name`` where ``x`` is not
    ``self``, ``cls``, ``super()`` or a third-party module (``torch._foreach_add_``)."""
    import ast

    tree = ast.parse(path.read_text())
    modules = {(a.asname or a.name).split(".")[0] for node in ast.walk(tree)
               if isinstance(node, ast.Import) for a in node.names} - {"flexdemo"}
    modules |= {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and not (node.module or "").startswith(("flexdemo", "__future__"))
                for a in node.names}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant) \
                and str(node.args[1].value).startswith("_") \
                and node.args[1].value not in ALLOWED_PRIVATE:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        if not isinstance(node, ast.Attribute):
            continue
        if node.attr == "path" and isinstance(node.value, ast.Name) and node.value.id == "sys":
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif node.attr.startswith("_") and not node.attr.startswith("__") \
                and node.attr not in {"_replace", "_asdict"} | ALLOWED_PRIVATE:
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Call) and isinstance(root.func, ast.Name) \
                    and root.func.id == "super":
                continue
            if isinstance(root, ast.Name) and root.id in {"self", "cls"} | modules:
                continue
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


SCRIPTS = sorted([*BENCH.glob("*.py"), *(ROOT / "examples").rglob("*.py")])


@pytest.mark.parametrize("path", [p for p in SCRIPTS if p.name != "prototypes.py"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_scripts_edit_no_path_and_use_no_private_name(path):
    """Benchmarks and examples use the installed flexdemo as documented: no ``sys.path``
    edits (a script beside them is loaded from its file) and no private name of an object
    (benchmarks/prototypes.py alone hooks private stages; docs/extending.md says why)."""
    assert not _path_edits_and_private_names(path)


def test_the_script_checker_sees_a_path_edit_and_a_private_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nimport torch\nsys.path.insert(0, '.')\n"
                   "rep = object()\nprint(rep._work, torch._foreach_add_, super()._x)\n"
                   "hasattr(rep, '_graphs')\n")
    assert sorted(_path_edits_and_private_names(bad)) == [
        "3: sys.path", "5: rep._work", "6: hasattr(rep, '_graphs')"]

def test_the_checker_sees_a_private_import(tmp_path):
    """The import check reads what a file imports: a private module and a private name show."""
    bad = tmp_path / "bad.py"
    bad.write_text("import flexdemo.optim\nfrom flexdemo.app.tasks.gpt import GPT\n"
                   "from flexdemo.transport import _all_gather_single\n")
    found = _flexdemo_imports(bad)
    assert (1, "flexdemo.optim", "") in found and (2, "flexdemo.app.tasks.gpt", "GPT") in found
    allowed = _documented_script_modules()
    assert "flexdemo.optim" not in allowed and "flexdemo.app.tasks.gpt" not in allowed
    import flexdemo.transport

    assert "_all_gather_single" not in flexdemo.transport.__all__


@pytest.mark.multiprocess
def test_memory_bench_counts_a_strategy_exactly(tmp_path):
    """bench_memory.py on two real ranks: DeMo's state is its momentum (one copy of the
    parameters), its held buffers and step workspace are counted, the table and JSON written."""
    import subprocess

    out = tmp_path / "memory.json"
    run = subprocess.run([sys.executable, str(BENCH / "bench_memory.py"), "--model", "tiny",
                          "--shards", "1", "--strategies", "demo-defaults", "--steps", "2",
                          "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["strategy"] == "demo-defaults" and row["ranks"] == 2
    assert row["P"] <= row["state"] <= 1.1 * row["P"]  # the momentum (padding rounds up)
    assert row["held"] > 0 and row["peak"] > row["state"] + row["params"]
    assert "| whole, 2 ranks | demo-defaults |" in run.stdout


def test_memory_bench_names_an_unknown_strategy(capsys, tmp_path):
    mem = _load("bench_memory")
    assert mem.main(["--strategies", "nope", "--out", str(tmp_path / "m.json")]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "unknown strategies ['nope']" in out[0]


# ------------------------------------------------------------------- bench_compressibility.py
def test_compressibility_compressors_on_known_inputs():
    """Each compressor on an input whose answer is known: a matrix with 64 DCT coefficients
    per block is kept whole by the DCT top-64 and not by the plain one; a rank-1 matrix by
    rank 1; on Gaussian noise the top 1/64 keeps what theory says (0.1197 of the energy) and
    a shared random subset picks the same entries for every replica."""
    comp = _load("bench_compressibility")
    gen = torch.Generator().manual_seed(0)
    d = comp.dct_matrix(64)
    coef = torch.zeros(128, 64 * 64)
    coef.scatter_(1, torch.randperm(4096, generator=gen)[:64].expand(128, 64),
                  torch.randn(128, 64, generator=gen))
    x = comp._untile(d.T @ coef.reshape(-1, 64, 64) @ d, torch.Size((512, 1024)))
    assert torch.allclose(comp.top_k(x, 64, dct=True), x, atol=1e-5)
    assert (comp.top_k(x, 64, dct=False) - x).norm() > 0.5 * x.norm()
    u, v = torch.randn(256, 1, generator=gen), torch.randn(1, 128, generator=gen)
    assert torch.allclose(comp.low_rank(u @ v, 1), u @ v, atol=1e-4)
    noise = torch.randn(1024, 1024, generator=gen)
    kept = 1 - (noise - comp.top_k(noise, 64, dct=False)).pow(2).sum() / noise.pow(2).sum()
    assert abs(float(kept) - 0.1197) < 0.005, kept
    a = comp.subset(noise, 0.25, 1, torch.Generator().manual_seed(7))
    b = comp.subset(noise * 2, 0.25, 1, torch.Generator().manual_seed(7))
    assert torch.equal(a != 0, b != 0) and abs(float((a != 0).float().mean()) - 0.25) < 0.01
    two = comp.codebook(noise, 2)
    assert two.unique().numel() <= 4 * noise.numel() // 256


def test_compressibility_table_and_json(capsys, tmp_path):
    """Two periods of the tiny GPT: the first is skipped, the second measured; every
    compressor's share lies in [0, 1] and the denser one keeps more."""
    comp = _load("bench_compressibility")
    out = comp.main(["--model", "tiny", "--batches", "4", "--steps", "10", "--inner-steps", "5",
                     "--corpus-bytes", "200000", "--out", str(tmp_path)])
    text = capsys.readouterr().out
    assert "| DCT top-64 of 4096 (sparseloco) | 0.0293 | 0.00586 |" in text, text
    data = json.loads((tmp_path / "compressibility.json").read_text())
    assert data == json.loads(json.dumps(out)) and data[0]["syncs_measured"] == 1
    rows = {r["compressor"]: r for r in data[0]["rows"]}
    assert set(rows) == set(comp.COMPRESSORS)
    assert all(0 <= r["kept"] <= 1 and 0 <= r["kept_on_noise"] <= 1 for r in rows.values())
    assert rows["dense stat2 (block 256)"]["kept"] > rows["dense stat1 (block 256)"]["kept"] \
        > rows["DCT top-256 of 4096"]["kept"] > rows["DCT top-64 of 4096 (sparseloco)"]["kept"]
    assert -1 <= data[0]["cosine"][0] <= 1


@pytest.mark.parametrize("argv, message", [
    (["--replicas", "1"], "--replicas must be at least 2"),
    (["--steps", "30", "--inner-steps", "30"], "--steps must be at least 2 x --inner-steps"),
    (["--batches", "8,x"], "--batches takes a comma list of integers"),
])
def test_compressibility_bad_options(capsys, tmp_path, argv, message):
    comp = _load("bench_compressibility")
    _one_line_exit(capsys, comp.main, argv + ["--out", str(tmp_path / "c")], message)
    assert not (tmp_path / "c").exists()


def test_security_bench_table_and_json(tmp_path, capsys):
    """bench_security: a row per quorum size with the per-step and per-quorum costs of the
    run secret, the heal's MAC beside its serialisation, and the JSON."""
    res = _load("bench_security").main(["--members", "2,3", "--repeat", "20",
                                        "--heal-mparams", "0.01", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert [r["members"] for r in res["quorums"]] == [2, 3]
    assert all(r["per_step_us"] > 0 and r["per_new_quorum_ms"] > 0 for r in res["quorums"])
    assert "per new quorum (ms)" in out and "heal of 0.01M parameters" in out
    saved = json.loads((tmp_path / "security.json").read_text())
    assert saved["heal"]["megabytes"] == pytest.approx(0.12, rel=0.1)


def test_bound_bench_table_and_json(tmp_path, capsys):
    """bench_bound: the step with and without the bound on each peer's part, the same bits
    (honest peers never reach it), none clipped, and the JSON."""
    rows = _load("bench_bound").main(["--model", "tiny", "--steps", "3", "--cases",
                                      "int4,demo", "--out", str(tmp_path)])
    assert [r["case"] for r in rows] == ["int4", "demo"]
    assert all(r["same_bits"] and r["clipped"] == 0 and r["mean_on_ms"] > 0 for r in rows)
    assert "on / off" in capsys.readouterr().out
    assert json.loads((tmp_path / "bound.json").read_text())["replicas"] == 2


def test_bound_bench_names_an_unknown_case(capsys):
    _one_line_exit(capsys, _load("bench_bound").main, ["--cases", "nope"],
                   "--cases: unknown 'nope'; choose from int4")
