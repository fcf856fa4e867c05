"""What a plan is asked for: `PlanRequest`, built once per run from the configuration, the run's shape and the
machine by `resolve_request`, the one place where budgets and defaults are resolved for both `lazytrain-hf plan`
(lazytrain_hf/cli_plan.py) and the Trainer (lazytrain_hf/hf/plan.py).

Pure like the rest of `planning`: the caller measures the machine (hardware profile, free GPU memory, RAM, free disk)
and builds cost models from the request (`cost_model_kwargs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .buckets import seq_len_buckets
from .schedule import plan_fingerprint, plan_inputs

__all__ = ["Budgets", "PlanRequest", "resolve_budgets", "resolve_request", "FIXED_DEFAULTS", "same_tokens_batch"]

#: the fixed policy's knobs and their defaults (lazytrain_config checkpoint_every / activation_tier / prefetch_depth)
FIXED_DEFAULTS: dict[str, Any] = {"checkpoint_every": 4, "tier": "gpu", "prefetch_depth": 1}


@dataclass(frozen=True)
class Budgets:
    """GPU, host and NVMe budgets: as asked (None or 0: the default was taken; `nvme_asked` 0: no NVMe tier) and as
    the planner sees them (bytes)."""

    gpu_asked: int | None
    host_asked: int | None
    nvme_asked: int | None
    #: the GPU bytes before the margin: the one asked for, else the machine's (free) GPU memory
    gpu_total: int
    host_bytes: int
    nvme_bytes: int
    margin: float
    #: GPU bytes taken off every plan's budget: what measured steps needed beyond their plans (hf/recovery.py)
    reduction_bytes: int = 0

    @property
    def gpu_bytes(self) -> int:
        """The planner's GPU budget: `gpu_total` less the margin (fragmentation, unmodelled workspaces) and the
        reduction."""
        return max(0, int(self.gpu_total * (1 - self.margin)) - int(self.reduction_bytes))


def resolve_budgets(gpu_memory_budget: int | None, host_memory_budget: int | None, nvme_budget: int | None, *,
                    nvme: bool, margin: float, gpu_available: int, host_total: int, nvme_available: int,
                    ranks_per_host: int = 1, reduction_bytes: int = 0) -> Budgets:
    """The budgets to plan with. Defaults: the GPU `gpu_available` (the profile's GPU memory for the CLI, the free
    GPU memory for the Trainer), the host 90% of `host_total` (the process's memory limit for the Trainer,
    `profiling.limits.host_memory_limit`; the profile's RAM for the CLI) shared by the `ranks_per_host` processes on
    this host, NVMe (`nvme` set) `nvme_available` shared likewise."""
    ranks = max(1, int(ranks_per_host))
    return Budgets(gpu_asked=gpu_memory_budget, host_asked=host_memory_budget,
                   nvme_asked=nvme_budget if nvme else 0, gpu_total=int(gpu_memory_budget or gpu_available),
                   host_bytes=int(host_memory_budget or int(0.9 * host_total) // ranks),
                   nvme_bytes=int(nvme_budget or nvme_available // ranks) if nvme else 0, margin=float(margin),
                   reduction_bytes=int(reduction_bytes))


@dataclass(frozen=True)
class PlanRequest:
    """One run's planning question: the model, the batch shape, the budgets, the machine's rates and the policy.

    Attributes:
        model_config: the model's config as a dict (its identity in the fingerprint).
        model: what cost models are built from (a transformers config or a profiling `ModelShape`).
        batch_size, seq_len: the micro-batch (rows, longest sequence in tokens).
        buckets: sequence-length buckets planned (ascending, the last one `seq_len`).
        hardware: the hardware profile (`profiling.HardwareProfile`; its `to_dict()` enters the fingerprint).
        budgets: `Budgets`.
        policy, fixed: the planner and the fixed policy's knobs (`FIXED_DEFAULTS` keys).
        rows_per_pass, resident: as configured (None / "auto": the planner chooses).
        gpu_optimizer, kept_grads: GPU-side layer updates allowed; their gradients kept on the GPU.
        loss_chunk_tokens, state_dtype, master_weights, block_size: the optimizer and loss layout.
        resident_states: the embedding / LM head optimizer states ("fp32", Hybrid8's default, or "8bit").
        time_limit_s, mip_rel_gap: the MILP's limits.
        name: the model's name in cost models.
        frozen: the frozen layout (`plan_inputs`' `frozen`: frozen layer indices, resident adapter parameters), or
            None when every decoder layer trains.
        host_weight_ranks: ranks on this host that map one host copy of the streamed layers' weights
            (`LazyTrainConfig.dp_host_weights`): each rank's host bytes count 1 / host_weight_ranks of them. 1: each
            rank its own copy.
    """

    model_config: Mapping[str, Any]
    model: Any
    batch_size: int
    seq_len: int
    buckets: tuple[int, ...]
    hardware: Any
    budgets: Budgets
    policy: str = "milp"
    fixed: Mapping[str, Any] = field(default_factory=lambda: dict(FIXED_DEFAULTS))
    rows_per_pass: int | None = None
    resident: str = "auto"
    gpu_optimizer: bool = True
    kept_grads: bool = True
    loss_chunk_tokens: int = 2048
    state_dtype: str = "8bit"
    master_weights: str = "fp32"
    block_size: int = 256
    resident_states: str = "fp32"
    time_limit_s: float = 10.0
    mip_rel_gap: float = 0.01
    name: str = ""
    frozen: Mapping[str, Any] | None = None
    host_weight_ranks: int = 1

    def inputs(self, seq_len: int | None = None) -> dict[str, Any]:
        """`planning.schedule.plan_inputs` for `seq_len` (default: the longest): budgets as asked."""
        b = self.budgets
        return plan_inputs(dict(self.model_config), self.batch_size, seq_len or self.seq_len, b.gpu_asked,
                           b.host_asked, b.nvme_asked, self.hardware.to_dict(), policy=self.policy,
                           rows_per_pass=self.rows_per_pass, gpu_optimizer=self.gpu_optimizer,
                           loss_chunk_tokens=self.loss_chunk_tokens, state_dtype=self.state_dtype,
                           master_weights=self.master_weights, block_size=self.block_size,
                           gpu_memory_margin=b.margin, fixed=dict(self.fixed), kept_grads=self.kept_grads,
                           resident=self.resident, frozen=None if self.frozen is None else dict(self.frozen),
                           resident_states=self.resident_states, host_weight_ranks=self.host_weight_ranks)

    def fingerprint(self, seq_len: int | None = None) -> str:
        """The fingerprint of `inputs(seq_len)`."""
        return plan_fingerprint(self.inputs(seq_len))

    def cost_model_kwargs(self, rows: int | None, resident: str) -> dict[str, Any]:
        """Keyword arguments of `profiling.analytic_cost_model` for `rows` per pass and the `resident` placement."""
        b = self.budgets
        return dict(gpu_bytes=b.gpu_bytes, host_bytes=b.host_bytes, nvme_bytes=b.nvme_bytes,
                    loss_chunk_tokens=self.loss_chunk_tokens, state_dtype=self.state_dtype,
                    master_weights=self.master_weights, block_size=self.block_size, rows_per_pass=rows,
                    kept_grads=self.kept_grads, resident=resident, resident_states=self.resident_states,
                    name=self.name, host_weight_ranks=self.host_weight_ranks)

    def with_gpu_reduction(self, nbytes: int) -> PlanRequest:
        """This request with `nbytes` taken off the GPU budget (in total, not in addition to an earlier one)."""
        if nbytes == self.budgets.reduction_bytes:
            return self
        return dataclasses.replace(self, budgets=dataclasses.replace(self.budgets, reduction_bytes=int(nbytes)))


def resolve_request(model_config: Mapping[str, Any], model: Any, *, batch_size: int, seq_len: int, hardware: Any,
                    gpu_memory_budget: int | None, host_memory_budget: int | None, nvme_budget: int | None,
                    nvme: bool, gpu_memory_margin: float, gpu_available: int, host_total: int, nvme_available: int,
                    ranks_per_host: int = 1, policy: str = "milp", fixed: Mapping[str, Any] | None = None,
                    rows_per_pass: int | None = None, resident: str = "auto", gpu_optimizer: bool = True,
                    keep_gpu_grads: bool = True, gradient_accumulation_steps: int = 1, loss_chunk_tokens: int = 2048,
                    state_dtype: str = "8bit", master_weights: str = "fp32", block_size: int = 256,
                    time_limit_s: float = 10.0, mip_rel_gap: float = 0.01, max_buckets: int = 1,
                    name: str = "", frozen: Mapping[str, Any] | None = None,
                    resident_states: str = "fp32", host_weight_ranks: int = 1) -> PlanRequest:
    """The `PlanRequest` for a run, with every default resolved: budgets (`resolve_budgets`), master weights "auto"
    planned as kahan (the analytic model's bf16 weights), kept gradients only with one micro-batch per optimizer step (accumulated gradients are summed on
    the host), the fixed knobs' defaults, and `max_buckets` sequence-length buckets (powers of two up to `seq_len`,
    `seq_len_buckets`; 1: `seq_len` alone). `host_weight_ranks`: the ranks on this host sharing one host copy of the
    streamed weights (1: none share); the host budget per rank is the host's share as before, the shared weights
    count their share in each rank's host bytes."""
    budgets = resolve_budgets(gpu_memory_budget, host_memory_budget, nvme_budget, nvme=nvme, margin=gpu_memory_margin,
                              gpu_available=gpu_available, host_total=host_total, nvme_available=nvme_available,
                              ranks_per_host=ranks_per_host)
    knobs = {k: v if v is not None else FIXED_DEFAULTS[k] for k, v in {**FIXED_DEFAULTS, **(fixed or {})}.items()}
    buckets = seq_len_buckets(seq_len, min_seq_len=min(128, max(8, seq_len // 8)), max_buckets=max_buckets)
    return PlanRequest(model_config=model_config, model=model, batch_size=batch_size, seq_len=seq_len,
                       buckets=tuple(buckets), hardware=hardware, budgets=budgets, policy=policy, fixed=knobs,
                       rows_per_pass=rows_per_pass, resident=resident, gpu_optimizer=bool(gpu_optimizer),
                       kept_grads=bool(keep_gpu_grads) and gradient_accumulation_steps == 1,
                       loss_chunk_tokens=loss_chunk_tokens, state_dtype=state_dtype,
                       master_weights="kahan" if master_weights == "auto" else master_weights, block_size=block_size,
                       time_limit_s=time_limit_s, mip_rel_gap=mip_rel_gap, name=name, frozen=frozen,
                       resident_states=resident_states, host_weight_ranks=max(1, int(host_weight_ranks)))


def same_tokens_batch(batch_size: int, accumulation: int, fits: int) -> tuple[int, int]:
    """(micro-batch, accumulation steps) with the same rows per optimizer step as `batch_size` x `accumulation` and
    the micro-batch at most `fits`: the largest divisor of the rows per step that fits (`fits` >= 1)."""
    rows = batch_size * accumulation
    b = max(d for d in range(1, min(fits, rows) + 1) if rows % d == 0)
    return b, rows // b
