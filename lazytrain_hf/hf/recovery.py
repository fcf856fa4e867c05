"""Plans that hold in the run: re-planning when a step needs more GPU memory than its MILP plan predicted.

Two triggers (LazyTrainer, hf/trainer.py and hf/callback.py):
  - a micro-batch runs out of memory (torch.OutOfMemoryError anywhere in the executor's forward / backward): the
    executor drops the micro-batch (`StreamingExecutor.abort_microbatch`: the window's gradients are cleared, the
    previous step's deferred updates kept), the plan is solved again with the GPU budget reduced by the measured
    overshoot, and the accumulation window runs again from its first micro-batch with the RNG state of the
    window's start, so the result equals a run that never ran out of memory. At most `MAX_OOM_RECOVERIES` per run;
    then, and at once for a plan that is not the MILP's (policy "fixed", `schedule_path`) or data parallelism (the
    other ranks would wait in their collectives), one RuntimeError names the measured need, the budget and the fix;
  - after each of the first `CHECK_STEPS` optimizer steps on CUDA, the step's peak allocated bytes exceed the
    budget the plan was solved for: the plans are solved again in the same way before the next step.

overshoot = need - predicted peak (when the need was below the prediction, less memory is usable than the budget
says: the request, at least `MIN_REDUCTION` of the budget); need = the larger of the peak allocated bytes
since the step began (reset at the checked steps' start) and the bytes allocated at the failure plus the request
the error names ("Tried to allocate ..."). Off CUDA (tests) the plan's predicted peak stands for the allocated
bytes. Reductions add up (`RunPlans.gpu_reduction_bytes`, hf/plans.py, taken off the GPU budget of every later plan,
calibration's included); `RunPlans.replan_for_memory` solves the plans again.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import GIB

__all__ = ["MAX_OOM_RECOVERIES", "CHECK_STEPS", "MIN_REDUCTION", "MemoryMiss", "Window", "requested_bytes",
           "measure_oom", "oom_error", "plan_budget", "unrecoverable", "log_replan"]

logger = logging.getLogger(__name__)

#: out-of-memory recoveries per run before the error
MAX_OOM_RECOVERIES = 3
#: optimizer steps whose measured peak is checked against the plan's budget (CUDA)
CHECK_STEPS = 3
#: smallest budget reduction per re-plan (fraction of the budget)
MIN_REDUCTION = 0.05

_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_REQUEST = re.compile(r"Tried to allocate ([0-9.]+) ?(B|KiB|MiB|GiB|TiB)")


def requested_bytes(message: str) -> int:
    """The allocation an out-of-memory message names ("Tried to allocate 2.00 GiB"), 0 when it names none."""
    m = _REQUEST.search(message)
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else 0


@dataclass
class MemoryMiss:
    """A step that needed more GPU memory than its plan: bytes, and where (`microbatch` None: a measured step)."""

    step: int
    need_bytes: int
    predicted_bytes: int
    budget_bytes: int | None
    microbatch: int | None = None
    request_bytes: int = 0
    error: str = ""

    @property
    def overshoot_bytes(self) -> int:
        """The budget reduction: need - predicted peak; when the need was below the prediction (less memory is
        usable than the budget says), the request, at least `MIN_REDUCTION` of the budget."""
        over = self.need_bytes - self.predicted_bytes
        if over > 0:
            return over
        return max(self.request_bytes, int(MIN_REDUCTION * (self.budget_bytes or 0)), 1)


@dataclass
class Window:
    """The micro-batches of the accumulation window so far (the inputs the Trainer holds for the window anyway:
    references, no copies), with the RNG state at the window's start, to run the window again after an abort."""

    items: list[tuple[dict[str, Any], Any, bool]] = field(default_factory=list)
    replay: bool = False
    _cpu_rng: torch.Tensor | None = None
    _device_rng: torch.Tensor | None = None

    def start(self, device: torch.device) -> None:
        self.items.clear()
        self.replay = False
        self._cpu_rng = torch.get_rng_state()
        self._device_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore_rng(self, device: torch.device) -> None:
        if self._cpu_rng is not None:
            torch.set_rng_state(self._cpu_rng)
        if self._device_rng is not None:
            torch.cuda.set_rng_state(self._device_rng, device)


def _gib(b: float | None) -> str:
    if b is None:
        return "-"
    return f"{b / GIB:.2f} GiB" if abs(b) >= GIB else f"{b / (1 << 20):.2f} MiB"


