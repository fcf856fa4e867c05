"""The O(L) mixed-integer program that chooses the per-layer schedule (LazyTrain, arXiv 2608.11919 §3, extended).

Decisions per decoder layer i: materialize boundary i (c_i) and its tier (g_i / k_i / n_i: GPU, pinned CPU, NVMe),
retain the layer's autograd activations from forward (r_i), run its optimizer update on the GPU (o_i); the
recompute indicator x_i follows from them by linking constraints. The weight prefetch depth d is an outer loop
(one MILP per d in 1..3). The objective is the predicted step time (ms) of the linear step model in
`estimate.py` (compute + recompute + exposed transfers + exposed optimizer, as event times of max-plus lane
recursions), plus tiny tie-breakers. Memory rows are in GiB (`GIB`), time rows in ms.

Solved with HiGHS through `highspy` (rows collected as sparse arrays, one `passModel`): output silenced, explicit
`mip_rel_gap` and `time_limit`, warm-started from the best feasible `fixed` variant (MegaTrain's heuristic). The result is a `Schedule` with
`solver` = {status, mip_gap, solve_ms, objective_ms, ...} and `predicted` = {step_ms, peak_gpu_bytes, ...}.
Infeasible budgets raise `InfeasiblePlanError`, which names the smallest feasible GPU and host budgets.

Size: about 26 columns (8 binary) and 50 rows per layer (64 layers: ~1,700 x ~3,300). Handed to HiGHS whole it
takes 8-14 s on 2 CPU cores for 64 layers with optimizer placement open: the LP relaxation is weakest on the
optimizer placement (fractional o_i split a layer's update between CPU and GPU) and the global flags. The default
path (`_PlanMilp.solve_search`) branches on those itself (per-class counts of on-GPU updates, flags) with LP bounds
and leaves the rest to HiGHS (benchmarks/results/planner-20261129.json); its leaves are
settled by an LP rounding improved by local search under the linear model (`fast_eval.improve_plan`), HiGHS only
where that plan is not within the gap (planner-20261129.json: every bench case under 1 s at 64 layers).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any

from .cost_model import CostModel
from .estimate import (
    Key,
    Lin,
    decision_values,
    evaluate,
    layer_units,
    memory_terms,
    recompute_flags,
    unit_terms,
    workspace_slack_ms,
)
from .fast_eval import (
    TIE_MS_PER_DECISION,
    TIE_MS_PER_GIB_PEAK,
    PlanArrays,
    StepEvaluator,
    improve_plan,
    perturb_plan,
)
from .fixed import checkpoint_interval, checkpoint_tier, fixed_schedule
from .schedule import LayerPlan, Schedule
from .schedule import fingerprint as _fingerprint

__all__ = ["solve_milp", "min_gpu_bytes", "InfeasiblePlanError", "fixed_candidates", "milp_value", "infeasible_error",
           "GIB"]

logger = logging.getLogger(__name__)

#: Bytes per GiB: memory enters the model in GiB (coefficients of order 1) and leaves it in bytes.
GIB = float(1024**3)
# Tie-breakers (TIE_MS_PER_GIB_PEAK, TIE_MS_PER_DECISION, from fast_eval.py; ms-equivalents, far below the 1% gap):
# prefer less GPU memory, then fewer offloads / retains / on-GPU updates / checkpoints, among plans of equal step time.
#: Slack added to the smallest feasible budgets named by InfeasiblePlanError before rounding up to 0.01 GiB.
_BUDGET_ROUND = GIB / 100
#: Where a time limit is set, for messages that reach CLI and Trainer users alike.
TIME_LIMIT_HINT = "--time-limit / lazytrain_config.solver_time_limit_s"


class InfeasiblePlanError(ValueError):
    """No schedule fits the budgets.

    Attributes:
        min_gpu_bytes: smallest GPU budget (bytes) with which a schedule exists under the given host and NVMe
            budgets (None when the host budget alone is too small).
        min_host_bytes: smallest host budget (bytes): the host memory taken regardless of the plan.
        min_gpu_bytes_any_host: smallest GPU budget with unlimited host memory (bytes).
        min_gpu_bytes_at_min_host: when the host budget is too small, the smallest GPU budget with the smallest
            host budget (bytes; None otherwise or when unknown).
    """

    def __init__(self, message: str, *, min_gpu_bytes: int | None, min_host_bytes: int,
                 min_gpu_bytes_any_host: int | None, min_gpu_bytes_at_min_host: int | None = None) -> None:
        super().__init__(message)
        self.min_gpu_bytes = min_gpu_bytes
        self.min_host_bytes = min_host_bytes
        self.min_gpu_bytes_any_host = min_gpu_bytes_any_host
        self.min_gpu_bytes_at_min_host = min_gpu_bytes_at_min_host

    def restated(self, message: str) -> InfeasiblePlanError:
        """The same budgets with another message (a prefix or suffix added by a caller)."""
        return InfeasiblePlanError(message, min_gpu_bytes=self.min_gpu_bytes, min_host_bytes=self.min_host_bytes,
                                   min_gpu_bytes_any_host=self.min_gpu_bytes_any_host,
                                   min_gpu_bytes_at_min_host=self.min_gpu_bytes_at_min_host)


# ---------------------------------------------------------------------------------------------------------------
# HiGHS helpers


_BANNER_SILENCED = False


def _new_highs() -> Any:
    """A silent `highspy.Highs`. HiGHS prints a banner on fd 1 when the first instance of a process is created;
    redirect fd 1 to /dev/null for that one construction."""
    global _BANNER_SILENCED
    import highspy

    if _BANNER_SILENCED:
        h = highspy.Highs()
    else:
        _BANNER_SILENCED = True
        try:
            sys.stdout.flush()
            saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
        except (OSError, ValueError):
            h = highspy.Highs()
        else:
            try:
                os.dup2(devnull, 1)
                h = highspy.Highs()
            finally:
                os.dup2(saved, 1)
                os.close(saved)
                os.close(devnull)
    h.silent()
    return h


def _layer_classes(cm: CostModel) -> list[list[int]]:
    """Layers grouped by identical kind and costs (members ascending), in order of their first layer."""
    classes: dict[tuple[Any, ...], list[int]] = {}
    for i in range(cm.num_layers):
        sig = (cm.layer_kind[i], cm.fwd_ms[i], cm.bwd_ms[i], cm.param_bytes[i], cm.grad_bytes[i],
               cm.act_bytes[i], cm.saved_bytes[i], cm.num_params[i], cm.gpu_optim_h2d_bytes[i],
               cm.gpu_optim_d2h_bytes[i], cm.fwd_work_bytes[i], cm.bwd_work_bytes[i], cm.kept(i))
        classes.setdefault(sig, []).append(i)
    return list(classes.values())


@dataclass
class _Result:
    """One HiGHS solve."""

    depth: int
    status: str  # "optimal", "time_limit", "infeasible", or HiGHS's model status text
    has_solution: bool
    objective: float  # ms incl. tie-breakers (nan without a solution)
    mip_gap: float
    solve_ms: float
    schedule: Schedule | None
    bound: float = -math.inf  # HiGHS's dual bound (ms incl. tie-breakers)


class _X:
    """A linear expression over MILP columns (column index -> coefficient, plus a constant), for building rows."""

    __slots__ = ("t", "c")

    def __init__(self, t: dict[int, float] | None = None, c: float = 0.0) -> None:
        self.t = t if t is not None else {}
        self.c = c

    @staticmethod
    def of(x: _X | float) -> _X:
        return x if isinstance(x, _X) else _X(None, float(x))

    def __add__(self, other: _X | float) -> _X:
        if not isinstance(other, _X):
            return _X(self.t, self.c + other)  # terms shared: expressions are never mutated
        t = dict(self.t)
        for j, a in other.t.items():
            t[j] = t.get(j, 0.0) + a
        return _X(t, self.c + other.c)

    __radd__ = __add__

    def __mul__(self, s: float) -> _X:
        return _X({j: a * s for j, a in self.t.items()}, self.c * s)

    __rmul__ = __mul__

    def __neg__(self) -> _X:
        return self * -1.0

    def __sub__(self, other: _X | float) -> _X:
        return self + (-_X.of(other))

    def __rsub__(self, other: _X | float) -> _X:
        return _X.of(other) + (-self)


class _PlanMilp:
    """The MILP for one prefetch depth d (or, with `memory_only`, the smallest-peak-memory problem).

    Columns are created in a fixed order and remembered with a key (`v[key]` is the column index), so a warm start
    can give every column a value. Rows are collected as sparse arrays and handed to HiGHS in one `passModel`
    (highspy's expression objects took 0.4-0.6 s for 64 layers).
    """

    def __init__(self, cm: CostModel, depth: int, *, memory_only: bool = False,
                 symmetry_breaking: bool = True, gpu_optimizer: bool = True, units: list[Any] | None = None) -> None:
        self.cm, self.d, self.memory_only = cm, depth, memory_only
        self._units = units  # unit_terms(cm), when the caller has them
        self.gpu_optimizer = gpu_optimizer and not memory_only
        self.h = _new_highs()
        self._start: tuple[list[float], Schedule] | None = None  # the warm start (column values, schedule)
        self._incumbent: Schedule | None = None  # a start for `solve_search` only (`set_incumbent`)
        self.cols: list[Key] = []  # keys in column order
        self.v: dict[Key, int] = {}  # key -> column index
        self._x: dict[Key, _X] = {}  # key -> the column as an expression
        self._col_lb: list[float] = []
        self._col_ub: list[float] = []
        self._col_int: list[bool] = []
        self._row_lb: list[float] = []
        self._row_ub: list[float] = []
        self._row_of: list[int] = []  # nonzeros: row, column, value
        self._col_of: list[int] = []
        self._val_of: list[float] = []
        self._build(symmetry_breaking)

    # -- columns and rows ---------------------------------------------------------------------------------------
    def _var(self, key: Key, lb: float = 0.0, ub: float = math.inf, integer: bool = False) -> _X:
        j = len(self.cols)
        self.v[key] = j
        self.cols.append(key)
        self._col_lb.append(lb)
        self._col_ub.append(ub)
        self._col_int.append(integer)
        x = self._x[key] = _X({j: 1.0})
        return x

    def _expr(self, lin: Lin, scale: float = 1.0) -> _X:
        """Lin (over decision keys) -> expression over columns, times `scale`."""
        return _X({self.v[k]: c * scale for k, c in lin.terms.items()}, lin.const * scale)

    def _row(self, e: _X, lb: float, ub: float) -> None:
        """lb <= e <= ub (e's constant moves into the bounds)."""
        r = len(self._row_lb)
        self._row_lb.append(lb - e.c)
        self._row_ub.append(ub - e.c)
        for j, a in e.t.items():
            if a:
                self._row_of.append(r)
                self._col_of.append(j)
                self._val_of.append(a)

    def _diff_row(self, a: _X | float, b: _X | float, lb: float, ub: float) -> None:
        """lb <= a - b <= ub."""
        if not isinstance(a, _X):
            a = _X(None, float(a))
        if isinstance(b, _X):
            t = dict(a.t)
            for j, x in b.t.items():
                t[j] = t.get(j, 0.0) - x
            self._row(_X(t, a.c - b.c), lb, ub)
        else:
            self._row(_X(a.t, a.c - b), lb, ub)

    def _ge(self, a: _X | float, b: _X | float) -> None:
        self._diff_row(a, b, 0.0, math.inf)

    def _le(self, a: _X | float, b: _X | float) -> None:
        self._diff_row(a, b, -math.inf, 0.0)

    def _eq(self, a: _X | float, b: _X | float) -> None:
        self._diff_row(a, b, 0.0, 0.0)

    def _pass_model(self, objective: _X) -> None:
        """Hand the collected columns, rows and objective to HiGHS (column-wise matrix, minimize)."""
        import highspy
        import numpy as np

        n, m = len(self.cols), len(self._row_lb)
        rows = np.asarray(self._row_of, dtype=np.int32)
        cols = np.asarray(self._col_of, dtype=np.int32)
        vals = np.asarray(self._val_of, dtype=float)
        order = np.lexsort((rows, cols))
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = n, m
        cost = np.zeros(n)
        for j, a in objective.t.items():
            cost[j] += a
        lp.col_cost_ = cost
        lp.offset_ = objective.c
        lp.col_lower_ = np.asarray(self._col_lb, dtype=float)
        lp.col_upper_ = np.asarray(self._col_ub, dtype=float)
        lp.row_lower_ = np.asarray(self._row_lb, dtype=float)
        lp.row_upper_ = np.asarray(self._row_ub, dtype=float)
        a = lp.a_matrix_
        a.format_ = highspy.MatrixFormat.kColwise
        a.num_col_, a.num_row_ = n, m
        a.start_ = np.concatenate([[0], np.cumsum(np.bincount(cols, minlength=n))]).astype(np.int32)
        a.index_ = rows[order]
        a.value_ = vals[order]
        lp.a_matrix_ = a
        kint, kcont = highspy.HighsVarType.kInteger, highspy.HighsVarType.kContinuous
        lp.integrality_ = [kint if b else kcont for b in self._col_int]
        lp.sense_ = highspy.ObjSense.kMinimize
        status = self.h.passModel(lp)
        if status == highspy.HighsStatus.kError:
            raise RuntimeError("HiGHS refused the planning model (passModel returned an error)")
        self._row_of, self._col_of, self._val_of = [], [], []  # not needed any more

    def _build(self, symmetry_breaking: bool) -> None:
        cm = self.cm
        L = cm.num_layers
        nvme_ok = cm.nvme_bytes > 0
        for i in range(L):
            self._var(("c", i), 1.0 if i == 0 else 0.0, 1.0, True)  # c_i: boundary i materialized (c_0 = 1)
            self._var(("g", i), 1.0 if i == 0 else 0.0, 1.0, True)  # g_i: ... on the GPU (boundary 0 always)
            self._var(("k", i), 0.0, 0.0 if i == 0 else 1.0, True)  # k_i: ... in pinned CPU memory
            self._var(("n", i), 0.0, 1.0 if nvme_ok and i > 0 else 0.0, True)  # n_i: ... on NVMe
            self._var(("r", i), 0.0, 1.0, True)  # r_i: layer i keeps its autograd activations from forward
            self._var(("o", i), 0.0, 1.0 if self.gpu_optimizer else 0.0, True)  # o_i: optimizer update on the GPU
            self._var(("x", i), 0.0, 1.0 if i + 1 < L else 0.0)  # x_i: layer i re-run in backward (integral by links)
        self._var(("yoff", 0), 0.0, 1.0, True)  # yoff: some boundary is offloaded (CPU or NVMe)
        self._var(("ynv", 0), 0.0, 1.0, True)  # ynv: some boundary is on NVMe (host staging buffers)
        self._var(("ygo", 0), 0.0, 1.0, True)  # ygo: some layer updates on the GPU (one state workspace)
        v = self._x

        # [Constraint] tier one-hot: a materialized boundary lives in exactly one tier; an absent one in none
        for i in range(L):
            self._eq(v["g", i] + v["k", i] + v["n", i], v["c", i])
            self._ge(v["yoff", 0], v["k", i] + v["n", i])
            self._ge(v["ynv", 0], v["n", i])
            self._ge(v["ygo", 0], v["o", i])

        # [Constraint] recompute linking: x_i = 1 iff boundary i+1 is not materialized and neither layer i (it
        # keeps its output) nor layer i+1 (it needs no input) is retained
        for i in range(L - 1):
            self._ge(v["x", i], 1 - v["c", i + 1] - v["r", i + 1] - v["r", i])
            self._le(v["x", i], 1 - v["c", i + 1])
            self._le(v["x", i], 1 - v["r", i + 1])
            self._le(v["x", i], 1 - v["r", i])

        # [Constraint] segment-start tier, carried along the segment; its fetch is charged where the segment ends
        # (lower bounds suffice: these only add cost)
        for i in range(L):
            self._var(("t", i), 0.0, 1.0)  # t_i: the start boundary of layer i's segment is offloaded
            self._var(("tn", i), 0.0, 1.0)  # tn_i: ... on NVMe
            self._var(("z", i), 0.0, 1.0)  # z_i: layer i ends a segment with an offloaded start (fetch before B(i))
            self._var(("zn", i), 0.0, 1.0)  # zn_i: ... with an NVMe start (disk read before B(i))
        for i in range(L):
            self._ge(v["t", i], v["k", i] + v["n", i])
            self._ge(v["tn", i], v["n", i])
            if i:
                self._ge(v["t", i], v["t", i - 1] - v["c", i])
                self._ge(v["tn", i], v["tn", i - 1] - v["c", i])
            ends = v["c", i + 1] if i + 1 < L else 1.0
            self._ge(v["z", i], v["t", i] + ends - 1)
            self._ge(v["zn", i], v["tn", i] + ends - 1)

        self.classes = _layer_classes(cm)
        self.ordered = symmetry_breaking
        if symmetry_breaking:
            self._symmetry_breaking()
        self._memory()
        if not self.memory_only:
            self._time()
        self._pass_model(self.objective())

    def _symmetry_breaking(self) -> None:
        """Order decisions among identical layers (same kind and costs), by exchange arguments.

        - On-GPU updates come first (o_i >= o_j for identical i < j): per-layer durations do not depend on the
          order (the update workspaces are double-buffered), the CPU updates its layers in order, and a CPU-updated
          layer stalls the forward only when its update is not done yet, so putting the CPU-updated layers last
          gives the CPU the most time; swapping a GPU-updated layer in front never delays a forward.
        - Retained layers come last (r_i <= r_j for identical 0 < i < j): a later retain lowers every prefix sum
          Q of stored bytes and frees S - A in its segment's working set; compute and traffic totals are the same
          (the saving moves between backward windows, a second-order change inside the MIP gap).
        Without these, HiGHS spends its time on permutations of near-equal cost (a 28-layer 7B plan with a slow
        CPU optimizer did not reach a 1% gap in 120 s; with them, 0.5 s). The orderings are exchange arguments on
        the model, not proofs: on a synthetic 64-layer plan the ordered optimum was 0.5% above the unordered one
        (inside the 1% gap), so `symmetry_breaking=False` is there to check. Tiers are deliberately not ordered:
        "offloaded boundaries first" is memory-dominant but moved stash and fetch traffic enough to cost 0.8% on
        that plan and tripled its solve time.
        """
        v = self._x
        for members in self.classes:
            for a, b in zip(members, members[1:]):
                self._ge(v["o", a], v["o", b])
                if a > 0:
                    self._le(v["r", a], v["r", b])

    # -- memory (GiB) -------------------------------------------------------------------------------------------
    def _memory(self) -> None:
        cm, v = self.cm, self._x
        L = cm.num_layers
        mem = memory_terms(cm, self.d)
        s = 1.0 / GIB
        Q = [self._var(("Q", i)) for i in range(L)]  # Q_i (GiB): GPU-tier boundaries + retained layers, l <= i
        m = [self._var(("m", i)) for i in range(L)]  # m_i (GiB): boundary bytes held by i's segment up to layer i
        peak = self._var(("peak", 0))  # peak (GiB): static bound on GPU memory over the step
        big_m_ws = sum(cm.act_bytes) * s  # big-M (GiB) for resetting m at a materialized boundary

        # [Constraint] cumulative stored bytes
        for i in range(L):
            prev = Q[i - 1] if i else 0.0
            self._eq(Q[i], prev + self._expr(mem.stored[i], s))

        # [Constraint] segment working set: reset to the fetched start boundary at c_i = 1, else grow by the
        # recomputed input of layer i
        for i in range(L):
            self._ge(m[i], self._expr(mem.fetched[i], s))
            if i:
                self._ge(m[i], m[i - 1] + self._expr(mem.recomputed_input[i], s) - big_m_ws * v["c", i])

        # [Constraint] GPU peak: forward of each layer, the head, backward of each layer
        base = mem.base * s
        for i in range(L):
            self._ge(peak, base + Q[i] + self._expr(mem.fwd[i], s))
            self._ge(peak, base + Q[i] + m[i] + self._expr(mem.bwd[i], s))
        self._ge(peak, base + Q[L - 1] + self._expr(mem.head, s))
        if not self.memory_only:
            # [Constraint] GPU budget
            self._le(peak, cm.gpu_bytes * s)

        # [Constraint] host budget: fixed host bytes + CPU-tier boundaries + NVMe staging buffers
        self._le(self._expr(mem.host, s), cm.pinned_host_bytes * s)
        # [Constraint] NVMe budget
        self._le(self._expr(mem.nvme, s), cm.nvme_bytes * s)
        self.peak = peak

    # -- time (ms) ----------------------------------------------------------------------------------------------
    def _time(self) -> None:
        cm, v, d = self.cm, self._x, self.d
        L = cm.num_layers
        units = self._units if self._units is not None else unit_terms(cm)
        U = len(units)
        lus = layer_units(L)
        slot_pred = {u: lus[k - d - 1] for k, u in enumerate(lus) if k - d - 1 >= 0}
        E = [self._var(("E", u)) for u in range(U)]  # E_u (ms): compute of unit u ends
        HE = [self._var(("HE", u)) for u in range(U)]  # HE_u (ms): H2D of unit u's inputs ends
        DE = [self._var(("DE", u)) for u in range(U)]  # DE_u (ms): D2H of unit u's outputs ends
        DK = [self._var(("DK", u)) for u in range(U)]  # DK_u (ms): disk lane through unit u ends
        hd = [self._var(("hd", u)) for u in range(U)]  # hd_u (ms): H2D duration of unit u (max of its bounds)
        dd = [self._var(("dd", u)) for u in range(U)]  # dd_u (ms): D2H duration of unit u (max of its bounds)
        O = [self._var(("O", i)) for i in range(L)]  # noqa: E741 - O_i (ms): CPU optimizer has updated layer i
        end = self._var(("END", 0))  # END (ms): predicted step time
        big_m_ms = self._big_m_ms(units)  # big-M (ms) for the conditional orderings below

        for u, t in enumerate(units):
            # [Constraint] H2D / D2H durations: one-way rate and the duplex limit shared with the neighbour unit
            for lb in t.h2d:
                self._ge(hd[u], self._expr(lb))
            for lb in t.d2h:
                self._ge(dd[u], self._expr(lb))
            c = self._expr(t.compute)
            is_fwd, is_head = u < L, u == L
            # [Constraint] compute lane in order; a unit computes after its inputs arrived
            self._ge(E[u], (E[u - 1] if u else 0.0) + c)
            if not is_head:
                self._ge(E[u], HE[u] + c)
            # [Constraint] two D2H buffers: compute of u starts after the D2H of unit u-2 is done
            if u >= 2:
                self._ge(E[u], DE[u - 2] + c)
            # [Constraint] H2D lane in order; weight slots: loads of u start after the layer-unit d+1 earlier
            self._ge(HE[u], (HE[u - 1] if u else 0.0) + hd[u])
            if u in slot_pred:
                self._ge(HE[u], E[slot_pred[u]] + hd[u])
            # [Constraint] D2H lane in order, after the unit's compute (a forward unit's on-GPU update states
            # from the start of its forward; its stash after the forward)
            self._ge(DE[u], (DE[u - 1] if u else 0.0) + dd[u])
            self._ge(DE[u], E[u] - t.d2h_early_ms + dd[u])
            if is_fwd:
                self._ge(DE[u], E[u] + self._expr(t.stash))
            # [Constraint] disk lane in order: stash writes after their D2H; reads as early as the lane allows
            self._ge(DK[u], (DK[u - 1] if u else 0.0) + self._expr(t.disk_write) + self._expr(t.disk_read))
            if is_fwd and t.layer + 1 < L:
                # [Constraint] a stash is written after its D2H (only when n_{i+1} = 1: big-M)
                self._ge(DK[u], DE[u] + self._expr(t.disk_write) - big_m_ms * (1 - v["n", t.layer + 1]))
            elif not is_fwd and not is_head:
                # [Constraint] a fetched NVMe boundary is read before its H2D. Unconditional (no big-M, a tight
                # LP): the H2D lane runs in order, so loads behind a fetch wait for its read anyway, and DK_u only
                # holds reads charged to units up to u (and writes, zero unless some boundary is on NVMe)
                self._ge(HE[u], DK[u] + hd[u])
            if is_fwd:
                i = t.layer
                # [Constraint] CPU optimizer: resident parameters first, then the CPU-updated layers in order. F(i)'s loads
                # start after the CPU chain through layer i (for a GPU-updated layer that is the chain through the
                # previous CPU-updated one, which its forward waits for anyway); no big-M, so fractional o_i in
                # the LP relaxation is a meaningful CPU/GPU split. The first forward waits for the resident update.
                self._eq(O[i], (O[i - 1] if i else cm.resident_optim_ms) + cm.cpu_optim_ms(i)
                         - cm.cpu_optim_ms(i) * v["o", i])
                self._ge(HE[u], O[i] + hd[u])
                if i == 0:
                    self._ge(E[u], cm.resident_optim_ms + c)
                # [Constraint] two on-GPU update workspaces: when o_i = 1 (big-M), layer i's states and weights go
                # up once layer i-1's update is done (its forward started), and after the D2H of unit F(i-2),
                # which holds layer i-2's states
                if i:
                    self._ge(HE[u], E[u - 1] - cm.fwd_ms[i - 1] + cm.gpu_optim_load_ms(i) - big_m_ms * (1 - v["o", i]))
                if i >= 2:
                    slack = workspace_slack_ms(cm, t)  # a small, tight big-M (see workspace_slack_ms)
                    self._ge(HE[u], DE[u - 2] + hd[u] - slack * (1 - v["o", i]))
        # [Constraint] the step ends when the last compute and the last gradient D2H are done
        self._ge(end, E[U - 1])
        self._ge(end, DE[U - 1])
        self.end = end

    def _big_m_ms(self, units: list[Any]) -> float:
        """An upper bound on any event time (ms): every duration at its largest, serialized."""
        ones = {k: 1.0 for k in self.v}
        total = sum(max(0.0, t.compute.value(ones)) + max(x.value(ones) for x in t.h2d)
                    + max(x.value(ones) for x in t.d2h)
                    + t.disk_write.value(ones) + t.disk_read.value(ones) for t in units)
        cm = self.cm
        total += cm.resident_optim_ms + sum(cm.cpu_optim_ms(i) for i in range(cm.num_layers))
        return 2.0 * total + 1.0

    # -- objective, warm start, solve ---------------------------------------------------------------------------
    def objective(self) -> _X:
        v, L = self._x, self.cm.num_layers
        ties = _X()
        for i in range(L):
            ties += TIE_MS_PER_DECISION * (v["k", i] + 2 * v["n", i] + v["r", i] + v["o", i] + 0.1 * v["c", i])
        if self.memory_only:
            return self.peak + 1e-4 * ties  # smallest peak GiB; ties only between equal peaks
        return self.end + TIE_MS_PER_GIB_PEAK * self.peak + ties

    def set_incumbent(self, schedule: Schedule) -> None:
        """A first incumbent for `solve_search` (no column vector: the search values it with its evaluator)."""
        if schedule.prefetch_depth != self.d:
            raise ValueError(f"incumbent has prefetch_depth {schedule.prefetch_depth}, the model {self.d}")
        self._incumbent = schedule

    def warm_start(self, schedule: Schedule) -> None:
        """Give every column its value for `schedule` (a full solution, so HiGHS starts with an incumbent)."""
        if schedule.prefetch_depth != self.d:
            raise ValueError(f"warm start has prefetch_depth {schedule.prefetch_depth}, the model {self.d}")
        x = self._column_values(schedule)
        bad = self._violations(x)
        if bad:  # a bug in the mirror; HiGHS can misreport objectives when handed an infeasible start
            warnings.warn(f"MILP warm start violates {len(bad)} rows (first: {bad[0]}); solving without it",
                          stacklevel=2)
            return
        sol = self.h.getSolution()
        sol.col_value = x
        sol.value_valid = True
        self.h.setSolution(sol)
        self._start = (x, schedule)

    def _column_values(self, schedule: Schedule) -> list[float]:
        """Every column's value for `schedule` (decisions, event times from `estimate.evaluate`, memory sums)."""
        cm = self.cm
        vals = decision_values(schedule)
        units = self._units if self._units is not None else unit_terms(cm)
        est = evaluate(cm, schedule, units=units)
        mem = memory_terms(cm, self.d)
        q = m = 0.0
        opt = cm.resident_optim_ms
        for i in range(cm.num_layers):
            q += mem.stored[i].value(vals) / GIB
            m = mem.fetched[i].value(vals) / GIB if vals[("c", i)] > 0.5 else m + mem.recomputed_input[i].value(vals) / GIB
            vals[("Q", i)], vals[("m", i)] = q, m
            opt += cm.cpu_optim_ms(i) * (1 - vals[("o", i)])
            vals[("O", i)] = opt
        for u, t in enumerate(units):
            he, e, de, dk = est.event_times[t.name]
            vals[("HE", u)], vals[("E", u)], vals[("DE", u)], vals[("DK", u)] = he, e, de, dk
            vals[("hd", u)] = t.h2d_ms(vals)
            vals[("dd", u)] = t.d2h_ms(vals)
        vals[("peak", 0)] = est.peak_gpu_bytes / GIB
        vals[("END", 0)] = est.step_ms
        return [float(vals.get(key, 0.0)) for key in self.cols]

    def _violations(self, x: list[float], tol: float = 1e-6) -> list[str]:
        """Rows and bounds of the model that the column values `x` violate (relative tolerance `tol`)."""
        import numpy as np

        lp = self.h.getLp()
        a = lp.a_matrix_
        xs = np.asarray(x)
        act = np.zeros(lp.num_row_)
        start, index, value = np.asarray(a.start_), np.asarray(a.index_), np.asarray(a.value_)
        if a.format_ == type(a.format_).kColwise:
            cols = np.repeat(np.arange(lp.num_col_), np.diff(start))
            np.add.at(act, index, value * xs[cols])
        else:  # row-wise: start holds row offsets, index column indices
            rows_of = np.repeat(np.arange(lp.num_row_), np.diff(start))
            np.add.at(act, rows_of, value * xs[index])
        lo, up = np.asarray(lp.row_lower_), np.asarray(lp.row_upper_)
        scale = tol * np.maximum(1.0, np.abs(act))
        rows = np.nonzero((act < lo - scale) | (act > up + scale))[0]
        out = [f"row {r}: {lo[r]:.6g} <= {act[r]:.6g} <= {up[r]:.6g}" for r in rows[:3]]
        cl, cu = np.asarray(lp.col_lower_), np.asarray(lp.col_upper_)
        for j in np.nonzero((xs < cl - tol) | (xs > cu + tol))[0][:3]:
            out.append(f"column {self.cols[j]}={xs[j]:.6g} outside [{cl[j]:.6g}, {cu[j]:.6g}]")
        return out

    def solve(self, time_limit_s: float, mip_rel_gap: float) -> _Result:

        h = self.h
        h.setOptionValue("mip_rel_gap", float(mip_rel_gap))
        h.setOptionValue("time_limit", max(0.0, float(time_limit_s)))
        t0 = time.perf_counter()
        h.solve()
        return self._read_result((time.perf_counter() - t0) * 1e3)

    def _read_result(self, solve_ms: float) -> _Result:
        import highspy

        h = self.h
        ms = h.getModelStatus()
        info = h.getInfo()
        has_solution = info.primal_solution_status == 2  # kSolutionStatusFeasible
        status = {highspy.HighsModelStatus.kOptimal: "optimal",
                  highspy.HighsModelStatus.kTimeLimit: "time_limit",
                  highspy.HighsModelStatus.kInfeasible: "infeasible"}.get(ms, h.modelStatusToString(ms))
        if status == "infeasible":
            has_solution = False
        sched = self._extract() if has_solution else None
        obj = info.objective_function_value if has_solution else math.nan
        if has_solution:
            # Note [objective from the solution]: when HiGHS stops at its time limit holding only the user-given
            # warm start, it can report an objective that is not that solution's (seen with highspy 1.16); the
            # objective is therefore recomputed from the returned column values.
            lp = h.getLp()
            x = h.getSolution().col_value
            direct = float(sum(c * xv for c, xv in zip(lp.col_cost_, x)) + lp.offset_)
            if abs(direct - obj) > 1e-6 * max(1.0, abs(direct)):
                logger.debug("HiGHS reported objective %.6g for a solution worth %.6g", obj, direct)
                obj = direct
        gap = info.mip_gap if has_solution and math.isfinite(info.mip_gap) else math.nan
        bound = info.mip_dual_bound if math.isfinite(info.mip_dual_bound) else -math.inf
        if status == "optimal" and has_solution:
            bound = max(bound, obj * (1 - max(gap, 0.0)) if math.isfinite(gap) else obj)
        return _Result(self.d, status, has_solution, obj, gap, solve_ms, sched, bound)

    def solve_search(self, time_limit_s: float, mip_rel_gap: float, evaluator: StepEvaluator | None = None,
                     local_search: bool = True, dive: bool = True, kick_s: float = 0.25,
                     kick_margin: float = 0.005) -> _Result:
        """Branch and bound over the structural decisions, HiGHS for the rest (the default path of `solve_milp`).

        The LP relaxation of the full MILP is weak (2.5-4% under the optimum on 64 layers) almost only through the
        optimizer placement o_i and the global flags yoff / ynv: a fractional o_i splits one layer's update between
        CPU and GPU, and fractional flags charge a fraction of the prefetch / staging memory. With the optimizer
        placement fixed the relaxation is within 0.2-0.5% of the optimum. With the symmetry-breaking orderings the
        on-GPU updates of a class of identical layers are a prefix of the class, so the placement is one count per
        class. This search branches on those counts (boxes of count ranges, LP bound per box, best first, LP
        re-solved from the previous basis after each bound change) and then on fractional flags; a box whose counts
        are fixed and whose LP has integral flags is a leaf. At a leaf the LP solution is rounded and improved by a
        local search under the linear model (`fast_eval.improve_plan`, `local_search`; its plans keep the orderings,
        so they are points of this MILP), with a few random kicks (`fast_eval.perturb_plan`, at most `kick_s`) when
        it ends less than `kick_margin` above the objective that would settle the leaf; a plan within the gap of the
        leaf's LP bound settles it. Otherwise HiGHS solves the leaf MILP, started from the incumbent when it lies in
        the leaf's box (else with the incumbent as cutoff). The diving start (`_dive`, `dive`) runs only
        without the local search or without an incumbent. Boxes whose bound is within `mip_rel_gap` of the incumbent
        are pruned, so the returned gap is proven over the whole MILP (with its orderings), as for `solve` (up to
        HiGHS's own leaf bounds). `evaluator`: a `StepEvaluator` of this cost model and depth (built when None).
        """
        import heapq

        import highspy
        import numpy as np

        t0 = time.perf_counter()
        deadline = t0 + max(0.0, float(time_limit_s))
        h = self.h
        base = h.getLp()
        lp = highspy.Highs()
        lp.silent()
        lp.setOptionValue("presolve", "off")  # re-solves start from the previous basis
        lp.passModel(base)
        n = lp.getNumCol()
        lp.changeColsIntegrality(n, np.arange(n, dtype=np.int32), np.zeros(n, dtype=np.uint8))
        col_lo, col_hi = np.asarray(base.col_lower_, dtype=float), np.asarray(base.col_upper_, dtype=float)
        cost, offset = np.asarray(base.col_cost_, dtype=float), float(base.offset_)
        o_cols = [np.array([self.v["o", i] for i in members], dtype=np.int32) for members in self.classes]
        widths = tuple(int(sum(col_hi[c] >= 0.5 for c in cols)) for cols in o_cols)  # GPU-updatable members
        flag_cols = [self.v["yoff", 0], self.v["ynv", 0]]
        box_cols = np.concatenate(o_cols + [np.array(flag_cols, dtype=np.int32)]).astype(np.int32)

        def bounds_of(box: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]) -> tuple[Any, Any]:
            los, his, flags = box
            lo, hi = [], []
            for cols, a, b in zip(o_cols, los, his):
                j = np.arange(len(cols))
                lo.append((j < a).astype(float))
                hi.append((j < b).astype(float))
            fl = np.array([0.0 if f < 0 else float(f) for f in flags])
            fh = np.array([1.0 if f < 0 else float(f) for f in flags])
            lo_a = np.maximum(np.concatenate(lo + [fl]), col_lo[box_cols])
            hi_a = np.minimum(np.concatenate(hi + [fh]), col_hi[box_cols])
            return lo_a, hi_a

        def apply(hs: Any, box: Any) -> bool:
            lo_a, hi_a = bounds_of(box)
            if np.any(lo_a > hi_a + 1e-9):
                return False
            hs.changeColsBounds(len(box_cols), box_cols, lo_a, hi_a)
            return True

        def relax(box: Any) -> tuple[float, Any]:
            if not apply(lp, box):
                return math.inf, None
            lp.setOptionValue("time_limit", max(0.0, deadline - time.perf_counter()))
            t_lp = time.perf_counter()
            lp.run()
            stats["lp"] += 1
            stats["lp_ms"] += (time.perf_counter() - t_lp) * 1e3
            st = lp.getModelStatus()
            if st == highspy.HighsModelStatus.kOptimal:
                return float(lp.getInfo().objective_function_value), np.asarray(lp.getSolution().col_value)
            if st in (highspy.HighsModelStatus.kInfeasible, highspy.HighsModelStatus.kUnboundedOrInfeasible):
                return math.inf, None
            return -math.inf, None  # time limit or trouble: no bound

        stats: dict[str, Any] = {"lp": 0, "lp_ms": 0.0, "leaves": [], "dives": [], "dive_plans": [], "dive_lp": 0,
                                 "dive_ms": 0.0}
        dive_cols = np.array([self.v[s, i] for s in ("c", "g", "k", "n", "r") for i in range(self.cm.num_layers)]
                             + [self.v["ygo", 0]], dtype=np.int32)
        inc_obj, inc_sched = math.inf, None
        ev = evaluator if evaluator is not None else StepEvaluator(self.cm, self.d)
        stats.update({"ls": [], "ls_plans": [], "ls_evals": 0, "ls_ms": 0.0, "kicked": 0, "boxes": [], "branched": [],
                      "leaf_boxes": []})

        def improve(xv: Any, target: float) -> tuple[float, Schedule] | None:
            """LP rounding + local search (`fast_eval.improve_plan`), then, if the plan is above `target` by less
            than `kick_margin`, a few random kicks and local searches again (`fast_eval.perturb_plan`, at most
            `kick_s` seconds): a plan that fits, with its objective."""
            t_ls = time.perf_counter()
            kw = dict(classes=self.classes, nvme=self.cm.nvme_bytes > 0, gpu_optimizer=self.gpu_optimizer)
            plan, val, evals = improve_plan(ev, self._round(xv), deadline, **kw)
            if val.fits(self.cm) and target < val.objective <= target * (1.0 + kick_margin):
                stats["kicked"] += 1
                plan, val, more = perturb_plan(ev, plan, min(deadline, time.perf_counter() + kick_s), target=target,
                                               seed=len(stats["ls"]), **kw)
                evals += more
            stats["ls_evals"] += evals
            stats["ls_ms"] += (time.perf_counter() - t_ls) * 1e3
            stats["ls"].append(round(val.objective, 2) if val.fits(self.cm) else None)
            if not val.fits(self.cm):
                return None
            sched = plan.schedule(self.d)
            stats["ls_plans"].append((val.objective, sched))
            return val.objective, sched

        if self._start is not None:
            inc_obj = float(cost @ np.asarray(self._start[0]) + offset)
            inc_sched = Schedule(policy="milp", layers=[LayerPlan(**vars(lp)) for lp in self._start[1].layers],
                                 prefetch_depth=self.d)
        elif self._incumbent is not None:
            val = ev.evaluate(PlanArrays.of(self._incumbent))
            if val.fits(self.cm):
                inc_obj = val.objective
                inc_sched = Schedule(policy="milp", layers=[LayerPlan(**vars(lp)) for lp in self._incumbent.layers],
                                     prefetch_depth=self.d)
        gap = float(mip_rel_gap)
        prune = lambda b: b >= inc_obj - gap * abs(inc_obj)  # noqa: E731
        root = (tuple(0 for _ in o_cols), widths, (-1, -1))
        bound, x = relax(root)
        heap: list[tuple[float, int, int, Any, Any]] = []
        tick = 0
        if bound < math.inf:
            heap.append((bound, 0, tick, root, x))
        settled = math.inf  # smallest bound of the pruned boxes and solved leaves
        timed_out = False
        leaves_done = 0  # leaves settled (by a heuristic plan, a dive or HiGHS)
        while heap:
            diving = not math.isfinite(inc_obj) or not leaves_done
            if diving:
                # dive first (deepest box, then smallest bound) to a leaf: its plan gives the incumbent that prunes
                # most boxes as soon as their LP is solved
                heap.sort(key=lambda e: (e[1], e[0], e[2]))
                entry = heap.pop(0)
                heapq.heapify(heap)
            else:
                entry = heapq.heappop(heap)
            bound, neg_depth, _, box, x = entry
            if prune(bound):
                settled = min(settled, bound)
                if diving:  # not the smallest bound: the others may still need work
                    continue
                heap.clear()  # best first: every box left has a bound at least this one's
                break
            if time.perf_counter() >= deadline:
                heapq.heappush(heap, (bound, neg_depth, 0, box, x))
                timed_out = True
                break
            los, his, flags = box
            children = []
            wide = [c for c in range(len(o_cols)) if his[c] > los[c]]
            split_flags = [j for j, (fv, col) in enumerate(zip(flags, flag_cols))
                           if x is not None and fv < 0 and 1e-6 < x[col] < 1 - 1e-6]
            if split_flags:
                f = split_flags[0]
                children = [(los, his, flags[:f] + (v,) + flags[f + 1:]) for v in (0, 1)]
            elif x is not None and wide:
                c = max(wide, key=lambda k: his[k] - los[k])
                k = min(max(int(math.floor(float(x[o_cols[c]].sum()) + 1e-6)), los[c]), his[c] - 1)
                children = [(los, his[:c] + (k,) + his[c + 1:], flags),
                            (los[:c] + (k + 1,) + los[c + 1:], his, flags)]
            if children:
                stats["branched"].append(box)
                for child in children:
                    b, cx = relax(child)
                    b = max(b, bound)
                    stats["boxes"].append((child, b))
                    if b == math.inf:
                        continue
                    if prune(b):
                        settled = min(settled, b)
                        continue
                    tick += 1
                    heapq.heappush(heap, (b, neg_depth - 1, tick, child, cx))
                continue
            # a leaf: first an LP rounding improved by local search, then a diving start from its LP (HiGHS alone
            # spends most of a leaf finding a solution within the gap of its tight bound), then the MILP with this
            # box's counts and flags
            leaves_done += 1
            stats["leaf_boxes"].append(box)
            if local_search and x is not None:
                found = improve(x, bound / (1.0 - gap) if gap < 1 else math.inf)  # the objective that settles it
                if found is not None and found[0] < inc_obj - 1e-9:
                    inc_obj, inc_sched = found
                if prune(bound):  # the incumbent is within the gap of the leaf's LP bound: no MILP
                    settled = min(settled, bound)
                    continue
            cutoff = inc_obj
            # a diving start without the local search or without an incumbent (with one, HiGHS gets it as its
            # start or cutoff: on random 64-layer instances the dives were all worse than the local search's plans)
            xd = (self._dive(lp, dive_cols, x, col_lo, col_hi, deadline, stats)
                  if x is not None and dive and (not local_search or not math.isfinite(inc_obj)) else None)
            if xd is not None:
                d_obj = float(cost @ xd + offset)
                stats["dives"].append(round(d_obj, 2))
                stats["dive_plans"].append((d_obj, self._schedule_of(xd)))
                if d_obj < inc_obj - 1e-9:
                    inc_obj, inc_sched = d_obj, self._schedule_of(xd)
                    if prune(bound):  # the diving start is within the gap of the leaf's LP bound: no MILP
                        settled = min(settled, bound)
                        continue
            apply(h, box)  # (a bound change drops a given solution: set the start afterwards)
            # the start: the incumbent when it lies in this box (HiGHS then only has to prove or improve it), else
            # the diving start when it improved on the incumbent
            start = None
            if inc_sched is not None:
                xi = self._column_values(inc_sched)
                start = xi if not self._violations(xi) else None
            if start is None and xd is not None and cutoff > inc_obj:
                start = list(xd)
            if start is not None:
                sol = h.getSolution()
                sol.col_value = start
                sol.value_valid = True
                h.setSolution(sol)
            h.setOptionValue("mip_rel_gap", gap)
            h.setOptionValue("time_limit", max(0.0, deadline - time.perf_counter()))
            # without a start, the incumbent is the cutoff (a start equal to the cutoff might be discarded)
            h.setOptionValue("objective_bound", math.inf if start is not None or not math.isfinite(cutoff) else cutoff)
            t1 = time.perf_counter()
            h.solve()
            res = self._read_result((time.perf_counter() - t1) * 1e3)
            stats["leaves"].append((box, res.status, round(res.solve_ms), round(res.objective, 2),
                                    round(res.bound, 2)))
            if res.has_solution and res.objective < inc_obj:
                inc_obj, inc_sched = res.objective, res.schedule
            if res.status == "infeasible":  # nothing below the cutoff (or nothing at all) in this box
                leaf_bound = max(bound, inc_obj)
            else:
                # HiGHS's dual bound can exceed a solution it has not seen once it prunes nodes within its gap
                # (seen with a start: bound 2714.9 on a leaf holding a 2710.9 plan); its stopping rule only promises
                # the objective within the gap
                leaf_bound = max(bound, min(res.bound, res.objective * (1 - gap)) if res.has_solution else res.bound)
            settled = min(settled, leaf_bound)
            if res.status == "time_limit":
                timed_out = True
        # restore the full model (a later `solve` continues from it)
        h.changeColsBounds(len(box_cols), box_cols, col_lo[box_cols], col_hi[box_cols])
        h.setOptionValue("objective_bound", math.inf)
        final_bound = min([settled] + [b for b, *_ in heap])
        solve_ms = (time.perf_counter() - t0) * 1e3
        if inc_sched is None:
            status = "infeasible" if not timed_out and not heap else "time_limit"
            return _Result(self.d, status, False, math.nan, math.nan, solve_ms, None,
                           final_bound if status != "infeasible" else math.inf)
        final_bound = min(final_bound, inc_obj)
        mgap = max(0.0, (inc_obj - final_bound) / max(abs(inc_obj), 1e-9)) if math.isfinite(final_bound) else math.inf
        status = "optimal" if mgap <= gap + 1e-9 else "time_limit"
        self.search_stats = stats
        logger.debug("search: %s", {k: v for k, v in stats.items() if k not in ("dive_plans", "ls_plans")})
        return _Result(self.d, status, True, inc_obj, mgap if math.isfinite(mgap) else math.nan, solve_ms,
                       inc_sched, final_bound)

    def _dive(self, lp: Any, cols: Any, x: Any, col_lo: Any, col_hi: Any, deadline: float,
              stats: dict[str, Any]) -> Any:
        """Fractional diving on the relaxed copy `lp` (its bounds already those of a leaf box, `x` its LP
        solution): round a quarter of the fractional integer columns `cols` to their nearest value (first those
        whose rounding frees GPU memory, each group least fractional first), re-solve the LP from the previous basis, repeat until integral. A fix that makes the LP infeasible is
        undone and its least fractional column fixed the other way (then the dive gives up). Returns the column
        values of an integral LP solution: a feasible point of the MILP (every row holds, the integer columns are
        0/1), or None. The bounds of `cols` are restored afterwards. Typically 10-30 LPs (0.07-0.2 s at 64 layers).
        On the benchmarks the start is within the gap of the leaf's LP bound for synthetic-64 without GPU updates
        and qwen3.6-27b (the leaf MILP is skipped), 16% above it on synthetic-64 with GPU updates (HiGHS then
        solves the leaf as before)."""
        import highspy
        import numpy as np

        ok = highspy.HighsModelStatus.kOptimal
        t0 = time.perf_counter()
        L = self.cm.num_layers
        # rounding up frees GPU memory for k, n (offload); rounding down for g, r, c
        safe_up = np.array([s in ("k", "n") for s in ("c", "g", "k", "n", "r") for i in range(L)] + [False])
        out = None
        try:
            while time.perf_counter() < deadline:
                xi = x[cols]
                rd = np.round(xi)
                fr = np.abs(xi - rd)
                frac = np.nonzero(fr > 1e-6)[0]
                if not len(frac):
                    out = x.copy()
                    break
                frac = frac[np.argsort(fr[frac], kind="stable")]
                # roundings that free GPU memory first (offload up; GPU tier, retain, checkpoint down), then the rest
                safe = safe_up[frac] == (rd[frac] > 0.5)
                frac = np.concatenate([frac[safe], frac[~safe]])
                sel = frac[:max(1, int(math.ceil(len(frac) / 4)))]
                fix_c, fix_v = cols[sel], rd[sel]
                lp.changeColsBounds(len(fix_c), fix_c, fix_v, fix_v)
                lp.setOptionValue("time_limit", max(0.0, deadline - time.perf_counter()))
                lp.run()
                stats["dive_lp"] += 1
                if lp.getModelStatus() != ok:
                    lp.changeColsBounds(len(fix_c), fix_c, col_lo[fix_c], col_hi[fix_c])
                    j = cols[sel[:1]]
                    other = 1.0 - rd[sel[:1]]
                    lp.changeColsBounds(1, j, other, other)
                    lp.run()
                    stats["dive_lp"] += 1
                    if lp.getModelStatus() != ok:
                        break
                x = np.asarray(lp.getSolution().col_value)
        finally:
            lp.changeColsBounds(len(cols), cols, col_lo[cols], col_hi[cols])
            stats["dive_ms"] += (time.perf_counter() - t0) * 1e3
        return out

    def _round(self, x: Any) -> PlanArrays:
        """The plan nearest to LP column values `x`: c, r, o rounded (rounding keeps the orderings), each
        materialized boundary in its largest tier."""
        import numpy as np

        L = self.cm.num_layers
        col = {s: np.array([self.v[s, i] for i in range(L)]) for s in ("c", "g", "k", "n", "r", "o")}
        c = np.round(x[col["c"]])
        c[0] = 1.0
        tier = np.argmax(np.stack([x[col["g"]], x[col["k"]], x[col["n"]]]), axis=0).astype(float) * c
        tier[0] = 0.0
        return PlanArrays(c, tier, np.round(x[col["r"]]), np.round(x[col["o"]]))

    def _extract(self) -> Schedule:
        return self._schedule_of(self.h.getSolution().col_value)

    def _schedule_of(self, x: Any) -> Schedule:
        """The schedule of column values `x` (integer columns rounded)."""
        L = self.cm.num_layers
        layers = []
        for i in range(L):
            c, k, n, r, o = (round(float(x[self.v[s, i]])) for s in ("c", "k", "n", "r", "o"))
            tier = "cpu" if k else "nvme" if n else "gpu"
            layers.append(LayerPlan(checkpoint=bool(c) or i == 0, tier=tier if c else "gpu", retain=bool(r),
                                    optimizer_device="gpu" if o else "cpu"))
        return Schedule(policy="milp", layers=layers, prefetch_depth=self.d)

    def peak_value_bytes(self) -> float:
        return float(self.h.getSolution().col_value[self.v["peak", 0]]) * GIB


# ---------------------------------------------------------------------------------------------------------------
# Public API


def fixed_candidates(cm: CostModel, prefetch_depth: int = 1, *, evaluator: StepEvaluator | None = None
                     ) -> list[Schedule]:
    """Variants of the `fixed` heuristic (checkpoint every k in 1, 2, 4, 8, all boundaries in one tier) that fit
    the budgets under the linear model, fastest first. Used as MILP warm starts and as the no-solution fallback.
    `evaluator`: a `StepEvaluator` of `cm` at `prefetch_depth` (built here when not given)."""
    import numpy as np

    ev = evaluator if evaluator is not None else StepEvaluator(cm, prefetch_depth)
    tiers = ["gpu", "cpu"] + (["nvme"] if cm.nvme_bytes > 0 else [])
    scheds = []
    for every in (1, 2, 4, 8):
        for tier in tiers:
            s = fixed_schedule(cm.num_layers, checkpoint_every=every, tier=tier, prefetch_depth=prefetch_depth)
            s.layers[0].tier = "gpu"  # boundary 0 stays on the GPU, as the MILP's g_0 = 1
            scheds.append(s)
    plans = [PlanArrays.of(s) for s in scheds]
    vals = ev.evaluate_many(*(np.stack([getattr(p, f) for p in plans], axis=1) for f in ("c", "tier", "r", "o")))
    out = [(val.step_ms, k) for k, val in enumerate(vals) if val.fits(cm)]
    out.sort()
    return [scheds[k] for _, k in out]


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
    model = _PlanMilp(cm, prefetch_depth, memory_only=True, symmetry_breaking=False)
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
    msg = (f"{e} These planner budgets are after the {margin:.0%} GPU memory margin (gpu_memory_margin):{when} pass "
           f"--gpu-memory / lazytrain_config.gpu_memory_budget of at least {need / GIB:.2f} GiB.")
    return InfeasiblePlanError(msg, min_gpu_bytes=need if at_host else None, min_host_bytes=e.min_host_bytes,
                               min_gpu_bytes_any_host=e.min_gpu_bytes_any_host,
                               min_gpu_bytes_at_min_host=None if at_host else need)


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
        msg = (f"No schedule fits: the host budget {gib(cm.pinned_host_bytes)} is below the "
               f"{gib(cm.host_fixed_bytes)} that weights, gradients and optimizer states take on the host. "
               f"Set the host budget (--host-memory / lazytrain_config.host_memory_budget) to at least "
               f"{gib(host_min)}{gpu_note}.")
        return InfeasiblePlanError(msg, min_gpu_bytes=None, min_host_bytes=host_min, min_gpu_bytes_any_host=any_host_r,
                                   min_gpu_bytes_at_min_host=at_min_r)
    at_host = min_gpu_bytes(cm) if min_gpu is _SOLVE else min_gpu
    at_host_r = _round_budget_up(at_host) if at_host is not None else None
    more_host = ""
    if any_host_r is not None and at_host_r is not None and any_host_r < at_host_r:
        more_host = f" (with more host memory for CPU-tier boundaries: {gib(any_host_r)})"
    smallest = (f"The smallest feasible GPU budget is {gib(at_host_r)}{more_host}" if at_host_r is not None else
                "The smallest feasible GPU budget was not found within the solver's limit")
    msg = (f"No schedule fits the GPU budget {gib(cm.gpu_bytes)} (host budget {gib(cm.pinned_host_bytes)}, "
           f"NVMe budget {gib(cm.nvme_bytes)}). {smallest}"
           f", at prefetch depth 1 with boundaries offloaded or recomputed; the smallest host budget is "
           f"{gib(host_min)}. Raise --gpu-memory / lazytrain_config.gpu_memory_budget, lower the batch size "
           f"or sequence length, or run each layer over fewer rows at a time (--rows-per-pass / "
           f"lazytrain_config.max_rows_per_pass: activation memory scales with it, not with the batch).")
    return InfeasiblePlanError(msg, min_gpu_bytes=at_host_r, min_host_bytes=host_min,
                               min_gpu_bytes_any_host=any_host_r)


def solve_milp(cm: CostModel, *, prefetch_depths: tuple[int, ...] = (1, 2, 3), time_limit_s: float = 10.0,
               mip_rel_gap: float = 0.01, warm_start: bool = True, symmetry_breaking: bool = True,
               gpu_optimizer: bool = True, fingerprint: str = "", search: bool = True) -> Schedule:
    """Solve the planning MILP for each prefetch depth and return the best schedule (policy "milp").

    Args:
        cm: the cost model (budgets included).
        prefetch_depths: depths d to try (each adds one weight slot per layer kind), in ascending order. A deeper
            one is solved only if the best plan so far, moved to that depth, still fits and gets faster by more
            than `mip_rel_gap` (`_deeper_may_help`); the others are reported as "skipped".
        time_limit_s: wall-clock limit for all solves together (s), split evenly over the remaining depths.
        mip_rel_gap: HiGHS relative MIP gap (0.01 = stop within 1% of the best bound).
        warm_start: start HiGHS from the best feasible `fixed` variant.
        symmetry_breaking: order decisions among identical layers (see `_PlanMilp._symmetry_breaking`).
        gpu_optimizer: allow per-layer optimizer updates on the GPU (o_i); False keeps every update on the CPU,
            as the current executor runs them (it warns about GPU placements it does not perform yet).
        fingerprint: stored in the schedule (default: a hash of the cost model).
        search: solve by branch and bound over the per-class optimizer-placement counts and the global flags,
            HiGHS for the rest (`_PlanMilp.solve_search`; used with `symmetry_breaking` and `gpu_optimizer`); False
            hands HiGHS the whole MILP at once (64 layers with `gpu_optimizer`: 8-14 s instead of 0.05-0.6 s). Without
            `gpu_optimizer` the search runs too (only the flags are branched on; symmetry breaking not needed);
            each leaf first gets an LP rounding + local search plan, then (if that is not within the gap) a diving start
            from its LP (`_PlanMilp._dive`) and HiGHS.

    Kept gradients (`cm.kept_grad_bytes`): they save PCIe but hold GPU memory across the step boundary, so the
    plan is solved with and without them (half the time limit each) and the faster one is returned, its
    `keep_grads` set accordingly.

    Returns:
        A `Schedule` with `solver` = {status, mip_gap, solve_ms, objective_ms, dual_bound_ms, depths: [...]} (the
        gap is over the depths solved: best objective against their smallest dual bound) and `predicted` =
        {step_ms, peak_gpu_bytes, pinned_host_bytes, nvme_bytes, compute_ms, recompute_ms, gpu_optim_ms,
        exposed_transfer_ms, exposed_optimizer_ms, tokens_per_s} (ms, bytes, tokens/s) from the linear model.

    Raises:
        InfeasiblePlanError: no schedule fits the budgets (names the smallest feasible budgets).
        ValueError: a prefetch depth outside 1..8 or a non-positive time limit / gap.

    Warns:
        UserWarning: a solve stopped at the time limit (the incumbent is used) or found no solution (the best
        `fixed` variant within every budget is used, else the memory-only MILP's plan; status "fallback_fixed" /
        "fallback_min_memory"; InfeasiblePlanError when neither fits).
    """
    if not (cm.keeps_grads and gpu_optimizer):
        return _solve_milp(cm, prefetch_depths, time_limit_s, mip_rel_gap, warm_start, symmetry_breaking,
                           gpu_optimizer, fingerprint, search)
    fp = fingerprint or _fingerprint(cm.to_dict())
    plans: list[Schedule] = []
    error: InfeasiblePlanError | None = None
    for variant in (cm, cm.without_kept()):
        try:
            plans.append(_solve_milp(variant, prefetch_depths, time_limit_s / 2, mip_rel_gap, warm_start,
                                     symmetry_breaking, gpu_optimizer, fp, search))
        except InfeasiblePlanError as e:  # kept gradients take memory: the plan without them may still fit
            error = e  # the last (without them) names the smaller budgets
    if not plans:
        assert error is not None
        raise error
    return min(plans, key=lambda s: s.predicted["step_ms"])


def _solve_milp(cm: CostModel, prefetch_depths: tuple[int, ...], time_limit_s: float, mip_rel_gap: float,
                warm_start: bool, symmetry_breaking: bool, gpu_optimizer: bool, fingerprint: str,
                search: bool) -> Schedule:
    """`solve_milp` for one cost model (kept gradients as `cm` says)."""
    depths = sorted(set(prefetch_depths))
    problems = []
    if not depths or any(not 1 <= d <= 8 for d in depths):
        problems.append(f"prefetch_depths must be in [1, 8], but got {tuple(prefetch_depths)}")
    if not time_limit_s > 0:
        problems.append(f"time_limit_s must be > 0, but got {time_limit_s}")
    if not 0 <= mip_rel_gap < 1:
        problems.append(f"mip_rel_gap must be in [0, 1), but got {mip_rel_gap}")
    if problems:
        raise ValueError("solve_milp: " + "; ".join(problems))
    if cm.pinned_host_bytes < cm.host_fixed_bytes:
        raise infeasible_error(cm)
    fp = fingerprint or _fingerprint(cm.to_dict())
    deadline = time.perf_counter() + time_limit_s
    results: list[_Result] = []
    models: list[_PlanMilp] = []
    skipped: list[int] = []
    evaluators = _Evaluators(cm)
    for idx, d in enumerate(depths):
        best_so_far = min((r for r in results if r.schedule is not None), key=lambda r: r.objective, default=None)
        if best_so_far is not None and not _deeper_may_help(cm, best_so_far.schedule, d, mip_rel_gap, evaluators):
            skipped.append(d)
            continue
        # the first depth gets 80% of the budget (deeper ones are usually screened out, and then the rest continues
        # the first depth), the others share what is left
        left = max(0.0, deadline - time.perf_counter())
        share = left * 0.8 if idx == 0 and len(depths) > 1 else left / (len(depths) - idx)
        model = _PlanMilp(cm, d, symmetry_breaking=symmetry_breaking, gpu_optimizer=gpu_optimizer,
                          units=evaluators.units)
        use_search = search and (symmetry_breaking or not gpu_optimizer)
        if warm_start:
            start = _best_start(cm, d, [r.schedule for r in results if r.schedule is not None], evaluators)
            if start is not None and use_search:
                model.set_incumbent(start)  # the search values it itself (no column vector needed)
            elif start is not None:
                model.warm_start(start)
        if use_search:
            res = model.solve_search(share, mip_rel_gap, evaluators(d))
        else:
            res = model.solve(share, mip_rel_gap)
        results.append(res)
        models.append(model)
        if res.status == "infeasible":
            skipped += depths[idx + 1:]  # a deeper prefetch only adds weight slots: also infeasible
            break
    # leftover time (deeper depths screened out): continue the best unproven depth from its incumbent
    left = deadline - time.perf_counter()
    open_ = [k for k, r in enumerate(results) if r.status == "time_limit" and r.schedule is not None]
    if open_ and left > 0.5:
        k = min(open_, key=lambda j: results[j].objective)
        models[k].warm_start(results[k].schedule)
        more = models[k].solve(left, mip_rel_gap)
        if more.has_solution and more.objective <= results[k].objective + 1e-9:
            more.solve_ms += results[k].solve_ms
            more.bound = max(more.bound, results[k].bound)
            results[k] = more
        else:
            results[k].solve_ms += more.solve_ms
    feasible = [r for r in results if r.has_solution and r.schedule is not None]
    total_ms = sum(r.solve_ms for r in results)
    per_depth = [{"prefetch_depth": r.depth, "status": r.status, "objective_ms": _nan_none(r.objective),
                  "mip_gap": _nan_none(r.mip_gap), "solve_ms": r.solve_ms} for r in results]
    per_depth += [{"prefetch_depth": d, "status": "skipped", "objective_ms": None, "mip_gap": None, "solve_ms": 0.0}
                  for d in skipped]
    if not feasible:
        if all(r.status == "infeasible" for r in results):
            raise infeasible_error(cm)
        sched, what = _fallback(cm, depths[0], evaluators(depths[0]), time_limit_s)
        warnings.warn(f"The planning MILP found no solution within {_seconds(time_limit_s)} (per prefetch depth: "
                      f"{[r.status for r in results]}); using {what}. Raise {TIME_LIMIT_HINT} for a faster plan.",
                      stacklevel=2)
        sched.fingerprint = fp
        sched.keep_grads = cm.keeps_grads
        status = "fallback_fixed" if sched.policy == "fixed" else "fallback_min_memory"
        sched.solver = {"status": status, "mip_gap": None, "solve_ms": total_ms, "objective_ms": None,
                        "depths": per_depth}
        sched.predicted = evaluate(cm, sched).as_predicted(cm.tokens_per_step)
        sched.predicted["recomputed_layers"] = sum(recompute_flags(sched))
        return sched
    best = min(feasible, key=lambda r: r.objective)
    # gap over all depths tried: the best objective against the weakest depth's dual bound
    bound = min(r.bound if r.status != "infeasible" else math.inf for r in results)
    gap = max(0.0, (best.objective - bound) / max(abs(best.objective), 1e-9)) if math.isfinite(bound) else math.nan
    status = "optimal" if math.isfinite(gap) and gap <= mip_rel_gap + 1e-9 else "time_limit"
    if status != "optimal":
        gap_note = f", gap {gap:.3g}" if math.isfinite(gap) else ""
        warnings.warn(f"The planning MILP stopped before proving optimality (per prefetch depth: "
                      f"{[r.status for r in results]}{gap_note}); using the best schedule found. Raise "
                      f"{TIME_LIMIT_HINT} to close the gap.", stacklevel=2)
    sched = best.schedule
    assert sched is not None
    sched.fingerprint = fp
    sched.keep_grads = cm.keeps_grads  # the plan counted the kept gradients' memory
    sched.solver = {"status": status, "mip_gap": _nan_none(gap), "solve_ms": total_ms,
                    "objective_ms": best.objective, "dual_bound_ms": _nan_none(bound if math.isfinite(bound) else
                                                                               math.nan), "depths": per_depth}
    sched.predicted = evaluate(cm, sched, units=evaluators.units).as_predicted(cm.tokens_per_step)
    sched.predicted["recomputed_layers"] = sum(recompute_flags(sched))
    return sched


def _fallback(cm: CostModel, depth: int, evaluator: StepEvaluator, time_limit_s: float) -> tuple[Schedule, str]:
    """A schedule within every budget (GPU, host, NVMe) when no solve found one in time, and words for it: the
    fastest fitting `fixed` variant, else the memory-only MILP's smallest-peak plan.

    Raises:
        InfeasiblePlanError: neither fits (the message says whether a longer time limit may still find one).
    """
    fixed = fixed_candidates(cm, depth, evaluator=evaluator)
    if fixed:
        s = fixed[0]
        return s, f"the fixed heuristic (checkpoint every {checkpoint_interval(s)} layers, boundaries in the {checkpoint_tier(s)} tier)"
    # the user's limit again (at least 1 s: a memory-only solve is small), not the 10 s default
    min_gpu, sched, proven = _min_memory_plan(cm, depth, max(1.0, time_limit_s))
    if sched is not None and evaluator.evaluate(PlanArrays.of(sched)).fits(cm):
        return sched, "the plan of smallest GPU memory (no fixed-heuristic variant fits the budgets)"
    e = infeasible_error(cm, min_gpu if depth == 1 and proven else _SOLVE)  # its figure is at depth 1
    if proven:
        raise e
    raise e.restated(f"{e} The solver stopped at its time limit ({_seconds(time_limit_s)}) before deciding: a "
                     f"longer {TIME_LIMIT_HINT} may find a plan.")


def _seconds(t: float) -> str:
    """A time limit for a message: 0.01 s, not 0.0 s."""
    return f"{t:.3g} s"


def _deeper_may_help(cm: CostModel, incumbent: Schedule | None, depth: int, mip_rel_gap: float,
                     evaluators: _Evaluators | None = None) -> bool:
    """Screen for solving prefetch depth `depth`: the incumbent moved to that depth must still fit and predict a
    step shorter by more than the gap; otherwise a deeper prefetch buys less than the gap (or costs memory the
    incumbent uses). A heuristic: the optimum at `depth` may differ from the moved incumbent."""
    if incumbent is None:
        return True
    evs = evaluators if evaluators is not None else _Evaluators(cm)
    plan = PlanArrays.of(incumbent)
    now, then = evs(incumbent.prefetch_depth).evaluate(plan), evs(depth).evaluate(plan)
    if not then.fits(cm):
        return False
    return then.step_ms < now.step_ms * (1.0 - mip_rel_gap)


def _best_start(cm: CostModel, depth: int, previous: list[Schedule],
                evaluators: _Evaluators | None = None) -> Schedule | None:
    """The fastest warm start for depth `depth` under the linear model: earlier depths' solutions moved to this
    depth (when they still fit: one more weight slot per kind) or the best fixed variant."""
    ev = (evaluators if evaluators is not None else _Evaluators(cm))(depth)
    cands = [(ev.evaluate(PlanArrays.of(s)).step_ms, s) for s in fixed_candidates(cm, depth, evaluator=ev)[:1]]
    for s in previous:
        moved = Schedule(policy="milp", layers=[LayerPlan(**vars(lp)) for lp in s.layers], prefetch_depth=depth)
        val = ev.evaluate(PlanArrays.of(moved))
        if val.fits(cm):
            cands.append((val.step_ms, moved))
    return min(cands, key=lambda c: c[0])[1] if cands else None


class _Evaluators:
    """`StepEvaluator`s of one cost model by prefetch depth, built on first use (unit terms shared)."""

    def __init__(self, cm: CostModel) -> None:
        self.cm = cm
        self._units: list[Any] | None = None
        self._by_depth: dict[int, StepEvaluator] = {}

    @property
    def units(self) -> list[Any]:
        """unit_terms(cm), computed once."""
        if self._units is None:
            self._units = unit_terms(self.cm)
        return self._units

    def __call__(self, depth: int) -> StepEvaluator:
        if depth not in self._by_depth:
            if self._by_depth:  # the unit forms do not depend on the depth
                self._by_depth[depth] = next(iter(self._by_depth.values())).at_depth(depth)
            else:
                self._by_depth[depth] = StepEvaluator(self.cm, depth, units=self.units)
        return self._by_depth[depth]


def milp_value(cm: CostModel, schedule: Schedule) -> tuple[float, float]:
    """(step ms, peak GPU bytes) the MILP assigns to `schedule`: its model solved with every decision fixed to the
    schedule's. Equals `estimate.evaluate` (the MILP's rows encode that recursion); used to test that they agree.

    Raises:
        ValueError: the schedule does not fit the budgets (the fixed model is infeasible).
    """
    model = _PlanMilp(cm, schedule.prefetch_depth, symmetry_breaking=False)
    vals = decision_values(schedule)
    for key, j in model.v.items():
        if key[0] in ("c", "g", "k", "n", "r", "o"):
            model.h.changeColBounds(j, vals[key], vals[key])
    res = model.solve(60.0, 1e-9)
    if not res.has_solution:
        raise ValueError(f"the schedule does not fit the budgets (HiGHS status {res.status})")
    return float(model.h.getSolution().col_value[model.v["END", 0]]), model.peak_value_bytes()


def _nan_none(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)
