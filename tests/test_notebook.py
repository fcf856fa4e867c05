"""The quickstart notebook runs top to bottom on the CPU, shows its pictures inline (the planned timeline and the
loss curve), and takes a model folder by changing the settings cell only (what a GPU user changes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import GSM8K_DIR, requires_gsm8k

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def _run(tmp_path, monkeypatch, model: str | None = None):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("LAZYTRAIN_GSM8K_DIR", str(GSM8K_DIR))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    if model is not None:
        (settings,) = [c for c in nb.cells if c.source.startswith("# Settings")]
        settings.source = settings.source.replace('MODEL = "qwen3-tiny-vocab"', f"MODEL = {model!r}")
        assert repr(model) in settings.source
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    assert (tmp_path / "outputs" / "quickstart" / "final" / "config.json").is_file()
    return nb


def _images(cell) -> int:
    return sum("image/png" in o.get("data", {}) for o in cell.get("outputs", []))


@requires_gsm8k
def test_quickstart_notebook_runs_with_inline_pictures(tmp_path, monkeypatch):
    nb = _run(tmp_path, monkeypatch)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code[0].source.startswith("# Install") and not code[0].outputs  # importable here: nothing installed
    shown = [c for c in code if _images(c)]
    assert len(shown) == 2 and "timeline.png" in shown[0].source and "plt.show()" in shown[1].source
    assert (tmp_path / "outputs" / "quickstart" / "loss.png").is_file()


@requires_gsm8k
def test_quickstart_notebook_takes_a_model_folder_from_the_settings_cell(tmp_path, monkeypatch):
    from lazytrain_hf.models import load_model

    folder = tmp_path / "my-model"
    load_model("qwen3-tiny-vocab", "float32", seed=1).save_pretrained(folder)
    nb = _run(tmp_path, monkeypatch, str(folder))
    (plan,) = [c for c in nb.cells if "timeline.png" in c.source]
    assert f"model {folder}" in "".join(o.get("text", "") for o in plan.outputs) and _images(plan)
