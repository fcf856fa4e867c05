"""`RunPlans`: the plans of one LazyTrainer run, in one object (`LazyTrainer.plans`).

It owns the run's `PlanRequest` (planning/request.py, built once at the first plan), the bucket plans (policy
"milp": one per sequence-length bucket), the running plan (the executor runs it: `current`), the calibration
(hf/calibrate.py) and every re-plan: after calibration, after a checked step that exceeded its GPU budget and after an
out-of-memory error (hf/recovery.py). The trainer asks it for the plan of each micro-batch (`for_batch`) and reports
the micro-batch and the optimizer step to it; the callback reports the step's time and peak memory.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from typing import TYPE_CHECKING, Any

import torch

from ..config import GIB, PlanningConfig
from ..planning.buckets import BucketSchedules
from ..planning.milp import InfeasiblePlanError
from ..planning.request import PlanRequest
from ..planning.schedule import Schedule
from .calibrate import SWITCH_GAIN, Calibration
from .recovery import MemoryMiss, log_replan, plan_budget

if TYPE_CHECKING:
    from .trainer import LazyTrainerMixin

__all__ = ["RunPlans"]

logger = logging.getLogger(__name__)

#: the fixed policy's own knobs and their defaults (a MILP run that changes one is told it is unused)
FIXED_ONLY = {f: PlanningConfig.__dataclass_fields__[f].default for f in ("checkpoint_every", "activation_tier")}


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0][:200] if str(e) else ""


def times_are_this_runs(executor: Any) -> bool:
    """Whether the plan's predicted times describe this run: on CUDA; on the CPU device the planner plans with a
    GPU's figures (H200 defaults), so its stall and step times say nothing about the run and no hint is drawn."""
    return executor.device.type == "cuda"


def optimizer_step_ms(step_ms: float, once_ms: float, micro_batches: int) -> float:
    """A plan's predicted optimizer step (ms) from its `step_ms` (one micro-batch plus the optimizer terms, `once_ms`:
    GPU-side updates and exposed CPU update, which run once a step) over `micro_batches` micro-batches."""
    return micro_batches * (step_ms - once_ms) + once_ms


