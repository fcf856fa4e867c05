"""A vectorized evaluation of the linear step model (`estimate.py`) for many plans of one cost model.

`estimate.evaluate` walks `Lin` dictionaries (about 10 ms per plan at 64 layers); the planner's primal heuristics
(`milp._PlanMilp`) evaluate hundreds of candidate plans per solve. `StepEvaluator` turns every linear piece of the
model into one sparse table once, so a plan costs one weighted `bincount` plus the max-plus recursion over the
2L + 1 units on plain floats (about 0.3 ms at 64 layers). It returns exactly what the MILP assigns to a plan (step
time, peak GPU bound, host and NVMe use, and the objective with its tie-breakers); `estimate.evaluate` stays the
reference (tested equal).

Plans are given as per-layer arrays: `c` (checkpoint), `tier` (0 GPU, 1 CPU, 2 NVMe), `r` (retain), `o` (update on
the GPU), all of length L.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cost_model import CostModel
from .estimate import Lin, UnitTerms, layer_units, memory_terms, unit_terms, workspace_slack_ms
from .schedule import LayerPlan, Schedule

__all__ = ["StepEvaluator", "PlanArrays", "TIE_MS_PER_GIB_PEAK", "TIE_MS_PER_DECISION"]

#: Tie-breakers of the MILP objective (ms-equivalents, far below the 1% gap): prefer less GPU memory, then fewer
#: offloads / retains / on-GPU updates / checkpoints among plans of equal step time (`milp.py` uses these).
TIE_MS_PER_GIB_PEAK = 1e-3
TIE_MS_PER_DECISION = 1e-3
_GIB = float(1024**3)
_SYMBOLS = ("c", "g", "k", "n", "r", "o", "x", "t", "tn", "z", "zn")
_NONE = -1e300  # value of a missing lower bound (max ignores it)


@dataclass
class PlanArrays:
    """One plan as per-layer 0/1 arrays (float): c, tier (0 GPU / 1 CPU / 2 NVMe, meaningful where c = 1), r, o."""

    c: np.ndarray
    tier: np.ndarray
    r: np.ndarray
    o: np.ndarray

    def copy(self) -> PlanArrays:
        return PlanArrays(self.c.copy(), self.tier.copy(), self.r.copy(), self.o.copy())

    @staticmethod
    def of(schedule: Schedule) -> PlanArrays:
        lp = schedule.layers
        tiers = {"gpu": 0, "cpu": 1, "nvme": 2}
        return PlanArrays(np.array([float(x.checkpoint or i == 0) for i, x in enumerate(lp)]),
                          np.array([float(tiers[x.tier]) if x.checkpoint and i else 0.0 for i, x in enumerate(lp)]),
                          np.array([float(x.retain) for x in lp]),
                          np.array([float(x.optimizer_device == "gpu") for x in lp]))

    def schedule(self, prefetch_depth: int) -> Schedule:
        names = ("gpu", "cpu", "nvme")
        layers = [LayerPlan(checkpoint=bool(c > 0.5) or i == 0, tier=names[int(t)] if c > 0.5 else "gpu",
                            retain=bool(r > 0.5), optimizer_device="gpu" if o > 0.5 else "cpu")
                  for i, (c, t, r, o) in enumerate(zip(self.c, self.tier, self.r, self.o))]
        return Schedule(policy="milp", layers=layers, prefetch_depth=prefetch_depth)


@dataclass
class PlanValue:
    """What the MILP assigns to one plan."""

    objective: float  # step_ms + tie-breakers (the MILP objective)
    step_ms: float
    peak_gpu_bytes: float
    host_bytes: float
    nvme_bytes: float

    def fits(self, cm: CostModel, tol: float = 1.0) -> bool:
        return (self.peak_gpu_bytes <= cm.gpu_bytes + tol and self.host_bytes <= cm.pinned_host_bytes + tol
                and self.nvme_bytes <= cm.nvme_bytes + tol)


class _Forms:
    """Linear forms over the decision vector, stacked: value = const + bincount(rows, coef * v[cols])."""

    def __init__(self, index: dict[tuple[str, int], int]) -> None:
        self.index = index
        self.const: list[float] = []
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.coef: list[float] = []

    def add(self, lin: Lin | None, scale: float = 1.0) -> int:
        r = len(self.const)
        if lin is None:
            self.const.append(_NONE)
            return r
        self.const.append(lin.const * scale)
        for k, c in lin.terms.items():
            self.rows.append(r)
            self.cols.append(self.index[k])
            self.coef.append(c * scale)
        return r

    def freeze(self) -> None:
        self.const_a = np.asarray(self.const, dtype=float)
        self.rows_a = np.asarray(self.rows, dtype=np.int64)
        self.cols_a = np.asarray(self.cols, dtype=np.int64)
        self.coef_a = np.asarray(self.coef, dtype=float)
        self.n = len(self.const)

    def values(self, v: np.ndarray) -> np.ndarray:
        return self.const_a + np.bincount(self.rows_a, weights=self.coef_a * v[self.cols_a], minlength=self.n)


class StepEvaluator:
    """The linear model of `cm` at prefetch depth `depth`, compiled for fast evaluation of many plans."""

    def __init__(self, cm: CostModel, depth: int, units: list[UnitTerms] | None = None) -> None:
        self.cm, self.d = cm, depth
        L = self.L = cm.num_layers
        index = {(s, i): j * L + i for j, s in enumerate(_SYMBOLS) for i in range(L)}
        for j, s in enumerate(("yoff", "ynv", "ygo")):
            index[(s, 0)] = len(_SYMBOLS) * L + j
        self.nv = len(index)
        units = unit_terms(cm) if units is None else units
        self.U = U = len(units)
        f = _Forms(index)
        # per unit: compute, 2 H2D bounds, 3 D2H bounds, disk write, disk read, stash (missing bounds: _NONE)
        self._rows = np.zeros((U, 9), dtype=np.int64)
        for u, t in enumerate(units):
            assert len(t.h2d) <= 2 and len(t.d2h) <= 3
            row = [f.add(t.compute)]
            row += [f.add(t.h2d[j] if j < len(t.h2d) else None) for j in range(2)]
            row += [f.add(t.d2h[j] if j < len(t.d2h) else None) for j in range(3)]
            row += [f.add(t.disk_write), f.add(t.disk_read), f.add(t.stash)]
            self._rows[u] = row
        mem = memory_terms(cm, depth)
        self.mem_base = mem.base
        self._stored = np.array([f.add(x) for x in mem.stored])
        self._fetched = np.array([f.add(x) for x in mem.fetched])
        self._recomp = np.array([f.add(x) for x in mem.recomputed_input])
        self._fwd = np.array([f.add(x) for x in mem.fwd])
        self._bwd = np.array([f.add(x) for x in mem.bwd])
        self._head = f.add(mem.head)
        self._host = f.add(mem.host)
        self._nvme = f.add(mem.nvme)
        f.freeze()
        self.forms = f
        lus = layer_units(L)
        self.slot_pred = [-1] * U
        for k, u in enumerate(lus):
            if k - depth - 1 >= 0:
                self.slot_pred[u] = lus[k - depth - 1]
        self.early = [t.d2h_early_ms for t in units]
        self.up_ms = [(cm.gpu_optim_h2d_bytes[i] + cm.param_bytes[i]) / (cm.h2d_gbps * 1e6) for i in range(L)]
        self.slack = [workspace_slack_ms(cm, units[i]) if i >= 2 else 0.0 for i in range(L)]
        self.cpu_ms = np.array([cm.cpu_optim_ms(i) for i in range(L)])
        self.resident_ms = cm.resident_optim_ms
        self.fwd_ms = list(cm.fwd_ms)

    # -- decisions ---------------------------------------------------------------------------------------------
    def vector(self, p: PlanArrays) -> np.ndarray:
        """The decision vector (c, g, k, n, r, o, x, t, tn, z, zn, flags) of a plan."""
        L = self.L
        c = p.c.copy()
        c[0] = 1.0
        tier = np.where(c > 0.5, p.tier, 0.0)
        tier[0] = 0.0
        g = c * (tier == 0)
        k = c * (tier == 1)
        n = c * (tier == 2)
        r, o = p.r, p.o
        x = np.zeros(L)
        x[:-1] = (1 - c[1:]) * (1 - r[1:]) * (1 - r[:-1])
        # t_j / tn_j: the start boundary of j's segment offloaded / on NVMe (carried from the last checkpoint)
        last = np.maximum.accumulate(np.where(c > 0.5, np.arange(L), 0))
        t = (k + n)[last]
        tn = n[last]
        ends = np.ones(L)
        ends[:-1] = c[1:]
        v = np.concatenate([c, g, k, n, r, o, x, t, tn, t * ends, tn * ends,
                            [float((k + n).any()), float(n.any()), float(o.any())]])
        return v

    # -- evaluation --------------------------------------------------------------------------------------------
    def evaluate(self, p: PlanArrays) -> PlanValue:
        v = self.vector(p)
        vals = self.forms.values(v)
        L = self.L
        rows = self._rows
        comp = vals[rows[:, 0]]
        h2d = np.maximum(vals[rows[:, 1]], vals[rows[:, 2]])
        d2h = np.maximum(np.maximum(vals[rows[:, 3]], vals[rows[:, 4]]), vals[rows[:, 5]])
        dw = vals[rows[:, 6]]
        dr = vals[rows[:, 7]]
        stash = vals[rows[:, 8]]
        o = p.o
        n_next = np.zeros(L, dtype=bool)
        n_next[:-1] = v[3 * L + 1:4 * L] > 0.5
        opt = self.resident_ms + np.cumsum(self.cpu_ms * (1.0 - o))
        step = self._recursion(comp.tolist(), h2d.tolist(), d2h.tolist(), dw.tolist(), dr.tolist(),
                               stash.tolist(), (o > 0.5).tolist(), opt.tolist(), n_next.tolist())
        # memory
        Q = np.cumsum(vals[self._stored])
        fetched, rec = vals[self._fetched], vals[self._recomp]
        c = v[:L]
        m = np.empty(L)
        acc = 0.0
        for i, (ci, fi, ri) in enumerate(zip(c.tolist(), fetched.tolist(), rec.tolist())):
            acc = fi if ci > 0.5 else acc + ri
            m[i] = acc
        base = self.mem_base
        peak = max(float(np.max(base + Q + vals[self._fwd])), float(np.max(base + Q + m + vals[self._bwd])),
                   base + float(Q[-1]) + float(vals[self._head]))
        ties = TIE_MS_PER_DECISION * float(np.sum(v[2 * L:3 * L] + 2 * v[3 * L:4 * L] + v[4 * L:5 * L]
                                                  + v[5 * L:6 * L] + 0.1 * c))
        obj = step + TIE_MS_PER_GIB_PEAK * peak / _GIB + ties
        return PlanValue(obj, step, peak, float(vals[self._host]), float(vals[self._nvme]))

    def _recursion(self, comp: list[float], h2d: list[float], d2h: list[float], dw: list[float], dr: list[float],
                   stash: list[float], on_gpu: list[bool], opt: list[float], n_next: list[bool]) -> float:
        """`estimate._event_times` on floats (same order of operations): the step end (ms)."""
        L, U = self.L, self.U
        slot_pred, early, up_ms, slack, fwd_ms = self.slot_pred, self.early, self.up_ms, self.slack, self.fwd_ms
        E = [0.0] * U
        DE = [0.0] * U
        e_prev = he_prev = de_prev = dk_prev = 0.0
        for u in range(U):
            c = comp[u]
            h = h2d[u]
            d = d2h[u]
            is_fwd = u < L
            if u == L:  # the head
                he = he_prev
                dk = dk_prev
            else:
                start = he_prev
                sp = slot_pred[u]
                if sp >= 0 and E[sp] > start:
                    start = E[sp]
                after = 0.0
                if is_fwd:
                    i = u
                    dk = 0.0
                    if opt[i] > start:
                        start = opt[i]
                    if on_gpu[i]:
                        if i:
                            after = e_prev - fwd_ms[i - 1] + up_ms[i]
                        if i >= 2 and DE[u - 2] > start:
                            start = DE[u - 2]
                    elif i >= 2:
                        a = DE[u - 2] + h - slack[i]
                        if a > after:
                            after = a
                else:
                    dk = dk_prev + dr[u]
                    if dk > start:
                        start = dk
                he = start + h
                if after > he:
                    he = after
            s = e_prev
            if u >= 2 and DE[u - 2] > s:
                s = DE[u - 2]
            if u == 0 and self.resident_ms > s:
                s = self.resident_ms
            if u != L and he > s:
                s = he
            e = s + c
            de = de_prev + d
            a = e - early[u] + d
            if a > de:
                de = a
            a = e + stash[u]
            if a > de:
                de = a
            if is_fwd:
                dk = (de if n_next[u] and de > dk_prev else dk_prev) + dw[u]
            E[u] = e
            DE[u] = de
            e_prev, he_prev, de_prev, dk_prev = e, he, de, dk
        return max(E[-1], DE[-1])

