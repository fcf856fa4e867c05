"""A vectorized evaluation of the linear step model (`estimate.py`) for many plans at once, and the local search
the planner's branch and bound uses for its leaves.

`estimate.evaluate` walks `Lin` dictionaries (20-40 ms per plan at 64 layers); the planner's leaf heuristic
evaluates thousands of candidate plans per solve. `StepEvaluator` compiles every linear piece of the model once
(forms grouped by their number of nonzeros) and evaluates N plans together: the max-plus recursion over the 2L + 1
units runs once on length-N arrays (a sweep of ~250-550 neighbouring plans of a 64-layer plan: 10-20 ms). It
returns exactly what the MILP assigns to a plan (step time, peak GPU bound, host and NVMe use, and the objective
with its tie-breakers); `estimate.evaluate` stays the reference (tested equal).

Plans are per-layer arrays: `c` (checkpoint), `tier` (0 GPU, 1 CPU, 2 NVMe), `r` (retain), `o` (update on the
GPU), each of length L (batches: L x N, one column per plan). `improve_plan` is a best-improvement local search
over single-layer moves with a budget penalty (see there).
"""
from __future__ import annotations

import copy
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
    """Linear forms over the decision vector, stacked; for a batch of decision vectors (columns of VT, nv x N)
    their values are const + the sum of coef * VT[col] over each form's nonzeros."""

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
            if c:
                self.rows.append(r)
                self.cols.append(self.index[k])
                self.coef.append(c * scale)
        return r

    def freeze(self) -> None:
        """Group the forms by their number of nonzeros k: one (forms x k) index and coefficient block per k."""
        self.const_a = np.asarray(self.const, dtype=float)
        self.n = len(self.const)
        by_row: dict[int, list[tuple[int, float]]] = {}
        for r, j, a in zip(self.rows, self.cols, self.coef):
            by_row.setdefault(r, []).append((j, a))
        by_k: dict[int, list[int]] = {}
        for r, terms in by_row.items():
            by_k.setdefault(len(terms), []).append(r)
        self.groups = []
        for _k, rows in sorted(by_k.items()):
            idx = np.array([[j for j, _ in by_row[r]] for r in rows], dtype=np.int64)
            coef = np.array([[a for _, a in by_row[r]] for r in rows], dtype=float)
            self.groups.append((np.array(rows, dtype=np.int64), idx, coef))

    def values(self, VT: np.ndarray) -> np.ndarray:
        """Form values, forms x N."""
        out = np.repeat(self.const_a[:, None], VT.shape[1], axis=1)
        for rows, idx, coef in self.groups:
            acc = VT[idx[:, 0]] * coef[:, 0:1]
            for j in range(1, idx.shape[1]):
                acc += VT[idx[:, j]] * coef[:, j:j + 1]
            out[rows] += acc
        return out


