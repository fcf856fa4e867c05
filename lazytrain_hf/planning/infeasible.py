"""No schedule fits: `InfeasiblePlanError`, the smallest feasible GPU and host budgets (memory-only MILP) and the
user-facing text that names them.
"""

from __future__ import annotations

import math
from typing import Any

from .cost_model import CostModel
from .milp_model import GIB, _PlanModel
from .schedule import Schedule

#: Slack added to the smallest feasible budgets named by InfeasiblePlanError before rounding up to 0.01 GiB.
_BUDGET_ROUND = GIB / 100


class InfeasiblePlanError(ValueError):
    """No schedule fits the budgets. `str(e)` names the fix for both interfaces (the `plan` flags and the
    lazytrain_config keys); a caller that knows its interface words its own fix from the numbers (`facts` and the
    attributes: lazytrain_hf/cli_plan.py, lazytrain_hf/hf/plan.py).

    Attributes:
        min_gpu_bytes: smallest GPU budget (bytes) with which a schedule exists under the given host and NVMe
            budgets (None when the host budget alone is too small).
        min_host_bytes: smallest host budget (bytes): the host memory taken regardless of the plan.
        min_gpu_bytes_any_host: smallest GPU budget with unlimited host memory (bytes).
        min_gpu_bytes_at_min_host: when the host budget is too small, the smallest GPU budget with the smallest
            host budget (bytes; None otherwise or when unknown).
        facts: the message without the fix: what does not fit and the smallest budgets.
        gpu_budget_bytes, host_budget_bytes, nvme_budget_bytes: the budgets planned with (the GPU one after the
            margin; None when unknown).
        batch_size, seq_len, rows_per_pass: the micro-batch planned (None when unknown).
        gpu_memory_margin: the margin the GPU figures are restated for (`with_margin`; 0: the planner's figures).
    """

    _FIELDS = ("min_gpu_bytes", "min_host_bytes", "min_gpu_bytes_any_host", "min_gpu_bytes_at_min_host",
               "gpu_budget_bytes", "host_budget_bytes", "nvme_budget_bytes", "batch_size", "seq_len",
               "rows_per_pass", "gpu_memory_margin")

    def __init__(self, message: str, *, min_gpu_bytes: int | None, min_host_bytes: int | None,
                 min_gpu_bytes_any_host: int | None, min_gpu_bytes_at_min_host: int | None = None,
                 facts: str | None = None, gpu_budget_bytes: int | None = None, host_budget_bytes: int | None = None,
                 nvme_budget_bytes: int | None = None, batch_size: int | None = None, seq_len: int | None = None,
                 rows_per_pass: int | None = None, gpu_memory_margin: float = 0.0) -> None:
        super().__init__(message)
        self.min_gpu_bytes = min_gpu_bytes
        self.min_host_bytes = min_host_bytes
        self.min_gpu_bytes_any_host = min_gpu_bytes_any_host
        self.min_gpu_bytes_at_min_host = min_gpu_bytes_at_min_host
        self.facts = message if facts is None else facts
        self.gpu_budget_bytes = gpu_budget_bytes
        self.host_budget_bytes = host_budget_bytes
        self.nvme_budget_bytes = nvme_budget_bytes
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.rows_per_pass = rows_per_pass
        self.gpu_memory_margin = gpu_memory_margin

    @property
    def needed_gpu_bytes(self) -> int | None:
        """The smallest GPU budget to ask for (at the given host budget, else at the smallest host budget)."""
        return self.min_gpu_bytes if self.min_gpu_bytes is not None else self.min_gpu_bytes_at_min_host

    @property
    def host_too_small(self) -> bool:
        """The host budget is below what the host takes regardless of the plan."""
        return (self.min_gpu_bytes is None and self.min_host_bytes is not None and self.host_budget_bytes is not None
                and self.host_budget_bytes < self.min_host_bytes)

    @property
    def host_alone_short(self) -> bool:
        """`host_too_small`, and at the smallest host budget the given GPU budget fits: more host memory alone would
        do."""
        need, have = self.min_gpu_bytes_at_min_host, self.gpu_budget_bytes
        return self.host_too_small and need is not None and have is not None and need <= have

    def restated(self, message: str, **changes: Any) -> InfeasiblePlanError:
        """The same budgets with another message (a prefix or suffix added to `str(self)` by a caller: `facts` gets
        the same addition) and `changes` to the attributes."""
        facts = changes.pop("facts", None)
        if facts is None:
            facts = message.replace(str(self), self.facts) if str(self) in message else message
        fields = {k: getattr(self, k) for k in self._FIELDS}
        return InfeasiblePlanError(message, facts=facts, **{**fields, **changes})

    def with_shape(self, *, batch_size: int | None = None, seq_len: int | None = None,
                   rows_per_pass: int | None = None) -> InfeasiblePlanError:
        """This error with the micro-batch filled in where it is not known yet (in place; returns self)."""
        for k, v in (("batch_size", batch_size), ("seq_len", seq_len), ("rows_per_pass", rows_per_pass)):
            if getattr(self, k) is None:
                setattr(self, k, v)
        return self


