"""LazyTrain's plan lines reach a script that configured no logging (hf/log_setup.py): the Trainer's log_level
decides, a script's own logging config takes over with no duplicate line. Each case runs in its own interpreter,
since pytest puts a handler on the root logger."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_TRAIN = """
import logging, sys, torch
from lazytrain_hf.hf import LazyTrainer, LazyTrainingArguments
from lazytrain_hf.models import load_model
{pre}
rows = [{{"input_ids": [1 + (i * 7 + j) % 90 for j in range(12)], "attention_mask": [1] * 12,
          "labels": [1 + (i * 7 + j) % 90 for j in range(12)]}} for i in range(8)]
collate = lambda rs: {{k: torch.tensor([r[k] for r in rs]) for k in rs[0]}}
args = LazyTrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=2, max_steps=1, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True, {args}
                             lazytrain_config={{"device": "cpu"}})
LazyTrainer(model=load_model("qwen3-tiny", "float32", seed=0), args=args, train_dataset=rows,
            data_collator=collate).train()
"""


def _run(tmp_path: Path, pre: str = "", args: str = "") -> str:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_TRAIN.format(pre=pre, args=args)))
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.run([sys.executable, str(script), str(tmp_path / "out")], capture_output=True, text=True,
                       env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stderr


def test_plan_lines_are_shown_by_default_and_follow_log_level(tmp_path):
    err = _run(tmp_path)
    plan_lines = [ln for ln in err.splitlines() if ln.startswith("[INFO|lazytrain_hf] LazyTrain schedule:")]
    assert len(plan_lines) == 1 and "rows per pass" in plan_lines[0], err[-3000:]
    quiet = _run(tmp_path, args='log_level="warning",')
    assert "[INFO|lazytrain_hf]" not in quiet and "LazyTrain schedule:" not in quiet, quiet[-3000:]


def test_a_scripts_own_logging_config_takes_over_without_duplicates(tmp_path):
    err = _run(tmp_path, pre='logging.basicConfig(level=logging.INFO, format="MINE %(name)s %(message)s")')
    assert "[INFO|lazytrain_hf]" not in err, err[-3000:]
    mine = [ln for ln in err.splitlines() if ln.startswith("MINE lazytrain_hf") and "LazyTrain schedule:" in ln]
    assert len(mine) == 1, err[-3000:]


def test_levels_follow_the_trainers_log_level_and_keep_a_more_verbose_root(monkeypatch):
    import logging
    from types import SimpleNamespace

    from lazytrain_hf.hf import log_setup

    log = logging.getLogger(log_setup.LOGGER_NAME)
    monkeypatch.setattr(log, "level", logging.NOTSET)
    monkeypatch.setattr(log, "handlers", [])
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", logging.DEBUG)  # the CLI's --verbose
    log_setup.configure(SimpleNamespace(should_log=True, log_level="passive"))
    assert log.level == logging.NOTSET and log.getEffectiveLevel() == logging.DEBUG
    monkeypatch.setattr(root, "level", logging.WARNING)
    log_setup.configure(SimpleNamespace(should_log=True, log_level="passive"))
    assert log.level == logging.INFO and len(log.handlers) == 1  # one handler however often configured
    log_setup.configure(SimpleNamespace(should_log=True, log_level="error"))
    assert log.level == logging.ERROR
    monkeypatch.setattr(log, "level", logging.NOTSET)
    log_setup.configure(SimpleNamespace(should_log=False, log_level="passive", log_level_replica="passive"))
    assert log.level == logging.WARNING
    log_setup.configure(SimpleNamespace(should_log=False, log_level="info", log_level_replica="debug"))
    assert log.level == logging.DEBUG
