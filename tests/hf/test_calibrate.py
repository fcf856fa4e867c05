"""Plan calibration from measured steps (lazytrain_hf/hf/calibrate.py, CostModel.scaled_compute)."""

from __future__ import annotations

import pytest

from lazytrain_hf.hf.calibrate import Calibration
from lazytrain_hf.models import resolve_config
from lazytrain_hf.planning.estimate import evaluate
from lazytrain_hf.planning.fixed import fixed_schedule
from lazytrain_hf.profiling import analytic_cost_model

GIB = 1024**3
PRED = {"step_ms": 1000.0, "compute_ms": 600.0, "recompute_ms": 150.0, "gpu_optim_ms": 50.0}  # compute 800 ms


def test_scale_comes_from_the_measured_steps_after_the_first():
    cal = Calibration(steps=2)
    cal.add_microbatch(PRED)
    assert cal.end_step(9.0) is None  # step 1: allocations, not used
    for measured_s in (1.16, 1.24):  # k = 1 + 160/800 = 1.2, 1 + 240/800 = 1.3
        cal.add_microbatch(PRED)
        k = cal.end_step(measured_s)
    assert k == pytest.approx(1.25) and cal.done
    cal.add_microbatch(PRED)
    assert cal.end_step(2.0) is None  # once per run


def test_gradient_accumulation_counts_the_optimizer_once_per_step():
    """A step of 4 micro-batches predicted exactly gives k = 1: the GPU-side update and the exposed CPU update
    happen once per optimizer step, not once per micro-batch (they are in every micro-batch's step_ms)."""
    pred = {"step_ms": 1000.0, "compute_ms": 600.0, "recompute_ms": 150.0, "gpu_optim_ms": 50.0,
            "exposed_transfer_ms": 50.0, "exposed_optimizer_ms": 150.0}
    cal = Calibration(steps=1, skip=2)
    for measured_s in (9.0, 5.0, 3.4):  # two skipped steps (allocation), then 1000 + 3 x 800 ms
        for _ in range(4):
            cal.add_microbatch(pred)
        k = cal.end_step(measured_s)
    assert k is None and cal.samples == [pytest.approx(1.0)]  # exact: no re-plan
    cal = Calibration(steps=1, skip=0)
    for _ in range(4):
        cal.add_microbatch(pred)
    assert cal.end_step(3.4 + 0.2 * 3050 / 1e3) == pytest.approx(1.2)  # 20% slower GPU compute (4 x 750 + 50 ms)


def test_small_misses_do_not_replan_and_zero_steps_is_off():
    cal = Calibration(steps=1, skip=0)
    cal.add_microbatch(PRED)
    assert cal.end_step(1.02) is None and cal.samples == [pytest.approx(1.025)]  # within 5%: keep the plan
    off = Calibration(steps=0)
    for s in (1.0, 3.0, 3.0):
        off.add_microbatch(PRED)
        assert off.end_step(s) is None


def test_scaled_compute_moves_only_gpu_compute():
    cm = analytic_cost_model(resolve_config("qwen3-tiny"), 2, 64, gpu_bytes=GIB, host_bytes=4 * GIB)
    s = cm.scaled_compute(2.0)
    assert s.fwd_ms == [2 * t for t in cm.fwd_ms] and s.bwd_ms == [2 * t for t in cm.bwd_ms]
    assert s.head_ms == 2 * cm.head_ms and s.gpu_optim_params_per_s == cm.gpu_optim_params_per_s / 2
    assert (s.h2d_gbps, s.cpu_optim_params_per_s, s.saved_bytes) == (cm.h2d_gbps, cm.cpu_optim_params_per_s,
                                                                     cm.saved_bytes)
    sched = fixed_schedule(cm.num_layers, 2, "gpu", 1)
    assert evaluate(s, sched).compute_ms == pytest.approx(2 * evaluate(cm, sched).compute_ms)
    with pytest.raises(ValueError, match="must be > 0"):
        cm.scaled_compute(0.0)