def _fits(cm: CostModel, peak: float, host: float, nvme: float) -> bool:
    tol = 1.0  # bytes
    return peak <= cm.gpu_bytes + tol and host <= cm.pinned_host_bytes + tol and nvme <= cm.nvme_bytes + tol


def min_gpu_bytes(cm: CostModel, prefetch_depth: int = 1, time_limit_s: float = 10.0) -> int | None:
    """Smallest GPU budget (bytes) for which a schedule exists under `cm`'s host and NVMe budgets, at
    `prefetch_depth`; None when the host budget is below `host_fixed_bytes` (nothing fits).

    Solves the memory-only MILP (minimize the peak bound, no time rows); the result is rounded up to a MiB.
    """
    return _min_memory_plan(cm, prefetch_depth, time_limit_s)[0]


def _min_memory_plan(cm: CostModel, prefetch_depth: int = 1, time_limit_s: float = 10.0
                     ) -> tuple[int | None, Schedule | None, bool]:
    """(`min_gpu_bytes`, the memory-only MILP's smallest-peak schedule, whether that solve was proven optimal)."""
    if cm.pinned_host_bytes < cm.host_fixed_bytes:
        return None, None, True
    model = _PlanModel(cm, prefetch_depth, memory_only=True, symmetry_breaking=False)
    res = model.solve(time_limit_s, 1e-6)
    if not res.has_solution:
        return None, None, res.status == "infeasible"
    mib = 1024**2
    return int(math.ceil((model.peak_value_bytes() + 1) / mib) * mib), res.schedule, res.status == "optimal"


def _round_budget_up(nbytes: float) -> int:
    """Round up to the next 0.01 GiB so that the figure printed with two decimals is itself feasible."""
    return int(math.ceil((nbytes + 1) / _BUDGET_ROUND) * _BUDGET_ROUND)


def with_margin(e: InfeasiblePlanError, margin: float) -> InfeasiblePlanError:
    """`e` restated for a caller that planned with `(1 - margin)` of the GPU budget it was given: the smallest
    budget to pass (--gpu-memory / gpu_memory_budget) is the planner's figure / (1 - margin)."""
    at_host = e.min_gpu_bytes is not None
    gpu = e.min_gpu_bytes if at_host else e.min_gpu_bytes_at_min_host
    if not margin or gpu is None:
        return e
    need = _round_budget_up(gpu / (1 - margin))
    when = "" if at_host else " with that host budget,"
    note = f" These planner budgets are after the {margin:.0%} GPU memory margin (gpu_memory_margin):{when}"
    msg = f"{e}{note} pass --gpu-memory / lazytrain_config.gpu_memory_budget of at least {need / GIB:.2f} GiB."
    facts = f"{e.facts}{note} the smallest GPU budget to give is {need / GIB:.2f} GiB."
    return e.restated(msg, facts=facts, min_gpu_bytes=need if at_host else None,
                      min_gpu_bytes_at_min_host=None if at_host else need, gpu_memory_margin=margin)


