"""Planning for a Trainer run: batch shape from the arguments and data, budgets from the config, MILP solve."""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any

import torch

from ..config import GIB
from ..planning.buckets import BucketSchedules
from ..planning.estimate import op_times
from ..planning.milp import InfeasiblePlanError, solve_milp, with_margin
from ..planning.planner import make_schedule, rows_options, search_plans, split_placements
from ..planning.request import PlanRequest, resolve_request, same_tokens_batch
from ..planning.schedule import RESIDENT_PLACEMENTS, Schedule, input_hashes, plan_fingerprint
from ..profiling.analytic import analytic_cost_model
from ..profiling.hardware import H200_DEFAULTS, probe
from ..profiling.layer_costs import apply_layer_measurements, measure_layer_costs
from ..profiling.limits import disk_free, host_memory_limit
from ..streaming.layer_calls import plan_ops
from . import peft_support, preflight

__all__ = ["cost_model_for_trainer", "plan_for_trainer", "plan_buckets_for_trainer", "fixed_plan_for_trainer", "run_shape",
           "rows_per_example", "plan_inputs_for_trainer", "request_for_trainer", "trainer_fix", "trainer_error",
           "InfeasiblePlanError", "plan_line", "bound_by", "optimizer_bound", "optimizer_bound_line", "EXPOSED_SHARE", "plan_log_level"]

logger = logging.getLogger(__name__)

#: the share of a step that exposed transfers or CPU optimizer updates may take before a plan is called bound by them
EXPOSED_SHARE = 0.10


def plan_log_level(trainer: Any, level: int = logging.INFO) -> int:
    """`level` on the main process, DEBUG on the other data-parallel ranks: every rank plans the same run, so their
    plan lines would repeat rank 0's."""
    main = getattr(trainer, "is_world_process_zero", None)
    return level if main is None or main() else logging.DEBUG


def bound_by(predicted: dict[str, Any], gradient_accumulation_steps: int = 1) -> str:
    """What a plan's optimizer step waits on: "CPU update" or "transfer" when that exposed part (the larger share)
    exceeds `EXPOSED_SHARE`, else "compute". The CPU update is exposed once per optimizer step (`optimizer_bound`),
    transfers in every micro-batch."""
    step = float(predicted.get("step_ms") or 0.0)
    opt = float(predicted.get("exposed_optimizer_ms") or 0.0)
    k = max(1, int(gradient_accumulation_steps))
    shares = {"CPU update": opt / (k * (step - opt) + opt) if step > 0 else 0.0,
              "transfer": float(predicted.get("exposed_transfer_ms") or 0.0) / step if step > 0 else 0.0}
    what, share = max(shares.items(), key=lambda kv: kv[1])
    return what if share > EXPOSED_SHARE else "compute"


def plan_line(schedule: Schedule, batch_size: int, seq_len: int, gradient_accumulation_steps: int = 1) -> str:
    """One short line a person reads for a plan: sequence bucket, batch, predicted (micro-batch) step and tokens/s,
    peak GPU and pinned host memory, and what bounds the optimizer step (`bound_by`; an exposed part in ms)."""
    p = schedule.predicted
    bound = bound_by(p, gradient_accumulation_steps)
    key = {"CPU update": "exposed_optimizer_ms", "transfer": "exposed_transfer_ms"}.get(bound)
    detail = f" ({p[key]:.0f} ms exposed)" if key else ""
    return (f"LazyTrain plan seq {seq_len} x batch {batch_size}: step {p.get('step_ms', float('nan')):.1f} ms, "
            f"{p.get('tokens_per_s', 0.0):,.0f} tokens/s, peak GPU {p.get('peak_gpu_bytes', 0) / GIB:.2f} GiB, "
            f"host {p.get('pinned_host_bytes', 0) / GIB:.2f} GiB, bound by {bound}{detail}")


def optimizer_bound(predicted: dict[str, Any], gradient_accumulation_steps: int,
                    share: float = EXPOSED_SHARE) -> tuple[float, int] | None:
    """(exposed share of the optimizer step, smallest gradient_accumulation_steps that brings it under `share`)
    when the plan's exposed CPU optimizer update takes more than `share` of the optimizer step, else None.

    The deferred CPU update of a step overlaps the next step's first micro-batch only, so it is exposed once per
    optimizer step: with k micro-batches of c = step_ms - exposed_optimizer_ms each, the step takes k * c + e and the
    share is e / (k * c + e); it is under `share` from k > e * (1 - share) / (share * c) on. A larger micro-batch
    with the same sequences per step hides at least as much (more compute overlaps the same update)."""
    e = float(predicted.get("exposed_optimizer_ms") or 0.0)
    c = float(predicted.get("step_ms") or 0.0) - e
    k = max(1, int(gradient_accumulation_steps))
    if e <= 0 or c <= 0 or e <= share * (k * c + e):
        return None
    return e / (k * c + e), int(e * (1 - share) / (share * c)) + 1


