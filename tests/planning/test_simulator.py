"""The discrete-event simulator (lazytrain_hf/planning/simulator.py): a timeline worked out by hand, the executor's
recompute rule, memory accounting, and agreement with the linear model on varied schedules."""

from __future__ import annotations

import dataclasses
import random

import pytest

from lazytrain_hf.planning import CostModel, LayerPlan, Schedule, evaluate, recompute_flags, simulate
from lazytrain_hf.planning.simulator import LANES

from .conftest import GIB, P, small_cm


def test_two_layer_timeline_by_hand():
    # 100 ms per weight load alone (1e8 B at 1 GB/s), 200 ms while a D2H runs too (0.5 GB/s each way);
    # boundary 1 not materialized, so layer 0 is rebuilt at the start of backward.
    #   W0 0-100 | fwd0 100-110 | W1 100-200 | fwd1 200-210 | W0 200-300 | head 210-215 | recompute0 300-310
    #   W1 300-400 | fwd+grad1 400-410 | bwd1 410-430 | W0 400-570 (alone 400-430, shared 430-570)
    #   grad1 D2H 430-600 (shared to 570, alone after) | fwd+grad0 570-580 | bwd0 580-600 | grad0 600-700
    cm = CostModel.uniform(2, fwd_ms=10.0, bwd_ms=20.0, param_bytes=10**8, act_bytes=0, saved_bytes=0, h2d_gbps=1.0,
                           d2h_gbps=1.0, bidir_gbps=0.5, head_ms=5.0, cpu_optim_params_per_s=1e18,
                           gpu_bytes=10**12, pinned_host_bytes=10**12)
    r = simulate(cm, Schedule("t", [LayerPlan(True), LayerPlan(False)], prefetch_depth=1))
    assert r.step_ms == pytest.approx(700.0, abs=1e-3)
    spans = {(lane, label): (round(s, 3), round(e, 3)) for lane, s, e, label in r.events}
    assert spans[("compute", "recompute L0")] == (300.0, 310.0)
    assert spans[("d2h", "grad L1")] == (430.0, 600.0)
    assert spans[("compute", "fwd+grad L0")] == (570.0, 580.0)
    assert r.lane_busy_ms["compute"] == pytest.approx(10 + 10 + 5 + 10 + 10 + 20 + 10 + 20, abs=1e-3)


def test_recompute_rule_matches_the_executor():
    plan_ops = pytest.importorskip("lazytrain_hf.streaming.executor").plan_ops
    rng = random.Random(3)
    for _ in range(50):
        layers = [LayerPlan(i == 0 or rng.random() < 0.4, "gpu", rng.random() < 0.3) for i in range(7)]
        s = Schedule("t", layers)
        rebuilt = sorted(i for op, i in plan_ops(s) if op == "recompute")
        assert rebuilt == [i for i, x in enumerate(recompute_flags(s)) if x]


def test_memory_peak_counts_resident_slots_and_retained_layers(cm4):
    base = cm4.resident_bytes + cm4.slot_bytes(1)
    plain_s = Schedule("t", [LayerPlan(True)] * 4)
    kept_s = Schedule("t", [LayerPlan(True)] * 3 + [LayerPlan(True, retain=True)])
    plain, kept = simulate(cm4, plain_s), simulate(cm4, kept_s)
    assert plain.peak_gpu_bytes >= base + cm4.saved_bytes[0]
    assert plain.memory[-1][1] == base  # everything else freed by the end of the step
    assert kept.step_ms == pytest.approx(plain.step_ms - cm4.fwd_ms[3])  # layer 3 is not re-forwarded
    # layer 3's activations and output live through the head: the head's peak grows by S + A
    assert kept.peak_gpu_bytes > plain.peak_gpu_bytes
    assert kept.peak_gpu_bytes <= evaluate(cm4, kept_s).peak_gpu_bytes


def _random_schedules(rng: random.Random, cm: CostModel, n: int) -> list[Schedule]:
    tiers = ["gpu", "cpu"] + (["nvme"] if cm.nvme_bytes else [])
    out = []
    for _ in range(n):
        layers = []
        for i in range(cm.num_layers):
            ck = i == 0 or rng.random() < 0.45
            layers.append(LayerPlan(ck, "gpu" if i == 0 or not ck else rng.choice(tiers), rng.random() < 0.2,
                                    rng.choice(["cpu", "cpu", "gpu"])))
        out.append(Schedule("t", layers, prefetch_depth=rng.choice([1, 2, 3])))
    return out


@pytest.mark.parametrize("overrides", [
    {},
    {"h2d_gbps": 12.0, "d2h_gbps": 12.5, "bidir_gbps": 8.0, "cpu_optim_params_per_s": 5e8},
    {"nvme_bytes": 50 * GIB, "embed_optim_params": 50_000_000, "cpu_optim_params_per_s": 2e9},
    {"h2d_gbps": 12.0, "d2h_gbps": 12.5, "bidir_gbps": 8.0, "cpu_optim_params_per_s": 5e8,
     "kept_grad_bytes": [P] * 8},
])
def test_linear_model_tracks_the_simulator(overrides):
    """The MILP's linear model against the executor-order simulator on random schedules: within 10 % on step
    time, and its peak memory is a bound."""
    cm = small_cm(8, gpu_bytes=10**13, pinned_host_bytes=10**13, **overrides)
    rng = random.Random(7)
    for s in _random_schedules(rng, cm, 12):
        est, sim = evaluate(cm, s), simulate(cm, s)
        assert sim.step_ms == pytest.approx(est.step_ms, rel=0.10)
        assert sim.peak_gpu_bytes <= est.peak_gpu_bytes + 1
        assert {lane for lane, *_ in sim.events} <= set(LANES)
        assert all(e >= s0 for _, s0, e, _ in sim.events)


