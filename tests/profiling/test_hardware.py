"""Hardware profile (lazytrain_hf/profiling/hardware.py): the H200 defaults, the CPU no-op, the cache key and
the disk probe (which runs anywhere)."""

from __future__ import annotations

import json

import pytest
import torch

from lazytrain_hf.profiling import H200_DEFAULTS, HardwareProfile, machine_fingerprint, probe
from lazytrain_hf.profiling.hardware import _disk_gbps, optimizer_rate


def test_defaults_are_the_design_figures():
    """The H200 machine's PCIe, disk and GEMM figures (2026-11-29); the optimizer rates are the project's own kernels
    as measured there on 2026-11-30 (Triton GPU update, C++ CPU update inside steps)."""
    d = H200_DEFAULTS
    assert (d.h2d_gbps, d.d2h_gbps, d.bidir_gbps) == (50.8, 54.1, 33.0)
    assert (d.nvme_read_gbps, d.nvme_write_gbps, d.gpu_tflops) == (1.5, 1.0, 787.0)
    assert (d.gpu_optim_params_per_s, d.cpu_optim_params_per_s) == (70e9, 3.6e9)
    assert d.gpu_memory_bytes == 143_771 * 1024**2
    assert d.measured is False


def test_probe_on_cpu_returns_defaults_unmeasured():
    p = probe("cpu", cpu_optim_params_per_s=3e9)
    assert p.measured is False and p.h2d_gbps == H200_DEFAULTS.h2d_gbps
    assert p.cpu_optim_params_per_s == 3e9
    if not torch.cuda.is_available():
        assert probe("cuda").measured is False


def test_profile_round_trip_ignores_unknown_keys():
    d = H200_DEFAULTS.to_dict()
    assert HardwareProfile.from_dict(json.loads(json.dumps({**d, "future_field": 1}))) == H200_DEFAULTS
    assert set(H200_DEFAULTS.planner_rates()) >= {"h2d_gbps", "bidir_gbps", "cpu_optim_params_per_s"}


def test_fingerprint_is_stable_and_depends_on_the_nvme_dir(tmp_path):
    a = machine_fingerprint("cpu")
    assert a == machine_fingerprint("cpu") and len(a) == 16
    assert machine_fingerprint("cpu", tmp_path) != a


def test_disk_probe_measures_a_temporary_file(tmp_path):
    write, read = _disk_gbps(tmp_path, 16 * 1024**2)
    assert write > 0 and read > 0
    assert list(tmp_path.iterdir()) == []  # the file is removed


@pytest.mark.gpu
def test_probe_measures_on_cuda(tmp_path, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setenv("LAZYTRAIN_CACHE_DIR", str(tmp_path))
    p = probe("cuda", refresh=True, copy_bytes=64 * 1024**2, disk_bytes=32 * 1024**2, nvme_dir=tmp_path / "nvme")
    assert p.measured and p.h2d_gbps > 1 and p.gpu_tflops > 10 and p.bidir_gbps > 1
    assert p.cpu_optim_params_per_s > 1e7 and p.gpu_optim_params_per_s > 1e9, p.notes  # timed, not defaults
    assert not any("default" in v for k, v in p.notes.items() if "optim" in k), p.notes
    assert any(tmp_path.glob("hardware-*.json"))
    assert probe("cuda", nvme_dir=tmp_path / "nvme") == p  # served from the cache


def test_optimizer_rate_times_the_hybrid8_update_on_cpu(monkeypatch):
    """The probe's CPU optimizer rate comes from the real Hybrid8bitOptimizer step: positive, finite, and it scales
    with the work (the same update over 4x the parameters takes longer; rates within 8x of each other)."""
    monkeypatch.setenv("LAZYTRAIN_CPU_THREADS", "1")
    small, large = optimizer_rate("cpu", numel=2**16), optimizer_rate("cpu", numel=2**18)
    assert 1e5 < small < 1e11 and 1e5 < large < 1e11
    assert 1 / 8 < large / small < 8
