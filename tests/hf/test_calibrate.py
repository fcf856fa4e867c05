"""Plan calibration from measured steps (lazytrain_hf/hf/calibrate.py, CostModel.scaled_compute)."""

from __future__ import annotations

import pytest

from lazytrain_hf.hf.calibrate import Calibration
from lazytrain_hf.models import resolve_config
from lazytrain_hf.planning.estimate import evaluate
from lazytrain_hf.planning.fixed import fixed_schedule
from lazytrain_hf.profiling import analytic_cost_model

GIB = 1024**3
PRED = {"step_ms": 1000.0, "compute_ms": 640.0, "recompute_ms": 160.0, "gpu_optim_ms": 50.0}  # compute 800 ms


def test_scale_comes_from_the_measured_steps_after_the_first():
    cal = Calibration(steps=2)
    cal.add_microbatch(PRED)
    assert cal.end_step(9.0) is False  # step 1: allocations, not used
    ready = []
    for measured_s in (1.16, 1.24):  # k = 1 + 160/800 = 1.2, 1 + 240/800 = 1.3
        cal.add_microbatch(PRED)
        ready.append(cal.end_step(measured_s))
    assert ready == [False, True] and cal.done
    assert cal.compute_factors() == [pytest.approx(1.2), pytest.approx(1.3)]
    assert cal.measured_cpu_rate() is None  # no CPU-side update ran
    cal.add_microbatch(PRED)
    assert cal.end_step(2.0) is False and len(cal.step_ms) == 2  # once per run


def test_gradient_accumulation_counts_the_optimizer_once_per_step():
    """A step of 4 micro-batches predicted exactly gives k = 1: the GPU-side update and the exposed CPU update
    happen once per optimizer step, not once per micro-batch (they are in every micro-batch's step_ms)."""
    pred = {"step_ms": 1000.0, "compute_ms": 600.0, "recompute_ms": 150.0, "gpu_optim_ms": 50.0,
            "exposed_transfer_ms": 50.0, "exposed_optimizer_ms": 150.0}
    cal = Calibration(steps=1, skip=2)
    for measured_s in (9.0, 5.0, 3.4):  # two skipped steps (allocation), then 1000 + 3 x 800 ms
        for _ in range(4):
            cal.add_microbatch(pred)
        ready = cal.end_step(measured_s)
    assert ready and cal.compute_factors() == [pytest.approx(1.0)]  # exact
    assert not Calibration.needs_replan(1.0, None, 2e9)
    cal = Calibration(steps=1, skip=0)
    for _ in range(4):
        cal.add_microbatch(pred)
    assert cal.end_step(3.4 + 0.2 * 3000 / 1e3)
    assert cal.compute_factors() == [pytest.approx(1.2)]  # 20% slower layer compute (4 x 750 ms)


def test_the_measured_cpu_update_rate_takes_its_share_of_the_miss():
    """The update worker's measured rate (parameters / wall time of the run that overlapped the step) is kept per
    used step; the compute factor only takes what the slower CPU updates (delta, from re-evaluating the plan at that
    rate: hf/callback.py) do not explain. A step with no CPU-side update adds no rate."""
    cal = Calibration(steps=3, skip=1)
    for measured_s, ms, params in ((9.0, 500.0, 1e9), (1.3, 400.0, 1e9), (1.3, 500.0, 1e9), (1.3, None, None)):
        cal.add_microbatch(PRED)
        cal.note_cpu_update(ms, params)
        cal.end_step(measured_s)
    assert cal.cpu_rates == [pytest.approx(2.5e9), pytest.approx(2e9)]  # step 1 skipped, step 4 had none
    assert cal.measured_cpu_rate() == pytest.approx(2.25e9)
    assert cal.compute_factors() == [pytest.approx(1.375)] * 3  # all of the 300 ms miss on the GPU compute
    assert cal.compute_factors(delta_ms=300.0) == [pytest.approx(1.0)] * 3  # the CPU rate explains all of it
    # per sequence-length bucket: each step is corrected by the plan its first micro-batch ran
    per = Calibration(steps=2, skip=0)
    for bucket, extra in ((512, 0), (1024, 200)):
        per.add_microbatch(PRED, bucket)
        per.add_microbatch(PRED, 64)  # a later micro-batch's bucket does not count
        per.end_step((1950 + 300 + extra) / 1e3)  # 1000 + 950 predicted (GPU update once), 300 (+200) more
    assert per.step_buckets == [512, 1024]
    assert per.compute_factors({512: 300.0, 1024: 500.0}) == [pytest.approx(1.0), pytest.approx(1.0)]
    # re-plan when the compute or the CPU rate is off: 5% and 10%
    assert Calibration.needs_replan(1.06, None, 2e9) and not Calibration.needs_replan(1.04, 2.1e9, 2e9)
    assert Calibration.needs_replan(1.0, 1.7e9, 2e9) and not Calibration.needs_replan(1.0, None, 2e9)


def test_small_misses_do_not_replan_and_zero_steps_is_off():
    cal = Calibration(steps=1, skip=0)
    cal.add_microbatch(PRED)
    assert cal.end_step(1.02) and cal.compute_factors() == [pytest.approx(1.025)]
    assert not Calibration.needs_replan(1.025, None, None)  # within 5%: keep the plan
    off = Calibration(steps=0)
    for s in (1.0, 3.0, 3.0):
        off.add_microbatch(PRED)
        assert off.end_step(s) is False


