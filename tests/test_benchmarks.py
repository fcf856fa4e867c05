"""The GPU benchmark harness runs on the CPU on a tiny shape (so it cannot rot); no timing is asserted."""

from __future__ import annotations

import json

import pytest

from .conftest import requires_gsm8k


@requires_gsm8k
@pytest.mark.parametrize("system", ["lazytrain_fixed", "lazytrain_milp", "lazytrain_milp+gpu_optimizer",
                                    "stock_trainer"])
def test_bench_executor_cpu_smoke(tmp_path, system):
    from benchmarks.bench_executor import main

    out = tmp_path / "executor.json"
    system, _, gpu_opt = system.partition("+")
    main(["--system", system, "--model", "qwen3-tiny-vocab", "--device", "cpu", "--batch-sizes", "2",
          "--seq-len", "32", "--steps", "1", "--checkpoint-every", "2", "--rows-per-pass", "1", "--out", str(out)]
         + (["--gpu-optimizer"] if gpu_opt else []))
    doc = json.loads(out.read_text())
    assert doc["suite"] == "executor" and doc["command"]
    (r,) = doc["rows"]
    assert r["status"] == "ok", r["reason"]
    assert r["steps_timed"] == 1 and r["tokens_per_s"] > 0 and r["tflops_6nd"] > 0
    assert set(r) >= {"exposed_h2d_ms", "pinned_planned_gib", "predicted_step_s", "extra"}
    if gpu_opt:  # the analytic H200 costs put some layers' updates on the GPU; the CPU run executes that path
        assert r["extra"]["gpu_updated_layers"] > 0 and r["extra"]["device_updates"] > 0


