"""Re-planning per sequence-length bucket (lazytrain_hf/planning/buckets.py): bucket lists, one solve per bucket on
analytic costs, the lookup of a batch's sequence length, and the errors."""

from __future__ import annotations

import pytest

from lazytrain_hf.planning import (
    BucketSchedules,
    InfeasiblePlanError,
    make_schedule,
    plan_buckets,
    schedule_for,
    seq_len_buckets,
)

from .conftest import GIB, HOST_FIXED, small_cm


def test_seq_len_buckets_are_powers_of_two_up_to_the_maximum():
    assert seq_len_buckets(1024) == [128, 256, 512, 1024]
    assert seq_len_buckets(3000, 512) == [512, 1024, 2048, 3000]
    assert seq_len_buckets(100) == [100]  # shorter than the smallest bucket: one bucket
    assert seq_len_buckets(1 << 15, 16, max_buckets=3) == [8192, 16384, 32768]  # bounded: shortest dropped
    with pytest.raises(ValueError, match="max_seq_len.*max_buckets"):
        seq_len_buckets(0, max_buckets=0)


def _analytic_build():
    from lazytrain_hf.models import resolve_config
    from lazytrain_hf.profiling import H200_DEFAULTS, analytic_cost_model, model_shape

    shape = model_shape(resolve_config("qwen3-tiny"), "qwen3-tiny")
    return lambda t: analytic_cost_model(shape, 4, t, H200_DEFAULTS, gpu_bytes=GIB, host_bytes=4 * GIB)


def test_plan_buckets_on_analytic_costs_and_lookup():
    build = _analytic_build()
    plans = plan_buckets(build, seq_len_buckets(1024, 256), time_limit_s=10.0)
    assert plans.buckets == [256, 512, 1024]
    for b, s in plans.schedules.items():
        assert s.policy == "milp" and s.solver["seq_len_bucket"] == b
        assert s.predicted["fits_budget"]
        # the same plan as a direct solve for that length (a deterministic solver on the same model)
        direct = make_schedule(build(b), "milp", time_limit_s=10.0)
        assert s.predicted["step_ms"] == pytest.approx(direct.predicted["step_ms"], rel=0.011)
    steps = [plans.schedules[b].predicted["step_ms"] for b in plans.buckets]
    assert steps == sorted(steps)  # longer sequences, longer steps
    # lookup: the smallest bucket >= seq_len
    assert plans.bucket_for(1) == 256 and plans.bucket_for(256) == 256
    assert plans.bucket_for(257) == 512 and plans.bucket_for(1024) == 1024
    assert schedule_for(plans, 300) is plans.schedules[512]
    with pytest.raises(ValueError, match="no schedule for sequence length 1025"):
        plans.schedule_for(1025)
    # JSON-ready round trip
    assert BucketSchedules.from_dict(plans.to_dict()) == plans


def test_a_bucket_plan_fits_every_shorter_length():
    # act/saved bytes grow with T: the 512-token plan, padded to its bucket, also fits 300 tokens
    build = lambda t: small_cm(6, act_bytes=t * GIB // 2048, saved_bytes=t * GIB // 256, gpu_bytes=5 * GIB)  # noqa: E731
    plans = plan_buckets(build, [256, 512], prefetch_depths=(1,))
    s = plans.schedule_for(300)
    assert plans.bucket_for(300) == 512
    assert make_schedule(build(300), "fixed").predicted["peak_gpu_bytes"] > 0
    from lazytrain_hf.planning import evaluate

    assert evaluate(build(300), s).peak_gpu_bytes <= evaluate(build(512), s).peak_gpu_bytes <= 5 * GIB


def test_fixed_policy_and_argument_errors():
    build = lambda t: small_cm(4, act_bytes=t * GIB // 1024)  # noqa: E731
    plans = plan_buckets(build, [128, 128, 64], "fixed", checkpoint_every=2)
    assert plans.buckets == [64, 128] and all(s.policy == "fixed" for s in plans.schedules.values())
    with pytest.raises(ValueError, match="buckets is empty"):
        plan_buckets(build, [])
    with pytest.raises(ValueError, match="at most 16 buckets"):
        plan_buckets(build, range(1, 40))
    with pytest.raises(ValueError, match="fingerprint"):
        plan_buckets(build, [64], fingerprint="x")
    with pytest.raises(ValueError, match="at least one bucket"):
        BucketSchedules({})


def test_infeasible_bucket_is_named():
    # the longest bucket's boundaries no longer fit a 6 GiB GPU with no host room for offload
    build = lambda t: small_cm(4, act_bytes=t * GIB // 1024, gpu_bytes=7 * GIB, pinned_host_bytes=HOST_FIXED)  # noqa: E731
    with pytest.raises(InfeasiblePlanError, match="sequence-length bucket 4096") as info:
        plan_buckets(build, [256, 4096], prefetch_depths=(1,))
    assert info.value.min_gpu_bytes is not None and info.value.min_gpu_bytes > 7 * GIB