def test_kept_gradients_skip_pcie_and_hold_gpu_memory_to_the_next_update():
    """With `kept_grad_bytes` a GPU-updated layer's gradient is neither sent D2H in backward nor H2D for its
    update: on slow PCIe the step gets shorter (linear model and simulator alike). The gradient stays on the GPU
    from B(l) to F(l) of the next step: the memory bound adds sum_{l >= j} of them in backward j and in forward i
    (and drops it from the update workspaces), and the simulated peak stays under the bound."""
    from lazytrain_hf.planning.estimate import decision_values, memory_terms

    over = dict(h2d_gbps=12.0, d2h_gbps=12.0, bidir_gbps=8.0, cpu_optim_params_per_s=1e8,
                gpu_bytes=10**13, pinned_host_bytes=10**13)
    plain, kept = small_cm(4, **over), small_cm(4, kept_grad_bytes=[P] * 4, **over)
    s = Schedule("t", [LayerPlan(True, optimizer_device="gpu")] * 4)
    assert evaluate(kept, s).step_ms < evaluate(plain, s).step_ms - 3 * P / 12e6  # >= 3 grads' D2H saved
    assert simulate(kept, s).step_ms < simulate(plain, s).step_ms
    assert simulate(kept, s).peak_gpu_bytes <= evaluate(kept, s).peak_gpu_bytes + 1
    vals = decision_values(s)
    mk, mp = memory_terms(kept, 1), memory_terms(plain, 1)
    for j in range(4):
        assert mk.bwd[j].value(vals) - mp.bwd[j].value(vals) == (4 - j) * P
        assert mk.fwd[j].value(vals) - mp.fwd[j].value(vals) == (4 - j) * P - 2 * P  # two workspaces, no grad
    assert mk.head.value(vals) - mp.head.value(vals) == -2 * P  # all consumed by the forward's updates
    with pytest.raises(ValueError, match="kept_grad_bytes"):
        small_cm(4, kept_grad_bytes=[2 * P] * 4)


def test_mismatched_layer_count_is_an_error(cm4):
    with pytest.raises(ValueError, match="layers"):
        simulate(cm4, Schedule("t", [LayerPlan(True)] * 3))


def test_op_times_sum_to_the_estimates_compute():
    """`op_times` prices the executor's own op list; its total is the linear model's compute + re-forwards for any
    schedule, so the per-op figures a benchmark sets against the GPU's measured op times add up to the plan."""
    from lazytrain_hf.planning.estimate import op_times

    plan_ops = pytest.importorskip("lazytrain_hf.streaming.executor").plan_ops
    rng = random.Random(5)
    kinds = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2
    cm = CostModel.uniform(8, fwd_ms=3.0, bwd_ms=7.0, param_bytes=P, act_bytes=GIB // 8, saved_bytes=GIB // 2,
                           head_ms=11.0, gpu_bytes=64 * GIB, pinned_host_bytes=64 * GIB)
    cm = dataclasses.replace(cm, layer_kind=kinds, fwd_ms=[3.0 + i for i in range(8)],
                             bwd_ms=[7.0 + 2 * i for i in range(8)])
    for _ in range(30):
        s = Schedule("t", [LayerPlan(i == 0 or rng.random() < 0.4, "gpu", rng.random() < 0.3) for i in range(8)])
        ops = op_times(cm, s, plan_ops(s))
        est = evaluate(cm, s)
        total = sum(v for by_kind in ops.values() for v in by_kind.values())
        assert total == pytest.approx(est.compute_ms + est.recompute_ms, rel=1e-9)
        assert set(ops["fwd"]) == set(kinds)
        assert ops["fwd"]["full_attention"] == pytest.approx(cm.fwd_ms[3] + cm.fwd_ms[7])
        assert ops["head"] == {"all": 11.0}


@pytest.mark.parametrize("depth", [1, 2])
def test_offloaded_boundaries_are_fetched_at_most_depth_ahead(depth):
    """Every boundary in host memory and a head whose working set dwarfs a layer's: the simulator fetched every
    offloaded boundary as soon as forward ended, all of them live through the head (at 24 GiB, 16 layers, batch 94:
    23.86 GiB simulated against the plan's 21.11 GiB bound, which counts `depth` fetched ahead as the executor
    runs). Now at most `depth` are fetched ahead and the simulated peak stays under the bound."""
    cm = small_cm(8, head_work_bytes=8 * GIB, head_ms=500.0, gpu_bytes=10**13)
    s = Schedule("t", [LayerPlan(True, "gpu" if i == 0 else "cpu") for i in range(8)], prefetch_depth=depth)
    sim = simulate(cm, s)
    assert sim.peak_gpu_bytes <= evaluate(cm, s).peak_gpu_bytes + 1
