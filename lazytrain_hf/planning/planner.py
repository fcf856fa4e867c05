"""Planner entry points: a `CostModel` in, a `Schedule` out (policy "milp" or "fixed"), and the largest batch that fits.

`make_schedule` is what the executor's callback and the `plan` CLI call; `make_schedule_from_config` reads the
policy knobs from a `LazyTrainConfig`. Both attach the linear model's prediction (`estimate.evaluate`) and the
discrete-event simulator's (`simulator.simulate`) to `Schedule.predicted`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

from ..config import format_bytes
from .cost_model import CostModel
from .estimate import evaluate, recompute_flags
from .fixed import checkpoint_interval, checkpoint_tier, fixed_schedule
from .milp import (
    InfeasiblePlanError,
    _round_budget_up,
    fixed_candidates,
    infeasible_error,
    min_gpu_bytes,
    solve_milp,
)
from .schedule import Schedule
from .schedule import fingerprint as _fingerprint
from .simulator import simulate

__all__ = ["make_schedule", "make_schedule_from_config", "largest_feasible_batch", "POLICIES", "InfeasiblePlanError",
           "over_budget_error", "search_plans", "rows_options", "FALLBACK_PLACEMENTS", "split_placements"]

POLICIES = ("milp", "fixed")


def make_schedule(cost_model: CostModel, policy: str = "milp", *, checkpoint_every: int = 4, tier: str = "gpu",
                  prefetch_depth: int = 1, prefetch_depths: tuple[int, ...] = (1, 2, 3), time_limit_s: float = 10.0,
                  mip_rel_gap: float = 0.01, gpu_optimizer: bool = True, fingerprint: str = "",
                  simulate_check: bool = True, strict: bool = False) -> Schedule:
    """Plan one step.

    Args:
        cost_model: costs, rates and budgets.
        policy: "milp" (solve the planning MILP) or "fixed" (MegaTrain's heuristic: a checkpoint every
            `checkpoint_every` layers in `tier`, every layer re-forwarded, CPU optimizer).
        checkpoint_every, tier, prefetch_depth: the fixed policy's knobs (boundary 0 always stays on the GPU).
        prefetch_depths: depths the MILP tries.
        time_limit_s, mip_rel_gap: HiGHS limits (s, relative gap).
        gpu_optimizer: let the MILP place layers' optimizer updates on the GPU (False: all on the CPU).
        fingerprint: stored in the schedule (default: a hash of the cost model).
        simulate_check: also replay the schedule in the simulator and store `simulated_step_ms` and
            `simulated_peak_gpu_bytes` in `predicted`.
        strict: raise InfeasiblePlanError instead of warning when the fixed schedule is over a budget.

    Returns:
        The schedule; `predicted` holds step_ms, peak_gpu_bytes, pinned_host_bytes, exposed_transfer_ms,
        recompute_ms, tokens_per_s, ... (ms, bytes, tokens/s) and `fits_budget`.

    Raises:
        ValueError: unknown policy or invalid fixed-policy knobs.
        InfeasiblePlanError: policy "milp" and no schedule fits the budgets, or (with `strict`) the fixed schedule
            does not.

    Warns:
        UserWarning: the fixed schedule does not fit the budgets (without `strict` it is returned anyway, as a
        baseline), or the MILP stopped at its time limit.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {list(POLICIES)}, but got {policy!r}")
    fp = fingerprint or _fingerprint(cost_model.to_dict())
    if policy == "milp":
        sched = solve_milp(cost_model, prefetch_depths=prefetch_depths, time_limit_s=time_limit_s,
                           mip_rel_gap=mip_rel_gap, gpu_optimizer=gpu_optimizer, fingerprint=fp)
    else:
        sched = fixed_schedule(cost_model.num_layers, checkpoint_every=checkpoint_every, tier=tier,
                               prefetch_depth=prefetch_depth, fingerprint=fp)
        sched.layers[0].tier = "gpu"  # boundary 0 (the embedding output) stays on the GPU
        sched.keep_grads = cost_model.keeps_grads
        if tier == "nvme" and cost_model.nvme_bytes <= 0:
            raise ValueError("the fixed policy with tier='nvme' needs an NVMe budget (nvme_bytes > 0, an nvme_dir)")
        sched.predicted = evaluate(cost_model, sched).as_predicted(cost_model.tokens_per_step)
        sched.predicted["recomputed_layers"] = sum(recompute_flags(sched))
    p = sched.predicted
    p["fits_budget"] = bool(p["peak_gpu_bytes"] <= cost_model.gpu_bytes
                            and p["pinned_host_bytes"] <= cost_model.pinned_host_bytes
                            and p["nvme_bytes"] <= cost_model.nvme_bytes)
    if not p["fits_budget"]:
        error = over_budget_error(cost_model, sched)
        if strict:
            raise error
        warnings.warn(f"{error} Returned anyway (as a baseline): expect out-of-memory.", stacklevel=2)
    if simulate_check:
        sim = simulate(cost_model.for_schedule(sched), sched)
        p["simulated_step_ms"] = sim.step_ms
        p["simulated_peak_gpu_bytes"] = sim.peak_gpu_bytes
    return sched


