"""The soak suite (benchmarks/soak.py) on a tiny shape: windows, evaluation, checkpoints and the targets' summary."""

from __future__ import annotations

import json

from .conftest import requires_gsm8k


def test_summary_targets_from_windows_and_steps():
    from benchmarks.soak import summarize

    windows = [{"step": s, "rss_gib": 10.0 + 0.01 * s, "pinned_locked_gib": 5.0} for s in (10, 20, 30)]
    steps = [{"step": s, "s": 1.0 + (0.5 if s == 29 else 0.0), "tokens": 1000, "bucket": 256 if s % 2 else 512,
              "computed_tokens": 1500 if s == 29 else 1000, "predicted_s": 0.5 * (1.5 if s == 29 else 1.0)}
             for s in range(1, 31)]
    out = summarize(steps, windows, warmup=10)
    assert out["windows_after_warmup"] == 2 and abs(out["rss_growth"] - 0.1 / 10.2) < 1e-9 and out["rss_growth_met"]
    assert out["pinned_constant_met"] and set(out["buckets"]) == {"256", "512"}
    assert out["buckets"]["512"]["p95_over_median"] == 1.0 and out["buckets"]["256"]["p95_over_median"] == 1.5
    assert out["p95_met"] is False  # the one slow step is the p95 of its bucket's 10
    # per computed token the slow step did 1.5x the work: flat
    assert out["buckets"]["256"]["p95_over_median_computed"] == 1.0
    # the plan predicted the slow step 1.5x longer (its own length): measured / predicted is flat at 2x
    assert out["buckets"]["256"]["p95_over_median_vs_plan"] == 1.0 and out["buckets"]["256"]["median_vs_plan"] == 2.0


@requires_gsm8k
def test_soak_cpu_smoke(tmp_path):
    from benchmarks import soak

    out = tmp_path / "soak.json"
    r = soak.main(["--out", str(out), "--model", "qwen3-tiny-vocab", "--device", "cpu", "--batch-size", "2",
                   "--max-length", "512", "--max-steps", "4", "--window", "2", "--warmup", "0", "--eval-every", "2",
                   "--eval-rows", "4", "--save-every", "2", "--work-dir", str(tmp_path / "work")])
    assert r["status"] == "ok", r["reason"]
    doc = json.loads(out.read_text())
    assert doc["suite"] == "soak" and len(doc["rows"]) == 1
    e = r["extra"]
    assert e["optimizer_steps"] == 4 and [w["step"] for w in e["windows"]] == [2, 4]
    assert e["batches"] == "grouped by length"
    assert [x["step"] for x in e["evals"]] == [2, 4] and e["checkpoints_left"] == ["checkpoint-4"]
    # each step's real tokens: the non-pad tokens of its batch (2 GSM8K examples, at most 512 tokens each)
    assert all(40 < s["tokens"] <= s["computed_tokens"] <= 1024 for s in e["steps"])
    # the running plan's prediction at each batch's own padded length (2 rows of `length`): longer, not cheaper
    assert all(2 * s["length"] == s["computed_tokens"] and 0 < s["predicted_s"] < 1e3 for s in e["steps"])
    by_length = sorted((s["bucket"], s["length"], s["predicted_s"]) for s in e["steps"])
    assert all(a[2] <= b[2] for a, b in zip(by_length, by_length[1:]) if a[0] == b[0]), by_length
    assert len({s["length"] for s in e["steps"]}) > 1  # (grouped GSM8K batches: lengths differ)
    assert all("p95_over_median_vs_plan" in b for b in e["summary"]["buckets"].values() if b["steps"] >= 2)
    assert e["summary"]["nvme_files_left"] == 0
    assert e["summary"]["windows_after_warmup"] == 2 and "rss_growth" in e["summary"]
