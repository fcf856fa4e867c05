"""Planner entry points (lazytrain_hf/planning/planner.py): policies, predictions, the config bridge, the largest
feasible batch, and the schedule's JSON round trip."""

from __future__ import annotations

import pytest

from lazytrain_hf.config import LazyTrainConfig
from lazytrain_hf.planning import (
    CostModel,
    InfeasiblePlanError,
    Schedule,
    largest_feasible_batch,
    make_schedule,
    make_schedule_from_config,
    min_gpu_bytes,
)

from .conftest import GIB, HOST_FIXED, P, small_cm

PREDICTED = ("step_ms", "peak_gpu_bytes", "pinned_host_bytes", "exposed_transfer_ms", "recompute_ms", "tokens_per_s",
             "simulated_step_ms", "simulated_peak_gpu_bytes", "fits_budget")


def test_fixed_policy_predictions(cm4):
    s = make_schedule(cm4, "fixed", checkpoint_every=2, tier="cpu")
    assert s.policy == "fixed" and [lp.checkpoint for lp in s.layers] == [True, False, True, False]
    assert s.layers[0].tier == "gpu" and s.layers[2].tier == "cpu"  # boundary 0 stays on the GPU
    assert all(k in s.predicted for k in PREDICTED) and s.predicted["fits_budget"]
    assert s.predicted["recomputed_layers"] == 2


def test_milp_is_no_slower_than_fixed(cm4):
    fixed = make_schedule(cm4, "fixed")
    milp = make_schedule(cm4, "milp")
    assert all(k in milp.predicted for k in PREDICTED)
    assert milp.predicted["step_ms"] <= fixed.predicted["step_ms"] + 1e-6
    assert milp.solver["status"] == "optimal" and milp.solver["solve_ms"] > 0


def test_fixed_over_budget_warns_and_is_marked():
    cm = small_cm(gpu_bytes=6 * GIB)
    with pytest.warns(UserWarning, match="expect out-of-memory"):
        s = make_schedule(cm, "fixed", checkpoint_every=1)
    assert s.predicted["fits_budget"] is False


def test_fixed_over_budget_advice_names_what_fits_and_strict_raises():
    """Before, the advice was always "Lower checkpoint_every, use tier='cpu', or use policy='milp'", also for a
    schedule that already checkpointed every layer in the CPU tier, and --policy fixed over budget exited 0."""
    cm = small_cm(8, gpu_bytes=7 * GIB)  # every 4 in the GPU tier: 7.12 GiB; CPU-tier variants fit
    with pytest.warns(UserWarning, match=r"checkpoint every 4 layers in the gpu tier.*needs 7.12 GiB GPU.*"
                                         r"--checkpoint-every \d --tier cpu") as caught:
        make_schedule(cm, "fixed", checkpoint_every=4, tier="gpu")
    assert "milp schedule" not in str(caught[0].message)
    with pytest.raises(InfeasiblePlanError, match="fixed variant") as e:
        make_schedule(cm, "fixed", checkpoint_every=4, tier="gpu", strict=True)
    assert e.value.min_gpu_bytes >= 7.12 * GIB
    # nothing fits with any policy: the smallest feasible budgets, as the MILP names them
    with pytest.raises(InfeasiblePlanError, match="smallest feasible GPU budget"):
        make_schedule(small_cm(8, gpu_bytes=GIB), "fixed", strict=True)


def test_unknown_policy_is_an_error(cm4):
    with pytest.raises(ValueError, match="policy"):
        make_schedule(cm4, "magic")


def test_config_bridge(cm4):
    s = make_schedule_from_config(cm4, LazyTrainConfig(policy="fixed", checkpoint_every=3, prefetch_depth=2))
    assert [lp.checkpoint for lp in s.layers] == [True, False, False, True] and s.prefetch_depth == 2
    with pytest.raises(ValueError, match="policy='none'"):
        make_schedule_from_config(cm4, LazyTrainConfig(policy="none"))


def _build(batch: int) -> CostModel:
    # activations scale with the batch; weights, budgets and the host part do not
    return small_cm(gpu_bytes=12 * GIB, act_bytes=batch * GIB // 16, saved_bytes=batch * GIB // 4,
                    fwd_work_bytes=batch * GIB // 64, bwd_work_bytes=batch * GIB // 32, head_work_bytes=GIB // 2,
                    pinned_host_bytes=HOST_FIXED + 2 * GIB)


def test_largest_feasible_batch_is_the_boundary():
    best = largest_feasible_batch(_build, "milp", max_batch=256)
    assert best >= 1
    assert min_gpu_bytes(_build(best)) <= 12 * GIB
    assert min_gpu_bytes(_build(best + 1)) > 12 * GIB
    assert largest_feasible_batch(_build, "fixed", max_batch=256) <= best


def test_largest_feasible_batch_edges():
    assert largest_feasible_batch(lambda b: small_cm(gpu_bytes=GIB), "milp") == 0
    assert largest_feasible_batch(lambda b: small_cm(), "milp", max_batch=5) == 5  # batch-independent: the cap
    with pytest.raises(ValueError, match="max_batch"):
        largest_feasible_batch(_build, max_batch=0)