def _predicted(schedule: Any) -> int:
    return int(schedule.predicted.get("peak_gpu_bytes") or 0)


def plan_budget(trainer: Any) -> int | None:
    """The GPU bytes the running plan was solved for (after the margin and any reduction), or for a plan not the
    MILP's the configured budget (None when none is configured)."""
    b = trainer.executor.schedule.solver.get("gpu_budget_bytes")
    if b is not None:
        return int(b)
    cfg = trainer.lazy_config
    return int(cfg.gpu_memory_budget) if cfg.gpu_memory_budget else None


def measure_oom(trainer: Any, error: BaseException, microbatch: int, step_peak_reset: bool) -> MemoryMiss:
    """What the failing micro-batch needed (called while the failed pass's tensors are still alive). With
    `step_peak_reset` the CUDA peak counter started with this step and counts too."""
    ex = trainer.executor
    text = str(error)
    request = requested_bytes(text)
    predicted = _predicted(ex.schedule)
    if ex.device.type == "cuda":
        need = torch.cuda.memory_allocated(ex.device) + request
        if step_peak_reset:
            need = max(need, torch.cuda.max_memory_allocated(ex.device))
    else:
        need = predicted + request
    return MemoryMiss(step=trainer.state.global_step + 1, need_bytes=int(need), predicted_bytes=predicted,
                      budget_bytes=plan_budget(trainer), microbatch=microbatch, request_bytes=request,
                      error=text.splitlines()[0][:200] if text else type(error).__name__)


def _fix(trainer: Any) -> str:
    cfg = trainer.lazy_config
    rows = f" (now {cfg.max_rows_per_pass})" if cfg.max_rows_per_pass else ""
    return (f"raise lazytrain_config.gpu_memory_margin (now {cfg.gpu_memory_margin:.2f}) so that the plan leaves more "
            f"room, or give it a larger gpu_memory_budget where the device has more free memory than the budget, "
            f"lower per_device_train_batch_size (now {trainer.args.per_device_train_batch_size}), or set a smaller "
            f"lazytrain_config.max_rows_per_pass{rows} (rows a decoder layer processes at once)")


def oom_error(trainer: Any, miss: MemoryMiss, reason: str) -> RuntimeError:
    """The one error that ends a run out of GPU memory: where, the measured need, the budget, the fix."""
    return RuntimeError(
        f"LazyTrain: CUDA out of memory in step {miss.step}{_where(miss)}: the step needed {_gib(miss.need_bytes)} "
        f"(measured) against a predicted peak of {_gib(miss.predicted_bytes)} and a GPU budget of "
        f"{_gib(miss.budget_bytes)}; {reason}. Fix: {_fix(trainer)}. ({miss.error})")


def unrecoverable(trainer: Any) -> str | None:
    """Why an out-of-memory error cannot be recovered from by re-planning in this run, or None when it can."""
    cfg = trainer.lazy_config
    if cfg.schedule_path:
        return ("the schedule was loaded from lazytrain_config.schedule_path and is not re-planned; remove "
                "schedule_path to plan for this run (policy 'milp')")
    if cfg.policy != "milp":
        return (f"policy '{cfg.policy}' has no planner to re-plan with; lazytrain_config.policy='milp' plans within "
                "the budget and re-plans when a step runs out of memory")
    if trainer.executor.dp is not None:
        return "with data parallelism a recovery on one rank would desynchronize the ranks' collectives"
    if trainer.oom_recoveries >= MAX_OOM_RECOVERIES:
        return f"the plan was already re-planned {trainer.oom_recoveries} times for out-of-memory errors"
    return None


def _where(miss: MemoryMiss) -> str:
    return f" (micro-batch {miss.microbatch + 1} of the window)" if miss.microbatch is not None else ""


def log_replan(miss: MemoryMiss, plans: Any, what: str, recovery: str = "") -> None:
    """The one log line of a re-plan for memory."""
    new = plans.schedules[plans.buckets[-1]]
    logger.warning("LazyTrain: %s in step %d%s: measured %s against a predicted peak of %s and a GPU budget of %s; "
                   "re-planned with %s less: budget %s, predicted peak %s, predicted step %.1f ms%s", what, miss.step, _where(miss),
                   _gib(miss.need_bytes), _gib(miss.predicted_bytes), _gib(miss.budget_bytes),
                   _gib(miss.overshoot_bytes), _gib(new.solver.get("gpu_budget_bytes")), _gib(_predicted(new)),
                   float(new.predicted.get("step_ms", float("nan"))), recovery)
