"""StepMeter's per-step CUDA allocator retries and the callback's one warning about them (CPU: torch.cuda faked)."""

import logging
from types import SimpleNamespace

import torch

from lazytrain_hf.hf.calibrate import Calibration
from lazytrain_hf.hf.callback import LazyTrainCallback
from lazytrain_hf.hf.metrics import StepMeter


def test_step_meter_counts_the_steps_allocator_retries(monkeypatch):
    retries = iter([3, 5, 5, 5])  # cumulative num_alloc_retries at each start / stop
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {"num_alloc_retries": next(retries)})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    meter = StepMeter(num_params=10, device=torch.device("cuda", 0))
    meter.start()
    meter.stop()
    assert meter.last["cuda_alloc_retries"] == 2  # 5 - 3: this step's retries, not the run's
    meter.start()
    meter.stop()
    assert meter.last["cuda_alloc_retries"] == 0
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {})  # no allocator activity yet
    meter.start()
    meter.stop()
    assert meter.last["cuda_alloc_retries"] == 0
    cpu = StepMeter(num_params=10, device=torch.device("cpu"))
    cpu.start()
    cpu.stop()
    assert "cuda_alloc_retries" not in cpu.last


def test_allocator_retries_warn_once_after_the_warm_up(caplog):
    trainer = SimpleNamespace(meter=SimpleNamespace(last={"cuda_alloc_retries": 2}),
                              lazy_config=SimpleNamespace(gpu_memory_margin=0.12, policy="milp", schedule_path=None))
    cb = LazyTrainCallback(trainer)
    calibrating = Calibration(steps=3)
    with caplog.at_level(logging.WARNING, logger="lazytrain_hf.hf.callback"):
        cb._warn_alloc_retries(2, None)  # warm-up step: the optimizer states are being allocated
        cb._warn_alloc_retries(4, calibrating)  # the calibration may still re-plan
        assert not caplog.records
        trainer.meter.last["cuda_alloc_retries"] = 0
        cb._warn_alloc_retries(7, None)
        assert not caplog.records
        trainer.meter.last["cuda_alloc_retries"] = 2
        cb._warn_alloc_retries(8, None)
        cb._warn_alloc_retries(9, None)
    assert len(caplog.records) == 1
    msg = caplog.records[0].getMessage()
    assert "step 8" in msg and "2 allocation" in msg
    assert "lazytrain_config.expandable_segments" in msg and "gpu_memory_margin (now 0.12)" in msg
    # segments already expandable (the CUDA default): only the plan's room is a fix
    caplog.clear()
    trainer.expandable_segments = True
    with caplog.at_level(logging.WARNING, logger="lazytrain_hf.hf.callback"):
        LazyTrainCallback(trainer)._warn_alloc_retries(8, None)
    msg = caplog.records[0].getMessage()
    assert "expandable" not in msg and "gpu_memory_margin (now 0.12)" in msg


def test_allocator_retries_warn_without_calibration_and_name_a_fix_that_applies(caplog):
    """calibrate_steps 0 (a Calibration that never completes) still warns; a fixed policy is not told to change
    the MILP's margin, which it never reads."""
    trainer = SimpleNamespace(meter=SimpleNamespace(last={"cuda_alloc_retries": 1}),
                              lazy_config=SimpleNamespace(gpu_memory_margin=0.12, policy="fixed", schedule_path=None))
    with caplog.at_level(logging.WARNING, logger="lazytrain_hf.hf.callback"):
        LazyTrainCallback(trainer)._warn_alloc_retries(3, Calibration(steps=0))
    (rec,) = caplog.records
    assert "gpu_memory_margin" not in rec.getMessage() and "gpu_memory_budget" in rec.getMessage()


def test_step_meter_counts_4_flops_per_frozen_parameter(monkeypatch):
    """A frozen parameter (LoRA's base) runs its forward and input gradient, no weight gradient: 4 FLOPs per token
    against a trainable one's 6."""
    clock = iter([10.0, 12.0])
    monkeypatch.setattr("lazytrain_hf.hf.metrics.time.perf_counter", lambda: next(clock))
    meter = StepMeter(num_params=1_000_000, device=torch.device("cpu"), frozen_params=3_000_000_000)
    meter.start()
    meter.add_tokens(4096)
    meter.stop()
    want = (6 * 1_000_000 + 4 * 3_000_000_000) * 4096 / 2.0 / 1e12
    assert abs(meter.last["tflops"] - want) / want < 1e-3
