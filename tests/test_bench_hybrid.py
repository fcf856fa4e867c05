"""The harness's hybrid suite machinery on the CPU: model strings with a depth option, the largest-batch search
(single batch sizes, out-of-memory recoveries, resume), the train-begin vs calibrated MILP prediction, LazyTrain rows
with the product's defaults and their report. Nothing about timing is asserted."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from .conftest import requires_gsm8k


def test_model_string_parsing():
    from benchmarks.common import parse_model

    assert parse_model("qwen3.6-27b") == ("qwen3.6-27b", {})
    assert parse_model("qwen3.6-27b:layers=16") == ("qwen3.6-27b", {"num_hidden_layers": 16})
    assert parse_model("Qwen/Qwen3.5-27B:layers=8") == ("Qwen/Qwen3.5-27B", {"num_hidden_layers": 8})
    for bad in ("qwen3.6-27b:layers=0", "qwen3.6-27b:layers=x", "qwen3.6-27b:depth=4", "qwen3.6-27b:layers",
                "qwen3.6-27b:layers=4:layers=2", ":layers=4"):
        with pytest.raises(ValueError, match="qwen3.6-27b:layers=16"):
            parse_model(bad)


def test_depth_override_keeps_the_first_layers_and_their_kinds(tmp_path):
    """Registry and loaded configs alike: num_hidden_layers and layer_types agree and are the deep model's first
    layers (Qwen3.5: 3 linear-attention, then 1 full-attention), as transformers derives them for that depth; a
    loaded config given only the count would keep its 64 layer kinds."""
    from transformers import AutoConfig

    from benchmarks.common import depth_overrides, model_overrides
    from lazytrain_hf.models import ARCHITECTURES, resolve_config

    name, over = model_overrides("qwen3.6-27b:layers=16")
    cfg = resolve_config(name, **over)
    model_type, kwargs = ARCHITECTURES["qwen3.6-27b"]
    derived = AutoConfig.for_model(model_type, **{**kwargs, "num_hidden_layers": 16}).layer_types
    assert cfg.num_hidden_layers == 16 and cfg.layer_types == derived
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"] + cfg.layer_types[4:]
    assert cfg.layer_types[:4] * 4 == cfg.layer_types and cfg.layer_types == resolve_config(name).layer_types[:16]
    assert cfg.hidden_size == resolve_config(name).hidden_size  # only the depth changes

    resolve_config("qwen3.6-27b").save_pretrained(tmp_path)  # a local folder: its config lists 64 layer kinds
    assert len(AutoConfig.from_pretrained(tmp_path, num_hidden_layers=16).layer_types) == 64
    loaded = AutoConfig.from_pretrained(tmp_path, **depth_overrides(str(tmp_path), 16))
    assert loaded.num_hidden_layers == 16 and loaded.layer_types == derived
    with pytest.raises(ValueError, match="layers=N with N <= 64"):
        depth_overrides("qwen3.6-27b", 65)
    assert model_overrides("qwen3-tiny") == ("qwen3-tiny", {})


def test_fast_random_model_builds_the_cut_depth():
    from benchmarks.common import fast_random_model

    model = fast_random_model("qwen3.5-tiny:layers=2")
    assert len(model.model.layers) == 2 and model.config.layer_types == ["linear_attention"] * 2


@pytest.mark.parametrize("models, match", [("qwen3.6-27b:layers=65", "N <= 64"), ("qwen3.6-27b:depth=2", "layers=N"),
                                           ("nosuch:layers=2", "unknown models")])
def test_bad_model_strings_are_refused_before_any_worker(capsys, models, match):
    from benchmarks.run import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--suite", "smoke", "--out", "x.json", "--models", models])
    assert match in capsys.readouterr().err


def test_search_resolves_single_batch_sizes():
    """Doubling, then bisection down to adjacent sizes, for every largest feasible batch up to the limit; each size
    probed once. (With the old 12.5% resolution the search stopped with a gap: 40 feasible, 44 not.)"""
    from benchmarks.run import search_max_batch

    for limit in [*range(1, 70), 100, 511]:
        seen: list[int] = []
        assert search_max_batch(lambda B, s=seen, m=limit: s.append(B) or B <= m, limit=512) == (limit, limit + 1,
                                                                                                   True)
        assert len(seen) == len(set(seen))
    seen = []
    assert search_max_batch(lambda B: seen.append(B) or B <= 43, lo=8, resolution=0.125) == (40, 44, True)
    assert search_max_batch(lambda B: True, lo=8, limit=100) == (100, None, True)   # the limit itself is tried
    assert search_max_batch(lambda B: False, lo=0) == (0, 1, True)                  # nothing fits
    steps: list[tuple] = []
    assert search_max_batch(lambda B: None if B == 64 else True, lo=8, progress=lambda lo, hi: steps.append((lo, hi))) \
        == (32, None, False)
    assert steps == [(16, None), (32, None)]


def test_a_probe_that_needed_an_out_of_memory_recovery_is_infeasible(tmp_path, monkeypatch):
    """LazyTrain may recover from running out of GPU memory and train on: such a batch is not feasible. The searched
    sizes and their outcomes are recorded."""
    from benchmarks import run
    from benchmarks.common import row

    def fake(spec, timeout_s, deadline, workdir):
        (B,) = spec["batch_sizes"]
        status = "ok" if B <= 40 else "oom"
        return [row(system=spec["system"], model=spec["model"], gpu_cap_gib=spec["gpu_cap_gib"], batch_size=B,
                    status=status, extra={"oom_recoveries": int(32 < B <= 40)} if status == "ok" else {})]

    monkeypatch.setattr(run, "run_process", fake)
    out = tmp_path / "mb.json"
    args = run.parse_args(["--suite", "smoke", "--out", str(out)])
    res = run.Results(out, "smoke", "test")
    run.find_max_batch(args, run.SUITES["smoke"], res, "lazytrain_milp", "m", 24, time.time() + 100, tmp_path)
    (entry,) = json.loads(out.read_text())["max_batch"]
    assert (entry["max_batch"], entry["first_infeasible"], entry["complete"]) == (32, 33, True)
    probes = {p["batch_size"]: p for p in entry["probes"]}
    assert [p["batch_size"] for p in entry["probes"]][:7] == [1, 2, 4, 8, 16, 32, 64]
    assert probes[48]["feasible"] is False and probes[48]["status"] == "oom"
    assert probes[40]["feasible"] is False and probes[40]["status"] == "ok" and probes[40]["reason"] == run.RECOVERED
    assert probes[32]["feasible"] is True and probes[32]["oom_recoveries"] == 0
    # the same rule for rows already measured (they seed the bounds) and for a row that failed after a recovery
    assert run.probe_outcome(row(status="ok", extra={"oom_recoveries": 2})) == (False, run.RECOVERED)
    assert run.probe_outcome(row(status="error", reason="x", extra={"oom_recoveries": 1})) == (False, run.RECOVERED)
    assert run.probe_outcome(row(status="error", reason="x")) == (None, "x")
    from benchmarks.report import max_batch_table

    text = "\n".join(max_batch_table([entry]))
    assert "| 32 | 33 | True | 1 feasible; 2 feasible;" in text and "40 infeasible (out-of-memory recovery)" in text


def test_an_unfinished_search_resumes_from_its_saved_probes(tmp_path, monkeypatch):
    from benchmarks import run
    from benchmarks.common import row

    seen: list[int] = []
    broken = {"on": True}

    def fake(spec, timeout_s, deadline, workdir):
        (B,) = spec["batch_sizes"]
        seen.append(B)
        status = "error" if broken["on"] and B == 64 else "ok" if B <= 50 else "oom"
        return [row(system=spec["system"], model=spec["model"], gpu_cap_gib=spec["gpu_cap_gib"], batch_size=B,
                    status=status, reason=None if status == "ok" else status)]

    monkeypatch.setattr(run, "run_process", fake)
    out = tmp_path / "mb.json"
    args = run.parse_args(["--suite", "smoke", "--out", str(out)])
    res = run.Results(out, "smoke", "test")
    res.put([row(system="lazytrain_fixed", model="m", gpu_cap_gib=24, batch_size=8, status="ok")])
    run.find_max_batch(args, run.SUITES["smoke"], res, "lazytrain_fixed", "m", 24, time.time() + 100, tmp_path)
    (entry,) = json.loads(out.read_text())["max_batch"]
    assert seen == [16, 32, 64] and not entry["complete"] and entry["max_batch"] == 32
    broken["on"], seen[:] = False, []
    res = run.Results(out, "smoke", "test")   # the next call
    run.find_max_batch(args, run.SUITES["smoke"], res, "lazytrain_fixed", "m", 24, time.time() + 100, tmp_path)
    (entry,) = json.loads(out.read_text())["max_batch"]
    assert seen[0] == 64 and 16 not in seen and 32 not in seen
    assert (entry["max_batch"], entry["first_infeasible"], entry["complete"]) == (50, 51, True)
    assert [p["batch_size"] for p in entry["probes"]][:4] == [16, 32, 64, 64]  # the failed probe stays recorded


def _fake_lazytrainer(step_ms: float, cal: object) -> SimpleNamespace:
    layer = SimpleNamespace(checkpoint=True, retain=False, optimizer_device="cpu")
    sched = SimpleNamespace(policy="milp", predicted={"step_ms": step_ms}, solver={"solve_ms": 9.0, "mip_gap": 0.01},
                            layers=[layer], prefetch_depth=1, keep_grads=False, rows_per_pass=4)
    stats = SimpleNamespace(recomputed_layers=0, weight_loads=1, extra={})
    ex = SimpleNamespace(schedule=sched, pinned_bytes={"planned": 0, "registered": 0, "host_allocator": 0},
                         stats=stats, reuse_slots=True, updater=None, streamer=None,
                         config=SimpleNamespace(max_rows_per_pass=None), resident=SimpleNamespace(placement="host"))
    return SimpleNamespace(executor=ex, calibration=cal, oom_recoveries=0)


def test_predicted_step_is_the_train_begin_plan_and_the_calibrated_one_is_kept_apart():
    """The first step records the plan it runs (made at train begin); a calibration re-plan later changes the running
    schedule: predicted_step_s stays the train-begin one, the re-planned step goes to extra; when calibration kept the
    plan, extra holds the running plan valued at the measured costs."""
    from benchmarks.systems import StepTimer, lazytrain_metrics
    from benchmarks.worker import recoveries
    from lazytrain_hf.hf.calibrate import Calibration

    cal = Calibration(3)
    trainer = _fake_lazytrainer(1500.0, cal)
    timer = StepTimer("cpu")
    timer.trainer = trainer
    timer.on_train_begin(None, None, None)
    for step in range(4):
        timer.on_step_begin(None, None, None)
        if step == 1:   # a recovery in the warm-up step, one in a timed step
            trainer.oom_recoveries += 1
        if step == 2:  # the calibration re-plans after this step
            trainer.oom_recoveries += 1
            cal.done, cal.predicted_before_ms = True, 1500.0
            trainer.executor.schedule.predicted = {"step_ms": 2100.0}
        timer.on_step_end(None, None, None)
    assert timer.plan_at_start == {"step_ms": 1500.0, "solve_ms": 9.0, "mip_gap": 0.01}
    fields, extra = lazytrain_metrics(trainer, timer.plan_at_start)
    assert fields["predicted_step_s"] == 1.5 and fields["solve_ms"] == 9.0 and extra["predicted_step_s_calibrated"] == 2.1
    assert recoveries(timer, 2) == {"oom_recoveries": 2, "oom_recoveries_timed": 1}
    kept = Calibration(3, done=True, kept_running_ms=1800.0)
    fields, extra = lazytrain_metrics(_fake_lazytrainer(1500.0, kept))
    assert fields["predicted_step_s"] == 1.5 and extra["predicted_step_s_calibrated"] == 1.8
    fields, extra = lazytrain_metrics(_fake_lazytrainer(1500.0, Calibration(0)))
    assert extra["predicted_step_s_calibrated"] is None


def test_product_defaults_lazytrain_rows(tmp_path):
    """The hybrid suite's LazyTrain rows: LazyTrainingArguments with only the policy and the GPU budget in
    lazytrain_config, the stock LazyTrainer (none of the harness's 8-bit embedding states, Kahan masters, row passes
    or calibration steps)."""
    from benchmarks import run, systems
    from benchmarks.common import fast_random_model
    from lazytrain_hf.hf import LazyTrainer

    args = run.parse_args(["--suite", "hybrid", "--device", "cpu", "--out", str(tmp_path / "h.json")])
    spec = run._spec(args, run.SUITES["hybrid"], "lazytrain_milp", "qwen3.5-tiny:layers=2", 24, [2])
    assert spec["configuration"] == systems.PRODUCT_DEFAULTS and "master_weights" not in spec
    targs, extra = systems.build_args("lazytrain_milp", spec, 2, 2, output_dir=str(tmp_path))
    assert extra["lazytrain_config"] == {"policy": "milp", "gpu_memory_budget": "24GiB"}
    assert extra["configuration"] == "product defaults"
    harness = run._spec(run.parse_args(["--suite", "smoke", "--out", "x.json"]), run.SUITES["smoke"],
                        "lazytrain_milp", "qwen3-tiny", None, [2])
    assert systems.build_args("lazytrain_milp", harness, 2, 2, output_dir=str(tmp_path))[1]["lazytrain_config"][
        "master_weights"] == "kahan"   # the 7b / full / smoke suites keep the harness's settings
    import torch

    from benchmarks.worker import TokenRows

    model = fast_random_model("qwen3.5-tiny:layers=2")
    trainer = systems.build_trainer("lazytrain_milp", spec, model, targs,
                                    TokenRows(torch.zeros(4, 8, dtype=torch.long)), systems.StepTimer("cpu"))
    assert type(trainer) is LazyTrainer


@pytest.mark.parametrize("bad, env", [(["--rows-per-pass", "4"], None), (["--embedding-states", "8bit"], None),
                                      (["--no-kept-grads"], None), ([], "HARNESS_CALIBRATE_STEPS"),
                                      ([], "HARNESS_GPU_MEMORY_MARGIN"), ([], "HARNESS_SLOT_REUSE")])
def test_product_defaults_refuse_harness_settings(monkeypatch, capsys, bad, env):
    from benchmarks.run import parse_args

    if env:
        monkeypatch.setenv(env, "0")
    with pytest.raises(SystemExit):
        parse_args(["--suite", "hybrid", "--device", "cpu", "--out", "x.json", *bad])
    assert "product's defaults" in capsys.readouterr().err


@requires_gsm8k
def test_hybrid_suite_cpu_smoke_and_report(tmp_path, monkeypatch):
    """The hybrid suite's machinery on a tiny Qwen3.5 shape cut to 2 layers: both LazyTrain rows train with the
    product's defaults, record the model string as given, its depth, the train-begin prediction, the recoveries and
    the linear-attention kernel; the report gives the suite's table; a resume re-runs nothing, and the file refuses
    rows of the harness's settings."""
    from benchmarks import report, run

    out = tmp_path / "hybrid.json"
    argv = ["--suite", "hybrid", "--device", "cpu", "--models", "qwen3.5-tiny:layers=2", "--caps", "none",
            "--seq-len", "32", "--steps", "1", "--warmup", "1", "--batch-sizes", "2", "--out", str(out)]
    run.main(argv)
    doc = json.loads(out.read_text())
    rows = {r["system"]: r for r in doc["rows"]}
    assert set(rows) == {"lazytrain_milp", "lazytrain_fixed"}  # the suite's systems only
    for s, r in rows.items():
        assert r["status"] == "ok", r["reason"]
        assert r["model"] == "qwen3.5-tiny:layers=2" and r["extra"]["num_hidden_layers"] == 2
        assert r["extra"]["configuration"] == "product defaults"
        assert r["extra"]["lazytrain_config"] == {"policy": s.split("_")[1]}  # uncapped: no budget either
        assert r["extra"]["oom_recoveries"] == 0 and "linear_attention_kernel" in r["extra"]
    assert rows["lazytrain_milp"]["predicted_step_s"] > 0 and rows["lazytrain_fixed"]["predicted_step_s"] > 0

    monkeypatch.setattr(run, "run_process", lambda *a, **k: pytest.fail("resume re-ran a finished row"))
    run.main(argv)
    text = report.markdown(doc, None)
    assert "## qwen3.5-tiny:layers=2, GPU cap uncapped" in text and "| linear-attention kernel | MILP / fixed |" in text
    milp = next(line for line in text.splitlines() if line.startswith("| lazytrain_milp | 2 | ok |"))
    ratio = rows["lazytrain_milp"]["tflops_6nd"] / rows["lazytrain_fixed"]["tflops_6nd"]
    assert f"| {ratio:.2f}x |" in milp
    err = 100 * (rows["lazytrain_milp"]["predicted_step_s"] / rows["lazytrain_milp"]["step_s_median"] - 1)
    assert f"| {err:+.1f} |" in milp

    harness = tmp_path / "harness.json"   # a file of another configuration is not resumed into
    harness.write_text(json.dumps(dict(doc, rows=[dict(r, extra=dict(r["extra"], configuration="harness settings"))
                                                  for r in doc["rows"]])))
    with pytest.raises(SystemExit, match="harness settings"):
        run.main([*argv[:-1], str(harness)])


