"""flexdemo.integrations: the HF Trainer, Accelerate and Lightning train a model from
``flexdemo.prepare()`` on 2 ranks (torchrun's variables) without wrapping it in DDP: as 2
replicas (a 2 x 1 mesh) in fp32 and bf16, and as one replica sharded with FSDP2 over both
ranks (a 1 x 2 mesh).

One launch trains every stack that is installed, in each of these ways
(tests/integration_workers.py); each test reads its records. 2 replicas: the gradient each
rank's optimizer saw differs between the replicas (the framework did not all-reduce it), each
rank read other data, every step sent what a plain loop's step sends (DeMo's payload, not the
gradient). 1 x 2: the parameters stay DTensors split between the 2 ranks, the loss is finite,
nothing crosses between replicas. bf16: the forward computes in bf16, the optimizer sees fp32
gradients and weights. The HF Trainer and Lightning resume bitwise from their checkpoints.
In this process, each refuses a DiLoCo pace that is not lockstep before the first step.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_util import Forked
from test_docs import snippets

import flexdemo
from flexdemo.tools.ranks import free_port

WORKER = Path(__file__).with_name("integration_workers.py")
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_hf_trainer.py"
DOC = ROOT / "docs" / "integrations.md"
NEEDS = {"hf": ("transformers", "accelerate"), "accelerate": ("accelerate",),
         "lightning": ("lightning",)}
EXTRA = {"hf": "hf", "accelerate": "hf", "lightning": "lightning"}
# what the launch runs of each stack: 2 replicas (fp32, bf16) and one replica on 2 ranks
RUNS = {stack: [stack, f"{stack}_shard2", f"{stack}_bf16"] for stack in NEEDS}
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def _missing(stack: str) -> list[str]:
    return [m for m in NEEDS[stack] if importlib.util.find_spec(m) is None]


INSTALLED = [s for s in NEEDS if not _missing(s)]


def _two_ranks(args: list[str], cwd: Path) -> list[str]:
    """``python ARGS`` on 2 ranks with torchrun's variables (forked from the preloaded fork
    server); each rank's output, after both exited 0."""
    port = str(free_port())
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    procs = [Forked(args, cwd=cwd, stdout=subprocess.PIPE,
                    env=dict(base, RANK=str(r), LOCAL_RANK=str(r), GROUP_RANK="0",
                             WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                             MASTER_PORT=port, TORCHELASTIC_RUN_ID="integrations",
                             OMP_NUM_THREADS="1", FLEXDEMO_TIMEOUT="60",
                             TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1"))
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, text in zip(procs, outs):
        assert p.returncode == 0, text[-4000:]
    return outs


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> list[dict]:
    """Each rank's records of every installed stack (one launch of 2 ranks)."""
    if not INSTALLED:
        pytest.skip("none of transformers, accelerate, lightning is installed")
    out = tmp_path_factory.mktemp("integrations")
    _two_ranks([str(WORKER), str(out), *(run for s in INSTALLED for run in RUNS[s])], out)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _skip_if_missing(stack: str) -> None:
    missing = _missing(stack)
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed "
                    f"(pip install \"flexdemo[{EXTRA[stack]}]\")")


def _check_stack(stack: str, records: list[dict], plain_model: str,
                 ranks: list[dict] | None = None) -> list[dict]:
    """2 replicas: ``ranks``, each rank's record of the run (default: ``stack``'s)."""
    _skip_if_missing(stack)
    ranks = ranks or [r[stack] for r in records]
    for r in ranks:
        assert r["wrapped"] != "DistributedDataParallel", r
    # each rank read its own data, and its optimizer saw its own gradient at every step
    assert ranks[0]["first"] != ranks[1]["first"], ranks
    assert len(ranks[0]["grads"]) >= 3, ranks
    for a, b in zip(ranks[0]["grads"], ranks[1]["grads"]):
        assert a != pytest.approx(b, rel=1e-3, abs=1e-6), ranks
    # what crossed between the replicas at every step is the replicator's own payload: the
    # bytes a plain loop's step sends, a small fraction of the fp32 gradient
    sent = records[0]["plain"][plain_model]
    assert 0 < sent
    for r in ranks:
        assert r["sent"] == [sent] * len(r["grads"]), (r["sent"], sent)
    return ranks


@pytest.mark.multiprocess
def test_hf_trainer_leaves_the_exchange_to_flexdemo(records):
    ranks = _check_stack("hf", records, "gpt2")
    assert records[0]["plain"]["gpt2"] < 0.01 * 4 * 34_176  # its fp32 gradient: 137 kB
    for r in ranks:
        # the Trainer's scheduler (linear, one warm-up step) drove the optimizer's lr
        assert r["lrs"] == pytest.approx([0.0, 1e-3, 2e-3 / 3, 1e-3 / 3]), r["lrs"]
        assert len(r["evals"]) == 2  # evaluation at steps 2 and 4
        # resumed from checkpoint-2 (each rank its own optimizer state): steps 3 and 4
        # again, the parameters bitwise those of the run that saved it
        assert r["resume_bitwise"] is True
        assert r["resumed_sent"] == r["sent"][2:]
    assert records[0]["hf"]["weights_file"] is True  # from_pretrained(checkpoint-4): bitwise


@pytest.mark.multiprocess
def test_hf_trainer_example_runs_as_written(tmp_path):
    """examples/train_hf_trainer.py on 2 ranks (2 replicas), a checkpoint on the way."""
    missing = _missing("hf")
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (pip install \"flexdemo[hf]\")")
    outs = _two_ranks([str(EXAMPLE), "--replicate", "2", "--steps", "3", "--seq", "16",
                       "--save-every", "2", "--eval-every", "2", "--out",
                       str(tmp_path / "out")], tmp_path)
    done = [line for line in outs[0].splitlines() if line.startswith("done: ")]
    assert done and done[0].startswith("done: 3 steps, 3 here, bytes sent per step ["), outs[0]
    assert done[0].endswith("mesh (2, 1)"), done
    assert (tmp_path / "out" / "checkpoint-2" / "flexdemo").is_dir()


SNIPPETS = r"""
import json, sys
for where, code in json.load(open(sys.argv[1])):
    exec(compile(code, where, "exec"), {"__name__": "__main__"})
    print("SNIPPET-DONE", where, flush=True)
"""


@pytest.mark.multiprocess
def test_doc_snippets_run_as_written_on_two_ranks(tmp_path):
    """docs/integrations.md's snippets (marked torchrun 2), one after the other in the same 2
    ranks (Lightning's last)."""
    missing = sorted({m for stack in NEEDS for m in _missing(stack)})
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed "
                    "(pip install \"flexdemo[hf,lightning]\")")
    todo = [(s.where, s.code) for s in snippets(DOC) if s.mode == "torchrun"]
    assert len(todo) == 3, todo
    (tmp_path / "snippets.json").write_text(json.dumps(todo))
    (tmp_path / "run_snippets.py").write_text(SNIPPETS)
    outs = _two_ranks([str(tmp_path / "run_snippets.py"), str(tmp_path / "snippets.json")],
                      tmp_path)
    for out in outs:
        done = [line.split()[1] for line in out.splitlines() if line.startswith("SNIPPET-DONE")]
        assert done == [where for where, _ in todo], out[-3000:]
        sent = [int(line.rsplit(" ", 1)[1]) for line in out.splitlines()
                if line.startswith("bytes sent in the last step:")]
        assert len(sent) == 2 and all(b > 0 for b in sent), out[-3000:]


@pytest.mark.multiprocess
def test_accelerate_leaves_the_exchange_to_flexdemo(records):
    _check_stack("accelerate", records, "mlp")


@pytest.mark.multiprocess
def test_lightning_strategy_leaves_the_exchange_to_flexdemo(records):
    for r in _check_stack("lightning", records, "mlp"):
        # saved at the end of epoch 0 (every rank its own optimizer state) and resumed to the
        # end of epoch 1: bitwise the run that went through; 4 steps after the resume
        assert r["resume_bitwise"] is True
        assert r["resumed_steps"] == 8 and len(r["resumed_sent"]) == 4, r


PLAIN_MODEL = {"hf": "gpt2", "accelerate": "mlp", "lightning": "mlp"}
STACKS = [pytest.param(stack, marks=pytest.mark.multiprocess) for stack in NEEDS]


@pytest.mark.parametrize("stack", STACKS)
def test_one_replica_sharded_over_both_ranks(stack, records):
    """``prepare(model, ..., replicate=1, shard=2)`` on 2 ranks: FSDP2 shards the model over
    both, the framework trains it without DDP, each rank reads its own data."""
    _skip_if_missing(stack)
    ranks = [r[f"{stack}_shard2"] for r in records]
    whole = ranks[0]["layout"]["full"]
    for r in ranks:
        assert r["wrapped"] != "DistributedDataParallel", r
        layout = r["layout"]
        assert layout["dtensor"] and layout["mesh"] == [2], layout
        assert layout["placements"] == ["(Shard(dim=0),)"], layout
        assert layout["fsdp"].startswith("FSDP"), layout  # fully_shard's class
        assert 0 < layout["local"] < whole, layout
        assert len(r["grads"]) >= 3 and all(math.isfinite(g) for g in r["grads"]), r
        assert r["losses"] and all(math.isfinite(x) for x in r["losses"]), r
        assert r["sent"] == [0] * len(r["grads"]), r  # one replica: nothing to exchange
    assert ranks[0]["layout"]["local"] + ranks[1]["layout"]["local"] == whole, ranks
    assert ranks[0]["first"] != ranks[1]["first"], ranks  # each rank read its own data
    if stack == "hf":  # checkpoint-2 resumed to step 4: each rank's shards bitwise
        for r in ranks:
            assert r["resume_bitwise"] is True and r["resumed_sent"] == [0, 0], r
        # the Trainer's weights file holds the whole model, gathered from the shards
        assert ranks[0]["weights_file"] is True, ranks[0]
    if stack == "lightning":
        for r in ranks:
            assert r["resume_bitwise"] is True and r["resumed_steps"] == 8, r


BF16 = [pytest.param("hf", "args", marks=pytest.mark.multiprocess, id="hf-TrainingArguments"),
        pytest.param("hf", "prepare", marks=pytest.mark.multiprocess, id="hf-prepare"),
        pytest.param("accelerate", "args", marks=pytest.mark.multiprocess,
                     id="accelerate-mixed_precision"),
        pytest.param("lightning", "args", marks=pytest.mark.multiprocess,
                     id="lightning-bf16-mixed")]


@pytest.mark.parametrize(("stack", "how"), BF16)
def test_bf16_on_two_replicas(stack, how, records):
    """bf16 at shard=1: the framework's own (``TrainingArguments(bf16=True)``,
    ``Accelerator(mixed_precision="bf16")``, ``L.Trainer(precision="bf16-mixed")``: autocast)
    or ``flexdemo.prepare(precision="bf16")`` (FSDP2's bf16 compute copies; HF). The forward
    computes in bf16, the optimizer keeps fp32 weights and sees fp32 gradients, and the
    replicas exchange what they exchange in fp32."""
    _skip_if_missing(stack)
    ranks = [r[f"{stack}_bf16"] for r in records]
    if stack == "hf":
        ranks = [r[how] for r in ranks]
    _check_stack(stack, records, PLAIN_MODEL[stack], ranks)
    for r in ranks:
        assert r["computed"] == ["torch.bfloat16"], r["computed"]
        assert r["grad_dtypes"] == ["torch.float32"], r["grad_dtypes"]
        assert r["layout"]["dtypes"] == ["torch.float32"], r["layout"]
        assert r["losses"] and all(math.isfinite(x) for x in r["losses"]), r["losses"]
        if stack != "accelerate":
            assert r["resume_bitwise"] is True, r
    if stack == "hf":
        assert ranks[0]["weights_file"] is True, ranks[0]


BLOCKED = r"""
import importlib, sys, flexdemo
print(sorted(m for m in sys.modules
             if m.startswith(('flexdemo.integrations', 'transformers', 'accelerate', 'lightning'))))
for name in ('transformers', 'accelerate', 'lightning'):
    sys.modules[name] = None  # as if not installed
for module in ('hf', 'accelerate', 'lightning'):
    try:
        importlib.import_module('flexdemo.integrations.' + module)
    except ImportError as e:
        print(type(e).__name__, e)
"""


@pytest.mark.multiprocess
def test_integrations_load_on_demand_and_name_their_extra():
    """``import flexdemo`` imports none of them, nor their frameworks; without its framework
    each says in one line which extra to install."""
    r = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "[]", lines
    assert len(lines) == 4, lines
    for line, (module, extra) in zip(lines[1:], [("hf", "hf"), ("accelerate", "hf"),
                                                  ("lightning", "lightning")]):
        assert line.startswith(f"IntegrationMissingError flexdemo.integrations.{module} needs ")
        assert line.endswith(f'pip install "flexdemo[{extra}]"'), line


def test_a_framework_that_sees_one_process_of_two_is_refused(monkeypatch):
    """On a CPU-only machine Accelerate (and so the Trainer) takes a torchrun job for one
    process unless told to use the CPU: every rank would train on the same data."""
    import torch.distributed as dist

    from flexdemo.integrations import check_data_split

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    check_data_split(2, "the Trainer", "fix")
    with pytest.raises(ValueError) as info:
        check_data_split(1, "the Trainer", "pass TrainingArguments(use_cpu=True)")
    assert str(info.value) == ("the Trainer sees 1 process(es) of this job's 2, so every rank "
                               "would read the same data; pass TrainingArguments(use_cpu=True)")


# ------------------------------------------------------------------ replicas at their own pace
# The frameworks run the same number of steps on every rank: a DiLoCo pace that gives each
# replica its own inner steps per period would leave one waiting at a sync its peers never
# reach. Each integration refuses it in one line before the first step; equal given counts
# (lockstep) train as without a pace.
FIX = ("train it with `flexdemo train` (which counts a paced run in syncs) or your own loop "
       "that steps until the pace's sync (docs/stragglers.md), or drop pace=")


def _refusal(info: pytest.ExceptionInfo, where: str) -> None:
    """One line, from ``where``, naming the pace and the fix."""
    text = str(info.value)
    assert "\n" not in text, text
    assert text.startswith(f"{where} runs the same number of steps on every rank"), text
    assert "pace=" in text and text.endswith(FIX), text


def test_a_pace_not_in_lockstep_is_refused_by_the_check():
    from types import SimpleNamespace

    from flexdemo.integrations import check_lockstep
    from flexdemo.replicate.pace import Pace

    def opt(*paces):
        return SimpleNamespace(replicators=[SimpleNamespace(name="diloco", pace=p)
                                            for p in paces])

    for fine in (opt(Pace([4, 4])), opt(None), opt(None, Pace([3, 3, 3])), object()):
        check_lockstep(fine, "FlexTrainer")
    for pace in (Pace([30, 30, 30, 10]), Pace(), Pace("fixed"), Pace("adaptive"),
                 Pace([4, 4], adaptive=True)):
        with pytest.raises(ValueError) as info:
            check_lockstep(opt(None, pace), "FlexTrainer")
        _refusal(info, "FlexTrainer")
        assert f"the optimizer's diloco has pace={pace!r}" in str(info.value)


@pytest.fixture
def own_environ():
    """``prepare()`` and Lightning in this process set launch variables (``MASTER_PORT``,
    ``LOCAL_RANK``, ...) and Lightning the threads: put them back for the tests after."""
    import torch

    env, threads = dict(os.environ), torch.get_num_threads()
    yield
    for key in set(os.environ) - set(env):
        del os.environ[key]
    os.environ.update(env)
    torch.set_num_threads(threads)


def _paced(pace) -> tuple:
    """An MLP and its DiLoCo optimizer with ``pace`` from ``flexdemo.prepare()``, in this
    process (one rank: one replica)."""
    import warnings

    from integration_workers import mlp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", flexdemo.NoReplicationWarning)
        return flexdemo.prepare(mlp(), "diloco", lr=1e-3, shard=1,
                                replicator_kwargs={"inner_steps": 4, "pace": pace})


def test_hf_trainer_refuses_a_pace_not_in_lockstep(tmp_path, single_process, own_environ):
    _skip_if_missing("hf")
    import transformers

    from flexdemo.integrations.hf import FlexTrainer
    from flexdemo.replicate.pace import Pace

    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                          report_to=[], disable_tqdm=True)
    model, opt = _paced("fixed")
    with pytest.raises(ValueError) as info:
        FlexTrainer(model=model, args=args, optimizers=(opt, None))
    _refusal(info, "FlexTrainer")
    model, opt = _paced(Pace([4]))  # equal given counts (one replica here): lockstep
    assert FlexTrainer(model=model, args=args, optimizers=(opt, None)).flexdemo_optimizer is opt