def test_a_switched_plan_is_kept_only_when_its_measured_steps_beat_the_replaced_plan():
    """After a switch (start_trial: replaced plan 1000 ms, new plan 900 ms at the measured figures), the first step
    under the new plan is not used; after `steps` more, the new plan stays when median(measured / predicted) x 900
    is under 1000 ms, else the verdict is to switch back. One verdict per run; a memory re-plan cancels it."""
    def run(measured: list[float]) -> Calibration:
        cal = Calibration(steps=2, skip=0)
        for _ in range(2):
            cal.add_microbatch(PRED)
            cal.end_step(1.0)
        assert cal.done and cal.trial_verdict() is None  # nothing on trial yet
        cal.start_trial(1000.0, 900.0)
        pred = {**PRED, "step_ms": 900.0}
        for s in measured:
            assert cal.trial_verdict() is None
            cal.add_microbatch(pred)
            cal.end_step(s)
        return cal

    kept = run([5.0, 0.95, 0.99])  # first step (5 s) not used; ratios 1.056, 1.1: 1.078 x 900 = 970 ms
    assert kept.trial == [(950.0, 900.0), (990.0, 900.0)]
    assert kept.trial_verdict() is True and kept.trial_ratio == pytest.approx(1.0778, abs=1e-4)
    assert kept.reverted is False and kept.trial_verdict() is None  # decided once
    back = run([0.5, 1.05, 1.10])  # 1.19 x 900 = 1075 ms: slower than the replaced plan
    assert back.trial_verdict() is False and back.reverted is True
    cancelled = run([1.0])
    cancelled.cancel_trial()
    cancelled.add_microbatch(PRED)
    cancelled.end_step(2.0)
    assert cancelled.trial_verdict() is None and cancelled.reverted is None


def test_cpu_optim_rate_moves_only_the_cpu_updates():
    cm = analytic_cost_model(resolve_config("qwen3-tiny"), 2, 64, gpu_bytes=GIB, host_bytes=4 * GIB)
    slow = cm.with_cpu_optim_rate(cm.cpu_optim_params_per_s / 100)
    assert slow.cpu_optim_ms(1) == pytest.approx(100 * cm.cpu_optim_ms(1))
    assert (slow.fwd_ms, slow.gpu_optim_params_per_s, slow.h2d_gbps) == (cm.fwd_ms, cm.gpu_optim_params_per_s,
                                                                         cm.h2d_gbps)
    sched = fixed_schedule(cm.num_layers, 2, "gpu", 1)  # every layer updates on the CPU
    before, after = evaluate(cm, sched), evaluate(slow, sched)
    assert after.compute_ms == before.compute_ms and after.step_ms > before.step_ms
    assert after.exposed_optimizer_ms > before.exposed_optimizer_ms
    with pytest.raises(ValueError, match="must be > 0"):
        cm.with_cpu_optim_rate(0.0)


def test_scaled_compute_moves_only_gpu_compute():
    cm = analytic_cost_model(resolve_config("qwen3-tiny"), 2, 64, gpu_bytes=GIB, host_bytes=4 * GIB)
    s = cm.scaled_compute(2.0)
    assert s.fwd_ms == [2 * t for t in cm.fwd_ms] and s.bwd_ms == [2 * t for t in cm.bwd_ms]
    assert s.head_ms == 2 * cm.head_ms
    assert (s.h2d_gbps, s.cpu_optim_params_per_s, s.gpu_optim_params_per_s, s.saved_bytes) == \
        (cm.h2d_gbps, cm.cpu_optim_params_per_s, cm.gpu_optim_params_per_s, cm.saved_bytes)
    sched = fixed_schedule(cm.num_layers, 2, "gpu", 1)
    assert evaluate(s, sched).compute_ms == pytest.approx(2 * evaluate(cm, sched).compute_ms)
    with pytest.raises(ValueError, match="must be > 0"):
        cm.scaled_compute(0.0)


def test_the_trial_compares_whole_optimizer_steps_under_accumulation():
    """4 micro-batches a step: the replaced plan predicts 1500 ms (1000 ms micro-batch + 500 ms optimizer terms,
    4500 ms a step), the new one 1400 ms (1100 + 300: 4700 ms a step). Valued per optimizer step
    (plans.optimizer_step_ms, what recalibrated_plans passes), the new plan running as predicted is slower and the
    trial switches back; per micro-batch it would have been kept."""
    from lazytrain_hf.hf.plans import optimizer_step_ms

    ga, new = 4, {"step_ms": 1400.0, "compute_ms": 1100.0, "exposed_optimizer_ms": 300.0}
    assert optimizer_step_ms(1500.0, 500.0, ga) == 4500.0 and optimizer_step_ms(1400.0, 300.0, ga) == 4700.0
    cal = Calibration(steps=2, skip=0)
    for _ in range(2):
        for _ in range(ga):
            cal.add_microbatch({"step_ms": 1500.0, "compute_ms": 1000.0, "exposed_optimizer_ms": 500.0})
        cal.end_step(4.5)
    cal.start_trial(optimizer_step_ms(1500.0, 500.0, ga), optimizer_step_ms(1400.0, 300.0, ga))
    for _ in range(3):
        for _ in range(ga):
            cal.add_microbatch(new)
        cal.end_step(4.7)
    assert cal.trial == [(4700.0, 4700.0)] * 2 and cal.trial_verdict() is False
