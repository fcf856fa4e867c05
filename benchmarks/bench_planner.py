"""Planner benchmark: HiGHS solve time and plan quality of the LazyTrain MILP at LLM depth.

Cases (all decisions open: checkpoint, GPU / CPU / NVMe tier, retain, optimizer placement, prefetch depth 1-3):
    synthetic-64      64 identical layers (the 27B layer count), hand-set costs, tight host budget, NVMe on
    qwen3.6-27b       analytic costs of the 64-layer Qwen3.5-hybrid shape (48 linear + 16 full attention),
                      batch 16 x 1024, 48 GiB GPU, 400 GiB host, NVMe on, H200 rates (DESIGN §7)
    qwen2.5-7b        28 layers, batch 16 x 1024, 24 GiB GPU, 100 GiB host (MegaTrain's 24 GiB setting)
Each case is solved `--repeats` times (solve_ms = HiGHS time summed over the prefetch depths tried; wall_ms adds
model building and warm starts); each case is solved with the per-layer optimizer placement open
(gpu_optimizer=True) and with every update on the CPU (what the executor runs); synthetic-64 also without
symmetry breaking. The 1-minute load average at each solve is recorded (the 2 cores are shared). Rows follow
shared/RESULTS_FORMAT.md (suite "planner"; measured-step fields are null: nothing runs on a GPU here).

    python -m benchmarks.bench_planner --repeats 3 --time-limit 30
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

from lazytrain_hf.planning import CostModel, evaluate, simulate, solve_milp
from lazytrain_hf.planning.milp import fixed_candidates

from .common import GIB, append_results, row


def _synthetic_64() -> tuple[CostModel, dict[str, Any]]:
    cm = CostModel.uniform(64, fwd_ms=10.0, bwd_ms=20.0, param_bytes=100_000_000, act_bytes=GIB // 4,
                           saved_bytes=4 * GIB, fwd_work_bytes=GIB // 4, bwd_work_bytes=GIB // 2, resident_bytes=GIB,
                           head_ms=5.0, head_work_bytes=GIB // 2, host_fixed_bytes=10 * GIB, gpu_bytes=16 * GIB,
                           pinned_host_bytes=10 * GIB + 4 * GIB, nvme_bytes=100 * GIB, h2d_gbps=50.8,
                           d2h_gbps=54.1, bidir_gbps=33.0, cpu_optim_params_per_s=4e9, tokens_per_step=16384)
    return cm, {"model": "synthetic-64", "params": cm.num_params_total(), "batch_size": None, "seq_len": None}


def _analytic(name: str, batch: int, seq: int, gpu_gib: float, host_gib: float, nvme_gib: float):
    from lazytrain_hf.models import resolve_config
    from lazytrain_hf.profiling import H200_DEFAULTS, analytic_cost_model, model_shape

    shape = model_shape(resolve_config(name), name)

    def build() -> tuple[CostModel, dict[str, Any]]:
        cm = analytic_cost_model(shape, batch, seq, H200_DEFAULTS, gpu_bytes=int(gpu_gib * GIB),
                                 host_bytes=int(host_gib * GIB), nvme_bytes=int(nvme_gib * GIB), name=name)
        return cm, {"model": name, "params": shape.num_params, "batch_size": batch, "seq_len": seq}

    return build


def _solve(cm: CostModel, time_limit: float, symmetry_breaking: bool, gpu_optimizer: bool) -> tuple[Any, float]:
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # time-limit warnings are recorded in the row instead
        s = solve_milp(cm, time_limit_s=time_limit, symmetry_breaking=symmetry_breaking, gpu_optimizer=gpu_optimizer)
    return s, (time.perf_counter() - t0) * 1e3


def _case_rows(label: str, cm: CostModel, info: dict[str, Any], repeats: int, time_limit: float,
               symmetry_breaking: bool = True, gpu_optimizer: bool = True) -> dict[str, Any]:
    solves, walls, loads, sched = [], [], [], None
    for _ in range(repeats):
        sched, wall = _solve(cm, time_limit, symmetry_breaking, gpu_optimizer)
        loads.append(os.getloadavg()[0])
        solves.append(sched.solver["solve_ms"])
        walls.append(wall)
    assert sched is not None
    p, s = sched.predicted, sched.solver
    sim = simulate(cm.for_schedule(sched), sched)
    fixed = fixed_candidates(cm)
    fixed_ms = evaluate(cm, fixed[0]).step_ms if fixed else None
    x = p.get("recomputed_layers", 0)
    decisions = {"gpu_boundaries": sum(lp.checkpoint and lp.tier == "gpu" for lp in sched.layers),
                 "cpu_boundaries": sum(lp.checkpoint and lp.tier == "cpu" for lp in sched.layers),
                 "nvme_boundaries": sum(lp.checkpoint and lp.tier == "nvme" for lp in sched.layers),
                 "retained": sum(lp.retain for lp in sched.layers),
                 "gpu_optimizer": sum(lp.optimizer_device == "gpu" for lp in sched.layers),
                 "rebuilt": x, "prefetch_depth": sched.prefetch_depth}
    flops = 6 * cm.num_params_total() * cm.tokens_per_step / (p["step_ms"] / 1e3) / 1e12
    r = row(system="lazytrain_milp_planner", model=info["model"], params=info["params"],
            gpu_cap_gib=round(cm.gpu_bytes / GIB, 2), batch_size=info["batch_size"], seq_len=info["seq_len"],
            status="ok", tokens_per_s=p["tokens_per_s"], tflops_6nd=flops,
            peak_gpu_gib=p["peak_gpu_bytes"] / GIB, pinned_planned_gib=p["pinned_host_bytes"] / GIB,
            predicted_step_s=p["step_ms"] / 1e3, solve_ms=statistics.median(solves), mip_gap=s["mip_gap"])
    r["extra"] = {
        "case": label, "layers": cm.num_layers, "symmetry_breaking": symmetry_breaking,
        "gpu_optimizer": gpu_optimizer, "load_avg_1min": loads,
        "solve_status": s["status"], "time_limit_s": time_limit, "repeats": repeats,
        "solve_ms_all": solves, "wall_ms_median": statistics.median(walls),
        "per_depth": s["depths"], "objective_ms": s["objective_ms"], "dual_bound_ms": s.get("dual_bound_ms"),
        "simulated_step_s": sim.step_ms / 1e3, "simulated_peak_gpu_gib": sim.peak_gpu_bytes / GIB,
        "fixed_best_predicted_step_s": None if fixed_ms is None else fixed_ms / 1e3,
        "decisions": decisions, "hardware": cm.meta.get("hardware", "synthetic"),
        "note": "predicted by the planner's linear model (analytic costs, H200 rates); nothing measured on a GPU",
    }
    print(f"{label:<28} L={cm.num_layers:<3} solve {statistics.median(solves):8.0f} ms (wall "
          f"{statistics.median(walls):6.0f} ms) {s['status']:<10} gap {100 * (s['mip_gap'] or 0):5.2f}%  "
          f"step {p['step_ms']:8.1f} ms (sim {sim.step_ms:8.1f}, best fixed "
          f"{'-' if fixed_ms is None else f'{fixed_ms:.1f}'})  {decisions}", flush=True)
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="solves per case (median reported)")
    ap.add_argument("--time-limit", type=float, default=30.0, help="HiGHS time limit per case, all depths (s)")
    ap.add_argument("--quick", action="store_true", help="synthetic-64 only, one repeat")
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/planner-<date>.json)")
    args = ap.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    # (label, build, symmetry breaking, gpu_optimizer): gpu_optimizer=False is what the executor runs (every layer
    # update on the CPU); True leaves the per-layer placement open (the harder problem)
    cases: list[tuple[str, Any, bool, bool]] = [("synthetic-64", _synthetic_64, True, True),
                                                ("synthetic-64 cpu-optimizer", _synthetic_64, True, False)]
    if not args.quick:
        q27 = _analytic("qwen3.6-27b", 16, 1024, 48, 400, 500)
        q7 = _analytic("qwen2.5-7b", 16, 1024, 24, 100, 0)
        cases += [("synthetic-64 (no symmetry)", _synthetic_64, False, True),
                  ("qwen3.6-27b b16 48GiB", q27, True, True), ("qwen3.6-27b b16 48GiB cpu-optimizer", q27, True, False),
                  ("qwen2.5-7b b16 24GiB", q7, True, True), ("qwen2.5-7b b16 24GiB cpu-optimizer", q7, True, False)]
    rows = []
    for label, build, sym, gpu_opt in cases:
        cm, info = build()
        rows.append(_case_rows(label, cm, info, repeats, args.time_limit, symmetry_breaking=sym,
                               gpu_optimizer=gpu_opt))
    out = Path(args.out or Path(__file__).parent / "results" / f"planner-{datetime.date.today():%Y%m%d}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    append_results(out, "planner", rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