@requires_gsm8k
@pytest.mark.parametrize("system, dp_updates", [("lazytrain_fixed", "replicated"), ("lazytrain_milp", "sharded")])
def test_bench_executor_data_parallel_cpu_smoke(tmp_path, system, dp_updates):
    """Two ranks under torchrun (gloo): one row, written by rank 0, tagged with the world size (sharded: with the
    MILP's GPU-side layer updates, which the owner runs before it broadcasts the layer)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "executor.json"
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "benchmarks.bench_executor", "--system", system, "--model", "qwen3-tiny-vocab", "--device", "cpu",
           "--batch-sizes", "2", "--seq-len", "32", "--steps", "1", "--checkpoint-every", "2", "--out", str(out),
           "--dp-updates", dp_updates, *(["--gpu-optimizer"] if system == "lazytrain_milp" else [])]
    r = subprocess.run(cmd, cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["status"] == "ok", row["reason"]
    assert row["extra"]["world_size"] == 2 and row["tokens_per_s"] > 0
    assert row["extra"]["dp_updates"] == dp_updates
    if dp_updates == "sharded":
        assert row["extra"]["shard_broadcasts"] > 0 and row["extra"]["device_updates"] > 0


def test_bench_optim_staggered_buffers(tmp_path):
    """--stagger places each buffer at its own page offset (a 4K-aliasing probe); a copy keeps every value."""
    import torch

    from benchmarks import bench_optim

    t = torch.randn(1000).to(torch.bfloat16)
    for off in (0, 64, 1088, 4032):
        c = bench_optim._at_page_offset(t, off)
        assert c.data_ptr() % 4096 == off and torch.equal(c, t)
    doc = bench_optim.main(["--params", "4096", "--systems", "hybrid8_torch", "--master-weights", "kahan",
                            "--grad-dtype", "bf16", "--stagger", "1088", "--steps", "5", "--warmup", "1",
                            "--out", str(tmp_path / "o.json")])
    (row,) = doc["rows"]
    assert row["status"] == "ok" and row["extra"]["stagger_bytes"] == 1088, row


def test_bench_optim_thread_sweep_gpu_rows_and_state_bytes(tmp_path, monkeypatch):
    """--threads 1,2 repeats the CPU rows per thread count, the C++ kernel's count included even when
    LAZYTRAIN_CPU_THREADS is exported (gpu_session.sh does with CPUSET: a sweep would run every row on it); GPU rows run once
    (unsupported without CUDA); the 8-bit rows hold 2 bytes of moments per parameter plus one fp32 absmax per
    256-element block per moment."""
    import torch

    from benchmarks import bench_optim

    monkeypatch.setenv("LAZYTRAIN_CPU_THREADS", "5")
    threads_before = torch.get_num_threads()

    doc = bench_optim.main(["--params", "65536", "--systems", "hybrid8_torch,torch_adamw_fused_fp32,hybrid8_gpu",
                            "--threads", "1,2", "--steps", "5", "--warmup", "1", "--out", str(tmp_path / "o.json")])
    rows = {(r["system"], r["extra"].get("threads")): r for r in doc["rows"]}
    assert set(rows) == {("hybrid8_torch", 1), ("torch_adamw_fused_fp32", 1), ("hybrid8_torch", 2),
                         ("torch_adamw_fused_fp32", 2), ("hybrid8_gpu", None)}
    h8 = rows[("hybrid8_torch", 1)]["extra"]
    assert h8["moment_bytes_per_param"] == 2 + 2 * 4 / 256  # 2.03 bytes (target <= 2.04)
    assert h8["state_bytes_per_param"] == 2 + 2 * 4 / 256 + 2  # + Kahan compensation (auto) for bf16 parameters
    assert rows[("torch_adamw_fused_fp32", 2)]["extra"]["moment_bytes_per_param"] == 8
    assert [rows[("hybrid8_torch", t)]["extra"]["kernel_threads"] for t in (1, 2)] == [1, 2]
    torch.set_num_threads(threads_before)
    gpu = rows[("hybrid8_gpu", None)]
    assert gpu["status"] == ("ok" if torch.cuda.is_available() else "unsupported")


@pytest.mark.parametrize("argv, match", [
    (["--params", "0"], "--params must be at least --tensors"),
    (["--params", "100", "--tensors", "200"], "--params must be at least --tensors"),
    (["--systems", "hybrid8_cpp,foo"], r"--systems: unknown \['foo'\]"),
])
def test_bench_optim_bad_arguments_exit_before_running(tmp_path, capsys, argv, match):
    """--params 0 ended in a ZeroDivisionError after the rows ran; an unknown system wrote an error row and exit 0."""
    import re

    from benchmarks import bench_optim

    with pytest.raises(SystemExit) as e:
        bench_optim.main([*argv, "--out", str(tmp_path / "b.json")])
    assert e.value.code == 2 and re.search(match, capsys.readouterr().err)
    assert not (tmp_path / "b.json").exists()


def test_bench_optim_triton_launch_sweep_restores_the_kernel_launch(tmp_path):
    """--triton-launch repeats the Triton row per launch shape (unsupported without CUDA, still one row each) and
    leaves the kernel's own launch shape as it was; malformed shapes are argument errors."""
    import pytest

    from benchmarks import bench_optim
    from lazytrain_hf.optim._triton_kernel import LAUNCH

    before = dict(LAUNCH)
    doc = bench_optim.main(["--params", "4096", "--systems", "hybrid8_gpu_triton", "--triton-launch", "2:2,8:4",
                            "--steps", "5", "--warmup", "1", "--out", str(tmp_path / "o.json")])
    assert len(doc["rows"]) == 2 and LAUNCH == before
    for bad in ("3:4", "4:3", "4", "x:y"):
        with pytest.raises(SystemExit):
            bench_optim.main(["--systems", "hybrid8_gpu_triton", "--triton-launch", bad])
    with pytest.raises(SystemExit):  # a sweep of a row that is not run
        bench_optim.main(["--systems", "hybrid8_cpp", "--triton-launch", "4:4"])
    with pytest.raises(SystemExit):
        bench_optim.main(["--systems", "hybrid8_cpp", "--threads", "1,,2"])


@requires_gsm8k
def test_quality_check_trains_every_configuration_from_one_init(tmp_path):
    """benchmarks.quality on the CPU for 3 steps: one row per configuration, the reference first; every row starts
    from the same held-out loss (one bf16-rounded init for all), trains (its loss and parameters move), and its
    distance from the reference is 0 for the reference only; bf16_no_master (updates rounded to bf16 weights) ends
    farther from the reference than the fp32 masters of the default."""
    from benchmarks import quality

    out = tmp_path / "quality.json"
    doc = quality.main(["--out", str(out), "--steps", "3", "--log-every", "1", "--seq-len", "32", "--batch-size",
                        "2", "--held-out-rows", "2", "--configs", "fp32_reference", "default", "bf16_no_master"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    rows = {r["system"]: r["extra"] for r in doc["rows"]}
    assert [r["system"] for r in doc["rows"]] == ["fp32_reference", "default", "bf16_no_master"]
    ref = rows["fp32_reference"]["held_out_loss_start"]  # the bf16 copies differ only in their rotary buffers
    assert all(e["held_out_loss_start"] == pytest.approx(ref, rel=1e-5) for e in rows.values())
    assert rows["fp32_reference"]["param_distance_from_reference"] == 0.0
    assert all(e["reference_distance_moved"] > 0 and len(e["loss_every"]) == 3 for e in rows.values())
    assert 0 < rows["default"]["param_distance_from_reference"] < rows["bf16_no_master"]["param_distance_from_reference"]
