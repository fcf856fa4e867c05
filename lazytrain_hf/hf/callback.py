"""`LazyTrainCallback`: plans at train begin, times steps for the metrics, saves the schedule into checkpoints."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback

from ..config import GIB
from ..planning.buckets import BucketSchedules
from ..planning.schedule import Schedule
from .calibrate import SWITCH_GAIN, Calibration
from .recovery import CHECK_STEPS, MemoryMiss, log_replan, plan_budget, replan_for_memory, switch_plans

if TYPE_CHECKING:
    from .trainer import LazyTrainer

__all__ = ["LazyTrainCallback", "SCHEDULE_NAME"]

logger = logging.getLogger(__name__)
SCHEDULE_NAME = "lazytrain_schedule.json"


class LazyTrainCallback(TrainerCallback):
    """Owned by `LazyTrainer` (added automatically): the Trainer-event side of the executor.

    - on_train_begin: load `schedule_path`, or plan (policy "milp") for the run's batch shape; log the plan.
    - on_step_begin / on_step_end: time each optimizer step and collect executor counters for `Trainer.log`; on
      CUDA, check the first `CHECK_STEPS` steps' peak allocated bytes against the plan's budget and re-plan with
      less GPU memory when a step exceeded it (hf/recovery.py).
    - on_save: write the schedule JSON into the checkpoint directory (atomically).
    """

    def __init__(self, trainer: LazyTrainer) -> None:
        self.trainer = trainer
        self._warned_retries = False
        self._run_peak = 0  # CUDA peak allocated bytes before the last reset of the peak counter

    def on_train_begin(self, args, state, control, **kwargs: Any):
        ex = self.trainer.executor
        cfg = self.trainer.lazy_config
        if cfg.schedule_path:
            from .plan import _kept_grads

            schedule = Schedule.from_json(cfg.schedule_path)
            # the kept gradients' memory is freed; the update workspaces stage gradients again (up to (depth + 1)
            # gradient copies per layer kind in forward, far less than the kept ones at the step boundary)
            if schedule.keep_grads and not _kept_grads(self.trainer):
                schedule.keep_grads = False
                logger.info("LazyTrain: the schedule at %s keeps GPU-updated layers' gradients on the GPU; this run "
                            "sends them to the host (keep_gpu_grads=%s, gradient_accumulation_steps=%d)",
                            cfg.schedule_path, cfg.keep_gpu_grads, args.gradient_accumulation_steps)
            ex.set_schedule(schedule)
            self._check_fingerprint(ex.schedule, cfg.schedule_path)
        elif cfg.policy == "milp":
            from .plan import plan_buckets_for_trainer

            plans = self.trainer.bucket_plans = plan_buckets_for_trainer(self.trainer)
            ex.set_schedule(plans.schedules[plans.buckets[-1]])
            steps = cfg.calibrate_steps if cfg.calibrate_steps is not None else (3 if ex.device.type == "cuda" else 0)
            self.trainer.calibration = Calibration(steps, skip=2 if cfg.overlap_optimizer else 1)
            if len(plans.buckets) > 1:
                logger.info("LazyTrain: %d sequence-length buckets %s, one plan each", len(plans.buckets),
                            plans.buckets)
        elif cfg.policy == "fixed":
            from .plan import fixed_plan_for_trainer

            ex.set_schedule(fixed_plan_for_trainer(self.trainer))
        s = ex.schedule
        predicted = s.predicted.get("step_ms")
        logger.info("LazyTrain schedule: policy=%s, %d layers, %d checkpoints (tiers %s), %d retained, "
                    "prefetch_depth=%d, %s rows per pass, embedding / LM head: %s%s", s.policy, s.num_layers,
                    sum(lp.checkpoint for lp in s.layers), sorted({lp.tier for lp in s.layers if lp.checkpoint}),
                    sum(lp.retain for lp in s.layers), s.prefetch_depth,
                    s.rows_per_pass or cfg.max_rows_per_pass or "all", s.resident,
                    f", predicted step {predicted:.1f} ms" if predicted else "")

    def _check_fingerprint(self, schedule: Schedule, path: str) -> None:
        """Warn when a loaded schedule was planned for other inputs than this run's (it is still used: a plan may
        be reused on purpose)."""
        from ..planning.schedule import differing_inputs, plan_fingerprint
        from .plan import plan_inputs_for_trainer, run_shape

        if not schedule.fingerprint:
            return
        try:
            inputs = plan_inputs_for_trainer(self.trainer, run_shape(self.trainer)[1])
        except Exception as e:  # a check only: never end a run over it
            logger.debug("LazyTrain: cannot compute this run's plan fingerprint (%s)", e)
            return
        if schedule.fingerprint == plan_fingerprint(inputs):
            return
        stored = schedule.solver.get("fingerprint_inputs")
        what = (f"these inputs differ: {', '.join(differing_inputs(stored, inputs))}" if isinstance(stored, dict)
                else "its fingerprint differs")
        logger.warning("LazyTrain: the schedule at %s was planned for another run than this one (%s); using it as "
                       "given. Remove lazytrain_config.schedule_path to plan for this run.", path, what)

    def on_step_begin(self, args, state, control, **kwargs: Any):
        tr = self.trainer
        tr.meter.start()
        tr.step_predicted_peak = 0
        tr.step_peak_reset = False
        dev = tr.executor.device
        if dev.type == "cuda" and state.global_step < CHECK_STEPS:  # the checked steps' own peaks
            self._run_peak = max(self._run_peak, torch.cuda.max_memory_allocated(dev))
            torch.cuda.reset_peak_memory_stats(dev)
            tr.step_peak_reset = True

    def on_step_end(self, args, state, control, **kwargs: Any):
        tr = self.trainer
        tr.meter.stop(tr.executor_metrics())
        if "peak_gpu_memory_gib" in tr.meter.last:  # the run's peak, across the checked steps' resets
            peak = max(self._run_peak, torch.cuda.max_memory_allocated(tr.executor.device))
            tr.meter.last["peak_gpu_memory_gib"] = round(peak / GIB, 3)
        self._check_memory(state.global_step)
        cal = self.trainer.calibration
        self._warn_alloc_retries(state.global_step, cal)
        if cal is not None and "step_time_s" in self.trainer.meter.last:
            if cal.end_step(self.trainer.meter.last["step_time_s"]):
                try:
                    plans = self._recalibrated_plans()
                except Exception as e:  # an optimization only: never end a run over it
                    plans = None
                    logger.warning("LazyTrain calibration: re-planning failed (%s: %s); keeping the current plan",
                                   type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
                if plans is not None:  # outside the guard: a failed deferred update raised here must end the run
                    self.trainer.executor.set_schedule(plans.schedules[plans.buckets[-1]])
                    self.trainer.bucket_plans = plans
        if control.should_save or control.should_evaluate or control.should_training_stop or \
                state.global_step >= state.max_steps:
            self.trainer.executor.flush_updates()  # weights and states are read next: land deferred updates

    def _step_peak_bytes(self) -> int | None:
        """Peak allocated GPU bytes of the optimizer step just ended, None when not measured (off CUDA, or a step
        after the checked ones)."""
        tr = self.trainer
        return torch.cuda.max_memory_allocated(tr.executor.device) if tr.step_peak_reset else None

    def _check_memory(self, step: int) -> None:
        """A checked step whose peak exceeded the budget its MILP plan was solved for: solve the plans again with
        the budget reduced by the overshoot (hf/recovery.py), before the next step."""
        tr, cfg = self.trainer, self.trainer.lazy_config
        peak = self._step_peak_bytes()
        budget = plan_budget(tr)
        if peak is None or cfg.policy != "milp" or cfg.schedule_path or tr.bucket_plans is None or budget is None \
                or peak <= budget:
            return
        predicted = tr.step_predicted_peak or int(tr.executor.schedule.predicted.get("peak_gpu_bytes") or 0)
        miss = MemoryMiss(step=step, need_bytes=int(peak), predicted_bytes=predicted, budget_bytes=budget)
        try:
            plans = replan_for_memory(tr, miss)
        except Exception as e:  # the step ran: keep the plan that did
            logger.warning("LazyTrain: step %d peaked at %.2f GiB, over the plan's GPU budget of %.2f GiB; "
                           "re-planning with less failed (%s: %s); keeping the current plan", step, peak / GIB,
                           budget / GIB, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
            return
        switch_plans(tr, plans)  # outside the guard: a failed deferred update raised here must end the run
        log_replan(miss, plans, "the measured peak exceeded the plan's GPU budget")

    def _warn_alloc_retries(self, step: int, cal: Calibration | None) -> None:
        """Once per run: a step after the warm-up (first 2 steps, the calibration) in which the CUDA caching
        allocator reached the memory cap and freed its cache to retry (`cuda_alloc_retries` in the logs)."""
        retries = self.trainer.meter.last.get("cuda_alloc_retries", 0)
        calibrating = cal is not None and cal.steps > 0 and not cal.done
        if self._warned_retries or not retries or step <= 2 or calibrating:
            return
        self._warned_retries = True
        cfg = self.trainer.lazy_config
        margin = (f", or raise lazytrain_config.gpu_memory_margin (now {cfg.gpu_memory_margin:.2f}) so that the MILP "
                  "plan leaves more room" if cfg.policy == "milp" and not cfg.schedule_path else
                  ", or lower lazytrain_config.gpu_memory_budget and plan again (policy \"milp\")")
        logger.warning(
            "LazyTrain: in step %d the CUDA caching allocator reached the GPU memory cap and freed its cache to "
            "retry %d allocation(s); each retry synchronizes the GPU and slows the step (fragmentation: memory is "
            "reserved but not in blocks of the needed size). Fix: start the run with "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True%s.", step, retries, margin)

    def _recalibrated_plans(self) -> BucketSchedules | None:
        """The bucket plans solved again with the measured CPU optimizer rate and the GPU compute costs scaled by
        the measured factor (hf/calibrate.py), or None when the measurements match the running plan or the new plan
        is not `SWITCH_GAIN` faster than the running one at the measured figures. Changes
        nothing itself (the caller switches). Each rank decides on its own measurements: ranks may run different
        plans (set_schedule issues no collective). The CPU-rate correction (delta) of each measured step is that of
        the bucket plan its first micro-batch ran (the one the CPU updates overlap)."""
        import statistics

        from ..planning.estimate import evaluate
        from .plan import cost_model_for_trainer, plan_buckets_for_trainer

        tr, cal = self.trainer, self.trainer.calibration
        old = tr.bucket_plans.schedules[tr.bucket_plans.buckets[-1]]
        old_scale = float(old.solver.get("compute_scale", 1.0))
        planned_rate = old.solver.get("cpu_optim_params_per_s")
        rate = cal.measured_cpu_rate()
        delta: dict[Any, float] = {}  # per bucket the measured steps ran: its plan at the measured rate, compute kept
        if rate is not None and planned_rate:
            for T in {b for b in cal.step_buckets if b in tr.bucket_plans.schedules}:
                plan = tr.bucket_plans.schedules[T]
                cm = cost_model_for_trainer(tr, T, old_scale)[0].for_schedule(plan)
                delta[T] = evaluate(cm.with_cpu_optim_rate(rate), plan).step_ms - evaluate(cm, plan).step_ms
        cal.k = cal.compute_factors(delta)
        k = statistics.median(cal.k)
        k = k if k > 0 else 1.0
        if not cal.needs_replan(k, rate, planned_rate):
            logger.info("LazyTrain calibration: measured steps match the plan (compute x%.3f, CPU optimizer %s); "
                        "keeping it", k, "not used" if rate is None else f"{rate / 1e9:.2f} G params/s")
            return None
        scale = old_scale * k
        plans = plan_buckets_for_trainer(tr, compute_scale=scale, cpu_optim_params_per_s=rate, resident=old.resident,
                                         rows=old.rows_per_pass)
        new = plans.schedules[plans.buckets[-1]]
        # the running plan valued with the same calibrated costs: switch only for a clear gain (SWITCH_GAIN)
        cm = cost_model_for_trainer(tr, plans.buckets[-1], scale, rate)[0]
        running_ms = evaluate(cm.for_schedule(old), old).step_ms
        new_ms = float(new.predicted.get("step_ms", float("nan")))
        if not cal.worth_switching(running_ms, new_ms):
            logger.info("LazyTrain calibration: GPU compute ran %.2fx the prediction, CPU optimizer %s; the re-plan "
                        "predicts %.1f ms against the running plan's %.1f ms at these figures (not %.0f%% better): "
                        "keeping the running plan", k, "-" if rate is None else f"{rate / 1e9:.2f} G params/s",
                        new_ms, running_ms, 100 * SWITCH_GAIN)
            cal.kept_running_ms, cal.replanned_ms = running_ms, new_ms
            return None
        cal.scale, cal.cpu_rate = scale, rate
        cal.predicted_before_ms = old.predicted.get("step_ms")
        logger.info("LazyTrain calibration: GPU compute ran %.2fx the prediction, CPU optimizer %s (planned %s); "
                    "re-planned: predicted step %.1f ms (was %.1f ms)", k,
                    "-" if rate is None else f"{rate / 1e9:.2f} G params/s",
                    "-" if not planned_rate else f"{planned_rate / 1e9:.2f}",
                    new.predicted.get("step_ms", float("nan")), old.predicted.get("step_ms", float("nan")))
        return plans

    def on_train_end(self, args, state, control, **kwargs: Any):
        self.trainer.executor.flush_updates()

    def on_save(self, args, state, control, **kwargs: Any):
        if not state.is_world_process_zero:  # one writer, as the Trainer's own checkpoint files
            return
        ckpt = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(ckpt) and self.trainer.executor is not None:
            self.trainer.executor.schedule.to_json(os.path.join(ckpt, SCHEDULE_NAME))
