"""What-if on the CPU (analytic costs, no GPU): how much a plan made for a lower CPU optimizer rate costs when the
rate holds, and saves when the host gives less (benchmarks/NOTES.md, Open). For each batch, the MILP plans at
R, 0.9 R and 0.8 R (R: the calibrated in-step rate of a 2026-11-30 row, e.g. 7b-milp24-b64-20261130.json) and each
plan is valued at R and at the lower rate the timed steps got. Qwen2.5-7B shape, seq 1024, 24 GiB less the 0.12
margin, Kahan master weights, kept gradients; compute scaled by the row's calibrated k.

    python -m benchmarks.whatif_cpu_rate_hedge
"""

from __future__ import annotations

import warnings

from lazytrain_hf.models import resolve_config
from lazytrain_hf.planning import evaluate
from lazytrain_hf.planning.planner import make_schedule
from lazytrain_hf.profiling.analytic import analytic_cost_model, model_shape
from lazytrain_hf.profiling.hardware import H200_DEFAULTS

GIB = 2**30
#: (batch, calibrated compute scale k, rate R the plan assumed, the lower rate measured in steps), params/s
CASES = ((64, 1.12, 4.04e9, 3.27e9), (32, 1.07, 4.5e9, 3.7e9), (16, 1.06, 3.9e9, 3.3e9), (8, 1.06, 3.5e9, 3.0e9))


def cm_at(shape, B: int, k: float, rate: float):
    """The analytic cost model at batch B, compute scaled by k, CPU optimizer at `rate` params/s."""
    cm = analytic_cost_model(shape, B, 1024, H200_DEFAULTS, gpu_bytes=int(24 * GIB * 0.88), host_bytes=110 * GIB,
                             rows_per_pass=8, master_weights="kahan", kept_grads=True)
    return cm.scaled_compute(k).with_cpu_optim_rate(rate)


def main() -> None:
    shape = model_shape(resolve_config("qwen2.5-7b"), "qwen2.5-7b")
    for B, k, R, low in CASES:
        for h in (0.0, 0.1, 0.2):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sched = make_schedule(cm_at(shape, B, k, R * (1 - h)), "milp", time_limit_s=20)
            gpu = sum(lp.optimizer_device == "gpu" for lp in sched.layers)
            at_r, at_low = (evaluate(cm_at(shape, B, k, r), sched).step_ms for r in (R, low))
            print(f"B={B} plan at {1 - h:.1f} R: GPU-updated layers {gpu:2d}, step at R={R / 1e9:.2f}: {at_r:7.1f} ms, "
                  f"at {low / 1e9:.2f}: {at_low:7.1f} ms")


if __name__ == "__main__":
    main()
