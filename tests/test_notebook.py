"""The quickstart notebook runs top to bottom on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import GSM8K_DIR, requires_gsm8k

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


@requires_gsm8k
def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("LAZYTRAIN_GSM8K_DIR", str(GSM8K_DIR))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    assert (tmp_path / "outputs" / "quickstart" / "final" / "config.json").is_file()
