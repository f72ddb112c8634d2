"""flexdemo train's messages: one step count (from 1, as in metrics.jsonl and the progress
lines) and advice in config keys, not in library calls."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from flexdemo.app.config.files import load_config
from flexdemo.app.errors import TrainingError, UsageError
from flexdemo.app.train.trainer import train

ROOT = Path(__file__).parent.parent
QUICK = ["task.model=tiny", "task.corpus_bytes=200000", "train.batch=2", "train.warmup=0",
         "train.tensorboard=false", "train.progress=false", "train.threads=0"]


def _run(overrides: list[str]) -> dict:
    return train(load_config(ROOT / "configs/gpt.toml", [*QUICK, *overrides]),
                 echo=lambda text: None)


def test_a_nan_step_is_named_in_one_step_count(tmp_path, single_process):
    """lr 1e30 makes step 2's gradients NaN. The line used to read "step 2: ... at step 1"
    (the trainer counts from 1, the library from 0) and to advise constructing the optimizer
    with nonfinite='skip', which a config cannot do."""
    with pytest.raises(TrainingError) as info:
        _run(["train.steps=4", "strategy.lr=1e30", f"train.out={tmp_path / 'run'}"])
    text = str(info.value)
    assert "\n" not in text and text.startswith("step 2: "), text
    steps = {int(n) for n in re.findall(r"\bstep (\d+)", text)}
    assert steps == {2}, text
    assert "strategy.nonfinite='skip'" in text and "construct the optimizer" not in text, text
    assert "strategy.lr" in text, text


def test_an_unreadable_unverified_checkpoint_is_damaged_not_a_resume_to_retry(
        tmp_path, single_process):
    """A checkpoint written before digests were recorded (no file table in its marker) whose
    flexdemo.json is garbage: the refusal used to tell the user to call
    flexdemo.checkpoint.latest_checkpoint(root), then to run resume=true, which is what had
    been run. It is damaged: set aside, and with nothing intact left, refused."""
    out = tmp_path / "run"
    _run(["train.steps=2", "train.checkpoint_every=2", f"train.out={out}"])
    ckpt = out / "checkpoints" / "step_000002"
    marker = json.loads((ckpt / "COMPLETE").read_text())
    marker.pop("files", None)
    (ckpt / "COMPLETE").write_text(json.dumps(marker))
    (ckpt / "flexdemo.json").write_text("{not json")
    with pytest.raises(UsageError) as info:
        _run(["train.steps=4", "train.checkpoint_every=2", f"train.out={out}", "resume=true"])
    text = str(info.value)
    assert "\n" not in text and "latest_checkpoint(" not in text, text
    assert "step_000002 is damaged (flexdemo.json is unreadable" in text, text
    assert "resume=true" not in text and "train.overwrite=true" in text, text