def optimizer_bound_line(predicted: dict[str, Any], per_device_batch: int, gradient_accumulation_steps: int,
                         share: float = EXPOSED_SHARE) -> str | None:
    """The log line for an optimizer-bound plan (`optimizer_bound`), or None when it is not: the exposed update per
    optimizer step and the accumulation / sequences per optimizer step that would hide it."""
    found = optimizer_bound(predicted, gradient_accumulation_steps, share)
    if found is None:
        return None
    frac, k = found
    e = float(predicted["exposed_optimizer_ms"])
    ga = max(1, int(gradient_accumulation_steps))
    step = ga * (float(predicted["step_ms"]) - e) + e
    return (f"LazyTrain: optimizer-bound: the CPU optimizer update is predicted to stall {e:.0f} ms of each "
            f"{step:.0f} ms optimizer step ({100 * frac:.0f}%); gradient_accumulation_steps={k} (now {ga}), or "
            f"per_device_train_batch_size x gradient_accumulation_steps >= {per_device_batch * k} sequences per "
            f"optimizer step (now {per_device_batch * ga}), hides it under {100 * share:.0f}%")


def run_shape(trainer: Any, multiple: int = 8) -> tuple[int, int]:
    """(micro-batch rows, longest sequence rounded up to `multiple`) of the trainer's training data; with
    `DataCollatorWithFlattening` (one packed row per micro-batch) 1 row of the longest packing of
    `per_device_train_batch_size` sequences; with a tokenized preference data set (TRL's DPOTrainer) 2 rows per
    example (`rows_per_example`)."""
    from ..streaming.packing import is_flattening_collator, packed_row_tokens

    B = trainer.args.per_device_train_batch_size
    packed = is_flattening_collator(getattr(trainer, "data_collator", None))
    ds = trainer.train_dataset
    T = 1024 * (B if packed else 1)
    try:
        lengths = _preference_lengths(ds, getattr(trainer.args, "max_length", None))
        if lengths is None:
            # a datasets.Dataset's column, or a plain list of rows (iterating other data sets could tokenize them)
            column = [r["input_ids"] for r in ds] if isinstance(ds, (list, tuple)) else ds["input_ids"]
            lengths = [len(x) for x in column]
        T = packed_row_tokens(lengths, B) if packed else max(lengths)
    except (TypeError, KeyError, ValueError, IndexError):
        if not getattr(trainer, "_lengths_warned", False):  # run_shape is asked once per plan and re-plan
            logger.warning("cannot read input_ids lengths from the training data (%s); planning for %d tokens per "
                           "row", type(ds).__name__, T)
            trainer._lengths_warned = True
    return (1 if packed else B * rows_per_example(trainer)), -(-T // multiple) * multiple


#: a tokenized preference data set's columns (TRL's DPOTrainer): TRL's `DataCollatorForPreference` makes each example
#: two rows, prompt + chosen and prompt + rejected, padded to the longest row of the micro-batch
_PREFERENCE_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


def rows_per_example(trainer: Any) -> int:
    """Micro-batch rows per training example: 2 for a tokenized preference data set (chosen and rejected), else 1."""
    names = getattr(trainer.train_dataset, "column_names", None) or ()
    return 2 if "input_ids" not in names and set(_PREFERENCE_COLUMNS) <= set(names) else 1


def _preference_lengths(ds: Any, max_length: int | None) -> list[int] | None:
    """Per example of a tokenized preference data set its longer row (prompt + the longer completion), truncated at
    `max_length` as TRL's collator truncates; None for other data."""
    names = getattr(ds, "column_names", None) or ()
    if "input_ids" in names or not set(_PREFERENCE_COLUMNS) <= set(names):
        return None
    out = [len(p) + max(len(c), len(r)) for p, c, r in zip(*(ds[k] for k in _PREFERENCE_COLUMNS), strict=True)]
    return [min(n, max_length) for n in out] if max_length else out


def machine_budgets(trainer: Any) -> tuple[Any, dict[str, Any]]:
    """(hardware profile, the machine's side of `planning.request.resolve_budgets`) for this trainer: on CUDA the
    probe and the free GPU memory now, elsewhere the H200 defaults and an 80 GiB GPU; the host memory this process
    may use (`profiling.limits.host_memory_limit`: cgroup limits, available RAM) and the processes sharing it (data
    parallel: every rank on this host keeps its own gradients, optimizer states and stash, and its own copy of the
    weights unless the host's ranks share one, `host_weight_ranks`); the free space of `nvme_dir` (256 GiB without
    one)."""
    cfg = trainer.lazy_config
    ex = trainer.executor
    if ex.device.type == "cuda":
        hardware = probe(ex.device, nvme_dir=cfg.nvme_dir)
        gpu = torch.cuda.mem_get_info(ex.device)[0]
    else:
        hardware, gpu = H200_DEFAULTS, 80 * GIB
    local = preflight.ranks_per_host()
    # the limit the process really has (cgroup, memory other processes use), not the host's RAM
    host = 0 if cfg.host_memory_budget else host_memory_limit().bytes
    nvme = disk_free(cfg.nvme_dir).bytes if cfg.nvme_dir and not cfg.nvme_budget else 256 * GIB
    return hardware, dict(gpu_available=int(gpu), host_total=host, nvme_available=nvme, ranks_per_host=local)


def request_for_trainer(trainer: Any) -> PlanRequest:
    """The run's `PlanRequest` (`planning.request.resolve_request`): the micro-batch (`per_device_train_batch_size`
    x the longest sequence, `run_shape`), the budgets (`gpu_memory_budget` less `gpu_memory_margin`, default: the
    device's free memory now, 80 GiB on CPU runs; `host_memory_budget`, default: 90% of the process's memory limit /
    data-parallel ranks on this host; `nvme_budget` when `nvme_dir` is set, default its free space / ranks), the
    hardware rates (the cached or fresh probe on CUDA, the H200 defaults elsewhere), `plan_buckets` sequence-length
    buckets (policy "milp") and the fixed policy's knobs. Its fingerprint names policy "milp" whatever `lazytrain_config.policy` is, as the
    Trainer's plans always have (`lazytrain-hf plan --policy milp` schedules match it)."""
    cfg = trainer.lazy_config
    B, T = run_shape(trainer)
    hardware, machine = machine_budgets(trainer)
    config = trainer.model.config
    if getattr(config, "tie_word_embeddings", False) and \
            getattr(getattr(trainer.executor, "resident", None), "tied", True) is False:
        # a tied config whose head the run trains apart (PEFT modules_to_save on lm_head or embed_tokens holds a
        # copy): priced as the untied head it runs
        config = copy.deepcopy(config)
        config.tie_word_embeddings = False
    request = resolve_request(
        config.to_dict(), config, batch_size=B, seq_len=T, hardware=hardware,
        gpu_memory_budget=cfg.gpu_memory_budget, host_memory_budget=cfg.host_memory_budget,
        nvme_budget=cfg.nvme_budget, nvme=bool(cfg.nvme_dir), gpu_memory_margin=cfg.gpu_memory_margin, **machine,
        policy="milp", fixed={"checkpoint_every": cfg.checkpoint_every, "tier": cfg.activation_tier,
                                  "prefetch_depth": cfg.prefetch_depth},
        rows_per_pass=cfg.max_rows_per_pass, resident=cfg.resident_placement, gpu_optimizer=_gpu_optimizer(trainer),
        keep_gpu_grads=cfg.keep_gpu_grads, gradient_accumulation_steps=trainer.args.gradient_accumulation_steps,
        loss_chunk_tokens=cfg.loss_chunk_tokens, state_dtype=cfg.state_dtype,
        master_weights=master_weights_priced(cfg.master_weights, trainer.model),
        block_size=cfg.block_size, time_limit_s=cfg.solver_time_limit_s, mip_rel_gap=cfg.solver_mip_rel_gap,
        max_buckets=cfg.plan_buckets if cfg.policy == "milp" else 1,
        frozen=peft_support.frozen_layout(trainer.executor), resident_states=resident_states(trainer),
        host_weight_ranks=host_weight_ranks(trainer))
    if machine["ranks_per_host"] > 1 and not cfg.host_memory_budget:
        shared = request.host_weight_ranks
        logger.log(plan_log_level(trainer), "planning with %.1f GiB host memory per rank (%d ranks on this host%s)",
                   request.budgets.host_bytes / GIB, machine["ranks_per_host"],
                   f"; one copy of the layers' weights for {shared} of them, 1/{shared} in each rank's bytes"
                   if shared > 1 else "")
    return request


def host_weight_ranks(trainer: Any) -> int:
    """The ranks mapping the executor's one host copy of the streamed weights (streaming/shared_host.py), or 1 (a
    stand-in executor of planning code has no store, as in `peft_support.frozen_costs`)."""
    store = getattr(trainer.executor, "store", None)
    return store.weight_ranks if store is not None else 1


def resident_states(trainer: Any) -> str:
    """The embedding / LM head optimizer state layout the planner prices: "8bit" when the trainer's Hybrid8 optimizer
    (created before the first plan) gives the input embedding 8-bit states (`fp32_state_params` without it), else
    "fp32" (Hybrid8's default; another optimizer's states are counted as fp32)."""
    opt = getattr(trainer, "optimizer", None)
    inner = trainer._inner_optimizer(opt) if opt is not None else None
    if inner is None or not peft_support.is_hybrid8(inner):
        return "fp32"
    return "8bit" if inner.wants_8bit(trainer.executor.resident.embed.weight) else "fp32"


def cost_model_for_trainer(trainer: Any, seq_len: int, compute_scale: float = 1.0,
                           cpu_optim_params_per_s: float | None = None, resident: str | None = None,
                           rows: int | None = None) -> tuple[Any, str, str]:
    """The cost model `plan_for_trainer` solves on, for `seq_len` tokens per sequence: (cost model, "measured" or
    "analytic" layer costs, fingerprint). `compute_scale` multiplies the GPU compute costs and
    `cpu_optim_params_per_s` replaces the probed CPU optimizer rate (calibration from measured steps,
    hf/calibrate.py). `resident`: the embedding / LM head placement, `rows`: rows per pass (defaults: the running
    plan's, `running_choices`)."""
    cm, layer_costs, inputs = _cost_model_and_inputs(trainer, seq_len, compute_scale, cpu_optim_params_per_s,
                                                     resident, rows)
    return cm, layer_costs, plan_fingerprint(inputs)


def running_choices(trainer: Any) -> tuple[str, int | None]:
    """(embedding / LM head placement, rows per pass) the executor runs now."""
    ex = trainer.executor
    return ex.resident.placement, ex.schedule.rows_per_pass or trainer.lazy_config.max_rows_per_pass


def analytic_cost_model_for_trainer(trainer: Any, seq_len: int, resident: str, rows: int | None) -> Any:
    """The analytic cost model of this trainer's plan request at `seq_len` tokens per sequence, for the embedding /
    LM head `resident` and `rows` per pass (no layer timed: `cost_model_for_trainer` adds the measured layers)."""
    request = trainer.plans.request
    return analytic_cost_model(request.model, request.batch_size, seq_len, request.hardware,
                               **request.cost_model_kwargs(rows, resident), **peft_support.frozen_costs(trainer.executor))


def _cost_model_and_inputs(trainer: Any, seq_len: int, compute_scale: float = 1.0,
                           cpu_optim_params_per_s: float | None = None, resident: str | None = None,
                           rows: int | None = None) -> tuple[Any, str, dict[str, Any]]:
    """`cost_model_for_trainer` with the plan inputs instead of their fingerprint (the run's `PlanRequest`)."""
    cfg = trainer.lazy_config
    request = trainer.plans.request
    running = running_choices(trainer)
    resident, rows = resident or running[0], rows or running[1]
    B = request.batch_size
    cm = analytic_cost_model_for_trainer(trainer, seq_len, resident, rows)
    ex = trainer.executor
    # frozen layers (adapters, a 4-bit base) are measured as they run: the model's own layer, not a fresh bf16 one
    own = getattr(ex, "store", None) is not None and any(ex.frozen)
    cm, layer_costs = measured_layer_costs(cm, trainer.model.config, cfg, ex.device, B, seq_len,
                                           trainer.plans.layer_costs, rows, layers=ex.layers if own else None,
                                           autocast_dtype=getattr(ex, "autocast_dtype", None) if own else None,
                                           hidden_dtype=trainer.model.get_input_embeddings().weight.dtype if own
                                           else None)
    if compute_scale != 1.0:
        cm = cm.scaled_compute(compute_scale)
    if cpu_optim_params_per_s is not None:
        cm = cm.with_cpu_optim_rate(cpu_optim_params_per_s)
    return cm, layer_costs, request.inputs(seq_len)


def plan_inputs_for_trainer(trainer: Any, seq_len: int) -> dict[str, Any]:
    """What this trainer's plan for `seq_len` depends on (`planning.schedule.plan_inputs`; its `plan_fingerprint`
    is the fingerprint `cost_model_for_trainer` returns)."""
    return trainer.plans.request.inputs(seq_len)


def _kept_grads(trainer: Any) -> bool:
    """GPU-updated layers keep their gradients on the GPU (`keep_gpu_grads`) only with one micro-batch per step
    (streaming/grads.py)."""
    return trainer.lazy_config.keep_gpu_grads and trainer.args.gradient_accumulation_steps == 1


def _gpu_optimizer(trainer: Any) -> bool:
    """GPU-side layer updates run only with the overlapped (deferred) optimizer (streaming/executor.py); on a CPU
    device they would only move the update from the worker thread into the forward's critical path. Not with
    master_weights "stochastic": its unfused torch update holds ~49 bytes of temporaries per element where the plan
    prices the fused kernel's 18."""
    cfg = trainer.lazy_config
    return cfg.gpu_layer_updates and cfg.overlap_optimizer and trainer.executor.device.type == "cuda" and \
        cfg.master_weights != "stochastic"


def master_weights_priced(choice: str, model: Any) -> str:
    """The master-weight mode the plan prices for `choice` on `model`'s trained weights: "auto" as kahan (bf16) or
    fp32 (fp16), "stochastic" as fp32 where the weights are not bf16 (the optimizer keeps fp32 masters there)."""
    params = getattr(model, "parameters", None)  # (a stand-in model without parameters: none known)
    dtypes = {p.dtype for p in params() if p.requires_grad} if callable(params) else set()
    if choice == "stochastic" and dtypes and dtypes != {torch.bfloat16}:
        return "fp32"
    if choice == "auto":
        return "fp32" if torch.float16 in dtypes else "kahan"
    return choice


def plan_for_trainer(trainer: Any, seq_len: int | None = None, prefetch_depths: tuple[int, ...] = (1, 2, 3),
                     compute_scale: float = 1.0, cpu_optim_params_per_s: float | None = None,
                     resident: str | None = None, rows: int | None = None) -> Schedule:
    """Solve the MILP (lazytrain_hf.planning.milp) for this trainer's model, batch shape and budgets.

    Args:
        seq_len: tokens per sequence to plan for (default: the longest in the training data, `run_shape`).
        prefetch_depths: prefetch depths the MILP may choose from.
        compute_scale: multiplies the GPU compute costs (calibration from measured steps, hf/calibrate.py).
        cpu_optim_params_per_s: the CPU optimizer rate to plan with (parameters/s; default: the hardware probe's);
            calibration passes the rate the executor measured.
        resident: the embedding / LM head placement to plan for (default: the executor's current one); the plan
            records it (`Schedule.resident`) and the executor moves them when it switches to the plan.
        rows: rows per pass to plan for (default: the running plan's or `max_rows_per_pass`); recorded as
            `Schedule.rows_per_pass`, which the executor follows.

    Budgets and hardware rates: the run's `PlanRequest` (`request_for_trainer`, held by `trainer.plans`).

    Raises:
        InfeasiblePlanError: no schedule fits; the message names the smallest feasible budgets (`trainer_error`
            words the fix in lazytrain_config keys and TrainingArguments).
    """
    request = trainer.plans.request
    T = seq_len or request.seq_len
    running = running_choices(trainer)
    resident, rows = resident or running[0], rows or running[1]
    cm, layer_costs, inputs = _cost_model_and_inputs(trainer, T, compute_scale, cpu_optim_params_per_s, resident,
                                                     rows)
    try:
        schedule = solve_milp(cm, prefetch_depths=prefetch_depths, time_limit_s=request.time_limit_s,
                              mip_rel_gap=request.mip_rel_gap, gpu_optimizer=request.gpu_optimizer,
                              fingerprint=plan_fingerprint(inputs))
    except InfeasiblePlanError as e:  # name the budget to pass, not the planner's after-margin figure
        raise with_margin(e, request.budgets.margin).with_shape(batch_size=request.batch_size, seq_len=T,
                                                                rows_per_pass=rows) from None
    schedule.resident, schedule.rows_per_pass = resident, rows
    schedule.solver.update(seq_len_bucket=T, layer_costs=layer_costs, compute_scale=compute_scale,
                           op_ms=op_times(cm, schedule, plan_ops(schedule)),
                           gpu_budget_bytes=int(cm.gpu_bytes),
                           cpu_optim_params_per_s=cm.cpu_optim_params_per_s,
                           fingerprint_inputs=input_hashes(inputs))
    logger.debug("%s; %s rows per pass, embedding / LM head %s; solver %s, predicted %s",
                 plan_line(schedule, request.batch_size, T), rows or "all", resident, schedule.solver,
                 schedule.predicted)
    return schedule


def measured_layer_costs(cm: Any, model_config: Any, cfg: Any, device: torch.device, B: int, T: int,
                         cache: dict | None = None, rows: int | None = None, layers: Any = None,
                         autocast_dtype: torch.dtype | None = None, hidden_dtype: torch.dtype | None = None
                         ) -> tuple[Any, str]:
    """`cm` with the forward / backward times and the memory (autograd-saved activations, forward and backward
    workspaces) of one decoder layer per kind measured on the CUDA `device` at one row pass (min(B,
    rows or cfg.max_rows_per_pass) rows x T), scaled to the micro-batch's passes, and what was used: "measured" or
    "analytic" (`cfg.profile_layers` off, not CUDA, or even one row ran out of memory: a warning). A pass that
    does not fit next to what the GPU already holds is measured at half the rows, then a quarter, ..., and scaled
    up (times and activations are linear in rows). `cache`: measurements by (rows, T, device), reused when present
    and filled when not. With `cfg.compile_linear_attention` the linear-attention layer is measured compiled where
    the reference kernels run, as the executor runs it. `layers` / `autocast_dtype` / `hidden_dtype`: measure the
    model's own layers under the executor's autocast on hidden states of the model's dtype (`measure_layer_costs`;
    frozen and 4-bit layers)."""
    if not cfg.profile_layers or device.type != "cuda":
        return cm, "analytic"
    rows = min(B, rows or cfg.max_rows_per_pass or B)
    measured, r = None, rows
    while r >= 1:
        key = (r, T, str(device))
        measured = (cache or {}).get(key)  # a re-plan mid-training reuses the first measurement
        if measured is not None:
            break
        try:
            measured = measure_layer_costs(model_config, r, T, device, memory=True,
                                           compile_linear_attention=cfg.compile_linear_attention, layers=layers,
                                           autocast_dtype=autocast_dtype, hidden_dtype=hidden_dtype)
        except torch.OutOfMemoryError as e:
            torch.cuda.empty_cache()
            logger.info("layer profiling at %d x %d ran out of GPU memory (%s); measuring at %d rows", r, T,
                        str(e).splitlines()[0][:120], r // 2)
            r //= 2
            continue
        if not measured:
            return cm, "analytic"
        if cache is not None:
            cache[key] = measured
        logger.debug("measured layer costs at %d x %d: %s", r, T,
                    {k: f"fwd {m.fwd_ms:.1f} ms, bwd {m.bwd_ms:.1f} ms, saved {(m.saved_bytes or 0) / GIB:.2f} GiB"
                     for k, m in measured.items()})
        break
    if measured is None:
        logger.warning("layer profiling ran out of GPU memory even at 1 row x %d; planning with analytic layer "
                       "costs", T)
        return cm, "analytic"
    out = apply_layer_measurements(cm, measured, time_scale=B / r, memory_scale=rows / r)
    # memory: the larger of the measured and the analytic figure per layer. The analytic one already held on the
    # dense shapes measured (Qwen2.5-7B); the measurement catches kernels that keep more (the reference Gated
    # DeltaNet path saved 2x the analytic activations at Qwen3.6-27B width)
    worst = {k: [max(a, b) for a, b in zip(getattr(out, k), getattr(cm, k))]
             for k in ("saved_bytes", "fwd_work_bytes", "bwd_work_bytes")}
    worst["retained_bytes"] = [max(out.retained(i), cm.retained(i)) for i in range(cm.num_layers)]
    return dataclasses.replace(out, **worst), "measured"


def resident_candidates(trainer: Any, placement: str | None = None) -> list[str]:
    """Placements of the embedding and LM head the planner tries: the configured one, or (`auto`) every one this
    model can run (streaming/resident.py), GPU first, those of `planning.planner.FALLBACK_PLACEMENTS` last (tried
    only when no other has a plan); data-parallel ranks keep them on the GPU; a loss of the user's
    (hf/user_loss.py) multiplies by the whole head, so not "host_sliced"."""
    placement = placement or trainer.lazy_config.resident_placement  # `placement`: instead of the configured one
    if placement != "auto":
        return [placement]
    ex = trainer.executor
    if ex.dp is not None:
        return ["gpu"]
    user_loss = bool(getattr(trainer, "user_loss", None))
    return [p for p in ex.resident.allowed() if not (user_loss and p == "host_sliced")]


def plan_buckets_for_trainer(trainer: Any, compute_scale: float = 1.0,
                             cpu_optim_params_per_s: float | None = None, resident: str | None = None,
                             rows: int | None = None) -> BucketSchedules:
    """One MILP plan per sequence-length bucket (`lazytrain_config.plan_buckets` of them, powers of two up to the
    longest sequence; lazytrain_hf/planning/buckets.py). Every bucket uses the prefetch depth of the longest
    bucket's plan, so switching plans between batches never reallocates weight slots. `compute_scale`: as in
    `plan_for_trainer`, and so is `cpu_optim_params_per_s`. `resident` (the embedding / LM head placement) and
    `rows` (rows per pass): None chooses them on the longest bucket (`planning.planner.search_plans`: the largest
    rows per pass that has a plan, `max_rows_per_pass` if set, and the fastest of `resident_candidates` there);
    every bucket's plan then has the same.

    Raises:
        InfeasiblePlanError: the longest bucket has no schedule within the budgets (in any placement tried; the
            error of the placement that needs the least GPU memory).
    """
    request = trainer.plans.request
    buckets = list(request.buckets)
    rates = dict(compute_scale=compute_scale, cpu_optim_params_per_s=cpu_optim_params_per_s)
    B = request.batch_size
    tried: list[str] = []

    def solve(r: int, placement: str) -> Schedule:
        try:
            plan = plan_for_trainer(trainer, buckets[-1], resident=placement, rows=r, **rates)
        except InfeasiblePlanError:
            tried.append(f"{r} rows per pass with the embedding / LM head {placement}: no plan")
            raise
        tried.append(f"{r} rows per pass, {placement}: {plan.predicted.get('step_ms', float('nan')):.1f} ms")
        return plan

    placements = [resident] if resident else resident_candidates(trainer)
    try:
        longest = search_plans(solve, [rows] if rows else rows_options(B, request.rows_per_pass),
                               *split_placements(placements))
    except InfeasiblePlanError as e:
        raise trainer_error(trainer, e, placements[-1]) from None
    if len(tried) > 1:
        logger.log(plan_log_level(trainer), "LazyTrain: %s rows per pass, embedding / LM head %s, for every "
                   "sequence-length bucket (the fastest of %d tried)", longest.rows_per_pass or "all",
                   longest.resident, len(tried))
        logger.debug("LazyTrain: planned %s", "; ".join(tried))
    rates.update(resident=longest.resident, rows=longest.rows_per_pass)
    plans = {buckets[-1]: longest}
    for b in buckets[:-1]:  # shorter sequences: smaller activations, always feasible when the longest is
        plans[b] = plan_for_trainer(trainer, b, prefetch_depths=(longest.prefetch_depth,), **rates)
    for b in buckets:
        logger.log(plan_log_level(trainer), plan_line(plans[b], B, b, trainer.args.gradient_accumulation_steps))
    return BucketSchedules(plans)


def fixed_plan_for_trainer(trainer: Any) -> Schedule:
    """The fixed policy's schedule for this run (checkpoint every `checkpoint_every` layers in `activation_tier`,
    every layer re-forwarded), with its two simple rules: the embedding / LM head where the executor put them
    (`planning.fixed.fixed_resident`), and the largest rows per pass (`max_rows_per_pass` if set, else the batch,
    then halves) at which the schedule fits the budgets by the cost model; its prediction in `predicted`. When no
    row count fits, the fewest rows tried (one, unless `max_rows_per_pass`) with a warning: a baseline runs in its
    leanest configuration, so that its largest batch is where it runs out of memory, not where the model says it
    would."""
    import warnings

    request = trainer.plans.request
    resident = trainer.executor.resident.placement
    rows = rows_options(request.batch_size, request.rows_per_pass)

    def solve(rows: int, placement: str, strict: bool = True) -> Schedule:
        cm, _, inputs = _cost_model_and_inputs(trainer, request.seq_len, resident=placement, rows=rows)
        inputs = {**inputs, "policy": "fixed", "fixed": dict(request.fixed)}  # as `plan --policy fixed` names it
        return make_schedule(cm, "fixed", **request.fixed, fingerprint=plan_fingerprint(inputs), strict=strict,
                             simulate_check=False)

    try:
        return search_plans(solve, rows, [resident])
    except InfeasiblePlanError as e:
        logger.warning("LazyTrain fixed policy: %s Running it at %d rows per pass (its fewest): expect an "
                       "out-of-memory error", e, rows[-1])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sched = solve(rows[-1], resident, strict=False)
        sched.resident, sched.rows_per_pass = resident, rows[-1]
        return sched


def trainer_fix(trainer: Any, e: InfeasiblePlanError, resident: str | None = None) -> str:
    """The fix for `e` in this run's terms (lazytrain_config keys, TrainingArguments), from its numbers: the GPU
    (and host) budget to configure, a per-device batch with a plan at the budgets (the embedding / LM head
    `resident`, one row per pass) with the gradient accumulation that keeps the rows per optimizer step, fewer rows
    per pass or shorter sequences."""
    cfg, request = trainer.lazy_config, trainer.plans.request
    fixes = []
    leaner = leaner_placement(trainer)
    if leaner is not None:
        fixes.append(f"lazytrain_config.resident_placement='{leaner}' (now '{cfg.resident_placement}'; 'auto' finds "
                     "it too), which has a plan at these budgets")
    if e.host_too_small and e.min_host_bytes:
        fixes.append(f"set lazytrain_config.host_memory_budget to at least '{_gib_text(e.min_host_bytes)}' (now "
                     f"{_gib_text(request.budgets.host_bytes)})")
    need = e.needed_gpu_bytes
    if need is not None:
        now = f"now {_gib_text(cfg.gpu_memory_budget)}" if cfg.gpu_memory_budget else \
            f"now unset: {_gib_text(request.budgets.gpu_total)} free"
        fixes.append(f"set lazytrain_config.gpu_memory_budget='{_gib_text(need)}' ({now}) on a device with that "
                     "much free memory")
    per = rows_per_example(trainer)  # the plan counts rows, per_device_train_batch_size examples
    B, ga = request.batch_size // per, trainer.args.gradient_accumulation_steps
    batch = fitting_batch(trainer, resident) // per if B > 1 else 0
    if batch:
        b, steps = same_tokens_batch(B, ga, batch)
        fixes.append(f"per_device_train_batch_size={b} with gradient_accumulation_steps={steps} (now {B} and {ga}: "
                     f"the same rows per optimizer step; batches up to {batch} have a plan at these budgets)")
    if request.rows_per_pass and request.rows_per_pass > 1:
        fixes.append(f"lazytrain_config.max_rows_per_pass=1 (now {request.rows_per_pass})")
    fixes.append(f"shorter sequences (the longest is {e.seq_len or request.seq_len} tokens)")
    return ", or ".join(fixes)


def leaner_placement(trainer: Any) -> str | None:
    """With a configured embedding / LM head placement that has no plan: the first placement after it in
    `RESIDENT_PLACEMENTS` (less GPU memory) that the run may take (`resident_candidates` under 'auto') and that plans
    at this run's batch and budgets, one row per pass; None when none does or the placement is 'auto'."""
    cfg = trainer.lazy_config
    if cfg.resident_placement == "auto":
        return None
    order = list(RESIDENT_PLACEMENTS)
    candidates = resident_candidates(trainer, "auto")
    for placement in [p for p in order[order.index(cfg.resident_placement) + 1:] if p in candidates]:
        try:
            plan_for_trainer(trainer, trainer.plans.request.seq_len, resident=placement, rows=1)
        except InfeasiblePlanError:
            continue
        return placement
    return None


def trainer_error(trainer: Any, e: InfeasiblePlanError, resident: str | None = None) -> InfeasiblePlanError:
    """`e` with the fix worded for the Trainer (`trainer_fix`); the numbers stay in its attributes."""
    request = trainer.plans.request
    e = e.with_shape(batch_size=request.batch_size, seq_len=request.seq_len)
    return e.restated(f"LazyTrain: no plan for batch {e.batch_size} x {e.seq_len}: {e.facts} Fix: "
                      f"{trainer_fix(trainer, e, resident)}.", facts=e.facts)


def fitting_batch(trainer: Any, resident: str | None = None) -> int:
    """The largest per-device batch below the configured one with a plan at this run's budgets (the analytic costs,
    one row per pass, the embedding / LM head `resident`, default the executor's); 0 when even one row does not
    fit."""
    import warnings

    from ..planning.planner import largest_feasible_batch

    request = trainer.plans.request
    placement = resident or trainer.executor.resident.placement

    def build(b: int) -> Any:
        return analytic_cost_model(request.model, b, request.seq_len, request.hardware,
                                   **request.cost_model_kwargs(1, placement),
                                   **peft_support.frozen_costs(trainer.executor))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return largest_feasible_batch(build, "milp", max_batch=max(1, request.batch_size - 1))


def _gib_text(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f}GiB"