class RunPlans:
    """The plans of one LazyTrainer run.

    Attributes:
        bucket_plans: policy "milp" (not `schedule_path`): one plan per sequence-length bucket; None otherwise.
        calibration: policy "milp": the calibration from the first measured steps (set at train begin).
        layer_costs: layer timings measured for planning, by (rows, seq, device), reused by re-plans.
        gpu_reduction_bytes: GPU bytes taken off the budget of every plan: what measured steps needed beyond their
            plans (hf/recovery.py).
        step_peak_reset: the CUDA peak-memory counter started with this optimizer step.
        step_predicted_peak: the largest predicted peak of the plans this optimizer step ran (bytes).
    """

    def __init__(self, trainer: LazyTrainerMixin) -> None:
        self.trainer = trainer
        self.bucket_plans: BucketSchedules | None = None
        self.calibration: Calibration | None = None
        self.layer_costs: dict[tuple, Any] = {}
        self.gpu_reduction_bytes = 0
        self.step_peak_reset = False
        self.step_predicted_peak = 0
        self._before_trial: BucketSchedules | None = None  # the plans a calibration switch replaced, while on trial
        self._request: PlanRequest | None = None
        self._request_shape: tuple[Any, ...] | None = None

    # ---- what is planned --------------------------------------------------------------------------------
    @property
    def request(self) -> PlanRequest:
        """The run's `PlanRequest` (hf/plan.py `request_for_trainer`, built at the first call: the free GPU memory
        then is the default budget of every later plan), with `gpu_reduction_bytes` taken off the GPU budget."""
        if self._request is None:
            from . import plan

            self._request = plan.request_for_trainer(self.trainer)
            self._request_shape = self._shape()
        self._request = self._request.with_gpu_reduction(self.gpu_reduction_bytes)
        return self._request

    def _shape(self) -> tuple[Any, ...]:
        """What of the run the request reads from TrainingArguments and the data (not the budgets): a later
        `train()` on the same trainer with another batch size, accumulation or dataset plans for it."""
        from . import plan

        args = self.trainer.args
        return (*plan.run_shape(self.trainer), args.gradient_accumulation_steps, id(self.trainer.train_dataset))

    def refresh(self) -> None:
        """Re-resolve the request when the run's shape (`_shape`) changed since it was built, keeping its budgets
        (the first plan's free GPU memory stays the default budget: the executor holds part of it now)."""
        shape = self._shape() if self._request is not None else None
        if shape is None or shape == self._request_shape:
            return
        from . import plan

        old = self._request
        self._request = dataclasses.replace(plan.request_for_trainer(self.trainer), budgets=old.budgets)
        self._request_shape = shape
        logger.log(plan.plan_log_level(self.trainer), "LazyTrain: planning again for batch %d x %d (was %d x %d)",
                   self._request.batch_size, self._request.seq_len, old.batch_size, old.seq_len)

    @property
    def current(self) -> Schedule:
        """The plan the executor runs now."""
        return self.trainer.executor.schedule

    @property
    def budget_bytes(self) -> int | None:
        """The GPU bytes the running plan was solved for (`recovery.plan_budget`)."""
        return plan_budget(self.trainer)

    def _longest(self) -> Schedule:
        return self.bucket_plans.schedules[self.bucket_plans.buckets[-1]]

    # ---- train begin ------------------------------------------------------------------------------------
    def start(self) -> Schedule:
        """The plan at train begin, run by the executor from now on: `schedule_path` loaded, or (policy "milp") one
        plan per sequence-length bucket, the longest bucket's first, or the fixed policy's; one log line.

        Raises:
            InfeasiblePlanError: policy "milp" and no plan fits (the fix in lazytrain_config / TrainingArguments).
        """
        from . import plan

        tr = self.trainer
        ex, cfg = tr.executor, tr.lazy_config
        level = plan.plan_log_level(tr)  # data parallel: the main process logs the plan
        self.refresh()
        if cfg.schedule_path:
            schedule = Schedule.from_json(cfg.schedule_path)
            # the kept gradients' memory is freed; the update workspaces stage gradients again (up to (depth + 1)
            # gradient copies per layer kind in forward, far less than the kept ones at the step boundary)
            if schedule.keep_grads and not plan._kept_grads(tr):
                schedule.keep_grads = False
                logger.log(level, "LazyTrain: the schedule at %s keeps GPU-updated layers' gradients on the GPU; this "
                           "run sends them to the host (keep_gpu_grads=%s, gradient_accumulation_steps=%d)",
                           cfg.schedule_path, cfg.keep_gpu_grads, tr.args.gradient_accumulation_steps)
            ex.set_schedule(schedule)
            self.check_fingerprint(ex.schedule, cfg.schedule_path)
        elif cfg.policy == "milp":
            knobs = [f"{f}={getattr(cfg, f)!r}" for f, default in FIXED_ONLY.items() if getattr(cfg, f) != default]
            if knobs:
                logger.log(plan.plan_log_level(tr, logging.WARNING), "LazyTrain: %s set the fixed policy's "
                           "schedule; policy 'milp' (the default) plans its own checkpoints and where they live, so "
                           "they are unused. Set policy: fixed to use them", " and ".join(knobs))
            plans = self.bucket_plans = plan.plan_buckets_for_trainer(tr)
            ex.set_schedule(self._longest())
            steps = cfg.calibrate_steps if cfg.calibrate_steps is not None else (3 if ex.device.type == "cuda" else 0)
            self.calibration = Calibration(steps, skip=2 if cfg.overlap_optimizer else 1)
            if len(plans.buckets) > 1:
                logger.log(level, "LazyTrain: %d sequence-length buckets %s, one plan each", len(plans.buckets),
                           plans.buckets)
        elif cfg.policy == "fixed":
            ex.set_schedule(plan.fixed_plan_for_trainer(tr))
        s = ex.schedule
        predicted = s.predicted.get("step_ms")
        logger.log(level, "LazyTrain schedule: policy=%s, %d layers, %d checkpoints (tiers %s), %d retained, "
                   "prefetch_depth=%d, %s rows per pass, embedding / LM head: %s%s", s.policy, s.num_layers,
                   sum(lp.checkpoint for lp in s.layers), sorted({lp.tier for lp in s.layers if lp.checkpoint}),
                   sum(lp.retain for lp in s.layers), s.prefetch_depth,
                   s.rows_per_pass or cfg.max_rows_per_pass or "all", s.resident,
                   f", predicted step {predicted:.1f} ms" if predicted else "")
        bound = plan.optimizer_bound_line(s.predicted, tr.args.per_device_train_batch_size,
                                          tr.args.gradient_accumulation_steps) if times_are_this_runs(ex) else None
        if bound:
            logger.log(plan.plan_log_level(tr, logging.WARNING), bound)
        return s

    def check_fingerprint(self, schedule: Schedule, path: str) -> None:
        """Warn when a loaded schedule was planned for other inputs than this run's (it is still used: a plan may
        be reused on purpose)."""
        from ..planning.schedule import differing_inputs, plan_fingerprint

        if not schedule.fingerprint:
            return
        try:  # under the schedule's own policy: a `plan --policy fixed` one names "fixed" and its knobs
            policy = schedule.policy if schedule.policy in ("milp", "fixed") else self.request.policy
            inputs = dataclasses.replace(self.request, policy=policy).inputs()
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

    # ---- each micro-batch and step ----------------------------------------------------------------------
    def for_batch(self, seq_len: int) -> Schedule:
        """The plan for a micro-batch of `seq_len` tokens per row (the smallest bucket holding it), switched to when
        the executor runs another; accounted for the step's predicted peak and the calibration."""
        ex = self.trainer.executor
        if self.bucket_plans is not None:
            if seq_len > self.bucket_plans.buckets[-1]:
                self._plan_longer(seq_len)
            plans = self.bucket_plans
            sched = plans.schedule_for(seq_len)
            if sched is not ex.schedule:
                ex.set_schedule(sched)
        sched = ex.schedule
        self.step_predicted_peak = max(self.step_predicted_peak, int(sched.predicted.get("peak_gpu_bytes") or 0))
        if self.calibration is not None:
            self.calibration.add_microbatch(sched.predicted, sched.solver.get("seq_len_bucket"))
        return sched

    def _plan_longer(self, seq_len: int) -> None:
        """A batch longer than the longest bucket (the collator pads past the training data's longest row, e.g.
        `pad_to_multiple_of`): plan a bucket for it with the longest bucket's placement, rows per pass, prefetch
        depth and rates, and say so once. Its plan's peak is then the one checked, not a shorter bucket's.

        Raises:
            InfeasiblePlanError: no plan at that length (the fix in lazytrain_config / TrainingArguments terms).
        """
        from . import plan

        longest = self._longest()
        length = -(-seq_len // 8) * 8
        logger.warning("LazyTrain: a batch of %d tokens per row is longer than the longest planned (%d, the training "
                       "data's longest row): planning a bucket of %d (a collator padding past the data, e.g. "
                       "pad_to_multiple_of, does this)", seq_len, self.bucket_plans.buckets[-1], length)
        try:
            sched = plan.plan_for_trainer(self.trainer, length, prefetch_depths=(longest.prefetch_depth,),
                                          resident=longest.resident, rows=longest.rows_per_pass,
                                          compute_scale=longest.solver.get("compute_scale") or 1.0,
                                          cpu_optim_params_per_s=longest.solver.get("cpu_optim_params_per_s"))
        except InfeasiblePlanError as e:
            raise plan.trainer_error(self.trainer, e.with_shape(seq_len=length), longest.resident) from None
        logger.log(plan.plan_log_level(self.trainer), plan.plan_line(sched, self.request.batch_size, length,
                                                                      self.trainer.args.gradient_accumulation_steps))
        self.bucket_plans = BucketSchedules({**self.bucket_plans.schedules, length: sched})

    def microbatch_done(self, cpu_update_ms: float | None, cpu_update_params: float | None,
                        step_skipped: bool = False) -> None:
        """The micro-batch ran: the executor's last deferred CPU update (its wall time, ms, and parameters); a
        skipped optimizer step's updates were no-ops, their time is no rate."""
        if self.calibration is not None:
            self.calibration.note_cpu_update(None if step_skipped else cpu_update_ms, cpu_update_params)

    def begin_step(self, peak_reset: bool) -> None:
        """An optimizer step begins; `peak_reset`: the CUDA peak-memory counter was reset for it."""
        self.step_predicted_peak = 0
        self.step_peak_reset = peak_reset

    def end_step(self, step: int, peak_bytes: int | None) -> None:
        """After optimizer step `step`: its measured GPU peak (None: not measured) checked against the plan's budget:
        over it, the plans are solved again with the budget reduced by the overshoot (hf/recovery.py)."""
        tr, cfg = self.trainer, self.trainer.lazy_config
        budget = self.budget_bytes
        if peak_bytes is None or cfg.policy != "milp" or cfg.schedule_path or self.bucket_plans is None \
                or budget is None or peak_bytes <= budget:
            return
        predicted = self.step_predicted_peak or int(tr.executor.schedule.predicted.get("peak_gpu_bytes") or 0)
        miss = MemoryMiss(step=step, need_bytes=int(peak_bytes), predicted_bytes=predicted, budget_bytes=budget)
        try:
            plans = self.replan_for_memory(miss)
        except Exception as e:  # the step ran: keep the plan that did
            logger.warning("LazyTrain: step %d peaked at %.2f GiB, over the plan's GPU budget of %.2f GiB; "
                           "re-planning with less failed (%s: %s); keeping the current plan", step, peak_bytes / GIB,
                           budget / GIB, type(e).__name__, _first_line(e))
            return
        self.switch(plans)  # outside the guard: a failed deferred update raised here must end the run
        self._end_trial()
        log_replan(miss, plans, "the measured peak exceeded the plan's GPU budget")

    def step_timed(self, step_time_s: float) -> None:
        """The optimizer step's wall time (s), for the calibration: once enough steps were measured, the plans are
        solved again with the measured costs and switched to when clearly faster (`recalibrated_plans`)."""
        cal = self.calibration
        if cal is None:
            return
        if not cal.end_step(step_time_s):
            self._judge_trial()
            return
        try:
            plans = self.recalibrated_plans()
        except Exception as e:  # an optimization only: never end a run over it
            plans = None
            logger.warning("LazyTrain calibration: re-planning failed (%s: %s); keeping the current plan",
                           type(e).__name__, _first_line(e))
        if plans is not None:  # outside the guard: a failed deferred update raised here must end the run
            self._before_trial = self.bucket_plans
            self.switch(plans)

    def _judge_trial(self) -> None:
        """After the calibration's switch has run its trial steps: keep the new plans, or switch back to the
        replaced ones when they were no faster (Calibration.trial_verdict)."""
        cal = self.calibration
        keep = cal.trial_verdict()
        if keep is None:
            return
        old, self._before_trial = self._before_trial, None
        if keep or old is None:
            logger.info("LazyTrain calibration: the re-planned plan ran %.2fx its prediction (%.1f ms against the "
                        "replaced plan's %.1f ms): keeping it", cal.trial_ratio, cal.trial_ratio * cal.switched_to_ms,
                        cal.switched_from_ms)
            return
        logger.warning("LazyTrain calibration: the re-planned plan ran %.2fx its prediction, %.1f ms a step against "
                       "the replaced plan's %.1f ms: switching back to the replaced plan",
                       cal.trial_ratio, cal.trial_ratio * cal.switched_to_ms, cal.switched_from_ms)
        self.switch(old)

    @property
    def on_trial(self) -> bool:
        """A calibration switch's new plans are being measured (their steps' peaks are checked too)."""
        return self.calibration is not None and self.calibration.on_trial

    # ---- re-planning ------------------------------------------------------------------------------------
    def switch(self, plans: BucketSchedules) -> None:
        """Run `plans` from the next micro-batch on (the longest bucket's now). On CUDA the caching allocator's free
        blocks go back first: cut to the replaced plan's sizes they fragment the new plan's memory."""
        ex = self.trainer.executor
        ex.set_schedule(plans.schedules[plans.buckets[-1]])
        self.bucket_plans = plans
        if ex.device.type == "cuda":
            torch.cuda.empty_cache()

    def _end_trial(self) -> None:
        """A re-plan for memory replaced the plans: a calibration switch on trial is not judged."""
        self._before_trial = None
        if self.calibration is not None:
            self.calibration.cancel_trial()

    def replan_for_memory(self, miss: MemoryMiss) -> BucketSchedules:
        """Every bucket plan solved again with the GPU budget reduced by `miss`'s overshoot (cumulative), keeping
        the running calibration (compute scale, measured CPU rate). Changes no schedule itself (the caller switches:
        a failed deferred update raised by the switch is no planning failure).

        Raises:
            InfeasiblePlanError: no plan fits the reduced budget (the reduction is undone), or any planning error.
        """
        from . import plan

        old = self._longest() if self.bucket_plans else self.current
        scale = float(old.solver.get("compute_scale", 1.0))
        rate = self.calibration.cpu_rate if self.calibration is not None else None
        self.gpu_reduction_bytes += miss.overshoot_bytes
        try:
            return plan.plan_buckets_for_trainer(self.trainer, compute_scale=scale, cpu_optim_params_per_s=rate)
        except Exception:
            self.gpu_reduction_bytes -= miss.overshoot_bytes
            raise

    def recover(self, miss: MemoryMiss) -> BucketSchedules:
        """After an out-of-memory error (the executor already dropped the micro-batch): re-plan with less GPU memory
        (`replan_for_memory`), switch, and drop the step from the calibration (its micro-batches run again).

        Raises:
            InfeasiblePlanError: no plan fits the reduced budget.
        """
        self.step_predicted_peak = 0
        plans = self.replan_for_memory(miss)
        self.switch(plans)
        self._end_trial()
        if self.calibration is not None:
            self.calibration.drop_step()
        return plans

    def recalibrated_plans(self) -> BucketSchedules | None:
        """The bucket plans solved again with the measured CPU optimizer rate and the GPU compute costs scaled by
        the measured factor (hf/calibrate.py), or None when the measurements match the running plan or the new plan
        is not `SWITCH_GAIN` faster than the running one at the measured figures. Changes nothing itself
        (`step_timed` switches). Each rank decides on its own measurements: ranks may run different plans
        (set_schedule issues no collective). The CPU-rate correction (delta) of each measured step is that of the
        bucket plan its first micro-batch ran (the one the CPU updates overlap)."""
        from ..planning.estimate import evaluate
        from . import plan

        tr, cal = self.trainer, self.calibration
        old = self._longest()
        old_scale = float(old.solver.get("compute_scale", 1.0))
        planned_rate = old.solver.get("cpu_optim_params_per_s")
        rate = cal.measured_cpu_rate()
        delta: dict[Any, float] = {}  # per bucket the measured steps ran: its plan at the measured rate, compute kept
        if rate is not None and planned_rate:
            for T in {b for b in cal.step_buckets if b in self.bucket_plans.schedules}:
                bucket_plan = self.bucket_plans.schedules[T]
                cm = plan.cost_model_for_trainer(tr, T, old_scale)[0].for_schedule(bucket_plan)
                delta[T] = (evaluate(cm.with_cpu_optim_rate(rate), bucket_plan).step_ms
                            - evaluate(cm, bucket_plan).step_ms)
        cal.k = cal.compute_factors(delta)
        k = statistics.median(cal.k)
        k = k if k > 0 else 1.0
        if not cal.needs_replan(k, rate, planned_rate):
            logger.info("LazyTrain calibration: measured steps match the plan (compute x%.3f, CPU optimizer %s); "
                        "keeping it", k, "not used" if rate is None else f"{rate / 1e9:.2f} G params/s")
            return None
        scale = old_scale * k
        plans = plan.plan_buckets_for_trainer(tr, compute_scale=scale, cpu_optim_params_per_s=rate,
                                              resident=old.resident, rows=old.rows_per_pass)
        new = plans.schedules[plans.buckets[-1]]
        # the running plan valued with the same calibrated costs: switch only for a clear gain (SWITCH_GAIN)
        cm = plan.cost_model_for_trainer(tr, plans.buckets[-1], scale, rate)[0]
        running = evaluate(cm.for_schedule(old), old)
        running_ms = running.step_ms
        new_ms = float(new.predicted.get("step_ms", float("nan")))
        # compared per optimizer step: a plan's step is one micro-batch plus the optimizer terms, once a step
        ga = max(1, int(tr.args.gradient_accumulation_steps or 1))
        running_step = optimizer_step_ms(running_ms, running.gpu_optim_ms + running.exposed_optimizer_ms, ga)
        new_step = optimizer_step_ms(new_ms, float(new.predicted.get("gpu_optim_ms") or 0.0)
                                     + float(new.predicted.get("exposed_optimizer_ms") or 0.0), ga)
        if not cal.worth_switching(running_step, new_step):
            logger.info("LazyTrain calibration: GPU compute ran %.2fx the prediction, CPU optimizer %s; the re-plan "
                        "predicts %.1f ms a step against the running plan's %.1f ms at these figures (not %.0f%% "
                        "better): keeping the running plan", k, "-" if rate is None else f"{rate / 1e9:.2f} G params/s",
                        new_step, running_step, 100 * SWITCH_GAIN)
            cal.kept_running_ms, cal.replanned_ms = running_step, new_step
            return None
        cal.scale, cal.cpu_rate = scale, rate
        cal.predicted_before_ms = old.predicted.get("step_ms")
        cal.start_trial(running_step, new_step)
        logger.info("LazyTrain calibration: GPU compute ran %.2fx the prediction, CPU optimizer %s (planned %s); "
                    "re-planned: predicted step %.1f ms (was %.1f ms)", k,
                    "-" if rate is None else f"{rate / 1e9:.2f} G params/s",
                    "-" if not planned_rate else f"{planned_rate / 1e9:.2f}",
                    new.predicted.get("step_ms", float("nan")), old.predicted.get("step_ms", float("nan")))
        return plans