def test_accelerate_prepare_refuses_a_pace_not_in_lockstep(single_process, own_environ):
    _skip_if_missing("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from flexdemo.integrations.accelerate import prepare
    from flexdemo.replicate.pace import Pace

    AcceleratorState._reset_state()
    try:
        accelerator = Accelerator(cpu=True)
        model, opt = _paced(Pace([4], adaptive=True))  # given counts, then measured
        with pytest.raises(ValueError) as info:
            prepare(accelerator, model, opt)
        _refusal(info, "flexdemo.integrations.accelerate.prepare()")
        model, opt = _paced(Pace([4]))  # lockstep
        assert prepare(accelerator, model, opt)[0] is model
    finally:
        AcceleratorState._reset_state()


def test_lightning_refuses_a_pace_not_in_lockstep(tmp_path, single_process, own_environ):
    _skip_if_missing("lightning")
    import lightning as L
    import torch
    from integration_workers import mlp_data

    from flexdemo.integrations.lightning import FlexStrategy
    from flexdemo.replicate.pace import Pace

    class Module(L.LightningModule):
        def __init__(self, pace) -> None:
            super().__init__()
            self.pace, self.steps = pace, 0

        def configure_model(self) -> None:
            self.net, self.flex_opt = _paced(self.pace)

        def configure_optimizers(self):
            return self.flex_opt

        def training_step(self, batch, i):
            self.steps += 1
            return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def fit(module: Module) -> None:
        L.Trainer(strategy=FlexStrategy(), accelerator="cpu", devices=1, max_steps=2,
                  logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, default_root_dir=str(tmp_path)).fit(
            module, torch.utils.data.DataLoader(mlp_data(), batch_size=4))

    refused = Module("adaptive")
    with pytest.raises(ValueError) as info:
        fit(refused)
    _refusal(info, "FlexStrategy")
    assert refused.steps == 0  # before the first step
    accepted = Module(Pace([4]))  # lockstep
    fit(accepted)
    assert accepted.steps == 2
