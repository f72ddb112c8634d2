"""examples/train_gpt.py and examples/train_hf.py as users run them: they import only the
public API (what a user copies), bad arguments end in one line on stderr and exit code 2 (on
every rank), and tiny valid runs train, alone in a folder of their own and under torchrun."""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_util import Forked, run_python

from flexdemo.tools.ranks import free_port

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "train_gpt.py"
HF = ROOT / "examples" / "train_hf.py"
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
TINY_GPT = ["--model", "tiny", "--steps", "3", "--batch", "2", "--corpus-bytes", "20000",
            "--eval-batches", "1", "--log-every", "2"]
TINY_HF = ["--steps", "3", "--batch", "2", "--seq", "16", "--log-every", "1"]
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", FLEXDEMO_TIMEOUT="60", **extra)
    return env


def _run(args: list[str], timeout: float = 120, **extra: str) -> subprocess.CompletedProcess:
    """``python ARGS``: a script forked from the preloaded fork server (dist_util.run_python);
    torchrun (``-m torch.distributed.run``), which starts its ranks itself, as a real one."""
    if args[0] != "-m":
        return run_python(list(map(str, args)), timeout=timeout, env=_env(**extra), cwd=ROOT)
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=_env(**extra), cwd=ROOT)



def _ranks(args: list[str], world: int = 2, timeout: float = 120) -> list[tuple[int, str]]:
    """``world`` bare ranks of ``python ARGS`` with torchrun's variables, started together;
    each one's exit code and stderr."""
    port = str(free_port())
    procs = [Forked(list(map(str, args)), cwd=ROOT, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                             LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                             MASTER_PORT=port))
             for r in range(world)]  # (forked from the preloaded fork server)
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return [(p.returncode, err) for p, (_, err) in zip(procs, outs)]


def _one_line_error(stderr: str, script: str, argument: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"{script}: error: "), lines[0]
    assert argument in lines[0], lines[0]
    assert "Traceback" not in stderr
    return lines[0]


def _exit_code_in_process(path: Path, argv: list[str], monkeypatch) -> int:
    """Run example ``path``'s ``main(argv)`` in this process, outside any launcher (as
    ``python path ARGV`` would, its ``argparse`` named after the file); its exit code. For
    checks that refuse the arguments before anything starts: a subprocess here spends most of
    its time importing torch."""
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FLEXDEMO_TIMEOUT", "60")
    monkeypatch.setattr(sys, "argv", [str(path), *map(str, argv)])
    with pytest.raises(SystemExit) as leave:
        _loaded(path).main([str(a) for a in argv])
    assert not dist.is_initialized()  # refused before any process group
    return leave.value.code


@functools.cache
def _loaded(path: Path):
    return _load(path)


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------ public API
def _flexdemo_uses(path: Path) -> tuple[list[str], set[str]]:
    """An example's imports that are not ``import flexdemo`` / ``from flexdemo import NAME``
    (as ``"line: text"``), and every name it reaches: ``flexdemo.NAME`` or imported NAME."""
    tree = ast.parse(path.read_text())
    bad, names = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.partition(".")[0] == "flexdemo" and (
                        alias.name != "flexdemo" or alias.asname):
                    bad.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flexdemo"):
            if (node.module or "").startswith("flexdemo.integrations.") and not node.level:
                continue  # the training stacks' modules (docs/integrations.md): public
            if node.module != "flexdemo" or node.level:
                bad.append(f"{node.lineno}: from {node.module} import ...")
            names.update(alias.name for alias in node.names)
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id == "flexdemo"):
            names.add(node.attr)
    return bad, names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_use_only_the_public_api(path):
    """What a user copies: ``import flexdemo`` and names of ``flexdemo.__all__``, each named in
    the docs; besides that only torch, the standard library and transformers."""
    import flexdemo

    bad, names = _flexdemo_uses(path)
    assert not bad, f"{path.name} imports flexdemo's internals: {bad}"
    assert names and names <= set(flexdemo.__all__), sorted(names - set(flexdemo.__all__))
    docs = " ".join(p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
    undocumented = sorted(n for n in names if f"flexdemo.{n}" not in docs and
                          f"`{n}`" not in docs and f"`{n}(" not in docs)
    assert not undocumented, f"{path.name} uses names no page documents: {undocumented}"
    allowed = set(sys.stdlib_module_names) | {"torch", "transformers", "flexdemo", "__future__"}
    for node in ast.walk(ast.parse(path.read_text())):
        modules = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                   [node.module] if isinstance(node, ast.ImportFrom) else [])
        for m in modules:
            assert m.partition(".")[0] in allowed, f"{path.name}:{node.lineno} imports {m}"


