"""The side-by-side harness (benchmarks.run / worker / report) on the CPU: smoke suite on a tiny shape, resume,
timeouts, the largest-batch search and the report. Nothing about timing is asserted."""

from __future__ import annotations

import json
import time

import pytest

from .conftest import requires_gsm8k

REQUIRED = {"system", "model", "params", "gpu_cap_gib", "batch_size", "seq_len", "status", "reason", "step_s_median",
            "step_s_p10", "step_s_p90", "steps_timed", "tokens_per_s", "tflops_6nd", "tflops_executed",
            "peak_gpu_gib", "peak_host_rss_gib", "pinned_planned_gib", "exposed_h2d_ms", "exposed_d2h_ms",
            "optimizer_ms", "predicted_step_s", "solve_ms", "mip_gap", "extra"}


@requires_gsm8k
def test_smoke_suite_and_report(tmp_path, monkeypatch):
    from benchmarks import report, run

    out = tmp_path / "smoke.json"
    run.main(["--suite", "smoke", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["suite"] == "smoke" and doc["commands"] and doc["machine"]["torch"]
    rows = {r["system"]: r for r in doc["rows"]}
    assert set(rows) == set(run.ORDER)
    for r in doc["rows"]:
        assert REQUIRED <= set(r), REQUIRED - set(r)
    for s in ("stock_trainer", "stock_trainer_bnb8", "lazytrain_fixed", "lazytrain_milp"):
        r = rows[s]
        assert r["status"] == "ok", (s, r["reason"])
        assert r["steps_timed"] == 2 and r["tokens_per_s"] > 0 and r["tflops_6nd"] > 0 and r["tflops_executed"] > 0
        assert len(r["extra"]["step_s"]) == 3  # 1 warm-up + 2 timed
    for s in ("fsdp2_cpu_offload", "zero_offload"):
        assert rows[s]["status"] == "unsupported" and rows[s]["reason"]
    assert rows["lazytrain_milp"]["extra"]["schedule_policy"] == "milp"
    assert rows["lazytrain_milp"]["solve_ms"] is not None
    assert rows["lazytrain_fixed"]["pinned_planned_gib"] is not None

    # resume: nothing left to run, so no process is started
    monkeypatch.setattr(run, "run_process", lambda *a, **k: pytest.fail("resume re-ran a finished row"))
    run.main(["--suite", "smoke", "--out", str(out)])
    assert len(json.loads(out.read_text())["rows"]) == len(doc["rows"])

    md, png = report.main([str(out), "--md", str(tmp_path / "BENCHMARKS.md"), "--png", str(tmp_path / "p.png")])
    text = md.read_text()
    assert "python -m benchmarks.run --suite smoke" in text and "| lazytrain_milp | 2 | ok |" in text
    assert "Ratios lazytrain_milp / system" in text and "unsupported" in text
    assert png.stat().st_size > 1000
    # by default a results file outside benchmarks/results/ is reported next to itself (never over BENCHMARKS.md)
    md, png = report.main([str(out)])
    assert md == out.with_suffix(".md") and png == out.with_suffix(".png") and md.exists() and png.exists()


@requires_gsm8k
@pytest.mark.parametrize("system", ["stock_trainer", "lazytrain_fixed"])
def test_each_batch_size_of_one_process_trains_on_its_own_rows(tmp_path, system):
    """Several batch sizes in one worker (stock: a fresh Trainer each; LazyTrain: the same one): every step's rows,
    counted where batches enter the model, are that row's batch size (a GPU run once showed batch 16 at batch 8's
    step time and peak memory)."""
    from benchmarks import run

    args = run.parse_args(["--suite", "smoke", "--out", str(tmp_path / "x.json")])
    spec = run._spec(args, run.SUITES["smoke"], system, "qwen3-tiny", None, [1, 3])
    rows = run.run_process(spec, timeout_s=300, deadline=time.time() + 600, workdir=tmp_path)
    assert [r["status"] for r in rows] == ["ok", "ok"], [r["reason"] for r in rows]
    assert [r["extra"]["rows_per_step"] for r in rows] == [[1, 1, 1], [3, 3, 3]]


@requires_gsm8k
def test_lazytrain_rows_record_weight_h2d_and_the_slot_reuse_switch(tmp_path, monkeypatch):
    """LazyTrain rows record the weight H2D bytes per optimizer step and whether slot reuse was on; the
    HARNESS_SLOT_REUSE=0 A/B switch reaches the worker and turns it off (never fewer bytes than with reuse; equal
    here: on CPU no layer is GPU-updated, so no slot is reused across steps), and the recorded command names it."""
    from benchmarks import run

    got = {}
    monkeypatch.setenv("HARNESS_PROFILE_STEP", "1")  # and a profiled step's table (the second of three)
    monkeypatch.setenv("HARNESS_PROFILE_DIR", str(tmp_path / "prof"))
    monkeypatch.setenv("HARNESS_GPU_MEMORY_MARGIN", "0.05")  # and the MILP's margin switch reaches the config
    for reuse in ("1", "0"):
        monkeypatch.setenv("HARNESS_SLOT_REUSE", reuse)
        out = tmp_path / f"r{reuse}.json"
        args = run.parse_args(["--suite", "smoke", "--out", str(out)])
        spec = run._spec(args, run.SUITES["smoke"], "lazytrain_fixed", "qwen3-tiny", None, [3])
        (r,) = run.run_process(spec, timeout_s=300, deadline=time.time() + 600, workdir=tmp_path)
        assert r["status"] == "ok", r["reason"]
        got[reuse] = r["extra"]
    assert got["1"]["slot_reuse"] is True and got["0"]["slot_reuse"] is False
    assert got["0"]["h2d_weight_gib_per_step"] >= got["1"]["h2d_weight_gib_per_step"] > 0
    assert "HARNESS_SLOT_REUSE=0" in " ".join(run._env_settings())
    assert got["0"]["lazytrain_config"]["gpu_memory_margin"] == 0.05
    prof = tmp_path / "prof" / "profile-lazytrain_fixed-capNone-b3.txt"
    assert got["0"]["profiled_step"] == 1 and got["0"]["profile"] == str(prof)
    text = prof.read_text()
    assert text.startswith("step 1: ") and "aten::" in text  # the profiled step's operator table
    ops = json.loads(prof.with_suffix(".json").read_text())["ops"]
    assert ops["aten::mm"]["count"] > 0 and ops["aten::mm"]["device_us"] > 0  # CPU run: "device" is the CPU


@pytest.mark.parametrize("name, value", [("HARNESS_PROFILE_STEP", "abc"), ("HARNESS_CALIBRATE_STEPS", "-1"),
                                         ("HARNESS_SLOT_REUSE", "2"), ("HARNESS_GPU_MEMORY_MARGIN", "0.9"),
                                         ("HARNESS_GPU_MEMORY_MARGIN", "-0.1"), ("HARNESS_GPU_MEMORY_MARGIN", "x")])
def test_bad_harness_switches_exit_before_any_row(tmp_path, monkeypatch, capsys, name, value):
    from benchmarks import run

    monkeypatch.setenv(name, value)
    monkeypatch.setattr(run, "run_process", lambda *a, **k: pytest.fail("a row ran"))
    with pytest.raises(SystemExit):
        run.main(["--suite", "smoke", "--out", str(tmp_path / "x.json")])
    assert f"environment {name}={value!r}" in capsys.readouterr().err


def test_worker_timeout_is_recorded(tmp_path):
    from benchmarks import run

    args = run.parse_args(["--suite", "smoke", "--out", str(tmp_path / "x.json")])
    spec = run._spec(args, run.SUITES["smoke"], "stock_trainer", "qwen3-tiny", None, [2, 4])
    t0 = time.time()
    rows = run.run_process(spec, timeout_s=0.5, deadline=time.time() + 100, workdir=tmp_path)
    assert time.time() - t0 < 30
    assert [r["status"] for r in rows] == ["timeout", "timeout"]
    assert "killed after" in rows[0]["reason"] and rows[1]["reason"].startswith("not run")
    # killed at the global deadline instead: nothing recorded, so a rerun redoes it
    assert run.run_process(spec, timeout_s=100, deadline=time.time() + 0.5, workdir=tmp_path) == []


def test_finished_rows_are_saved_while_the_worker_still_runs(tmp_path, monkeypatch):
    """A row the worker has written reaches on_rows (the harness saves it into --out) within about a second, before
    the worker exits, so an outer `timeout` that kills the harness while a worker frees its pinned store loses no
    measured row. At the deadline the hanging worker is killed and the row is still returned."""
    from benchmarks import run

    monkeypatch.setattr(run, "WORKER_MODULE", "tests._hanging_worker")
    args = run.parse_args(["--suite", "smoke", "--out", str(tmp_path / "x.json")])
    spec = run._spec(args, run.SUITES["smoke"], "stock_trainer", "qwen3-tiny", None, [2])
    got: list[tuple[float, list]] = []
    t0 = time.time()
    rows = run.run_process(spec, timeout_s=100, deadline=t0 + 8, workdir=tmp_path,
                           on_rows=lambda r: got.append((time.time() - t0, r)))
    assert len(got) == 1 and got[0][0] < 7, got          # delivered while the worker was still alive
    assert [r["batch_size"] for r in got[0][1]] == [2] and [r["status"] for r in rows] == ["ok"]
    assert time.time() - t0 < 30


def test_find_max_batch_doubles_then_bisects(tmp_path, monkeypatch):
    from benchmarks import run
    from benchmarks.common import row

    limit = 40  # batches above this run out of memory
    seen: list[int] = []

    def fake(spec, timeout_s, deadline, workdir):
        (B,) = spec["batch_sizes"]
        seen.append(B)
        ok = B <= limit
        return [row(system=spec["system"], model=spec["model"], gpu_cap_gib=spec["gpu_cap_gib"], batch_size=B,
                    status="ok" if ok else "oom", step_s_median=1.0 if ok else None)]

    monkeypatch.setattr(run, "run_process", fake)
    out = tmp_path / "mb.json"
    args = run.parse_args(["--suite", "smoke", "--out", str(out), "--max-batch-resolution", "0"])
    res = run.Results(out, "smoke", "test")
    res.put([row(system="stock_trainer", model="m", gpu_cap_gib=24, batch_size=8, status="ok")])
    run.find_max_batch(args, run.SUITES["smoke"], res, "stock_trainer", "m", 24, time.time() + 100, tmp_path)
    (entry,) = json.loads(out.read_text())["max_batch"]
    assert seen[:3] == [16, 32, 64]  # doubling from the largest measured batch, then bisection
    assert entry["max_batch"] == limit and entry["first_infeasible"] == limit + 1 and entry["complete"]


def test_report_targets_and_ratios():
    from benchmarks.common import row
    from benchmarks.report import markdown

    rows = [row(system=s, model="qwen2.5-7b", gpu_cap_gib=24, batch_size=B, status="ok", tflops_6nd=t,
                step_s_median=1.0, step_s_p10=1.0, step_s_p90=1.0, steps_timed=5)
            for s, B, t in (("lazytrain_milp", 64, 360.0), ("lazytrain_fixed", 64, 300.0),
                            ("fsdp2_cpu_offload", 8, 100.0))]
    rows.append(row(system="stock_trainer_bnb8", model="qwen2.5-7b", gpu_cap_gib=24, batch_size=1, status="oom",
                    reason="CUDA out of memory"))
    doc = {"suite": "t", "date": "2026-01-01", "rows": rows, "commands": ["python -m benchmarks.run --suite 7b"]}
    text = markdown(doc, None)
    assert "| fsdp2_cpu_offload | 100.0 (8) | 3.60x | - |" in text
    assert "| 24 GiB: MILP >= 1.3x lazytrain_fixed | 1.20x | not met |" in text
    assert "| 24 GiB: MILP >= 350 TFLOPS 6ND | 360.00 TFLOPS | met |" in text
    assert "| 80 GiB: MILP >= 450 TFLOPS 6ND at the best batch | - | not measured |" in text
    assert "| 24 GiB: MILP largest batch >= 64 | 64 | met |" in text
    assert "| 24 GiB: MILP largest batch >= 4x stock 8-bit Adam's | inf (the other system: no feasible batch) | met |" in text
    # a MILP that ran and failed at every batch is "not met", not "not measured" (a fresh user's finding)
    failed = [r for r in rows if r["system"] != "lazytrain_milp"] + [
        row(system="lazytrain_milp", model="qwen2.5-7b", gpu_cap_gib=80, batch_size=64, status="oom", reason="oom")]
    text = markdown({**doc, "rows": failed}, None)
    assert "| 80 GiB: MILP >= 450 TFLOPS 6ND at the best batch | 0.00 TFLOPS | not met |" in text
    # 8-bit Adam measured at one batch with no search: the ratio is flagged as an upper bound
    bnb_ok = rows[:3] + [row(system="stock_trainer_bnb8", model="qwen2.5-7b", gpu_cap_gib=24, batch_size=8,
                             status="ok", tflops_6nd=50.0, step_s_median=1.0, step_s_p10=1.0, step_s_p90=1.0,
                             steps_timed=5)]
    text = markdown({**doc, "rows": bnb_ok}, None)
    assert "(8-bit Adam: largest measured batch, no search: an upper bound on the ratio) | 8.00x | met |" in text


def test_report_stock_ratio_targets_pair_rows_of_one_run_only():
    """The stock-ratio targets: MILP-24 vs the uncapped stock Trainer counts only pairs from one results file, the
    most recent file's pair decides; exposed transfer only at >= 16k tokens/step; host bytes per parameter from peak
    RSS / params."""
    from benchmarks.common import row
    from benchmarks.report import markdown, merge

    def r(system, B, status="ok", t=None, step=1.0, h2d=None, rss=None, cap=None):
        return row(system=system, model="qwen2.5-7b", gpu_cap_gib=cap, batch_size=B, seq_len=1024, status=status,
                   params=7_000_000_000, tflops_6nd=t, step_s_median=step, step_s_p10=step, step_s_p90=step,
                   steps_timed=5, exposed_h2d_ms=h2d, exposed_d2h_ms=h2d and 0.0, peak_host_rss_gib=rss)

    milp = lambda B, t, **kw: r("lazytrain_milp", B, t=t, cap=24, **kw)  # noqa: E731
    old = {"suite": "7b", "date": "2026-01-01", "rows": [
        milp(32, 400.0, step=3.0, h2d=60.0, rss=50.0), r("stock_trainer", 32, t=440.0),  # 0.91x, older
        milp(16, 330.0, step=2.0, h2d=260.0, rss=60.0),     # 13% exposed; its stock row is only in `new`
        r("stock_trainer", 64, "oom")]}
    new = {"suite": "7b", "date": "2026-01-02", "rows": [
        milp(32, 330.0, step=3.0, h2d=60.0, rss=50.0), r("stock_trainer", 32, t=440.0),  # 0.75x, most recent
        r("stock_trainer", 16, t=440.0),
        milp(8, 200.0, step=1.0, h2d=900.0, rss=40.0),      # 8192 tokens: not a target-2 row
        milp(64, 400.0, step=7.0, h2d=140.0, rss=40.0)]}   # 2% exposed
    docs = [("old.json", old), ("new.json", new)]
    text = markdown(merge(docs), None, docs)
    section = text[text.rindex("## Targets"):]  # the last targets section: the stock-ratio one
    assert "Only lazytrain_milp rows at this cap: no ratios" in text  # not an empty ratios table
    t1 = "MILP >= 0.85x stock Trainer (uncapped) TFLOPS 6ND, same run"
    assert f"| 24 GiB, B=32: {t1} | 0.75x (new.json); all same-run pairs 0.75-0.91x, n=2 | not met |" in section
    assert f"| 24 GiB, B=16: {t1} | - | not measured |" in section   # MILP in old, stock in new: no pair
    assert f"| 24 GiB, B=8: {t1} | - | not measured |" in section
    assert f"| 24 GiB, B=64: {t1} | stock out of memory uncapped (old.json); MILP ok | met (LazyTrain only) |" \
        in section
    assert "| 24 GiB, B=16: exposed transfer <= 10% of step time (>= 16k tokens/step) | 13.0% (260 of 2000 ms, " \
           "old.json) | not met |" in section
    assert "| 24 GiB, B=64: exposed transfer <= 10% of step time (>= 16k tokens/step) | 2.0% (140 of 7000 ms, " \
           "new.json) | met |" in section
    assert "B=8: exposed" not in section
    assert f"| {60 * 2**30 / 7e9:.1f} (largest, B=16, old.json) | met |" in section  # 9.2 bytes; its file named
    assert "host bytes per parameter <= 10 (peak RSS; master weights: -)" in section  # rows without a config
    assert "| 24 GiB: pinned memory locked <= 1.05x planned | - | not measured |" in section
    assert "| 24 GiB, B=32: MILP vs MegaTrain's 152 TFLOPS (reference, same cap) | 2.17x (330.0 TFLOPS 6ND, " \
           "new.json) | reference |" in section
    # the most recent pair decides, whichever way: with the files in the other order, 0.91x is met
    text = markdown(merge(docs[::-1]), None, docs[::-1])
    assert f"| 24 GiB, B=32: {t1} | 0.91x (old.json); all same-run pairs 0.75-0.91x, n=2 | met |" in text
    # without the per-file docs, a merged doc's rows are still paired within their source file only
    assert "| 24 GiB, B=16: " + t1 + " | - | not measured |" in markdown(merge(docs), None)


def test_report_merges_results_files_of_one_suite():
    """Rows of calls at different commits report as one table: each names its file, a later file's row for the
    same (system, model, cap, batch) wins, every file's commit is listed; files of different suites are refused."""
    from benchmarks.common import row
    from benchmarks.report import markdown, merge

    def r(system, B, status, t=None):
        return row(system=system, model="qwen2.5-7b", gpu_cap_gib=24, batch_size=B, status=status, tflops_6nd=t,
                   step_s_median=t and 1.0, step_s_p10=t and 1.0, step_s_p90=t and 1.0, steps_timed=t and 5)

    a = {"suite": "7b", "date": "2026-01-01", "git_commit": "aaa", "commands": ["cmd a"],
         "rows": [r("lazytrain_milp", 64, "oom"), r("lazytrain_fixed", 64, "ok", 300.0)]}
    b = {"suite": "7b", "date": "2026-01-02", "git_commit": "bbb", "commands": ["cmd b"],
         "rows": [r("lazytrain_milp", 64, "ok", 390.0), r("zero_offload", 8, "ok", 100.0)]}
    doc = merge([("a.json", a), ("b.json", b)])
    got = {(x["system"], x["batch_size"]): (x["status"], x["source"]) for x in doc["rows"]}
    assert got == {("lazytrain_milp", 64): ("ok", "b.json"), ("lazytrain_fixed", 64): ("ok", "a.json"),
                   ("zero_offload", 8): ("ok", "b.json")}
    text = markdown(doc, None)
    assert "commit `aaa`" in text and "commit `bbb`" in text and "cmd a" in text and "cmd b" in text
    assert "| zero_offload | 100.0 (8) | 3.90x | - |" in text  # 390 / 100, ratios across the files
    with pytest.raises(ValueError, match="different suites"):
        merge([("a.json", a), ("c.json", dict(b, suite="smoke"))])


def test_report_never_cuts_a_note_mid_word():
    """A long failure reason shows in its table cell up to a word boundary and in full below the table (before:
    cut at 200 characters, mid-word, the rest lost); one full text per distinct note."""
    from benchmarks.common import row
    from benchmarks.report import NOTE_CELL, markdown

    reason = ("OutOfMemoryError: CUDA out of memory. Tried to allocate 1.16 GiB. GPU 0 has a total capacity of 139.80 "
              "GiB of which 114.97 GiB is free. Including non-PyTorch memory, this process has 24.80 GiB memory in "
              "use. Of the allocated memory 23.9 GiB is allocated by PyTorch | see the allocator documentation")
    rows = [row(system="stock_trainer", model="qwen2.5-7b", gpu_cap_gib=24, batch_size=B, status="oom",
                reason=reason) for B in (8, 16)]
    rows.append(row(system="zero_offload", model="qwen2.5-7b", gpu_cap_gib=24, batch_size=8, status="error",
                    reason="short reason"))
    text = markdown({"suite": "t", "date": "2026-01-01", "rows": rows, "commands": ["c"]}, None)
    cells = [line.rstrip(" |").rsplit("| ", 1)[1] for line in text.splitlines() if line.startswith("| stock_trainer")]
    assert len(cells) == 2
    for cell in cells:
        shown = cell.split(" ... (note 1)")[0]
        assert cell.endswith("(note 1)") and len(cell) <= NOTE_CELL
        assert reason.startswith(shown) and reason[len(shown)] == " ", f"cut mid-word: {cell!r}"
    assert f"1. {reason}" in text and text.count(reason) == 1
    assert "| short reason |" in text


def test_step_timer_counts_skipped_updates_through_accelerates_wrapper():
    """A Hybrid8 step skipped for a non-finite norm costs nothing, so the harness must see it (the row becomes an
    error instead of a flattering timing); the Trainer hands callbacks accelerate's wrapper, not the optimizer."""
    from types import SimpleNamespace

    from benchmarks.systems import StepTimer

    timer = StepTimer("cpu")
    inner = SimpleNamespace(last_step_skipped=False)
    wrapped = SimpleNamespace(optimizer=inner)
    for skipped in (False, True, True, False):
        inner.last_step_skipped = skipped
        timer.on_pre_optimizer_step(None, None, None, optimizer=wrapped)
        timer.on_optimizer_step(None, None, None, optimizer=wrapped)
    assert timer.skipped == 2
    timer.on_optimizer_step(None, None, None, optimizer=None)  # stock optimizers have no such flag
    assert timer.skipped == 2


@pytest.mark.parametrize("text", ['{"suite": "7b", "rows": []}', '{"suite":', "[]"])
def test_results_file_of_another_suite_or_unreadable_is_refused(tmp_path, text):
    from benchmarks.run import Results

    out = tmp_path / "r.json"
    out.write_text(text)
    with pytest.raises(SystemExit, match="pass another --out"):
        Results(out, "smoke", "python -m benchmarks.run --suite smoke")
    assert out.read_text() == text


def test_out_folder_and_rows_of_another_seq_len_are_refused(tmp_path, capsys, monkeypatch):
    """A folder as --out failed at the first save, after a worker had run; a resume at another --seq-len kept the
    old rows as if measured at the new one (rows are keyed by system, model, cap and batch)."""
    from benchmarks import run
    from benchmarks.common import row

    with pytest.raises(SystemExit):
        run.parse_args(["--suite", "smoke", "--out", str(tmp_path)])
    assert "is a folder" in capsys.readouterr().err
    out = tmp_path / "s.json"
    res = run.Results(out, "smoke", "test")
    res.put([row(system="stock_trainer", model="qwen3-tiny", gpu_cap_gib=None, batch_size=1, seq_len=32,
                 status="ok")])
    monkeypatch.setattr(run, "run_process", lambda *a, **k: pytest.fail("a worker started"))
    data = tmp_path / "gsm8k"   # the data check comes first; no row is read here
    data.mkdir()
    (data / "train.jsonl").write_text("")
    with pytest.raises(SystemExit, match=r"seq_len \[32\], not 64"):
        run.main(["--suite", "smoke", "--systems", "stock_trainer", "--seq-len", "64", "--data-dir", str(data),
                  "--out", str(out)])
    # the same for LazyTrain rows of another --rows-per-pass (lazytrain_config.max_rows_per_pass in extra)
    out2 = tmp_path / "r.json"
    res = run.Results(out2, "smoke", "test")
    res.put([row(system="lazytrain_milp", model="qwen3-tiny", gpu_cap_gib=None, batch_size=1, seq_len=32,
                 status="ok", extra={"lazytrain_config": {"max_rows_per_pass": 8}})])
    with pytest.raises(SystemExit, match=r"max_rows_per_pass=\[8\], not --rows-per-pass 16"):
        run.main(["--suite", "smoke", "--systems", "lazytrain_milp", "--rows-per-pass", "16", "--data-dir", str(data),
                  "--out", str(out2)])
    # and of the other kept-gradients setting (lazytrain_config.keep_gpu_grads)
    res.put([row(system="lazytrain_milp", model="qwen3-tiny", gpu_cap_gib=None, batch_size=2, seq_len=32,
                 status="ok", extra={"lazytrain_config": {"max_rows_per_pass": 8, "keep_gpu_grads": True}})])
    with pytest.raises(SystemExit, match=r"keep_gpu_grads=\[True\], not --no-kept-grads"):
        run.main(["--suite", "smoke", "--systems", "lazytrain_milp", "--no-kept-grads", "--data-dir", str(data),
                  "--out", str(out2)])
    # a LazyTrain row from before the option existed kept no gradients: a kept run does not resume into its file
    with pytest.raises(SystemExit, match=r"keep_gpu_grads=\[False\], not kept gradients"):
        run.main(["--suite", "smoke", "--systems", "lazytrain_milp", "--data-dir", str(data), "--out", str(out2)])
    # and of another MILP margin (HARNESS_GPU_MEMORY_MARGIN; rows without the key ran the default)
    out3 = tmp_path / "m.json"
    run.Results(out3, "smoke", "test").put([row(
        system="lazytrain_milp", model="qwen3-tiny", gpu_cap_gib=None, batch_size=1, seq_len=32, status="ok",
        extra={"lazytrain_config": {"max_rows_per_pass": 8, "keep_gpu_grads": True, "gpu_memory_margin": 0.06}})])
    with pytest.raises(SystemExit, match=r"gpu_memory_margin=\[0.06\], not the default margin 0.12"):
        run.main(["--suite", "smoke", "--systems", "lazytrain_milp", "--data-dir", str(data), "--out", str(out3)])
    monkeypatch.setenv("HARNESS_GPU_MEMORY_MARGIN", "0.2")
    with pytest.raises(SystemExit, match=r"gpu_memory_margin=\[0.06\], not HARNESS_GPU_MEMORY_MARGIN=0.2"):
        run.main(["--suite", "smoke", "--systems", "lazytrain_milp", "--data-dir", str(data), "--out", str(out3)])


@pytest.mark.parametrize("bad", [["--batch-sizes", "0"], ["--steps", "0"], ["--seq-len", "0"], ["--warmup", "-1"],
                                 ["--budget-s", "0"], ["--timeout-s", "-1"], ["--caps", "-5"],
                                 ["--max-batch-limit", "0"], ["--rows-per-pass", "0"]])
def test_non_positive_sizes_are_refused_before_any_worker(bad, capsys):
    from benchmarks.run import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--suite", "smoke", "--out", "x.json", *bad])
    err = capsys.readouterr().err
    assert "at least" in err or "must be positive" in err or "GiB > 0" in err, err


def test_unknown_model_and_missing_cuda_are_refused_before_any_worker(capsys):
    """Both reached a worker (model: a Hub lookup, then a truncated error row; cuda on a CPU machine: a row saying
    bf16/gpu is unsupported), each with exit 0."""
    import torch

    from benchmarks.run import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--suite", "smoke", "--out", "x.json", "--models", "qwen3-tiny,nosuch"])
    err = capsys.readouterr().err
    assert "unknown models ['nosuch']" in err and "qwen3-tiny" in err
    with pytest.raises(SystemExit):   # an empty name (a trailing comma) is a folder to Path: refused too
        parse_args(["--suite", "smoke", "--out", "x.json", "--models", "qwen3-tiny,"])
    assert "unknown models ['']" in capsys.readouterr().err
    assert parse_args(["--suite", "smoke", "--out", "x.json", "--models", "qwen3-tiny"]).models == ["qwen3-tiny"]
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            parse_args(["--suite", "smoke", "--out", "x.json", "--device", "cuda"])
        assert "no CUDA device is visible" in capsys.readouterr().err


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_worker_dies_with_a_sigkilled_harness(tmp_path):
    """kill -9 of the harness (no finally runs) must not leave its worker running: it would hold the GPU and skew
    the next run's rows."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import psutil

    code = ("import sys, time; from benchmarks import run; run.WORKER_MODULE = 'tests._hanging_worker'; "
            f"a = run.parse_args(['--suite', 'smoke', '--out', {str(tmp_path / 'x.json')!r}]); "
            "s = run._spec(a, run.SUITES['smoke'], 'stock_trainer', 'qwen3-tiny', None, [2]); "
            f"run.run_process(s, timeout_s=100, deadline=time.time() + 100, workdir=__import__('pathlib').Path({str(tmp_path)!r}))")
    harness = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1])
    try:
        t0 = time.time()
        while not list(tmp_path.glob("*.jsonl")) and time.time() - t0 < 60:
            time.sleep(0.2)
        workers = psutil.Process(harness.pid).children()
        assert workers, "no worker started"
    finally:
        os.kill(harness.pid, signal.SIGKILL)
        harness.wait()
    gone, alive = psutil.wait_procs(workers, timeout=10)
    for p in alive:
        p.kill()
    assert not alive, f"worker outlived the SIGKILLed harness: {alive}"


def test_report_refuses_unreadable_or_empty_inputs_naming_the_file(tmp_path):
    """Corrupt JSON, a non-results document, a file with no rows and files of two suites: one error each that
    names the file(s), no traceback (a fresh user got JSONDecodeError / KeyError / a matplotlib error)."""
    from benchmarks import report

    cases = {"corrupt.json": ('{"suite":', "cannot read"), "empty.json": ("{}", "is not a results file"),
             "norows.json": ('{"suite": "7b", "rows": []}', "no rows")}
    for name, (text, msg) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(SystemExit) as e:
            report.main([str(tmp_path / name), "--md", str(tmp_path / "o.md"), "--png", str(tmp_path / "o.png")])
        assert name in str(e.value) and msg in str(e.value), e.value
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text('{"suite": "7b", "rows": []}')
    b.write_text('{"suite": "smoke", "rows": []}')
    with pytest.raises(SystemExit) as e:
        report.main([str(a), str(b), "--md", str(tmp_path / "o.md")])
    assert "different suites" in str(e.value) and "b.json" in str(e.value)
    assert not (tmp_path / "o.md").exists()


def test_budget_counts_from_the_given_start(tmp_path, monkeypatch, capsys):
    """--budget-s counts from `started` (the command line passes the process's start: imports took ~20 s of a
    budget sized to a 10-minute device call): a budget already spent starts no worker."""
    from benchmarks import run

    monkeypatch.setattr(run, "run_process", lambda *a, **k: pytest.fail("a worker started"))
    data = tmp_path / "gsm8k"
    data.mkdir()
    (data / "train.jsonl").write_text("")
    run.main(["--suite", "smoke", "--systems", "stock_trainer", "--budget-s", "60", "--data-dir", str(data),
              "--out", str(tmp_path / "b.json")], started=time.time() - 100)
    assert "budget: not starting stock_trainer" in capsys.readouterr().out


def test_paper_suite_definition():
    """The paper suite: the dense 3B-14B registry shapes under 24 and 80 GiB, LazyTrain (product defaults) and the
    stock Trainer, the largest batch under 24 GiB searched, batch 32 (32k tokens per step) at every cap."""
    from benchmarks import run, systems
    from lazytrain_hf.models import ARCHITECTURES, resolve_config

    suite = run.SUITES["paper"]
    assert suite["models"] == ["qwen2.5-3b", "qwen2.5-7b", "qwen3-8b", "qwen2.5-14b", "qwen3-14b"]
    assert all(m in ARCHITECTURES and resolve_config(m).model_type in ("qwen2", "qwen3") for m in suite["models"])
    assert suite["caps"] == [24, 80, None] and suite["max_batch_caps"] == [24] and suite["device"] == "cuda"
    assert suite["systems"] == ["lazytrain_milp", "lazytrain_fixed", "stock_trainer"]
    assert run._configuration(suite) == systems.PRODUCT_DEFAULTS
    for cap in suite["caps"]:
        assert set(suite["batch"][cap]) == set(suite["systems"]) == set(suite["timeout"])
        ran = [s for s in suite["systems"] if suite["batch"][cap][s]]
        assert ran and all(32 in suite["batch"][cap][s] for s in ran)
        assert suite["row_s"][cap] < min(suite["timeout"][s] for s in run.LT)
    # uncapped, only the stock Trainer: the pair of the 24 GiB MILP rows at 32k tokens a step
    assert [s for s in suite["systems"] if suite["batch"][None][s]] == ["stock_trainer"]


def test_paper_targets_pair_24_gib_milp_rows_with_the_uncapped_stock_trainer():
    """benchmarks.report.paper_targets: the train-begin prediction's worst error, the 24 GiB MILP rows at >= 32k
    tokens against the uncapped stock Trainer at the same batch (n/a where stock is out of memory), the 14B wait and
    TFLOPS, and peak host RSS per parameter."""
    from benchmarks.report import paper_targets

    def row(system, cap, B, status="ok", step=2.0, tflops=300.0, pred=2.1, rss=40.0, wait=50.0, model="qwen2.5-14b"):
        return {"system": system, "model": model, "gpu_cap_gib": cap, "batch_size": B, "seq_len": 1024,
                "status": status, "step_s_median": step, "tflops_6nd": tflops, "predicted_step_s": pred,
                "peak_host_rss_gib": rss, "params": 14.8e9, "extra": {"exposed_update_wait_ms": wait}}

    doc = {"rows": [row("lazytrain_milp", 24, 32, tflops=380.0), row("lazytrain_milp", 24, 16, pred=2.5),
                    row("lazytrain_fixed", 24, 32), row("stock_trainer", None, 32, tflops=400.0, pred=None)]}
    out = "\n".join(paper_targets(doc, "qwen2.5-14b"))
    assert "worst +25.0% (lazytrain_milp, 24 GiB, B=16) | not met" in out
    assert "B=32: lazytrain_milp >= 0.9x the uncapped stock Trainer's TFLOPS 6ND | 0.950x (380.0 vs 400.0) | met" in out
    assert "B=16" not in out.split("prediction")[1].split("\n", 1)[1]  # 16k tokens: no stock pair asked
    assert "wait 2.5%, 380.0 TFLOPS (B=32) | met" in out
    assert "largest 2.90 (lazytrain_milp, 24 GiB, B=32) | met" in out
    doc["rows"][-1] = row("stock_trainer", None, 32, status="oom", tflops=None, pred=None)
    assert "stock oom | n/a (stock does not run)" in "\n".join(paper_targets(doc, "qwen2.5-14b"))
    doc["rows"] = doc["rows"][:-1]
    assert "stock not run | not measured" in "\n".join(paper_targets(doc, "qwen2.5-14b"))


@requires_gsm8k
def test_paper_suite_cpu_smoke(tmp_path):
    """The paper suite's machinery on a tiny dense shape: its three systems only, LazyTrain rows with the product's
    defaults (lazytrain_config: the policy and the GPU budget), the stock Trainer beside them."""
    from benchmarks import run

    out = tmp_path / "paper.json"
    run.main(["--suite", "paper", "--device", "cpu", "--models", "qwen3-tiny", "--caps", "none", "--seq-len", "32",
              "--steps", "1", "--warmup", "1", "--batch-sizes", "2", "--out", str(out)])
    doc = json.loads(out.read_text())
    rows = {r["system"]: r for r in doc["rows"]}
    assert doc["suite"] == "paper" and set(rows) == {"lazytrain_milp", "lazytrain_fixed", "stock_trainer"}
    for s, r in rows.items():
        assert r["status"] == "ok", (s, r["reason"])
    for s in run.LT:
        assert rows[s]["extra"]["configuration"] == "product defaults"
        assert rows[s]["extra"]["lazytrain_config"] == {"policy": s.split("_")[1]}


def _tiny_lora_flops(config, lora: dict, tokens: int, seq_len: int, fwd: float) -> tuple[float, float, int, int]:
    """(executed, model FLOPs, trainable, base parameters) of one step of LoRA on qwen3-tiny, from its config:
    q / k / v / o, gate / up / down projections, two RMSNorms and Qwen3's q / k norms per layer; rank-r adapters on
    every projection; tied embedding and LM head."""
    H, inter, L, V = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    heads, kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    shapes = [(H, heads * hd), (H, kv * hd), (H, kv * hd), (heads * hd, H), (H, inter), (H, inter), (inter, H)]
    base_layer = sum(i * o for i, o in shapes) + 2 * H + 2 * hd
    adapters = sum(lora["r"] * (i + o) for i, o in shapes)
    n_layer = base_layer + adapters
    attn = 2 * tokens * seq_len * heads * hd
    executed = L * (fwd * (2 * n_layer * tokens + attn) + 2 * n_layer * tokens + 2 * adapters * tokens + 2 * attn) \
        + 4 * V * H * tokens
    base = L * base_layer + V * H + H  # + the final norm
    return executed, (4 * base + 6 * L * adapters) * tokens, L * adapters, base


@requires_gsm8k
def test_lora_smoke_suite_accumulates_and_counts_executed_flops(tmp_path, monkeypatch):
    """The LoRA systems end to end on the CPU (qwen3-tiny, seq 32, 128 tokens per optimizer step): rows ok with the
    accumulation that reaches the step's tokens (lazytrain_lora at batch 1 and 2 in one process, the Trainer reused),
    every step trained on batch x accumulation rows, the FLOP fields equal to the count from the config, host bytes
    per base parameter from peak RSS, and the report's LoRA table and targets."""
    from benchmarks import report, run
    from benchmarks.common import GIB
    from benchmarks.systems import LORA_DEFAULTS
    from lazytrain_hf.models import resolve_config

    out = tmp_path / "lora.json"
    run.main(["--suite", "lora-smoke", "--out", str(out)])
    doc = json.loads(out.read_text())
    rows = {(r["system"], r["batch_size"]): r for r in doc["rows"]}
    assert set(rows) == {("lazytrain_lora", 1), ("lazytrain_lora", 2), ("stock_trainer_lora", 2),
                         ("fsdp2_cpu_offload_lora", 2)}
    assert rows["fsdp2_cpu_offload_lora", 2]["status"] == "unsupported"
    suite = run.SUITES["lora-smoke"]
    config = resolve_config("qwen3-tiny")
    for key in (("lazytrain_lora", 1), ("lazytrain_lora", 2), ("stock_trainer_lora", 2)):
        r, B = rows[key], key[1]
        e = r["extra"]
        assert r["status"] == "ok", (key, r["reason"])
        assert REQUIRED <= set(r)
        accum = -(-suite["tokens_per_step"] // (B * suite["seq_len"]))
        assert e["gradient_accumulation_steps"] == accum and accum > 1
        assert e["tokens_per_step"] == B * accum * suite["seq_len"]
        assert e["rows_per_step"] == [B * accum] * (suite["steps"] + suite["warmup"])
        assert e["lora"] == LORA_DEFAULTS and r["tflops_6nd"] is None
        assert r["tokens_per_s"] == pytest.approx(e["tokens_per_step"] / r["step_s_median"])
        fwd = e["fwd_passes_per_layer"]
        if key[0] == "stock_trainer_lora":
            assert fwd == 2.0 and e["optimizer"] == "adamw_torch" and e["activation_checkpointing"] == "every layer"
        else:
            assert e["lazytrain_config"] == {"policy": "milp"} and e["configuration"] == "product defaults"
            base_rss = r["peak_host_rss_gib"] * GIB - e["cpu_tier_activation_gib"] * GIB
            assert e["host_bytes_per_base_param"] == pytest.approx(base_rss / e["base_params"])
        executed, model_flops, trainable, base = _tiny_lora_flops(config, LORA_DEFAULTS, e["tokens_per_step"],
                                                                   suite["seq_len"], fwd)
        assert (e["trainable_params"], e["base_params"], e["total_params"]) == (trainable, base, base + trainable)
        assert r["params"] == base + trainable
        assert r["tflops_executed"] * 1e12 * r["step_s_median"] == pytest.approx(executed, rel=1e-9)
        assert e["tflops_model"] * 1e12 * r["step_s_median"] == pytest.approx(model_flops, rel=1e-9)

    md, _ = report.main([str(out), "--md", str(tmp_path / "B.md"), "--png", str(tmp_path / "p.png")])
    text = md.read_text()
    assert "| lazytrain_lora | 2 | 2 | 128 | ok |" in text and "`TFLOPS model` = (4 x N_frozen" in text
    assert "| 24 GiB: stock_trainer_lora runs out of memory | - | not measured |" in text


def test_lora_suite_settings(tmp_path):
    """The lora suite's rows as the GPU runs them: 32k tokens per optimizer step through accumulation, LazyTrain with
    only the policy and the GPU budget, the suite's LoraConfig, the stock run's largest-batch search up to 32 rows."""
    from benchmarks import run
    from benchmarks.systems import build_args

    args = run.parse_args(["--suite", "lora", "--out", str(tmp_path / "x.json"), "--device", "cpu"])
    suite = run.SUITES["lora"]
    assert args.max_batch_limit == 32 and suite["tokens_per_step"] == 32768 and args.seq_len == 1024
    model = suite["models"][0]
    spec = run._spec(args, suite, "lazytrain_lora", model, 24, [32])
    assert spec["lora"] == dict(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0,
                                task_type="CAUSAL_LM")
    for B, accum in ((32, 1), (8, 4), (3, 11)):
        ta, extra = build_args("lazytrain_lora", spec, B, 10)
        assert ta.gradient_accumulation_steps == accum
    assert extra["lazytrain_config"] == {"policy": "milp", "gpu_memory_budget": "24GiB"} and ta.bf16
    assert str(getattr(ta.optim, "value", ta.optim)) == "lazytrain_hybrid8" and extra["lora_of"] == "lazytrain_milp"
    ta, extra = build_args("stock_trainer_lora", run._spec(args, suite, "stock_trainer_lora", model, None, [16]), 16, 10)
    assert ta.gradient_accumulation_steps == 2 and extra["activation_checkpointing"] == "every layer" and ta.bf16
    assert run._sizes(args, suite, "lazytrain_lora", None) == []  # not run uncapped
    assert run._sizes(args, suite, "stock_trainer_lora", 24) == [1]  # the capped stock run: out of memory expected


@requires_gsm8k
def test_lora_suite_measures_the_stock_runs_searched_largest_batch(tmp_path, monkeypatch):
    """Uncapped, the stock Trainer + PEFT is measured at batch 32, its largest batch up to 32 searched, and that
    batch measured as a row; LazyTrain and FSDP2 do not run uncapped."""
    from benchmarks import run
    from benchmarks.common import row

    fits = 20
    ran: list[tuple] = []

    def fake(spec, timeout_s, deadline, workdir, on_rows=None):
        out = []
        for B in spec["batch_sizes"]:
            ran.append((spec["system"], spec["gpu_cap_gib"], B, spec["steps"]))
            ok = spec["gpu_cap_gib"] == 24 and spec["system"] == "lazytrain_lora" or \
                spec["gpu_cap_gib"] is None and B <= fits
            out.append(row(system=spec["system"], model=spec["model"], gpu_cap_gib=spec["gpu_cap_gib"], batch_size=B,
                           seq_len=spec["seq_len"], status="ok" if ok else "oom", step_s_median=1.0 if ok else None,
                           reason=None if ok else "CUDA out of memory"))
        return out

    monkeypatch.setattr(run, "run_process", fake)
    out = tmp_path / "lora.json"
    res = run.main(["--suite", "lora", "--out", str(out), "--device", "cpu"])
    (entry,) = res.doc["max_batch"]
    assert (entry["system"], entry["gpu_cap_gib"], entry["max_batch"], entry["complete"]) == \
        ("stock_trainer_lora", None, fits, True)
    measured = [(s, c, B) for s, c, B, steps in ran if steps == run.SUITES["lora"]["steps"]]
    assert measured == [("lazytrain_lora", 24, 32), ("stock_trainer_lora", 24, 1), ("stock_trainer_lora", None, 32),
                        ("stock_trainer_lora", None, fits), ("lazytrain_qlora", 24, 16)]  # the 4-bit base's row last
    assert {(r["system"], r["model"]) for r in res.doc["rows"] if r["model"] == "llama3-70b"} == \
        {("lazytrain_qlora", "llama3-70b")}  # model_systems: no bf16-base system on the 4-bit base's model
    assert res.get(("stock_trainer_lora", run.SUITES["lora"]["models"][0], None, fits))["status"] == "ok"
    assert all(r["system"] != "lazytrain_lora" or r["gpu_cap_gib"] == 24 for r in res.doc["rows"])


def test_op_times_set_measured_gpu_ops_against_the_plan_per_layer_kind():
    """benchmarks.systems.op_times: medians over the steps per (op, layer kind), the plan's figure and their ratio,
    the busy sum and the idle rest of each step's wall time; None when no step was timed per op."""
    from benchmarks.systems import op_times

    kinds = ["linear_attention", "full_attention"]
    steps = [{"fwd": [2.0, 1.0], "recompute": [0.0, 0.0], "bwd": [6.0, 3.0], "head": [1.0]},
             {"fwd": [4.0, 1.0], "recompute": [0.0, 0.0], "bwd": [6.0, 5.0], "head": [1.0]},
             {"fwd": [3.0, 1.0], "recompute": [0.0, 0.0], "bwd": [6.0, 4.0], "head": [1.0]}]
    planned = {"fwd": {"linear_attention": 2.0, "full_attention": 1.0}, "recompute": {},
               "bwd": {"linear_attention": 5.0, "full_attention": 4.0}, "head": {"all": 2.0}}
    out = op_times(steps, kinds, [0.020, 0.025, 0.030], planned)
    assert out["fwd linear_attention"] == {"measured_ms": 3.0, "planned_ms": 2.0, "ratio": 1.5}
    assert out["bwd full_attention"]["measured_ms"] == 4.0 and out["bwd full_attention"]["ratio"] == 1.0
    assert out["head all"]["ratio"] == 0.5
    assert not any(k.startswith("recompute") for k in out)  # neither ran nor planned
    assert out["busy_ms"] == 15.0  # per-step sums 13, 17, 15
    assert out["idle_ms"] == 8.0  # 20-13, 25-17, 30-15
    assert op_times([{}, {}], kinds, [1.0, 1.0], planned) is None
    two = op_times(steps, kinds, [0.040, 0.050, 0.060], planned, micro_batches=2)  # each step's ops ran twice
    assert two["fwd linear_attention"] == out["fwd linear_attention"]  # per micro-batch, as the plan's figure
    assert two["busy_ms"] == 30.0 and two["idle_ms"] == 16.0


def test_max_batch_search_starts_at_the_planners_guess():
    """A right guess settles the search in two probes (the guess, then guess + 1); a wrong one gallops away from it
    (offsets 1, 2, 4, ...), then bisects to adjacent sizes."""
    from benchmarks.run import search_max_batch

    for largest, first in ((73, [73, 74]), (80, [73, 74, 75, 77, 81, 79, 80]), (60, [73, 72, 71, 69, 65, 57])):
        seen: list[int] = []

        def probe(B: int, seen: list[int] = seen, largest: int = largest) -> bool:
            seen.append(B)
            return B <= largest

        assert search_max_batch(probe, guess=73, limit=512) == (largest, largest + 1, True), seen
        assert seen[:len(first)] == first and len(set(seen)) == len(seen), seen
        assert len(seen) == 2 or largest != 73, seen


def test_planned_max_batch_reads_the_plan_commands_largest_batch():
    from benchmarks.run import planned_max_batch

    fixed = planned_max_batch("lazytrain_fixed", "qwen3-tiny", 1, 64, 256)
    milp = planned_max_batch("lazytrain_milp", "qwen3-tiny", 1, 64, 256)
    assert fixed is not None and milp is not None and 1 <= fixed <= milp <= 256, (fixed, milp)
    assert planned_max_batch("stock_trainer", "qwen3-tiny", 1, 64, 256) is None