def over_budget_error(cm: CostModel, sched: Schedule) -> InfeasiblePlanError:
    """The error for a `fixed` schedule over a budget: what it needs, and what fits instead (a fixed variant, the
    MILP, or, when nothing does, the smallest feasible budgets)."""
    p = sched.predicted
    needs = (f"The fixed schedule (checkpoint every {checkpoint_interval(sched)} layers in the {checkpoint_tier(sched)} tier, "
             f"prefetch depth {sched.prefetch_depth}) needs "
             f"{format_bytes(p['peak_gpu_bytes'])} GPU and {format_bytes(p['pinned_host_bytes'])} host memory"
             f"{_nvme_need(p)}, over the budgets ({format_bytes(cm.gpu_bytes)} GPU, {format_bytes(cm.pinned_host_bytes)} host"
             f"{_nvme_need({'nvme_bytes': cm.nvme_bytes})}).")
    fitting = fixed_candidates(cm, sched.prefetch_depth)
    if fitting:
        f = fitting[0]
        advice = (f" The fixed variant --checkpoint-every {checkpoint_interval(f)} --tier {checkpoint_tier(f)} (lazytrain_config."
                  f"checkpoint_every / activation_tier) fits, and so may --policy milp.")
    else:
        need = min_gpu_bytes(cm)
        if need is None or need > cm.gpu_bytes:
            e = infeasible_error(cm, need)
            return e.restated(f"{needs} {e} (those minimums are --policy milp's; this fixed schedule needs the "
                              "budgets above)")
        advice = " No fixed variant fits; --policy milp (lazytrain_config.policy) finds a plan that does."
    # the budgets this schedule needs (with_margin restates the GPU one as the --gpu-memory to pass)
    gpu_over = p["peak_gpu_bytes"] > cm.gpu_bytes
    return InfeasiblePlanError(needs + advice,
                               min_gpu_bytes=_round_budget_up(p["peak_gpu_bytes"]) if gpu_over else None,
                               min_host_bytes=_round_budget_up(max(p["pinned_host_bytes"], cm.host_fixed_bytes)),
                               min_gpu_bytes_any_host=None)


def _nvme_need(p: dict[str, Any]) -> str:
    return f" and {format_bytes(p['nvme_bytes'])} NVMe" if p["nvme_bytes"] else ""


def make_schedule_from_config(cost_model: CostModel, config: Any, fingerprint: str = "") -> Schedule:
    """`make_schedule` with the policy knobs of a `LazyTrainConfig` (policy, checkpoint_every, activation_tier,
    prefetch_depth, solver_time_limit_s, solver_mip_rel_gap).

    Raises:
        ValueError: config.policy is "none" (no executor, nothing to plan).
    """
    if config.policy == "none":
        raise ValueError("lazytrain_config.policy='none' runs the plain HF path: there is no schedule to make")
    return make_schedule(cost_model, config.policy, checkpoint_every=config.checkpoint_every,
                         tier=config.activation_tier, prefetch_depth=config.prefetch_depth,
                         time_limit_s=config.solver_time_limit_s, mip_rel_gap=config.solver_mip_rel_gap,
                         fingerprint=fingerprint)


def _fits(cm: CostModel, policy: str, checkpoint_every: int, tier: str, prefetch_depth: int) -> bool:
    if cm.pinned_host_bytes < cm.host_fixed_bytes:
        return False
    if policy == "milp":
        need = min_gpu_bytes(cm)
        return need is not None and need <= cm.gpu_bytes
    s = fixed_schedule(cm.num_layers, checkpoint_every=checkpoint_every, tier=tier, prefetch_depth=prefetch_depth)
    s.layers[0].tier = "gpu"
    est = evaluate(cm, s)
    return (est.peak_gpu_bytes <= cm.gpu_bytes and est.pinned_host_bytes <= cm.pinned_host_bytes
            and est.nvme_bytes <= cm.nvme_bytes)