def test_the_hybrid_suite_searches_both_policies_from_the_planners_largest_batch(tmp_path, monkeypatch):
    """Both policies' searches start at the planner's largest batch (`planned_max_batch`, recorded as "planned")
    and end at adjacent sizes: a right guess takes two probes, a wrong one doubles / bisects from the probes."""
    from benchmarks import run
    from benchmarks.common import row

    largest = {"lazytrain_milp": 94, "lazytrain_fixed": 78}
    monkeypatch.setattr(run, "planned_max_batch", lambda system, *a: {"lazytrain_milp": 94, "lazytrain_fixed": 73}[system])
    monkeypatch.setattr(run, "run_process", lambda spec, *a, **k: [
        row(system=spec["system"], batch_size=spec["batch_sizes"][0],
            status="ok" if spec["batch_sizes"][0] <= largest[spec["system"]] else "oom")])
    out = tmp_path / "h.json"
    args = run.parse_args(["--suite", "hybrid", "--device", "cpu", "--out", str(out)])
    assert args.max_batch_limits == {} and args.max_batch_limit == 512
    res = run.Results(out, "hybrid", "test")
    model = "qwen3.6-27b:layers=16"
    res.put([row(system=s, model=model, gpu_cap_gib=24, batch_size=B, status="ok")
             for s, B in (("lazytrain_milp", 8), ("lazytrain_milp", 32), ("lazytrain_fixed", 8))])
    for system in ("lazytrain_milp", "lazytrain_fixed"):
        run.find_max_batch(args, run.SUITES["hybrid"], res, system, model, 24, time.time() + 1000, tmp_path)
    entries = {e["system"]: e for e in json.loads(out.read_text())["max_batch"]}
    milp, fixed = entries["lazytrain_milp"], entries["lazytrain_fixed"]
    assert (milp["max_batch"], milp["first_infeasible"], milp["planned"], milp["complete"]) == (94, 95, 94, True)
    assert [p["batch_size"] for p in milp["probes"]] == [94, 95]
    assert (fixed["max_batch"], fixed["first_infeasible"], fixed["planned"], fixed["complete"]) == (78, 79, 73, True)
    # the MILP's largest first (the claim: infeasible there), then from the planner's guess
    assert [p["batch_size"] for p in fixed["probes"]][:3] == [94, 73, 74]


