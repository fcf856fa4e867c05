"""The O(L) mixed-integer program that chooses the per-layer schedule (LazyTrain, arXiv 2608.11919 §3, extended):
its columns, rows and objective, handed to HiGHS, and one plain HiGHS solve.

Decisions per decoder layer i: materialize boundary i (c_i) and its tier (g_i / k_i / n_i: GPU, pinned CPU, NVMe),
retain the layer's autograd activations from forward (r_i), run its optimizer update on the GPU (o_i); the
recompute indicator x_i follows from them by linking constraints. One model per weight prefetch depth d (the outer
loop over d is `milp.solve_milp`). The objective is the predicted step time (ms) of the linear step model in
`estimate.py` (compute + recompute + exposed transfers + exposed optimizer, as event times of max-plus lane
recursions), plus tiny tie-breakers. Memory rows are in GiB (`GIB`), time rows in ms.

Solved with HiGHS through `highspy` (rows collected as sparse arrays, one `passModel`): output silenced, explicit
`mip_rel_gap` and `time_limit`, optionally warm-started from a full schedule. The branch-and-bound search over this
model is `milp_search.py`.

Size: about 26 columns (8 binary) and 50 rows per layer (64 layers: ~1,700 x ~3,300).
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
    unit_terms,
    workspace_slack_ms,
)
from .fast_eval import TIE_MS_PER_DECISION, TIE_MS_PER_GIB_PEAK
from .schedule import LayerPlan, Schedule

logger = logging.getLogger(__name__)

#: Bytes per GiB: memory enters the model in GiB (coefficients of order 1) and leaves it in bytes.
GIB = float(1024**3)
# Tie-breakers (TIE_MS_PER_GIB_PEAK, TIE_MS_PER_DECISION, from fast_eval.py; ms-equivalents, far below the 1% gap):
# prefer less GPU memory, then fewer offloads / retains / on-GPU updates / checkpoints, among plans of equal step time.

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


class _PlanModel:
    """The MILP for one prefetch depth d (or, with `memory_only`, the smallest-peak-memory problem), solved whole
    by HiGHS (`solve`); `milp_search._PlanMilp` adds the branch-and-bound search.

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
