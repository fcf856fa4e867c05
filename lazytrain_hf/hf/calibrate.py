"""Calibrate the MILP plan from the first measured optimizer steps.

The planner predicts a step from per-layer costs (analytic, or one layer timed in isolation: profiling/
layer_costs.py). The executor runs those layers with its own overheads (row passes, stream waits, kernel launches
competing with the CPU optimizer threads): on an H200 the 7B step ran 7-17% over the prediction (benchmarks/NOTES.md,
session 5). After `calibrate_steps` measured steps (the first `skip` are not used: they allocate and touch the
optimizer states, during step 2's forward when the updates overlap it) the GPU-compute part of the prediction is
scaled so the prediction matches the measurement, and the plan is solved again with that scale
(CostModel.scaled_compute): the costs come from warm-up steps on the real executor (issue 5).

    k_i   = 1 + (measured_i - predicted_i) / predicted_compute_i     (per step; compute = layers, re-forward, head,
    scale = scale_before x median(k_i)                                 GPU-side updates: what runs on the GPU)
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Calibration"]

#: re-plan only when the measured step is off the prediction by more than this (relative)
THRESHOLD = 0.05


@dataclass
class Calibration:
    """Collects (measured, predicted, predicted compute) per optimizer step and gives the compute scale once.

    Args:
        steps: measured steps to use (after the skipped ones); 0 disables calibration.
        skip: first optimizer steps not used (1, or 2 with the overlapped optimizer: the states are allocated in
            step 2's forward).
    """

    steps: int
    skip: int = 1
    samples: list[float] = field(default_factory=list)  # k_i
    done: bool = False
    #: set by the re-plan (hf/callback.py): the resulting compute scale, and the longest bucket's predicted step
    #: before it (ms)
    scale: float | None = None
    predicted_before_ms: float | None = None
    _predicted_ms: float = 0.0
    _compute_ms: float = 0.0
    _seen: int = 0

    def add_microbatch(self, predicted: dict[str, Any]) -> None:
        """Account one micro-batch run under a schedule whose `predicted` dict is given (ms). A schedule predicts
        one micro-batch plus the optimizer step; with gradient accumulation the optimizer terms (GPU-side updates,
        exposed CPU update) count once per optimizer step, on its first micro-batch."""
        def ms(key: str) -> float:
            return float(predicted.get(key) or 0.0)

        once = ms("gpu_optim_ms") + ms("exposed_optimizer_ms")
        first = self._predicted_ms == 0.0
        self._predicted_ms += ms("step_ms") - (0.0 if first else once)
        self._compute_ms += ms("compute_ms") + ms("recompute_ms") + (ms("gpu_optim_ms") if first else 0.0)

    def end_step(self, measured_s: float) -> float | None:
        """Close one optimizer step (its wall time, s). Returns the compute scale factor k (median over the
        calibration steps) once, when enough steps were seen and k differs from 1 by more than THRESHOLD; else
        None."""
        p, c = self._predicted_ms, self._compute_ms
        self._predicted_ms = self._compute_ms = 0.0
        self._seen += 1
        if self.done or self.steps <= 0 or self._seen <= self.skip or p <= 0 or c <= 0:
            return None
        self.samples.append(1.0 + (measured_s * 1e3 - p) / c)
        if len(self.samples) < self.steps:
            return None
        self.done = True
        k = statistics.median(self.samples)
        return k if k > 0 and abs(k - 1.0) > THRESHOLD else None