def test_schedule_json_round_trip(tmp_path, cm4):
    s = make_schedule(cm4, "milp", fingerprint="abc")
    path = tmp_path / "plan.json"
    s.to_json(path)
    back = Schedule.from_json(path)
    assert back == s
    assert back.solver["depths"] == s.solver["depths"] and back.predicted == s.predicted
    assert Schedule.from_json(s.to_json()) == s
    assert back.fingerprint == "abc"
    import json

    old = json.loads(s.to_json())
    del old["keep_grads"]  # a file written before the field existed: gradients not kept
    assert Schedule.from_dict(old).keep_grads is False
    with pytest.raises(ValueError, match="keep_grads must be true or false, but got 'false'"):
        Schedule.from_dict({**old, "keep_grads": "false"})  # a hand-edited string would read as true
    # misspelt keys: one error naming them and the close known key (before: a bare TypeError from __init__)
    layers = [dict(lp) for lp in old["layers"]]
    layers[1]["optimiser_device"] = layers[1].pop("optimizer_device")
    with pytest.raises(ValueError, match=r"schedule has unknown keys \['keep_grad'\] \(did you mean keep_grads\?\)"
                                         r".*layers\[1\] has unknown keys \['optimiser_device'\] \(did you mean "
                                         r"optimizer_device\?\)"):
        Schedule.from_dict({**old, "keep_grad": True, "layers": layers})


def test_cost_model_round_trip_and_validation(cm4):
    assert CostModel.from_dict(cm4.to_dict()) == cm4
    assert cm4.slot_bytes(2) == 3 * P
    with pytest.raises(ValueError) as info:
        CostModel.uniform(2, fwd_ms=-1.0, bwd_ms=1.0, param_bytes=1, act_bytes=1, saved_bytes=1, h2d_gbps=0.0)
    assert "fwd_ms" in str(info.value) and "h2d_gbps" in str(info.value)  # all problems at once
    with pytest.raises(ValueError, match="one entry per layer"):
        CostModel(**{**cm4.to_dict(), "bwd_ms": [1.0]})


def test_rows_options_halve_down_to_one_row_unless_configured():
    from lazytrain_hf.planning.planner import rows_options

    assert rows_options(72, None) == [72, 36, 18, 9, 5, 3, 2, 1]
    assert rows_options(1, None) == [1]
    assert rows_options(8, 4) == [4] and rows_options(8, 16) == [8]


def test_search_plans_takes_the_largest_rows_with_a_plan_and_the_fastest_placement_there():
    from lazytrain_hf.planning.fixed import fixed_schedule
    from lazytrain_hf.planning.planner import InfeasiblePlanError, search_plans

    ms = {(4, "host"): 90.0, (4, "gpu"): 80.0, (2, "gpu"): 50.0}  # rows 2 faster, but rows 4 fits first
    calls = []

    def solve(rows, resident):
        calls.append((rows, resident))
        if (rows, resident) not in ms:
            raise InfeasiblePlanError(f"no plan at {rows} rows, {resident}", min_gpu_bytes=None, min_host_bytes=None,
                                      min_gpu_bytes_any_host=None)
        s = fixed_schedule(4)
        s.predicted = {"step_ms": ms[rows, resident]}
        return s

    got = search_plans(solve, [8, 4, 2], ["gpu", "host"])
    assert (got.rows_per_pass, got.resident, got.predicted["step_ms"]) == (4, "gpu", 80.0)
    assert calls == [(8, "gpu"), (8, "host"), (4, "gpu"), (4, "host")]
    with pytest.raises(InfeasiblePlanError, match="1 rows, host"):
        search_plans(solve, [8, 1], ["gpu", "host"])


def test_fallback_placements_are_tried_only_when_no_other_has_a_plan():
    """"host_sliced" (no GPU time measured yet) never replaces a placement that plans, however much faster it is
    predicted; when none does, it is searched over every rows per pass, and its error is the one raised."""
    from lazytrain_hf.planning.fixed import fixed_schedule
    from lazytrain_hf.planning.planner import InfeasiblePlanError, search_plans, split_placements

    assert split_placements(["gpu", "host", "host_sliced"]) == (["gpu", "host"], ["host_sliced"])
    assert split_placements(["host_sliced"]) == ([], ["host_sliced"])
    calls = []

    def solver(ms):
        def solve(rows, resident):
            calls.append((rows, resident))
            if (rows, resident) not in ms:
                raise InfeasiblePlanError(f"no plan at {rows} rows, {resident}", min_gpu_bytes=None,
                                          min_host_bytes=None, min_gpu_bytes_any_host=None)
            s = fixed_schedule(4)
            s.predicted = {"step_ms": ms[rows, resident]}
            return s
        return solve

    got = search_plans(solver({(2, "host"): 90.0, (8, "host_sliced"): 10.0}), [8, 2], ["gpu", "host"], ["host_sliced"])
    assert (got.rows_per_pass, got.resident) == (2, "host")
    assert ("host_sliced" not in {r for _, r in calls})
    calls.clear()
    got = search_plans(solver({(2, "host_sliced"): 70.0}), [8, 2], ["gpu", "host"], ["host_sliced"])
    assert (got.rows_per_pass, got.resident) == (2, "host_sliced")
    assert calls == [(8, "gpu"), (8, "host"), (2, "gpu"), (2, "host"), (8, "host_sliced"), (2, "host_sliced")]
    with pytest.raises(InfeasiblePlanError, match="2 rows, host_sliced"):
        search_plans(solver({}), [8, 2], ["gpu", "host"], ["host_sliced"])
    got = search_plans(solver({(8, "host_sliced"): 5.0}), [8], [], ["host_sliced"])  # configured explicitly
    assert got.resident == "host_sliced"