def test_example_gpt_is_the_task_the_bench_trains():
    """train_gpt.py carries its own GPT, text and batches; they are the app's GPT task's (same
    parameters at one seed, same bytes, same windows), so its numbers compare with the bench's."""
    from flexdemo.app.tasks import GPT as AppGPT
    from flexdemo.app.tasks import get_batch, gpt_config, load_corpus

    example = _load(GPT)
    for name, cfg in example.PRESETS.items():
        assert tuple(cfg) == tuple(gpt_config(name).__dict__[k] for k in cfg._fields), name
        torch.manual_seed(0)
        mine = example.GPT(cfg).state_dict()
        torch.manual_seed(0)
        theirs = AppGPT(gpt_config(name)).state_dict()
        assert list(mine) == list(theirs), name
        assert all(torch.equal(mine[k], theirs[k]) for k in mine), name
    mine, theirs = example.load_corpus(200_000), load_corpus(200_000)
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    gens = [torch.Generator().manual_seed(7) for _ in range(2)]
    batches = [example.get_batch(mine[0], 4, 64, gens[0]), get_batch(theirs[0], 4, 64, gens[1])]
    assert all(torch.equal(a, b) for a, b in zip(*batches))


# ----------------------------------------------------------------------------- train_gpt.py
@pytest.mark.parametrize("args, argument, says", [
    (["--steps", "0"], "--steps", "at least 1"),
    (["--steps", "-2"], "--steps", "at least 1"),
    (["--batch", "0"], "--batch", "at least 1"),
    (["--model", "huge"], "--model", "'tiny', 'mini', 'small'"),
    (["--lr", "-1"], "--lr", "greater than 0"),
    (["--replicate", "2"], "--replicate", "world size 1"),
    (["--corpus-bytes", "10"], "--corpus-bytes", "at least 660"),
    (["--warmup", "5"], "--warmup", "from 0 to 1"),
    (["--strategies", "muloco-int4-paced"], "--strategies", "flexdemo train"),
    (["--strategies", "flexdemo-balanced"], "--strategies", "own pace or batch"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_gpt_bad_argument_is_one_line_and_code_2(tmp_path, args, argument, says, monkeypatch,
                                                 capsys):
    code = _exit_code_in_process(GPT, [*TINY_GPT, "--out", tmp_path / "r.json", *args],
                                 monkeypatch)
    err = capsys.readouterr().err
    assert code == 2, err
    assert says in _one_line_error(err, "train_gpt.py", argument)
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("args, argument", [
    (["--eval-batches", "0"], "--eval-batches"),
    (["--log-every", "0"], "--log-every"),
    (["--lr", "nan"], "--lr"),
    (["--warmup", "-0.1"], "--warmup"),
    (["--shard", "2"], "--shard"),
    (["--seed", "-1"], "--seed"),
    (["--strategies", " , "], "--strategies"),
    (["--strategies", "flexdem"], "did you mean 'flexdemo'"),
    (["--strategies", "flexdemo:topk=-1"], "topk"),
    (["--strategies", "flexdemo:bogus=1"], "bogus"),
    (["--out", "."], "--out"),
    (["--out", str(ROOT / "README.md" / "results.json")], "--out"),
    (["--model", "mini", "--corpus-bytes", "1299"], "at least 1300"),  # longer sequences
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_gpt_parse_args_rejects(capsys, args, argument):
    """The other arguments, through parse_args in this process (no subprocess per case)."""
    with pytest.raises(SystemExit) as e:
        _load(GPT).parse_args([*TINY_GPT, *args])
    assert e.value.code == 2
    _one_line_error(capsys.readouterr().err, "train_gpt.py", argument)


def test_gpt_help_says_warmup_is_a_fraction(capsys):
    with pytest.raises(SystemExit) as e:
        _load(GPT).parse_args(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "FRACTION of --steps, from 0 to 1" in text
    assert "{tiny,mini,small}" in text


def _alone(script: Path, folder: Path) -> Path:
    """A copy of ``script`` alone in ``folder``, as a user who copied it has it."""
    folder.mkdir(exist_ok=True)
    copy = folder / script.name
    copy.write_text(script.read_text())
    return copy


@pytest.mark.multiprocess
def test_gpt_tiny_run_trains_and_writes_results(tmp_path):
    """A copy of the example in a folder of its own, run from there: it needs no other file
    of this repository."""
    out = tmp_path / "r.json"
    script = _alone(GPT, tmp_path / "alone")
    r = subprocess.run([sys.executable, script, *TINY_GPT, "--corpus-bytes", "660", "--warmup",
                        "1", "--lr", "0.01", "--strategies", "flexdemo,hsdp-adamw", "--out",
                        out], capture_output=True, text=True, timeout=120, env=_env(),
                       cwd=script.parent)
    assert r.returncode == 0, r.stderr
    results = json.loads(out.read_text())["results"]
    assert [x["strategy"] for x in results] == ["flexdemo", "hsdp-adamw"]
    for x in results:
        assert x["steps"] == 3 and x["lr"] == 0.01
        assert math.isfinite(x["train_loss"]) and math.isfinite(x["val_loss"])
        assert [h["step"] for h in x["history"]] == [2, 3]


@pytest.mark.multiprocess
def test_gpt_two_ranks_replicate(tmp_path):
    """Two ranks with torchrun's variables, forked (torchrun itself starts the README's usage
    example in test_docs.py, and the HF example in the longer tier)."""
    out = tmp_path / "r.json"
    ranks = _ranks([GPT, *TINY_GPT, "--replicate", "2", "--out", out], timeout=240)
    assert [code for code, _ in ranks] == [0, 0], ranks
    payload = json.loads(out.read_text())
    assert payload["world"] == 2
    for x in payload["results"]:
        assert x["mesh"] == {"replicate": 2, "shard": 1}
        assert x["bytes_sent_per_step"] > 0  # the replicas exchanged
        assert x["replica_max_abs_diff"] == 0.0


@pytest.mark.multiprocess
def test_gpt_bad_argument_on_two_ranks_said_once(tmp_path):
    """Before the process group: rank 0 says it, every rank exits 2."""
    (code0, err0), (code1, err1) = _ranks([GPT, *TINY_GPT, "--replicate", "3",
                                           "--out", tmp_path / "r.json"])
    assert (code0, code1) == (2, 2), err0 + err1
    assert "world size 2" in _one_line_error(err0, "train_gpt.py", "--replicate")
    assert err1.strip() == ""


@pytest.mark.multiprocess
def test_gpt_error_after_the_process_group_started_said_once(tmp_path):
    """An error prepare() raises once the process group is up: one line from rank 0, exit 2
    on every rank, no hang."""
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(textwrap.dedent(f"""
        import importlib.util
        import sys

        spec = importlib.util.spec_from_file_location("train_gpt", {str(GPT)!r})
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)

        def prepare(model, **kwargs):
            example.flexdemo.init_distributed("cpu")
            # the group up on both ranks (else rank 0's exit can fail rank 1's connect)
            import torch.distributed
            torch.distributed.barrier()
            raise ValueError("this mesh cannot hold\\nthe model")

        example.flexdemo.prepare = prepare
        example.main(sys.argv[1:])
    """))
    (code0, err0), (code1, err1) = _ranks([wrapper, *TINY_GPT, "--strategies", "flexdemo",
                                           "--out", tmp_path / "r.json"], timeout=90)
    assert (code0, code1) == (2, 2), err0 + err1
    line = _one_line_error(err0, "train_gpt.py", "strategy 'flexdemo'")
    assert line.endswith("this mesh cannot hold the model")
    assert err1.strip() == ""


# ------------------------------------------------------------------------------ train_hf.py
def _model_dir(tmp_path: Path, **config) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    return tmp_path / "model"


@pytest.mark.parametrize("args, argument, says", [
    (["--steps", "0"], "--steps", "at least 1"),
    (["--warmup", "0.05"], "--warmup", "expected an integer"),
    (["--warmup", "-1"], "--warmup", "at least 0"),
    (["--optimizer", "lamb"], "--optimizer", "'lion'"),
    (["--replicator", "foo"], "--replicator", "'demo'"),
    (["--replicate", "2"], "--replicate", "world size 1"),
    (["--hidden", "80"], "--hidden", "64 or 96"),
    (["--model", "no/such/dir"], "--model", "config.json"),
    (["--weights"], "--weights", "local model directory"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_hf_bad_argument_is_one_line_and_code_2(args, argument, says, monkeypatch, capsys):
    """Checked before transformers is imported: the same with or without it."""
    code = _exit_code_in_process(HF, [*TINY_HF, *args], monkeypatch)
    err = capsys.readouterr().err
    assert code == 2, err
    assert says in _one_line_error(err, "train_hf.py", argument)


@pytest.mark.parametrize("args, config, argument", [
    (["--batch", "0"], None, "--batch"),
    (["--seq", "1"], None, "--seq"),
    (["--accum", "0"], None, "--accum"),
    (["--clip", "-1"], None, "--clip"),
    (["--lr", "0"], None, "--lr"),
    (["--log-every", "0"], None, "--log-every"),
    (["--layers", "0"], None, "--layers"),
    (["--model", "gpt2", "--hidden", "100"], None, "96 or 112"),
    (["--seq", "128"], {"vocab_size": 300, "n_positions": 64}, "--seq 64 or less"),
    ([], {"vocab_size": 100}, "vocab_size 100"),
    (["--weights"], {"vocab_size": 300}, "holds no weights"),
    (["--weights", "--meta"], {"vocab_size": 300}, "--meta"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_hf_parse_args_rejects(tmp_path, capsys, args, config, argument):
    model = ["--model", str(_model_dir(tmp_path, **config))] if config else []
    with pytest.raises(SystemExit) as e:
        _load(HF).parse_args([*TINY_HF, *model, *args])
    assert e.value.code == 2
    _one_line_error(capsys.readouterr().err, "train_hf.py", argument)


def test_hf_help_lists_the_library_optimizers_and_says_warmup_is_steps(capsys):
    from flexdemo import BASE_OPTIMIZERS

    with pytest.raises(SystemExit) as e:
        _load(HF).parse_args(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "{" + ",".join(BASE_OPTIMIZERS) + "}" in text and "lion" in text
    assert "warm-up as a NUMBER OF STEPS" in text
    args = _load(HF).parse_args(["--optimizer", "LION", "--model", "gpt2", "--hidden", "80"])
    assert (args.optimizer, args.hidden) == ("lion", 80)  # gpt2 needs no key-value heads


@pytest.mark.multiprocess
def test_hf_valid_arguments_without_transformers_say_what_to_install(tmp_path):
    """Without transformers (a module of that name that fails to import, first on the path,
    whether or not it is installed): one line saying what to install."""
    (tmp_path / "transformers.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'transformers'\", name='transformers')\n")
    r = subprocess.run([sys.executable, str(HF), *TINY_HF], capture_output=True, text=True,
                       timeout=120, env=_env(PYTHONPATH=str(tmp_path)), cwd=ROOT)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "train_hf.py needs the transformers package (pip install transformers); flexdemo "
        "itself does not"]


STUB = '''
"""A stand-in for transformers: the configs train_hf.py builds and a tiny causal LM."""
from types import SimpleNamespace

from torch import nn


def LlamaConfig(**kw):
    return SimpleNamespace(width=kw["hidden_size"], **kw)


def GPT2Config(**kw):
    return SimpleNamespace(width=kw["n_embd"], **kw)


class _LM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.width)
        self.head = nn.Linear(config.width, config.vocab_size)

    def forward(self, input_ids, labels):
        logits = self.head(self.embed(input_ids))[:, :-1]
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           labels[:, 1:].reshape(-1))
        return SimpleNamespace(loss=loss)


class AutoModelForCausalLM:
    @staticmethod
    def from_config(config):
        return _LM(config)
'''


def _stub(tmp_path: Path) -> str:
    """A folder holding the stand-in ``transformers`` (for PYTHONPATH)."""
    (tmp_path / "stub" / "transformers").mkdir(parents=True)
    (tmp_path / "stub" / "transformers" / "__init__.py").write_text(STUB)
    return str(tmp_path / "stub")


@pytest.mark.multiprocess
def test_hf_tiny_run_trains(tmp_path):
    """The training loop (prepare, accumulation, clipping, schedule) on a stand-in
    ``transformers`` (the real one is optional; the stub keeps the test quick), from a
    copy of the example alone in a folder of its own."""
    script = _alone(HF, tmp_path / "alone")
    r = subprocess.run([sys.executable, script, *TINY_HF, "--optimizer", "lion", "--lr", "1e-3",
                        "--accum", "2", "--clip", "1.0", "--warmup", "2"], capture_output=True,
                       text=True, timeout=120, env=_env(PYTHONPATH=_stub(tmp_path)),
                       cwd=script.parent)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("step")] == ["0", "1", "2"]
    assert lines[-1].startswith("done: loss") and "mesh (1, 1)" in lines[-1]


@pytest.mark.multiprocess
def test_hf_two_ranks_under_torchrun_replicate(tmp_path):
    r = _run(["-m", "torch.distributed.run", "--nproc-per-node", "2", HF, *TINY_HF,
              "--replicate", "2"], timeout=240, PYTHONPATH=_stub(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("step")] == ["0", "1", "2"]
    assert lines[-1].startswith("done: loss") and "mesh (2, 1)" in lines[-1]
    sent = [int(line.split("sent ")[1].split()[0].replace(",", "")) for line in lines
            if line.startswith("step")]
    assert all(b > 0 for b in sent), lines  # the replicas exchanged
