"""`fast_eval.StepEvaluator` (the vectorized linear model the planner's heuristics use) against
`estimate.evaluate` (the reference) and against the MILP's own objective."""

from __future__ import annotations

import random

import pytest

from lazytrain_hf.planning import evaluate
from lazytrain_hf.planning.fast_eval import PlanArrays, StepEvaluator, improve_plan, perturb_plan
from lazytrain_hf.planning.milp import _PlanMilp

from .conftest import GIB, HOST_FIXED, A, small_cm
from .test_milp import _random_schedule, _varied_cms
from .test_milp_search import _two_kinds


def _cms():
    return _varied_cms() + [
        _two_kinds(small_cm(12, gpu_bytes=14 * GIB, nvme_bytes=50 * GIB, pinned_host_bytes=HOST_FIXED + 3 * A,
                            cpu_optim_params_per_s=5e8, embed_optim_params=10_000_000)),
        small_cm(64, gpu_bytes=16 * GIB, cpu_optim_params_per_s=4e9, nvme_bytes=100 * GIB,
                 pinned_host_bytes=HOST_FIXED + 4 * GIB),
    ]


def test_step_evaluator_equals_evaluate():
    rng = random.Random(3)
    for cm in _cms():
        one = StepEvaluator(cm, 1)
        evs = {1: one, 2: StepEvaluator(cm, 2), 3: one.at_depth(3)}  # built, or derived from another depth
        for _ in range(20):
            s = _random_schedule(rng, cm)
            got, ref = evs[s.prefetch_depth].evaluate(PlanArrays.of(s)), evaluate(cm, s)
            assert got.step_ms == pytest.approx(ref.step_ms, rel=1e-12, abs=1e-9)
            assert got.peak_gpu_bytes == pytest.approx(ref.peak_gpu_bytes, rel=1e-12)
            assert got.host_bytes == pytest.approx(ref.pinned_host_bytes, rel=1e-12)
            assert got.nvme_bytes == pytest.approx(ref.nvme_bytes, rel=1e-12)
            assert got.fits(cm) == (ref.peak_gpu_bytes <= cm.gpu_bytes + 1 and ref.pinned_host_bytes
                                    <= cm.pinned_host_bytes + 1 and ref.nvme_bytes <= cm.nvme_bytes + 1)
            back = PlanArrays.of(PlanArrays.of(s).schedule(s.prefetch_depth))
            assert evs[s.prefetch_depth].evaluate(back).objective == got.objective


def test_step_evaluator_objective_is_the_milp_objective():
    """The evaluator's objective (step time plus tie-breakers) equals the MILP objective of the plan's column
    vector (the warm start built from `evaluate`)."""
    import numpy as np

    rng = random.Random(4)
    for cm in _cms()[:3]:
        big = cm.with_budgets(gpu_bytes=10**13, pinned_host_bytes=10**13, nvme_bytes=cm.nvme_bytes and 10**13)
        for _ in range(4):
            s = _random_schedule(rng, big)
            model = _PlanMilp(big, s.prefetch_depth, symmetry_breaking=False)
            model.warm_start(s)
            lp = model.h.getLp()
            milp_obj = float(np.dot(lp.col_cost_, model._start[0]) + lp.offset_)
            assert StepEvaluator(big, s.prefetch_depth).evaluate(PlanArrays.of(s)).objective == pytest.approx(
                milp_obj, rel=1e-9)


def test_local_search_repairs_an_over_budget_plan_and_kicks_never_worsen():
    """`improve_plan` from a plan that misses the GPU budget (every boundary on the GPU, nothing retained) ends
    inside every budget; `perturb_plan` returns a plan no worse than its start, deterministically for a seed."""
    import time

    import numpy as np

    from lazytrain_hf.planning.milp import _layer_classes

    cm = small_cm(32, gpu_bytes=12 * GIB, cpu_optim_params_per_s=4e9, nvme_bytes=50 * GIB,
                  pinned_host_bytes=HOST_FIXED + 3 * GIB)
    ev = StepEvaluator(cm, 1)
    L = cm.num_layers
    start = PlanArrays(np.ones(L), np.zeros(L), np.zeros(L), np.zeros(L))
    assert not ev.evaluate(start).fits(cm)
    classes = _layer_classes(cm)
    plan, val, evals = improve_plan(ev, start, time.perf_counter() + 30, classes=classes)
    assert val.fits(cm) and evals > 1
    ref = evaluate(cm, plan.schedule(1))
    assert ref.step_ms == pytest.approx(val.step_ms, rel=1e-12)
    assert ref.peak_gpu_bytes <= cm.gpu_bytes
    kicked = [perturb_plan(ev, plan, time.perf_counter() + 30, classes=classes, target=-1.0, kicks=3, seed=7)
              for _ in range(2)]
    assert kicked[0][1].objective <= val.objective + 1e-9 and kicked[0][1].fits(cm)
    assert kicked[0][1].objective == kicked[1][1].objective
