"""Timeline picture (lazytrain_hf/planning/timeline.py)."""

from __future__ import annotations

from lazytrain_hf.planning import make_schedule, plot_timeline, simulate
from lazytrain_hf.planning.timeline import task_category


def test_png_is_written(tmp_path, cm4):
    s = make_schedule(cm4, "fixed", checkpoint_every=2, tier="cpu")
    out = plot_timeline(simulate(cm4, s), tmp_path / "sub" / "t.png", title="test", gpu_budget_bytes=cm4.gpu_bytes)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_task_categories():
    assert task_category("opt state L3") == "opt state"
    assert task_category("fwd+grad L1") == "fwd+grad"
    assert task_category("W L0") == "W"
    assert task_category("opt emb") == "opt"