def _context(cm: CostModel) -> dict[str, object]:
    """The budgets and micro-batch of `cm`, for the error's attributes."""
    m = cm.meta
    return dict(gpu_budget_bytes=int(cm.gpu_bytes), host_budget_bytes=int(cm.pinned_host_bytes),
                nvme_budget_bytes=int(cm.nvme_bytes), batch_size=m.get("batch_size"), seq_len=m.get("seq_len"),
                rows_per_pass=m.get("rows_per_pass"))


_SOLVE = object()  # infeasible_error: solve for the smallest GPU budget itself


def infeasible_error(cm: CostModel, min_gpu: int | None | object = _SOLVE) -> InfeasiblePlanError:
    """The error for `cm`'s budgets, naming the smallest feasible GPU budget (at its host budget, and with
    unlimited host memory) and the smallest host budget. `min_gpu`: `min_gpu_bytes(cm)` when the caller has it
    already (the memory-only MILP is not solved again)."""
    gib = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    host_min = _round_budget_up(cm.host_fixed_bytes)
    big_host = cm.with_budgets(pinned_host_bytes=max(cm.pinned_host_bytes, cm.host_fixed_bytes)
                               + sum(cm.act_bytes) + 4 * max(cm.act_bytes))
    any_host = min_gpu_bytes(big_host)
    any_host_r = _round_budget_up(any_host) if any_host is not None else None
    if cm.pinned_host_bytes < cm.host_fixed_bytes:
        at_min = min_gpu_bytes(cm.with_budgets(pinned_host_bytes=host_min))
        at_min_r = _round_budget_up(at_min) if at_min else None
        gpu_note = f"; with that host budget the smallest GPU budget is {gib(at_min_r)}" if at_min_r else ""
        facts = (f"No schedule fits: the host budget {gib(cm.pinned_host_bytes)} is below the "
                 f"{gib(cm.host_fixed_bytes)} that weights, gradients and optimizer states take on the host.")
        msg = (f"{facts} Set the host budget (--host-memory / lazytrain_config.host_memory_budget) to at least "
               f"{gib(host_min)}{gpu_note}.")
        facts += f" The smallest host budget is {gib(host_min)}{gpu_note}."
        return InfeasiblePlanError(msg, min_gpu_bytes=None, min_host_bytes=host_min, min_gpu_bytes_any_host=any_host_r,
                                   min_gpu_bytes_at_min_host=at_min_r, facts=facts, **_context(cm))
    at_host = min_gpu_bytes(cm) if min_gpu is _SOLVE else min_gpu
    at_host_r = _round_budget_up(at_host) if at_host is not None else None
    more_host = ""
    if any_host_r is not None and at_host_r is not None and any_host_r < at_host_r:
        more_host = f" (with more host memory for CPU-tier boundaries: {gib(any_host_r)})"
    smallest = (f"The smallest feasible GPU budget is {gib(at_host_r)}{more_host}" if at_host_r is not None else
                "The smallest feasible GPU budget was not found within the solver's limit")
    facts = (f"No schedule fits the GPU budget {gib(cm.gpu_bytes)} (host budget {gib(cm.pinned_host_bytes)}, "
             f"NVMe budget {gib(cm.nvme_bytes)}). {smallest}"
             f", at prefetch depth 1 with boundaries offloaded or recomputed; the smallest host budget is "
             f"{gib(host_min)}.")
    msg = (f"{facts} Raise --gpu-memory / lazytrain_config.gpu_memory_budget, lower the batch size "
           f"or sequence length, or run each layer over fewer rows at a time (--rows-per-pass / "
           f"lazytrain_config.max_rows_per_pass: activation memory scales with it, not with the batch).")
    return InfeasiblePlanError(msg, min_gpu_bytes=at_host_r, min_host_bytes=host_min,
                               min_gpu_bytes_any_host=any_host_r, facts=facts, **_context(cm))