def test_hybrid_targets_read_the_rows_and_searches():
    from benchmarks.common import row
    from benchmarks.report import hybrid_targets

    model = "qwen3.6-27b:layers=16"

    def r(system, cap, B, step, tflops=None, pred=None, **extra):
        return row(system=system, model=model, gpu_cap_gib=cap, batch_size=B, status="ok", step_s_median=step,
                   tflops_6nd=tflops, predicted_step_s=pred, extra={"linear_attention_kernel": "torch", **extra})
    doc = {"rows": [r("lazytrain_milp", 80, 72, 14.0, 272.0, 13.5), r("lazytrain_fixed", 80, 72, 16.8, 227.0),
                    r("lazytrain_milp", 24, 8, 3.5, 120.0, 3.48), r("lazytrain_milp", 24, 32, 8.5, 199.0, 7.35)],
           "max_batch": [{"system": "lazytrain_milp", "model": model, "gpu_cap_gib": 24, "max_batch": 32,
                          "first_infeasible": None, "limit": 32, "complete": True},
                         {"system": "lazytrain_fixed", "model": model, "gpu_cap_gib": 24, "max_batch": 12,
                          "first_infeasible": 13, "limit": 512, "complete": True}]}
    lines = hybrid_targets(doc, model)[2:]
    verdicts = [line.rsplit("|", 2)[1].strip() for line in lines]
    assert verdicts == ["met", "met", "met", "met", "not met", "met"]
    assert "1.20x" in lines[0] and "MILP >= 32, fixed 12" in lines[3] and "-13.5%" in lines[4]
    doc["rows"][0]["extra"]["oom_recoveries"] = 1  # a recovered MILP row does not count
    assert hybrid_targets(doc, model)[2].rsplit("|", 2)[1].strip() == "not measured"
    # an unfinished fixed search decides the claim once the fixed policy failed at the MILP's largest batch
    doc["max_batch"] = [{"system": "lazytrain_milp", "model": model, "gpu_cap_gib": 24, "max_batch": 94,
                         "first_infeasible": 95, "limit": 512, "complete": True},
                        {"system": "lazytrain_fixed", "model": model, "gpu_cap_gib": 24, "max_batch": 81,
                         "first_infeasible": 94, "limit": 512, "complete": False}]
    claim = hybrid_targets(doc, model)[5]
    assert "MILP 94, fixed 81-93 (search unfinished)" in claim and claim.endswith("| met |"), claim
    doc["max_batch"][1].update(first_infeasible=None)
    assert hybrid_targets(doc, model)[5].endswith("| not measured |")
    doc["max_batch"][1].update(max_batch=94)
    assert hybrid_targets(doc, model)[5].endswith("| not met |")