class StepEvaluator:
    """The linear model of `cm` at prefetch depth `depth`, compiled for fast evaluation of many plans at once."""

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
        f.freeze()
        self.forms = f
        self._index = index
        self._depth_parts(depth)
        self.early = [t.d2h_early_ms for t in units]
        self.up_ms = [cm.gpu_optim_load_ms(i) for i in range(L)]
        self.slack = [workspace_slack_ms(cm, units[i]) if i >= 2 else 0.0 for i in range(L)]
        self.cpu_ms = np.array([cm.cpu_optim_ms(i) for i in range(L)])
        self.resident_ms = cm.resident_optim_ms
        self.fwd_ms = list(cm.fwd_ms)

    def _depth_parts(self, depth: int) -> None:
        """What depends on the prefetch depth: the memory forms (weight slots, prefetched boundaries) and the
        weight-slot predecessors of the recursion."""
        self.d = depth
        mem = memory_terms(self.cm, depth)
        self.mem_base = mem.base
        f = _Forms(self._index)
        self._stored = np.array([f.add(x) for x in mem.stored])
        self._fetched = np.array([f.add(x) for x in mem.fetched])
        self._recomp = np.array([f.add(x) for x in mem.recomputed_input])
        self._fwd = np.array([f.add(x) for x in mem.fwd])
        self._bwd = np.array([f.add(x) for x in mem.bwd])
        self._head = f.add(mem.head)
        self._host = f.add(mem.host)
        self._nvme = f.add(mem.nvme)
        f.freeze()
        self.mforms = f
        lus = layer_units(self.L)
        self.slot_pred = [-1] * self.U
        for k, u in enumerate(lus):
            if k - depth - 1 >= 0:
                self.slot_pred[u] = lus[k - depth - 1]

    def at_depth(self, depth: int) -> StepEvaluator:
        """This evaluator at another prefetch depth (the unit forms shared)."""
        other = copy.copy(self)
        other._depth_parts(depth)
        return other

    # -- decisions ---------------------------------------------------------------------------------------------
    def vectors(self, c: np.ndarray, tier: np.ndarray, r: np.ndarray, o: np.ndarray) -> np.ndarray:
        """Decision vectors (c, g, k, n, r, o, x, t, tn, z, zn, flags) as columns, nv x N (inputs L x N)."""
        L, N = c.shape
        c = c.copy()
        c[0] = 1.0
        tier = np.where(c > 0.5, tier, 0.0)
        tier[0] = 0.0
        g = c * (tier == 0)
        k = c * (tier == 1)
        n = c * (tier == 2)
        x = np.zeros((L, N))
        x[:-1] = (1 - c[1:]) * (1 - r[1:]) * (1 - r[:-1])
        # t_j / tn_j: the start boundary of j's segment offloaded / on NVMe (carried from the last checkpoint)
        last = np.maximum.accumulate(np.where(c > 0.5, np.arange(L)[:, None], 0), axis=0)
        off = k + n
        t = np.take_along_axis(off, last, axis=0)
        tn = np.take_along_axis(n, last, axis=0)
        ends = np.ones((L, N))
        ends[:-1] = c[1:]
        flags = np.stack([off.max(axis=0), n.max(axis=0), o.max(axis=0)])
        return np.concatenate([c, g, k, n, r, o, x, t, tn, t * ends, tn * ends, flags], axis=0)

    # -- evaluation --------------------------------------------------------------------------------------------
    def evaluate(self, p: PlanArrays) -> PlanValue:
        return self.evaluate_many(p.c[:, None], p.tier[:, None], p.r[:, None], p.o[:, None])[0]

    def evaluate_many(self, c: np.ndarray, tier: np.ndarray, r: np.ndarray, o: np.ndarray) -> list[PlanValue]:
        """Values of N plans given as L x N arrays (one column per plan; see `PlanArrays`)."""
        obj, step, peak, host, nvme = self.evaluate_arrays(c, tier, r, o)
        return [PlanValue(float(a), float(b), float(p), float(h), float(n))
                for a, b, p, h, n in zip(obj, step, peak, host, nvme)]

    def evaluate_arrays(self, c: np.ndarray, tier: np.ndarray, r: np.ndarray, o: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(objective, step ms, peak GPU bytes, host bytes, NVMe bytes), each of length N, for N plans (L x N)."""
        L = self.L
        V = self.vectors(c, tier, r, o)
        vals = self.forms.values(V)  # unit forms x N
        mvals = self.mforms.values(V)  # memory forms x N
        rows = self._rows
        comp = vals[rows[:, 0]]
        h2d = np.maximum(vals[rows[:, 1]], vals[rows[:, 2]])
        d2h = np.maximum(np.maximum(vals[rows[:, 3]], vals[rows[:, 4]]), vals[rows[:, 5]])
        dw, dr, stash = vals[rows[:, 6]], vals[rows[:, 7]], vals[rows[:, 8]]
        n_next = np.zeros((L, V.shape[1]), dtype=bool)
        n_next[:-1] = V[3 * L + 1:4 * L] > 0.5
        opt = self.resident_ms + np.cumsum(self.cpu_ms[:, None] * (1.0 - o), axis=0)
        step = self._recursion(comp, h2d, d2h, dw, dr, stash, o > 0.5, opt, n_next)
        # memory (bytes): Q_i stored up to i, m_i the segment's working set
        Q = np.cumsum(mvals[self._stored], axis=0)
        fetched, rec = mvals[self._fetched], mvals[self._recomp]
        cT = V[:L]
        last = np.maximum.accumulate(np.where(cT > 0.5, np.arange(L)[:, None], 0), axis=0)
        crec = np.cumsum(rec, axis=0)
        m = np.take_along_axis(fetched, last, axis=0) + crec - np.take_along_axis(crec, last, axis=0)
        base = self.mem_base
        peak = np.maximum(np.maximum((Q + mvals[self._fwd]).max(axis=0), (Q + m + mvals[self._bwd]).max(axis=0)),
                          Q[-1] + mvals[self._head]) + base
        ties = TIE_MS_PER_DECISION * (V[2 * L:3 * L] + 2 * V[3 * L:4 * L] + V[4 * L:5 * L]
                                      + V[5 * L:6 * L] + 0.1 * V[:L]).sum(axis=0)
        obj = step + TIE_MS_PER_GIB_PEAK * peak / _GIB + ties
        return obj, step, peak, mvals[self._host], mvals[self._nvme]

    def _recursion(self, comp: np.ndarray, h2d: np.ndarray, d2h: np.ndarray, dw: np.ndarray, dr: np.ndarray,
                   stash: np.ndarray, on_gpu: np.ndarray, opt: np.ndarray, n_next: np.ndarray) -> np.ndarray:
        """`estimate._event_times` over a batch (arrays units x N, or layers x N): the step end (ms) per plan."""
        L, U = self.L, self.U
        mx = np.maximum
        N = comp.shape[1]
        E: list[np.ndarray] = []
        DE: list[np.ndarray] = []
        zero = np.zeros(N)
        e_prev = he_prev = de_prev = dk_prev = zero
        for u in range(U):
            h = h2d[u]
            if u == L:  # the head
                he, dk = he_prev, dk_prev
            else:
                start = he_prev
                sp = self.slot_pred[u]
                if sp >= 0:
                    start = mx(start, E[sp])
                if u < L:
                    i = u
                    dk = zero
                    start = mx(start, opt[i])
                    gpu = on_gpu[i]
                    # on-GPU update: states go up once layer i-1's forward has started, after F(i-2)'s D2H
                    after_g = e_prev - self.fwd_ms[i - 1] + self.up_ms[i] if i else zero
                    start_g = mx(start, DE[u - 2]) if i >= 2 else start
                    # CPU update: the small big-M of the two-workspace row
                    after_c = mx(DE[u - 2] + h - self.slack[i], 0.0) if i >= 2 else zero
                    start = np.where(gpu, start_g, start)
                    after = np.where(gpu, after_g, after_c)
                    he = mx(start + h, after)
                else:
                    dk = dk_prev + dr[u]
                    he = mx(start, dk) + h
            s = e_prev
            if u >= 2:
                s = mx(s, DE[u - 2])
            if u == 0:
                s = mx(s, self.resident_ms)
            if u != L:
                s = mx(s, he)
            e = s + comp[u]
            d = d2h[u]
            de = mx(mx(de_prev + d, e - self.early[u] + d), e + stash[u])
            if u < L:
                dk = np.where(n_next[u], mx(dk_prev, de), dk_prev) + dw[u]
            E.append(e)
            DE.append(de)
            e_prev, he_prev, de_prev, dk_prev = e, he, de, dk
        return mx(E[-1], DE[-1])


def improve_plan(ev: StepEvaluator, plan: PlanArrays, deadline: float, *, classes: list[list[int]],
                 nvme: bool = True, gpu_optimizer: bool = True, window: int = 2, multi: int = 16
                 ) -> tuple[PlanArrays, PlanValue, int]:
    """Best-improvement local search from `plan` (which may violate the budgets) under `ev`'s linear model.

    Moves, per layer i >= 1: change the tier of a materialized boundary, drop it, move it to i - 1 or i + 1,
    materialize an absent one (any tier), swap the tiers of two materialized boundaries up to `window` apart; per
    class of identical layers (`classes`, members ascending): one more or one fewer on-GPU update (`gpu_optimizer`)
    and one more or one fewer retained layer, keeping the MILP's symmetry orderings (on-GPU updates a prefix,
    retained layers a suffix of the members after layer 0; layer 0 retains freely). A plan that keeps the orderings
    stays a point of the ordered MILP. The score is the MILP objective plus a penalty for bytes over the GPU / host
    / NVMe budgets (10x the start's objective per GiB), so an LP rounding that misses the GPU budget by a few
    boundaries is repaired by the same moves that then shorten the step. Stops at a local optimum or at `deadline`
    (time.perf_counter()). Returns (plan, its value, evaluations); the plan fits the budgets iff `value.fits(cm)`.
    """
    import time

    cm, L = ev.cm, ev.L
    tiers = (0.0, 1.0, 2.0) if nvme else (0.0, 1.0)
    first = ev.evaluate(plan)
    pen = 10.0 * max(abs(first.objective), 1.0) / _GIB

    def score(val: PlanValue) -> float:
        over = (max(0.0, val.peak_gpu_bytes - cm.gpu_bytes) + max(0.0, val.host_bytes - cm.pinned_host_bytes)
                + max(0.0, val.nvme_bytes - cm.nvme_bytes))
        return val.objective + pen * over

    def scores_of(obj: np.ndarray, peak: np.ndarray, host: np.ndarray, nv: np.ndarray) -> np.ndarray:
        over = (np.maximum(0.0, peak - cm.gpu_bytes) + np.maximum(0.0, host - cm.pinned_host_bytes)
                + np.maximum(0.0, nv - cm.nvme_bytes))
        return obj + pen * over

    cur, cur_val = plan, first
    cur_score = score(first)
    evals = 1
    while time.perf_counter() < deadline:
        moves = _moves(cur, L, tiers, classes, gpu_optimizer, window)
        if not moves:
            break
        arrs = _apply(cur, moves)
        obj, step, peak, host, nv = ev.evaluate_arrays(*arrs)
        evals += len(moves)
        scores = scores_of(obj, peak, host, nv)
        order = np.argsort(scores, kind="stable")
        if not scores[order[0]] < cur_score - 1e-9:
            break
        # the best move, and the best improving moves combined (each at least 3 layers from the others picked):
        # a rounding often needs several independent repairs, one per sweep otherwise
        picked: list[int] = []
        used: set[int] = set()
        for j in order[:multi]:
            if not scores[j] < cur_score - 1e-9:
                break
            near = {i + d for _, i, _ in moves[j] for d in (-2, -1, 0, 1, 2)}
            if near & used:
                continue
            picked.append(int(j))
            used |= {i for _, i, _ in moves[j]}
        combos = [sum((moves[j] for j in picked[:k]), []) for k in sorted({2, 4, len(picked)}) if 1 < k <= len(picked)]
        best = (float(scores[order[0]]), [arr[:, order[0]] for arr in arrs],
                PlanValue(float(obj[order[0]]), float(step[order[0]]), float(peak[order[0]]),
                          float(host[order[0]]), float(nv[order[0]])))
        if combos:
            carrs = _apply(cur, combos)
            cobj, cstep, cpeak, chost, cnv = ev.evaluate_arrays(*carrs)
            evals += len(combos)
            cscores = scores_of(cobj, cpeak, chost, cnv)
            k = int(np.argmin(cscores))
            if cscores[k] < best[0]:
                best = (float(cscores[k]), [arr[:, k] for arr in carrs],
                        PlanValue(float(cobj[k]), float(cstep[k]), float(cpeak[k]), float(chost[k]), float(cnv[k])))
        cur_score, cols, cur_val = best
        cur = PlanArrays(*(col.copy() for col in cols))
    return cur, cur_val, evals


def _apply(p: PlanArrays, moves: list[list[tuple[int, int, float]]]) -> tuple[np.ndarray, ...]:
    """The plans `moves` make from `p`, as L x N arrays (c, tier, r, o; one column per move)."""
    N, L = len(moves), len(p.c)
    out = np.empty((4, L, N))
    out[0], out[1], out[2], out[3] = p.c[:, None], p.tier[:, None], p.r[:, None], p.o[:, None]
    for n, mv in enumerate(moves):
        for a, i, val in mv:
            out[a, i, n] = val
    return out[0], out[1], out[2], out[3]


def _moves(p: PlanArrays, L: int, tiers: tuple[float, ...], classes: list[list[int]], gpu_optimizer: bool,
           window: int) -> list[list[tuple[int, int, float]]]:
    """The moves from `p` (see `improve_plan`); a move is a list of (array 0..3 = c, tier, r, o; layer; value)."""
    c, tier, r, o = p.c.tolist(), p.tier.tolist(), p.r.tolist(), p.o.tolist()
    moves: list[list[tuple[int, int, float]]] = []
    for i in range(1, L):
        if c[i] > 0.5:
            moves += [[(1, i, t)] for t in tiers if t != tier[i]]
            moves.append([(0, i, 0.0), (1, i, 0.0)])
            moves += [[(0, j, 1.0), (1, j, tier[i]), (0, i, 0.0), (1, i, 0.0)]
                      for j in (i - 1, i + 1) if 0 < j < L and c[j] < 0.5]
            moves += [[(1, i, tier[j]), (1, j, tier[i])]
                      for j in range(i + 1, min(L, i + 1 + window)) if c[j] > 0.5 and tier[j] != tier[i]]
        else:
            moves += [[(0, i, 1.0), (1, i, t)] for t in tiers]
    for members in classes:
        if gpu_optimizer:
            on = [i for i in members if o[i] > 0.5]  # a prefix
            if on:
                moves.append([(3, on[-1], 0.0)])
            if len(on) < len(members):
                moves.append([(3, members[len(on)], 1.0)])
        rest = [i for i in members if i > 0]
        kept = [i for i in rest if r[i] > 0.5]  # a suffix
        if kept:
            moves.append([(2, kept[0], 0.0)])
        if len(kept) < len(rest):
            moves.append([(2, rest[len(rest) - len(kept) - 1], 1.0)])
        if members[0] == 0:
            moves.append([(2, 0, 1.0 - r[0])])
    return moves


def perturb_plan(ev: StepEvaluator, plan: PlanArrays, deadline: float, *, classes: list[list[int]], target: float,
                 nvme: bool = True, gpu_optimizer: bool = True, kicks: int = 8, layers_per_kick: int = 4,
                 seed: int = 0) -> tuple[PlanArrays, PlanValue, int]:
    """Iterated local search from a local optimum `plan` (which fits the budgets): up to `kicks` times, give
    `layers_per_kick` random layers a random tier (materializing absent boundaries), run `improve_plan` from there and
    keep the result when it is better. Stops early once the best objective is at most `target`. Deterministic for
    a given `seed`. Returns (best plan, its value, evaluations)."""
    import random
    import time

    rng = random.Random(seed)
    L = ev.L
    tiers = (0.0, 1.0, 2.0) if nvme else (0.0, 1.0)
    best, best_val = plan, ev.evaluate(plan)
    evals = 1
    for _ in range(kicks):
        if best_val.objective <= target or time.perf_counter() >= deadline or L < 2:
            break
        q = best.copy()
        for i in rng.sample(range(1, L), min(layers_per_kick, L - 1)):
            q.c[i] = 1.0
            q.tier[i] = rng.choice(tiers)
        p, val, n = improve_plan(ev, q, deadline, classes=classes, nvme=nvme, gpu_optimizer=gpu_optimizer)
        evals += n
        if val.fits(ev.cm) and val.objective < best_val.objective - 1e-9:
            best, best_val = p, val
    return best, best_val, evals
