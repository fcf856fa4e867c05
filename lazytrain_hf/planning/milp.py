"""The planning MILP's entry point: `solve_milp` solves one MILP per weight prefetch depth (LazyTrain, arXiv
2608.11919 §3, extended) and returns the best per-layer schedule.

The model (columns, rows, objective, a plain HiGHS solve) is `milp_model.py`; the branch-and-bound search over it,
the default path, is `milp_search.py`; infeasible budgets (`InfeasiblePlanError`, `min_gpu_bytes`, the error text)
are `infeasible.py`. Each depth is warm-started from the best feasible `fixed` variant (MegaTrain's heuristic) or
the previous depth's plan; deeper depths are screened by the linear model first. The result is a `Schedule` with
`solver` = {status, mip_gap, solve_ms, objective_ms, ...} and `predicted` = {step_ms, peak_gpu_bytes, ...}.
Infeasible budgets raise `InfeasiblePlanError`, which names the smallest feasible GPU and host budgets.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

from .cost_model import CostModel
from .estimate import decision_values, evaluate, recompute_flags, unit_terms
from .fast_eval import PlanArrays, StepEvaluator
from .fixed import checkpoint_interval, checkpoint_tier, fixed_schedule
from .infeasible import (  # noqa: F401 - _fits, _round_budget_up: importable from here
    _SOLVE,
    InfeasiblePlanError,
    _fits,
    _min_memory_plan,
    _round_budget_up,
    infeasible_error,
    min_gpu_bytes,
    with_margin,
)
from .milp_model import GIB, _layer_classes, _PlanModel, _Result  # noqa: F401 - _layer_classes: importable from here
from .milp_search import _PlanMilp
from .schedule import LayerPlan, Schedule
from .schedule import fingerprint as _fingerprint

__all__ = ["solve_milp", "min_gpu_bytes", "InfeasiblePlanError", "fixed_candidates", "milp_value", "infeasible_error",
           "GIB"]

#: Where a time limit is set, for messages that reach CLI and Trainer users alike.
TIME_LIMIT_HINT = "--time-limit / lazytrain_config.solver_time_limit_s"


def fixed_candidates(cm: CostModel, prefetch_depth: int = 1, *, evaluator: StepEvaluator | None = None
                     ) -> list[Schedule]:
    """Variants of the `fixed` heuristic (checkpoint every k in 1, 2, 4, 8, all boundaries in one tier) that fit
    the budgets under the linear model, fastest first. Used as MILP warm starts and as the no-solution fallback.
    `evaluator`: a `StepEvaluator` of `cm` at `prefetch_depth` (built here when not given)."""
    import numpy as np

    ev = evaluator if evaluator is not None else StepEvaluator(cm, prefetch_depth)
    tiers = ["gpu", "cpu"] + (["nvme"] if cm.nvme_bytes > 0 else [])
    scheds = []
    for every in (1, 2, 4, 8):
        for tier in tiers:
            s = fixed_schedule(cm.num_layers, checkpoint_every=every, tier=tier, prefetch_depth=prefetch_depth)
            s.layers[0].tier = "gpu"  # boundary 0 stays on the GPU, as the MILP's g_0 = 1
            scheds.append(s)
    plans = [PlanArrays.of(s) for s in scheds]
    vals = ev.evaluate_many(*(np.stack([getattr(p, f) for p in plans], axis=1) for f in ("c", "tier", "r", "o")))
    out = [(val.step_ms, k) for k, val in enumerate(vals) if val.fits(cm)]
    out.sort()
    return [scheds[k] for _, k in out]


def solve_milp(cm: CostModel, *, prefetch_depths: tuple[int, ...] = (1, 2, 3), time_limit_s: float = 10.0,
               mip_rel_gap: float = 0.01, warm_start: bool = True, symmetry_breaking: bool = True,
               gpu_optimizer: bool = True, fingerprint: str = "", search: bool = True) -> Schedule:
    """Solve the planning MILP for each prefetch depth and return the best schedule (policy "milp").

    Args:
        cm: the cost model (budgets included).
        prefetch_depths: depths d to try (each adds one weight slot per layer kind), in ascending order. A deeper
            one is solved only if the best plan so far, moved to that depth, still fits and gets faster by more
            than `mip_rel_gap` (`_deeper_may_help`); the others are reported as "skipped".
        time_limit_s: wall-clock limit for all solves together (s), split evenly over the remaining depths.
        mip_rel_gap: HiGHS relative MIP gap (0.01 = stop within 1% of the best bound).
        warm_start: start HiGHS from the best feasible `fixed` variant.
        symmetry_breaking: order decisions among identical layers (see `_PlanMilp._symmetry_breaking`).
        gpu_optimizer: allow per-layer optimizer updates on the GPU (o_i); False keeps every update on the CPU,
            as the current executor runs them (it warns about GPU placements it does not perform yet).
        fingerprint: stored in the schedule (default: a hash of the cost model).
        search: solve by branch and bound over the per-class optimizer-placement counts and the global flags,
            HiGHS for the rest (`_PlanMilp.solve_search`; used with `symmetry_breaking` and `gpu_optimizer`); False
            hands HiGHS the whole MILP at once (64 layers with `gpu_optimizer`: 8-14 s instead of 0.05-0.6 s). Without
            `gpu_optimizer` the search runs too (only the flags are branched on; symmetry breaking not needed);
            each leaf first gets an LP rounding + local search plan, then (if that is not within the gap) a diving start
            from its LP (`_PlanMilp._dive`) and HiGHS.

    Kept gradients (`cm.kept_grad_bytes`): they save PCIe but hold GPU memory across the step boundary, so the
    plan is solved with and without them (half the time limit each) and the faster one is returned, its
    `keep_grads` set accordingly.

    Returns:
        A `Schedule` with `solver` = {status, mip_gap, solve_ms, objective_ms, dual_bound_ms, depths: [...]} (the
        gap is over the depths solved: best objective against their smallest dual bound) and `predicted` =
        {step_ms, peak_gpu_bytes, pinned_host_bytes, nvme_bytes, compute_ms, recompute_ms, gpu_optim_ms,
        exposed_transfer_ms, exposed_optimizer_ms, tokens_per_s} (ms, bytes, tokens/s) from the linear model.

    Raises:
        InfeasiblePlanError: no schedule fits the budgets (names the smallest feasible budgets).
        ValueError: a prefetch depth outside 1..8 or a non-positive time limit / gap.

    Warns:
        UserWarning: a solve stopped at the time limit (the incumbent is used) or found no solution (the best
        `fixed` variant within every budget is used, else the memory-only MILP's plan; status "fallback_fixed" /
        "fallback_min_memory"; InfeasiblePlanError when neither fits).
    """
    if not (cm.keeps_grads and gpu_optimizer):
        return _solve_milp(cm, prefetch_depths, time_limit_s, mip_rel_gap, warm_start, symmetry_breaking,
                           gpu_optimizer, fingerprint, search)
    fp = fingerprint or _fingerprint(cm.to_dict())
    plans: list[Schedule] = []
    error: InfeasiblePlanError | None = None
    for variant in (cm, cm.without_kept()):
        try:
            plans.append(_solve_milp(variant, prefetch_depths, time_limit_s / 2, mip_rel_gap, warm_start,
                                     symmetry_breaking, gpu_optimizer, fp, search))
        except InfeasiblePlanError as e:  # kept gradients take memory: the plan without them may still fit
            error = e  # the last (without them) names the smaller budgets
    if not plans:
        assert error is not None
        raise error
    return min(plans, key=lambda s: s.predicted["step_ms"])


def _solve_milp(cm: CostModel, prefetch_depths: tuple[int, ...], time_limit_s: float, mip_rel_gap: float,
                warm_start: bool, symmetry_breaking: bool, gpu_optimizer: bool, fingerprint: str,
                search: bool) -> Schedule:
    """`solve_milp` for one cost model (kept gradients as `cm` says)."""
    depths = sorted(set(prefetch_depths))
    problems = []
    if not depths or any(not 1 <= d <= 8 for d in depths):
        problems.append(f"prefetch_depths must be in [1, 8], but got {tuple(prefetch_depths)}")
    if not time_limit_s > 0:
        problems.append(f"time_limit_s must be > 0, but got {time_limit_s}")
    if not 0 <= mip_rel_gap < 1:
        problems.append(f"mip_rel_gap must be in [0, 1), but got {mip_rel_gap}")
    if problems:
        raise ValueError("solve_milp: " + "; ".join(problems))
    if cm.pinned_host_bytes < cm.host_fixed_bytes:
        raise infeasible_error(cm)
    fp = fingerprint or _fingerprint(cm.to_dict())
    deadline = time.perf_counter() + time_limit_s
    results: list[_Result] = []
    models: list[_PlanMilp] = []
    skipped: list[int] = []
    evaluators = _Evaluators(cm)
    for idx, d in enumerate(depths):
        best_so_far = min((r for r in results if r.schedule is not None), key=lambda r: r.objective, default=None)
        if best_so_far is not None and not _deeper_may_help(cm, best_so_far.schedule, d, mip_rel_gap, evaluators):
            skipped.append(d)
            continue
        # the first depth gets 80% of the budget (deeper ones are usually screened out, and then the rest continues
        # the first depth), the others share what is left
        left = max(0.0, deadline - time.perf_counter())
        share = left * 0.8 if idx == 0 and len(depths) > 1 else left / (len(depths) - idx)
        model = _PlanMilp(cm, d, symmetry_breaking=symmetry_breaking, gpu_optimizer=gpu_optimizer,
                          units=evaluators.units)
        use_search = search and (symmetry_breaking or not gpu_optimizer)
        if warm_start:
            start = _best_start(cm, d, [r.schedule for r in results if r.schedule is not None], evaluators)
            if start is not None and use_search:
                model.set_incumbent(start)  # the search values it itself (no column vector needed)
            elif start is not None:
                model.warm_start(start)
        if use_search:
            res = model.solve_search(share, mip_rel_gap, evaluators(d))
        else:
            res = model.solve(share, mip_rel_gap)
        results.append(res)
        models.append(model)
        if res.status == "infeasible":
            skipped += depths[idx + 1:]  # a deeper prefetch only adds weight slots: also infeasible
            break
    # leftover time (deeper depths screened out): continue the best unproven depth from its incumbent
    left = deadline - time.perf_counter()
    open_ = [k for k, r in enumerate(results) if r.status == "time_limit" and r.schedule is not None]
    if open_ and left > 0.5:
        k = min(open_, key=lambda j: results[j].objective)
        models[k].warm_start(results[k].schedule)
        more = models[k].solve(left, mip_rel_gap)
        if more.has_solution and more.objective <= results[k].objective + 1e-9:
            more.solve_ms += results[k].solve_ms
            more.bound = max(more.bound, results[k].bound)
            results[k] = more
        else:
            results[k].solve_ms += more.solve_ms
    feasible = [r for r in results if r.has_solution and r.schedule is not None]
    total_ms = sum(r.solve_ms for r in results)
    per_depth = [{"prefetch_depth": r.depth, "status": r.status, "objective_ms": _nan_none(r.objective),
                  "mip_gap": _nan_none(r.mip_gap), "solve_ms": r.solve_ms} for r in results]
    per_depth += [{"prefetch_depth": d, "status": "skipped", "objective_ms": None, "mip_gap": None, "solve_ms": 0.0}
                  for d in skipped]
    if not feasible:
        if all(r.status == "infeasible" for r in results):
            raise infeasible_error(cm)
        sched, what = _fallback(cm, depths[0], evaluators(depths[0]), time_limit_s)
        warnings.warn(f"The planning MILP found no solution within {_seconds(time_limit_s)} (per prefetch depth: "
                      f"{[r.status for r in results]}); using {what}. Raise {TIME_LIMIT_HINT} for a faster plan.",
                      stacklevel=2)
        sched.fingerprint = fp
        sched.keep_grads = cm.keeps_grads
        status = "fallback_fixed" if sched.policy == "fixed" else "fallback_min_memory"
        sched.solver = {"status": status, "mip_gap": None, "solve_ms": total_ms, "objective_ms": None,
                        "depths": per_depth}
        sched.predicted = evaluate(cm, sched).as_predicted(cm.tokens_per_step)
        sched.predicted["recomputed_layers"] = sum(recompute_flags(sched))
        return sched
    best = min(feasible, key=lambda r: r.objective)
    # gap over all depths tried: the best objective against the weakest depth's dual bound
    bound = min(r.bound if r.status != "infeasible" else math.inf for r in results)
    gap = max(0.0, (best.objective - bound) / max(abs(best.objective), 1e-9)) if math.isfinite(bound) else math.nan
    status = "optimal" if math.isfinite(gap) and gap <= mip_rel_gap + 1e-9 else "time_limit"
    if status != "optimal":
        gap_note = f", gap {gap:.3g}" if math.isfinite(gap) else ""
        warnings.warn(f"The planning MILP stopped before proving optimality (per prefetch depth: "
                      f"{[r.status for r in results]}{gap_note}); using the best schedule found. Raise "
                      f"{TIME_LIMIT_HINT} to close the gap.", stacklevel=2)
    sched = best.schedule
    assert sched is not None
    sched.fingerprint = fp
    sched.keep_grads = cm.keeps_grads  # the plan counted the kept gradients' memory
    sched.solver = {"status": status, "mip_gap": _nan_none(gap), "solve_ms": total_ms,
                    "objective_ms": best.objective, "dual_bound_ms": _nan_none(bound if math.isfinite(bound) else
                                                                               math.nan), "depths": per_depth}
    sched.predicted = evaluate(cm, sched, units=evaluators.units).as_predicted(cm.tokens_per_step)
    sched.predicted["recomputed_layers"] = sum(recompute_flags(sched))
    return sched


def _fallback(cm: CostModel, depth: int, evaluator: StepEvaluator, time_limit_s: float) -> tuple[Schedule, str]:
    """A schedule within every budget (GPU, host, NVMe) when no solve found one in time, and words for it: the
    fastest fitting `fixed` variant, else the memory-only MILP's smallest-peak plan.

    Raises:
        InfeasiblePlanError: neither fits (the message says whether a longer time limit may still find one).
    """
    fixed = fixed_candidates(cm, depth, evaluator=evaluator)
    if fixed:
        s = fixed[0]
        return s, f"the fixed heuristic (checkpoint every {checkpoint_interval(s)} layers, boundaries in the {checkpoint_tier(s)} tier)"
    # the user's limit again (at least 1 s: a memory-only solve is small), not the 10 s default
    min_gpu, sched, proven = _min_memory_plan(cm, depth, max(1.0, time_limit_s))
    if sched is not None and evaluator.evaluate(PlanArrays.of(sched)).fits(cm):
        return sched, "the plan of smallest GPU memory (no fixed-heuristic variant fits the budgets)"
    e = infeasible_error(cm, min_gpu if depth == 1 and proven else _SOLVE)  # its figure is at depth 1
    if proven:
        raise e
    raise e.restated(f"{e} The solver stopped at its time limit ({_seconds(time_limit_s)}) before deciding: a "
                     f"longer {TIME_LIMIT_HINT} may find a plan.")


def _seconds(t: float) -> str:
    """A time limit for a message: 0.01 s, not 0.0 s."""
    return f"{t:.3g} s"


def _deeper_may_help(cm: CostModel, incumbent: Schedule | None, depth: int, mip_rel_gap: float,
                     evaluators: _Evaluators | None = None) -> bool:
    """Screen for solving prefetch depth `depth`: the incumbent moved to that depth must still fit and predict a
    step shorter by more than the gap; otherwise a deeper prefetch buys less than the gap (or costs memory the
    incumbent uses). A heuristic: the optimum at `depth` may differ from the moved incumbent."""
    if incumbent is None:
        return True
    evs = evaluators if evaluators is not None else _Evaluators(cm)
    plan = PlanArrays.of(incumbent)
    now, then = evs(incumbent.prefetch_depth).evaluate(plan), evs(depth).evaluate(plan)
    if not then.fits(cm):
        return False
    return then.step_ms < now.step_ms * (1.0 - mip_rel_gap)


def _best_start(cm: CostModel, depth: int, previous: list[Schedule],
                evaluators: _Evaluators | None = None) -> Schedule | None:
    """The fastest warm start for depth `depth` under the linear model: earlier depths' solutions moved to this
    depth (when they still fit: one more weight slot per kind) or the best fixed variant."""
    ev = (evaluators if evaluators is not None else _Evaluators(cm))(depth)
    cands = [(ev.evaluate(PlanArrays.of(s)).step_ms, s) for s in fixed_candidates(cm, depth, evaluator=ev)[:1]]
    for s in previous:
        moved = Schedule(policy="milp", layers=[LayerPlan(**vars(lp)) for lp in s.layers], prefetch_depth=depth)
        val = ev.evaluate(PlanArrays.of(moved))
        if val.fits(cm):
            cands.append((val.step_ms, moved))
    return min(cands, key=lambda c: c[0])[1] if cands else None


class _Evaluators:
    """`StepEvaluator`s of one cost model by prefetch depth, built on first use (unit terms shared)."""

    def __init__(self, cm: CostModel) -> None:
        self.cm = cm
        self._units: list[Any] | None = None
        self._by_depth: dict[int, StepEvaluator] = {}

    @property
    def units(self) -> list[Any]:
        """unit_terms(cm), computed once."""
        if self._units is None:
            self._units = unit_terms(self.cm)
        return self._units

    def __call__(self, depth: int) -> StepEvaluator:
        if depth not in self._by_depth:
            if self._by_depth:  # the unit forms do not depend on the depth
                self._by_depth[depth] = next(iter(self._by_depth.values())).at_depth(depth)
            else:
                self._by_depth[depth] = StepEvaluator(self.cm, depth, units=self.units)
        return self._by_depth[depth]


def milp_value(cm: CostModel, schedule: Schedule) -> tuple[float, float]:
    """(step ms, peak GPU bytes) the MILP assigns to `schedule`: its model solved with every decision fixed to the
    schedule's. Equals `estimate.evaluate` (the MILP's rows encode that recursion); used to test that they agree.

    Raises:
        ValueError: the schedule does not fit the budgets (the fixed model is infeasible).
    """
    model = _PlanModel(cm, schedule.prefetch_depth, symmetry_breaking=False)
    vals = decision_values(schedule)
    for key, j in model.v.items():
        if key[0] in ("c", "g", "k", "n", "r", "o"):
            model.h.changeColBounds(j, vals[key], vals[key])
    res = model.solve(60.0, 1e-9)
    if not res.has_solution:
        raise ValueError(f"the schedule does not fit the budgets (HiGHS status {res.status})")
    return float(model.h.getSolution().col_value[model.v["END", 0]]), model.peak_value_bytes()


def _nan_none(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)
