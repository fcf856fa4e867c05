"""The GPU benchmark harness runs on the CPU on a tiny shape (so it cannot rot); no timing is asserted."""

from __future__ import annotations

import json

import pytest

from .conftest import requires_gsm8k


@requires_gsm8k
@pytest.mark.parametrize("system", ["lazytrain_fixed", "lazytrain_milp", "stock_trainer"])
def test_bench_executor_cpu_smoke(tmp_path, system):
    from benchmarks.bench_executor import main

    out = tmp_path / "executor.json"
    main(["--system", system, "--model", "qwen3-tiny-vocab", "--device", "cpu", "--batch-sizes", "2",
          "--seq-len", "32", "--steps", "1", "--checkpoint-every", "2", "--rows-per-pass", "1", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["suite"] == "executor" and doc["command"]
    (r,) = doc["rows"]
    assert r["status"] == "ok", r["reason"]
    assert r["steps_timed"] == 1 and r["tokens_per_s"] > 0 and r["tflops_6nd"] > 0
    assert set(r) >= {"exposed_h2d_ms", "pinned_planned_gib", "predicted_step_s", "extra"}
