"""Branch and bound over the planning MILP's structural decisions (`_PlanMilp.solve_search`, the default path of
`milp.solve_milp`).

Handed to HiGHS whole, the MILP (`milp_model.py`) takes 8-14 s on 2 CPU cores for 64 layers with optimizer
placement open: the LP relaxation is weakest on the optimizer placement (fractional o_i split a layer's update
between CPU and GPU) and the global flags. The search branches on those itself (per-class counts of on-GPU
updates, flags) with LP bounds and leaves the rest to HiGHS (benchmarks/results/planner-20261129.json); its leaves
are settled by an LP rounding improved by local search under the linear model (`fast_eval.improve_plan`), HiGHS
only where that plan is not within the gap (planner-20261129.json: every bench case under 1 s at 64 layers).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from .fast_eval import PlanArrays, StepEvaluator, improve_plan, perturb_plan
from .milp_model import _PlanModel, _Result
from .schedule import LayerPlan, Schedule

logger = logging.getLogger(__name__)


class _PlanMilp(_PlanModel):
    """The MILP for one prefetch depth d (`milp_model._PlanModel`) with the branch-and-bound search over it."""

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