def largest_feasible_batch(build: Callable[[int], CostModel], policy: str = "milp", *, max_batch: int = 4096,
                           checkpoint_every: int = 4, tier: str = "gpu", prefetch_depth: int = 1) -> int:
    """Largest batch size B <= max_batch for which a schedule fits the budgets (0 if even B = 1 does not).

    Args:
        build: batch size -> CostModel (same model, sequence length, machine and budgets).
        policy: "milp" (some schedule exists: the memory-only MILP's smallest peak fits) or "fixed" (the fixed
            schedule with the given knobs fits).
        max_batch: upper end of the search.

    Feasibility is monotone in B (every memory term grows with B), so a doubling search then bisection needs
    about 2 log2(B) feasibility checks.

    Raises:
        ValueError: unknown policy or max_batch < 1.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {list(POLICIES)}, but got {policy!r}")
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, but got {max_batch}")

    def fits(b: int) -> bool:
        return _fits(build(b), policy, checkpoint_every, tier, prefetch_depth)

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= max_batch and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, max_batch + 1)  # lo fits, hi does not (or is past the cap)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo



def rows_options(batch_size: int, rows_per_pass: int | None) -> list[int]:
    """Rows per pass to plan for: the configured number (at most the batch), else the whole batch, then halves
    (rounded up) down to one row: a layer's activations scale with its rows per pass, not with the batch."""
    if rows_per_pass:
        return [min(rows_per_pass, batch_size)]
    out = [batch_size]
    while out[-1] > 1:
        out.append(-(-out[-1] // 2))
    return out


#: placements the planner tries only when no other has a plan: their GPU time has not been measured yet
#: (benchmarks/NOTES.md), so they widen what fits without replacing a measured choice
FALLBACK_PLACEMENTS = ("host_sliced",)


def split_placements(placements: Sequence[str]) -> tuple[list[str], list[str]]:
    """(`placements` tried first, those tried only when none of them has a plan: `FALLBACK_PLACEMENTS`)."""
    return ([p for p in placements if p not in FALLBACK_PLACEMENTS],
            [p for p in placements if p in FALLBACK_PLACEMENTS])


def search_plans(solve: Callable[[int, str], Schedule], rows: list[int], residents: list[str],
                 fallback: Sequence[str] = ()) -> Schedule:
    """The plan to run: for the first of `rows` (rows per pass, largest first) with any feasible plan, the fastest
    over the `residents` placements of the embedding and LM head (`Schedule.resident`); when none has a plan at any
    rows per pass, the same search over `fallback`. `solve(rows, resident)` plans one combination or raises
    InfeasiblePlanError. The schedule records both choices.

    Raises:
        InfeasiblePlanError: no combination fits; of the fewest rows' errors, the one of the leanest placement (the
            last: the smallest GPU budget), or when the host budget is what every placement lacks, the one needing
            the least host memory with the GPU budget given (else the least host memory).
    """
    errors: list[InfeasiblePlanError] = []  # of the fewest rows tried, in order: the leanest placement last
    for group in (residents, list(fallback)):
        if not group:
            continue
        found, group_errors = _search_plans(solve, rows, group)
        if found is not None:
            return found
        errors += group_errors
    assert errors, "search_plans needs at least one row count and one placement"
    if all(e.host_too_small for e in errors):
        raise min(reversed(errors), key=lambda e: (not e.host_alone_short, e.min_host_bytes))
    raise errors[-1]


def _search_plans(solve: Callable[[int, str], Schedule], rows: list[int], residents: list[str]
                  ) -> tuple[Schedule | None, list[InfeasiblePlanError]]:
    """(the plan, []) or (None, the errors of the fewest rows per pass, one per placement)."""
    errors: list[InfeasiblePlanError] = []
    for r in rows:
        best = None
        errors = []
        for resident in residents:
            try:
                sched = solve(r, resident)
            except InfeasiblePlanError as e:
                errors.append(e)
                continue
            sched.resident, sched.rows_per_pass = resident, r
            if best is None or sched.predicted["step_ms"] < best.predicted["step_ms"]:
                best = sched
        if best is not None:
            return best, []
    return None, errors
