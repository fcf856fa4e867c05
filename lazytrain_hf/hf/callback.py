"""`LazyTrainCallback`: the Trainer events the run's plans (hf/plans.py) need, step timing for the metrics, the schedule
saved into checkpoints."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback

from ..config import GIB
from .calibrate import Calibration
from .recovery import CHECK_STEPS

if TYPE_CHECKING:
    from .trainer import LazyTrainer

__all__ = ["LazyTrainCallback", "SCHEDULE_NAME"]

logger = logging.getLogger(__name__)
SCHEDULE_NAME = "lazytrain_schedule.json"


class LazyTrainCallback(TrainerCallback):
    """Owned by `LazyTrainer` (added automatically): the Trainer-event side of the executor.

    - on_train_begin: `RunPlans.start` (load `schedule_path`, or plan for the run's batch shape; log the plan).
    - on_step_begin / on_step_end: time each optimizer step and collect executor counters for `Trainer.log`; on
      CUDA, reset the peak-memory counter for the first `CHECK_STEPS` steps and report each step's peak
      (`RunPlans.end_step`: a re-plan with less GPU memory when it exceeded the plan's budget, hf/recovery.py) and
      wall time (`RunPlans.step_timed`: the calibration, hf/calibrate.py).
    - on_optimizer_step: fp16's loss-scale update (`LazyTrainer.loss_scale_step_done`).
    - on_save: write the schedule JSON into the checkpoint directory (atomically).
    """

    def __init__(self, trainer: LazyTrainer) -> None:
        self.trainer = trainer
        self._warned_retries = False
        self._run_peak = 0  # CUDA peak allocated bytes before the last reset of the peak counter

    def on_train_begin(self, args, state, control, **kwargs: Any):
        self.trainer.plans.start()

    def on_step_begin(self, args, state, control, **kwargs: Any):
        tr = self.trainer
        tr.meter.start()
        dev = tr.executor.device
        # the checked steps' own peaks: the first ones, and a calibration switch's trial (its new plan's memory)
        reset = dev.type == "cuda" and (state.global_step < CHECK_STEPS or tr.plans.on_trial)
        if reset:
            self._run_peak = max(self._run_peak, torch.cuda.max_memory_allocated(dev))
            torch.cuda.reset_peak_memory_stats(dev)
        tr.plans.begin_step(reset)

    def on_optimizer_step(self, args, state, control, **kwargs: Any):
        self.trainer.loss_scale_step_done()  # fp16: before the Trainer decides whether the LR scheduler steps

    def on_step_end(self, args, state, control, **kwargs: Any):
        tr = self.trainer
        tr.meter.stop(tr.executor_metrics())
        if "peak_gpu_memory_gib" in tr.meter.last:  # the run's peak, across the checked steps' resets
            peak = max(self._run_peak, torch.cuda.max_memory_allocated(tr.executor.device))
            tr.meter.last["peak_gpu_memory_gib"] = round(peak / GIB, 3)
        tr.plans.end_step(state.global_step, self._step_peak_bytes())
        self._warn_alloc_retries(state.global_step, tr.plans.calibration)
        if "step_time_s" in tr.meter.last:
            tr.plans.step_timed(tr.meter.last["step_time_s"])
        if control.should_save or control.should_evaluate or control.should_training_stop or \
                state.global_step >= state.max_steps:
            tr.executor.flush_updates()  # weights and states are read next: land deferred updates

    def _step_peak_bytes(self) -> int | None:
        """Peak allocated GPU bytes of the optimizer step just ended, None when not measured (off CUDA, or a step
        after the checked ones)."""
        tr = self.trainer
        return torch.cuda.max_memory_allocated(tr.executor.device) if tr.plans.step_peak_reset else None

    def _warn_alloc_retries(self, step: int, cal: Calibration | None) -> None:
        """Once per run: a step after the warm-up (first 2 steps, the calibration) in which the CUDA caching
        allocator reached the memory cap and freed its cache to retry (`cuda_alloc_retries` in the logs)."""
        retries = self.trainer.meter.last.get("cuda_alloc_retries", 0)
        calibrating = cal is not None and cal.steps > 0 and not cal.done
        if self._warned_retries or not retries or step <= 2 or calibrating:
            return
        self._warned_retries = True
        cfg = self.trainer.lazy_config
        room = (f"raise lazytrain_config.gpu_memory_margin (now {cfg.gpu_memory_margin:.2f}) so that the MILP plan "
                "leaves more room" if cfg.policy == "milp" and not cfg.schedule_path else
                'lower lazytrain_config.gpu_memory_budget and plan again (policy "milp")')
        fix = room if getattr(self.trainer, "expandable_segments", False) else (
            "turn the allocator's expandable segments on (lazytrain_config.expandable_segments=True, or "
            f"expandable_segments:True in PYTORCH_CUDA_ALLOC_CONF), or {room}")
        logger.warning(
            "LazyTrain: in step %d the CUDA caching allocator reached the GPU memory cap and freed its cache to "
            "retry %d allocation(s); each retry synchronizes the GPU and slows the step (fragmentation: memory is "
            "reserved but not in blocks of the needed size). Fix: %s.", step, retries, fix)

    def on_train_end(self, args, state, control, **kwargs: Any):
        self.trainer.executor.flush_updates()

    def on_save(self, args, state, control, **kwargs: Any):
        if not state.is_world_process_zero:  # one writer, as the Trainer's own checkpoint files
            return
        ckpt = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(ckpt) and self.trainer.executor is not None:
            self.trainer.executor.schedule.to_json(os.path.join(ckpt, SCHEDULE_NAME))
