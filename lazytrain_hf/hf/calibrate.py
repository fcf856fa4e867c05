"""Calibrate the MILP plan from the first measured optimizer steps.

The planner predicts a step from per-layer costs (analytic, or one layer timed in isolation: profiling/
layer_costs.py) and the probed CPU optimizer rate. The executor runs those layers with its own overheads (row passes,
stream waits, kernel launches competing with the CPU optimizer threads), and its update worker shares the host's
memory with 50 GB/s of H2D copies: on an H200 the 7B step ran 7-17% over the prediction (2026-11-29:
benchmarks/results/7b-milp24-20261129.json), and at 80 GiB, batch 64 the training thread waited 0.9 s per step for
CPU updates the plan counted as hidden (7b-b64-20261130.json). After `calibrate_steps` measured steps (the first
`skip` are not used: they allocate and touch the optimizer states, during step 2's forward when the updates overlap
it) two costs are replaced by measured ones and the plan is solved again with them:

    rate  = median over the steps of (parameters the update worker updated / its wall time)      (CostModel
                                                                                                   .with_cpu_optim_rate)
    k_i   = 1 + (measured_i - predicted_i - delta) / predicted_compute_i                         (per step)
    scale = scale_before x median(k_i)                                                            (.scaled_compute)

delta is how much the running plan's predicted step grows when its CPU updates run at the measured rate (0 when
no layer updates on the CPU), so the compute scale k takes only what the measured rate does not explain; compute =
the layers' forward, backward and re-forward and the head (the optimizer kernels keep their probed rates).

A switch to the re-planned plan is a trial: its next `steps` steps (after one that settles its memory) are measured
against its own prediction, and when that puts it no faster than the replaced plan valued at the same figures, the
run switches back (`trial_verdict`). The cost model cannot see everything a new plan changes: on an H200 the 7B
recipe's re-plan ran 4.36 s a step with 2 allocator retries a step, against 4.02-4.16 s for the plan it replaced
(benchmarks/results/recipe-20261203.json).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Calibration", "THRESHOLD", "RATE_THRESHOLD", "SWITCH_GAIN"]

#: re-plan when the GPU compute is off the prediction by more than this (relative) ...
THRESHOLD = 0.05
#: ... or the measured CPU optimizer rate is off the planned one by more than this (relative)
RATE_THRESHOLD = 0.10
#: ... and switch to the new plan only when it is predicted faster than the running plan, both valued at the measured
#: figures, by more than this (relative): twice the planner's default MIP gap (1%), inside which two plans are not
#: told apart. Without it a noisy measured CPU rate flipped a batch-16 plan between keeping gradients on the GPU and
#: not (2.274 vs 2.431 s on an H200, 2026-11-30: 7b-b16-b32-pairs-20261130.json, 7b-prepared-off-20261130.json)
SWITCH_GAIN = 0.02


@dataclass
class Calibration:
    """Collects per optimizer step (measured, predicted, predicted compute) and the CPU update rate measured in it.

    Args:
        steps: measured steps to use (after the skipped ones); 0 disables calibration.
        skip: first optimizer steps not used (1, or 2 with the overlapped optimizer: the states are allocated in
            step 2's forward).
    """

    steps: int
    skip: int = 1
    #: (measured, predicted, predicted GPU compute) per used step (ms)
    step_ms: list[tuple[float, float, float]] = field(default_factory=list)
    #: per used step, the plan (sequence-length bucket) its first micro-batch ran: the CPU updates overlap it
    step_buckets: list[Any] = field(default_factory=list)
    #: parameters/s of the deferred CPU updates that ran during each used step (steps with none left out)
    cpu_rates: list[float] = field(default_factory=list)
    done: bool = False
    #: set by the re-plan (hf/callback.py): k per step, the resulting compute scale and CPU rate, and the
    #: longest bucket's predicted step before it (ms)
    k: list[float] = field(default_factory=list)
    scale: float | None = None
    cpu_rate: float | None = None
    predicted_before_ms: float | None = None
    #: set when the re-plan was not clearly faster and the running plan stayed: both valued at the measured figures
    #: (ms per optimizer step)
    kept_running_ms: float | None = None
    replanned_ms: float | None = None
    #: after a switch: the replaced plan and the new one valued at the measured figures (ms per optimizer step, the
    #: longest bucket's plans), the
    #: new plan's (measured, predicted) ms per trial step, the median measured / predicted, and whether the run
    #: switched back (None: no trial decided)
    switched_from_ms: float | None = None
    switched_to_ms: float | None = None
    trial: list[tuple[float, float]] = field(default_factory=list)
    trial_ratio: float | None = None
    reverted: bool | None = None
    _predicted_ms: float = 0.0
    _compute_ms: float = 0.0
    _rate: float | None = None
    _bucket: Any = None
    _seen: int = 0
    _dropped: bool = False
    _trial_seen: int = 0

    def add_microbatch(self, predicted: dict[str, Any], bucket: Any = None) -> None:
        """Account one micro-batch run under a schedule whose `predicted` dict is given (ms; `bucket`: which plan,
        e.g. its sequence-length bucket). A schedule predicts one micro-batch plus the optimizer step; with gradient
        accumulation the optimizer terms (GPU-side updates, exposed CPU update) count once per optimizer step, on its
        first micro-batch."""
        def ms(key: str) -> float:
            return float(predicted.get(key) or 0.0)

        once = ms("gpu_optim_ms") + ms("exposed_optimizer_ms")
        first = self._predicted_ms == 0.0
        if first:
            self._bucket = bucket
        self._predicted_ms += ms("step_ms") - (0.0 if first else once)
        self._compute_ms += ms("compute_ms") + ms("recompute_ms")  # what CostModel.scaled_compute scales

    def note_cpu_update(self, ms: float | None, params: float | None) -> None:
        """The executor's last deferred CPU update run (its wall time, ms, and parameters; `stats.extra`
        cpu_update_ms / cpu_update_params): the run that overlapped this step's forward."""
        self._rate = params / (ms / 1e3) if ms and params and ms > 0 and params > 0 else None

    def drop_step(self) -> None:
        """The step in progress is no measurement: its micro-batches run again (an out-of-memory recovery,
        hf/recovery.py) and its wall time holds the failed attempt and the re-plan. `end_step` does not use it."""
        self._predicted_ms = self._compute_ms = 0.0
        self._rate = None
        self._dropped = True

    def end_step(self, measured_s: float) -> bool:
        """Close one optimizer step (its wall time, s). True once, when enough steps were seen: then
        `compute_factors` and `measured_cpu_rate` give the calibration."""
        p, c, rate = self._predicted_ms, self._compute_ms, self._rate
        self._predicted_ms = self._compute_ms = 0.0
        self._rate = None
        self._seen += 1
        dropped, self._dropped = self._dropped, False
        if self.on_trial and not dropped and p > 0:
            self._trial_seen += 1
            if self._trial_seen > 1:  # the first step under the new plan allocates its buffers
                self.trial.append((measured_s * 1e3, p))
        if dropped or self.done or self.steps <= 0 or self._seen <= self.skip or p <= 0 or c <= 0:
            return False
        self.step_ms.append((measured_s * 1e3, p, c))
        self.step_buckets.append(self._bucket)
        if rate is not None:
            self.cpu_rates.append(rate)
        if len(self.step_ms) < self.steps:
            return False
        self.done = True
        return True

    def start_trial(self, running_ms: float, replanned_ms: float) -> None:
        """The run switched to the re-planned plan (predicted `replanned_ms`) from one predicted `running_ms` at the
        same measured figures: measure it (`trial_verdict`)."""
        self.switched_from_ms, self.switched_to_ms = running_ms, replanned_ms
        self.trial, self._trial_seen, self.trial_ratio, self.reverted = [], 0, None, None

    def cancel_trial(self) -> None:
        """Another re-plan (for memory) replaced the plan on trial: no verdict."""
        self.switched_from_ms = self.switched_to_ms = None
        self.trial = []

    @property
    def on_trial(self) -> bool:
        return self.done and self.switched_from_ms is not None and self.reverted is None

    def trial_verdict(self) -> bool | None:
        """None while the plan on trial has fewer than `steps` measured steps (or none is on trial); then, once,
        True to keep it, False when its measured steps (median measured / predicted x its predicted step) are no
        faster than the replaced plan's predicted step at the same figures: switch back."""
        if not self.on_trial or len(self.trial) < max(self.steps, 1):
            return None
        self.trial_ratio = statistics.median(m / p for m, p in self.trial)
        self.reverted = self.trial_ratio * self.switched_to_ms >= self.switched_from_ms
        return not self.reverted

    def compute_factors(self, delta_ms: float | dict[Any, float] = 0.0) -> list[float]:
        """k_i per used step, with the predictions raised by `delta_ms` (the measured CPU rate's effect): one value,
        or one per bucket (`step_buckets`; a bucket not in it: 0)."""
        deltas = [delta_ms.get(b, 0.0) if isinstance(delta_ms, dict) else delta_ms for b in self.step_buckets]
        return [1.0 + (m - p - d) / c for (m, p, c), d in zip(self.step_ms, deltas)]

    def measured_cpu_rate(self) -> float | None:
        """Median parameters/s of the deferred CPU updates over the used steps; None when none ran."""
        return statistics.median(self.cpu_rates) if self.cpu_rates else None

    @staticmethod
    def worth_switching(running_ms: float, replanned_ms: float) -> bool:
        """Whether the re-planned step (ms) beats the running plan's (ms, valued with the same calibrated costs) by
        more than `SWITCH_GAIN`."""
        return replanned_ms < running_ms * (1.0 - SWITCH_GAIN)

    @staticmethod
    def needs_replan(k: float, rate: float | None, planned_rate: float | None) -> bool:
        """Whether the measured compute factor `k` or CPU rate is far enough off the plan to solve it again."""
        if k > 0 and abs(k - 1.0) > THRESHOLD:
            return True
        return bool(rate and planned_rate and abs(rate / planned_rate - 1.0) > RATE_THRESHOLD)
