"""The README's Python examples run as written (offline: registry shapes, the GSM8K copy), in one namespace as a
reader pastes them one after another."""

from __future__ import annotations

import re
from pathlib import Path

from .conftest import GSM8K_DIR, requires_gsm8k

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@requires_gsm8k
def test_readme_python_examples_run(tmp_path, monkeypatch):
    blocks = _python_blocks()
    assert len(blocks) >= 2, "the README's two Trainer examples"
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    for code in blocks:
        exec(compile(code.replace("../shared/data/gsm8k", str(GSM8K_DIR)), str(README), "exec"), ns)  # noqa: S102
    trainer = ns["trainer"]
    logs = [h for h in trainer.state.log_history if "train_loss" in h]
    assert trainer.state.global_step == 4 and logs and logs[-1]["train_loss"] > 0
    assert trainer.executor is not None  # the second example streams the layers
