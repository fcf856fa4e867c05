"""The planner's linear step model, shared by the MILP (`milp.py`) and by a direct evaluation of any schedule.

One step is a sequence of *units*: forward F(0..L-1), the head H, then backward B(L-1..0). Each unit has a
compute time on the GPU, an H2D time (what it needs loaded first), a D2H time (what it sends back afterwards) and
NVMe write/read times, all linear in the per-layer decisions. Event times follow max-plus recursions (lanes are
compute, H2D, D2H, disk, CPU optimizer); minimising the step end over these recursions in an LP gives exactly the
recursion's value, so the MILP objective for a fixed set of decisions equals `evaluate(...)` of that schedule
(tested). `simulator.py` replays the executor's real task order (recompute at segment start, per-kind weight
slots, fluid PCIe sharing) to check this model.

Notation (per layer i; the MILP code uses the same symbols):
    c_i  boundary i materialized          g_i, k_i, n_i  its tier: GPU / pinned CPU / NVMe (one-hot, sum = c_i)
    r_i  layer i retains its activations   o_i  layer i's optimizer update runs on the GPU
    x_i  layer i re-run in backward to rebuild layer i+1's input: x_i = 1 iff c_{i+1} = r_{i+1} = r_i = 0
    z_i  layer i ends a segment whose start boundary is offloaded (zn_i: on NVMe): the fetch is charged to B(i)
    f_i, b_i forward / backward ms; P_i weight bytes; G_i grad bytes; A_i boundary bytes; S_i saved bytes
    (a retained layer holds R_i = S_i + A_i by default: its autograd activations and its output, which feeds
    layer i+1; `CostModel.retained_bytes` overrides it when layers run in row chunks)

Modelling choices (approximations the simulator quantifies):
    - the recompute of layer i (x_i f_i, and the reload of its weights x_i P_i) is charged to unit B(i), not to the
      start of its segment; totals are exact, their placement in time is approximate (the fetch of the
      segment's start boundary, a hard dependency, is charged to the segment's first unit B(e-1));
    - PCIe duplex: a unit's H2D time is at least its one-way time and the duplex time of its loads together
      with the previous unit's D2H; D2H times likewise with the next unit's loads (see `unit_terms`);
    - NVMe: one disk lane (forward writes after their D2H, backward reads as early as the lane allows); every
      backward unit's loads wait for the reads charged up to it (the H2D lane runs in order, so loads behind a
      fetch wait for its read anyway);
    - a forward unit's D2H starts when its forward starts (update states) and its stash when the forward ends;
    - weight slots: with prefetch depth d, a unit's loads start once the layer-unit d + 1 earlier has computed;
    - two D2H buffers: a unit's compute starts once the D2H of the unit two earlier is done;
    - optimizer: updates start when the previous backward ends (the global grad norm is known then): the resident
      parameters (embedding, lm_head, norm) first, at `optimizer.step()`, then layers 0..L-1 (CPU ones, in order,
      overlapping the next forward as streaming/updates.py does); the first forward waits for the resident
      update, F(i)'s loads for the CPU chain through layer i (a GPU-updated layer thus waits for the previous
      CPU-updated one: its forward would anyway); on-GPU updates use two
      state workspaces: layer i's states go up once layer i-1's forward has started (its update is done) and
      the D2H of unit F(i-2) (which holds layer i-2's states) is done.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .cost_model import CostModel
from .schedule import Schedule

__all__ = ["Lin", "UnitTerms", "MemoryTerms", "PlanEstimate", "unit_terms", "memory_terms", "decision_values",
           "evaluate", "peak_bytes", "recompute_flags", "layer_units", "workspace_slack_ms", "op_times"]

Key = tuple[str, int]


@dataclass
class Lin:
    """A linear expression `const + sum(coef * var[key])` over decision keys such as ("x", 3)."""

    const: float = 0.0
    terms: dict[Key, float] = field(default_factory=dict)

    def add(self, coef: float, key: Key | None = None) -> Lin:
        """Add `coef` (key None) or `coef * var[key]`; returns self."""
        if key is None:
            self.const += coef
        elif coef:
            self.terms[key] = self.terms.get(key, 0.0) + coef
        return self

    def value(self, vals: Mapping[Key, float]) -> float:
        return self.const + sum(c * vals.get(k, 0.0) for k, c in self.terms.items())

    def scaled(self, s: float) -> Lin:
        return Lin(self.const * s, {k: c * s for k, c in self.terms.items()})


@dataclass
class UnitTerms:
    """Durations of one unit (ms), linear in the decisions.

    Attributes:
        name: "F3", "H", "B3".
        layer: decoder layer of the unit (-1 for the head).
        compute: GPU compute time.
        h2d: lower bounds on the H2D time; the time is their maximum (one-way rate; duplex limit).
        d2h: lower bounds on the D2H time after the compute, likewise.
        disk_write: NVMe write time of the boundary the unit stashes (after its D2H).
        disk_read: NVMe read time of the boundary the unit fetches (before its H2D).
        stash: D2H time of the boundary a forward unit stashes (ms, one-way rate); it goes after the compute.
        d2h_early_ms: how long before the compute's end the unit's D2H may start (ms): a forward unit's on-GPU
            update finishes before its forward of f_i ms, and its states go back from then.
    """

    name: str
    layer: int
    compute: Lin
    h2d: list[Lin]
    d2h: list[Lin]
    disk_write: Lin
    disk_read: Lin
    stash: Lin = field(default_factory=Lin)
    d2h_early_ms: float = 0.0

    def h2d_ms(self, vals: Mapping[Key, float]) -> float:
        """H2D duration (ms) for 0/1 decision values."""
        return max(b.value(vals) for b in self.h2d)

    def d2h_ms(self, vals: Mapping[Key, float]) -> float:
        """D2H duration (ms) for 0/1 decision values."""
        return max(b.value(vals) for b in self.d2h)


def layer_units(num_layers: int) -> list[int]:
    """Unit indices of the layer units in execution order: F(0..L-1) = 0..L-1, then B(L-1..0) = L+1..2L."""
    return list(range(num_layers)) + list(range(num_layers + 1, 2 * num_layers + 1))


def unit_terms(cm: CostModel) -> list[UnitTerms]:
    """The 2L + 1 units F(0..L-1), H, B(L-1..0) with their durations as linear expressions (ms).

    PCIe is full duplex with a shared limit: H2D bytes H and D2H bytes D moved at the same time take at least
    max(H / h2d, D / d2h, (H + D) / (2 * bidir)). A unit's loads overlap the previous unit's D2H, and the
    gradients a backward unit sends overlap the next unit's loads, so those durations are bounded by their
    one-way time and by the duplex time of the pair; a forward unit's stash by the bidirectional rate, its update
    states (o_i = 1) by the pair bound.
    """
    L = cm.num_layers
    a_max = max(cm.act_bytes)  # a fetched boundary (all boundaries are [B, T, H]: equal in practice)
    names: list[tuple[str, int]] = []
    compute: list[Lin] = []
    h_bytes: list[Lin] = []  # H2D bytes the unit needs before its compute
    d_bytes: list[Lin] = []  # D2H bytes the unit sends after its compute
    writes: list[Lin] = []
    reads: list[Lin] = []
    stashes: list[Lin] = []
    stash_bytes: list[Lin] = []
    for i in range(L):
        # F(i): the optional on-GPU optimizer update of layer i, then its no-grad forward; stash boundary i+1.
        names.append((f"F{i}", i))
        compute.append(Lin(cm.fwd_ms[i]).add(cm.gpu_optim_ms(i), ("o", i)))
        # the last layer's loads also bring the host-placed LM head's updated weights (needed by the head next)
        head_w = cm.head_h2d_bytes if i == L - 1 else 0
        h_bytes.append(Lin(cm.param_bytes[i] + head_w).add(cm.gpu_optim_up_bytes(i), ("o", i)))
        db = Lin().add(cm.gpu_optim_d2h_bytes[i], ("o", i))
        write, stash = Lin(), Lin()
        sb = Lin()
        if i + 1 < L:
            db.add(cm.act_bytes[i + 1], ("k", i + 1)).add(cm.act_bytes[i + 1], ("n", i + 1))
            sb.add(cm.act_bytes[i + 1], ("k", i + 1)).add(cm.act_bytes[i + 1], ("n", i + 1))
            stash.add(cm.act_bytes[i + 1] / (cm.d2h_gbps * 1e6), ("k", i + 1))
            stash.add(cm.act_bytes[i + 1] / (cm.d2h_gbps * 1e6), ("n", i + 1))
            write.add(cm.act_bytes[i + 1] / (cm.nvme_write_gbps * 1e6), ("n", i + 1))
        d_bytes.append(db)
        stash_bytes.append(sb)
        stashes.append(stash)
        writes.append(write)
        reads.append(Lin())
    names.append(("H", -1))
    compute.append(Lin(cm.head_ms))
    h_bytes.append(Lin())
    d_bytes.append(Lin(cm.head_grad_bytes))
    writes.append(Lin())
    reads.append(Lin())
    for j in reversed(range(L)):
        # B(j): recompute of layer j (charged here), forward with grad unless retained, backward; grads D2H.
        names.append((f"B{j}", j))
        compute.append(Lin(cm.fwd_ms[j] + cm.bwd_ms[j]).add(cm.fwd_ms[j], ("x", j)).add(-cm.fwd_ms[j], ("r", j)))
        # The segment's start boundary is fetched (and read from NVMe) before the segment's first backward unit,
        # B(e-1): charged to the unit that ends a segment whose start is offloaded (z_j, zn_j).
        h_bytes.append(Lin(cm.param_bytes[j]).add(cm.param_bytes[j], ("x", j)).add(a_max, ("z", j)))
        # a GPU-updated layer's kept gradient stays on the GPU (`CostModel.kept_grad_bytes`)
        d_bytes.append(Lin(cm.grad_bytes[j] + (cm.embed_grad_bytes if j == 0 else 0)).add(-cm.kept(j), ("o", j)))
        writes.append(Lin())
        reads.append(Lin().add(a_max / (cm.nvme_read_gbps * 1e6), ("zn", j)))
    h_ms = 1.0 / (cm.h2d_gbps * 1e6)  # ms per byte, H2D alone
    d_ms = 1.0 / (cm.d2h_gbps * 1e6)  # ms per byte, D2H alone
    duplex_ms = 1.0 / (2.0 * cm.bidir_gbps * 1e6)  # ms per byte of H2D + D2H moved together
    b_ms = 1.0 / (cm.bidir_gbps * 1e6)  # ms per byte in one direction while the other is busy
    units: list[UnitTerms] = []
    for u, (name, layer) in enumerate(names):
        prev_d = d_bytes[u - 1] if u else Lin()
        next_h = h_bytes[u + 1] if u + 1 < len(names) else Lin()
        # a pair bound only on a lane that surely carries bytes (else it would invent a transfer); a forward
        # unit's D2H (stash, update states: decision-dependent) is bounded by the bidirectional rate instead
        h2d = [h_bytes[u].scaled(h_ms)]
        if h_bytes[u].const > 0:
            h2d.append(_plus(h_bytes[u], prev_d).scaled(duplex_ms))
        d2h = [d_bytes[u].scaled(d_ms)]
        if u < L:
            # stash alone at the bidirectional rate (weights stream meanwhile); with an on-GPU update (o_i = 1)
            # the pair bound, switched off for o_i = 0 by subtracting the next loads' largest time (a tight
            # big-M written as a linear term: -M + M o_i)
            d2h.append(stash_bytes[u].scaled(b_ms))
            big = max(0.0, _max_value(next_h)) * duplex_ms
            pair = _plus(d_bytes[u], next_h).scaled(duplex_ms)
            pair.add(-big).add(big, ("o", layer))
            d2h.append(pair)
        elif d_bytes[u].const > 0:
            d2h.append(_plus(d_bytes[u], next_h).scaled(duplex_ms))
        fwd_unit = u < L
        units.append(UnitTerms(name, layer, compute[u], h2d, d2h, writes[u], reads[u],
                               stashes[u] if fwd_unit else Lin(), cm.fwd_ms[layer] if fwd_unit else 0.0))
    return units


def _max_value(a: Lin) -> float:
    """Largest value of `a` over 0/1 decisions."""
    return a.const + sum(max(0.0, c) for c in a.terms.values())


def _plus(a: Lin, b: Lin) -> Lin:
    out = Lin(a.const + b.const, dict(a.terms))
    for k, c in b.terms.items():
        out.add(c, k)
    return out


@dataclass
class MemoryTerms:
    """Memory pieces (bytes) of the static peak bound; see `memory_terms`."""

    base: float
    fwd: list[Lin]
    head: Lin
    bwd: list[Lin]
    stored: list[Lin]
    fetched: list[Lin]
    recomputed_input: list[Lin]
    host: Lin
    nvme: Lin


def memory_terms(cm: CostModel, prefetch_depth: int) -> MemoryTerms:
    """Linear pieces of the GPU peak bound, host and NVMe use (bytes).

    With Q_i = sum_{l<=i} (A_l g_l + R_l r_l) (GPU-tier boundaries, retained activations and outputs alive from forward
    to backward) and m_i the boundary bytes held for the segment containing i up to i (its fetched start boundary
    plus recomputed inputs), the peak is the maximum of
        forward i:  base + Q_i + A_i (1 - g_i) + A_i + fwd_work_i + 2 W_opt ygo
        head:       base + Q_{L-1} + A_{L-1} + head_work + 2 W_opt ygo + d A_max yoff
        backward j: base + Q_j + m_j + (1 - r_j) S_j + max(fwd_work_j, bwd_work_j) + 2 G_j + d A_max yoff + K_j
    plus, in forward i, K'_i = sum_{l >= i} kept_l o_l (kept gradients of the previous backward not yet consumed by
    their update) and in backward j K_j = sum_{l >= j} kept_l o_l (those this backward has kept so far);
    where base = resident + reserve + (d + 1) slots per kind, W_opt the largest on-GPU optimizer workspace,
    ygo = any on-GPU update ((d + 1) workspaces per layer kind, counted as 2 W_opt above for d = 1 and one kind),
    yoff = any offloaded boundary (d of them may be prefetched at once).
    Conservative where the timeline would free earlier (the simulator measures the real peak).
    """
    L = cm.num_layers
    a_max = max(cm.act_bytes)
    # on-GPU update workspaces: the executor stages each update in its slot's set (streaming/executor.py), so up to
    # depth + 1 sets per layer structure exist during forward (2 for one structure at depth 1: double-buffered)
    w_opt = (prefetch_depth + 1) * len(set(cm.layer_kind)) * max(cm.gpu_optim_workspace_bytes(i) for i in range(L))
    base = cm.resident_bytes + cm.gpu_reserve_bytes + cm.slot_bytes(prefetch_depth)
    stored = [Lin().add(cm.act_bytes[i], ("g", i)).add(cm.retained(i), ("r", i)) for i in range(L)]
    fetched = [Lin().add(cm.act_bytes[i], ("k", i)).add(cm.act_bytes[i], ("n", i)) for i in range(L)]
    recomputed_input = [Lin() if i == 0 else Lin().add(cm.act_bytes[i], ("x", i - 1)) for i in range(L)]
    fwd = [Lin(2 * cm.act_bytes[i] + cm.fwd_work_bytes[i]).add(-cm.act_bytes[i], ("g", i)).add(w_opt, ("ygo", 0))
           for i in range(L)]
    head = Lin(cm.act_bytes[L - 1] + cm.head_work_bytes).add(w_opt, ("ygo", 0))
    head.add(prefetch_depth * a_max, ("yoff", 0))
    bwd = [Lin(cm.saved_bytes[j] + max(cm.fwd_work_bytes[j], cm.bwd_work_bytes[j]) + 2 * cm.grad_bytes[j])
           .add(-cm.saved_bytes[j], ("r", j)).add(prefetch_depth * a_max, ("yoff", 0)) for j in range(L)]
    for i in range(L):  # kept gradients: from B(k) to the update in F(k) of the next step, k >= i
        for k in range(i, L):
            fwd[i].add(cm.kept(k), ("o", k))
            bwd[i].add(cm.kept(k), ("o", k))
    host = Lin(cm.host_fixed_bytes).add(2 * a_max, ("ynv", 0))
    nvme = Lin()
    for i in range(L):
        host.add(cm.act_bytes[i], ("k", i))
        nvme.add(cm.act_bytes[i], ("n", i))
    return MemoryTerms(base, fwd, head, bwd, stored, fetched, recomputed_input, host, nvme)


def recompute_flags(schedule: Schedule) -> list[bool]:
    """x_i: layer i is re-run (no grad) in backward to rebuild layer i+1's input: boundary i+1 is not
    materialized and neither layer i nor layer i+1 is retained (a retained layer keeps its output, and a
    retained layer i+1 needs no input). This is the executor's rule (`streaming.executor.plan_ops`); it is
    stricter than `Schedule.recomputed_layers`, which ignores the retained layer's own output."""
    lp = schedule.layers
    return [i + 1 < len(lp) and not lp[i + 1].checkpoint and not lp[i + 1].retain and not lp[i].retain
            for i in range(len(lp))]


def decision_values(schedule: Schedule) -> dict[Key, float]:
    """0/1 values of every decision key for a schedule (the MILP's integer point)."""
    vals: dict[Key, float] = {}
    x = recompute_flags(schedule)
    for i, lp in enumerate(schedule.layers):
        vals[("c", i)] = float(lp.checkpoint)
        vals[("g", i)] = float(lp.checkpoint and lp.tier == "gpu")
        vals[("k", i)] = float(lp.checkpoint and lp.tier == "cpu")
        vals[("n", i)] = float(lp.checkpoint and lp.tier == "nvme")
        vals[("r", i)] = float(lp.retain)
        vals[("o", i)] = float(lp.optimizer_device == "gpu")
        vals[("x", i)] = float(x[i])
    L = schedule.num_layers
    # t_j / tn_j: the start boundary of j's segment is offloaded / on NVMe; z_j / zn_j: j also ends its segment
    t = tn = 0.0
    for j, lp_j in enumerate(schedule.layers):
        if lp_j.checkpoint:
            t, tn = vals[("k", j)] + vals[("n", j)], vals[("n", j)]
        ends = j + 1 == L or schedule.layers[j + 1].checkpoint
        vals[("t", j)], vals[("tn", j)] = t, tn
        vals[("z", j)], vals[("zn", j)] = (t, tn) if ends else (0.0, 0.0)
    vals[("yoff", 0)] = float(any(vals[("k", i)] + vals[("n", i)] for i in range(L)))
    vals[("ynv", 0)] = float(any(vals[("n", i)] for i in range(L)))
    vals[("ygo", 0)] = float(any(vals[("o", i)] for i in range(L)))
    return vals


@dataclass
class PlanEstimate:
    """The linear model's prediction for one schedule.

    Attributes:
        step_ms: predicted step time (ms): end of the last compute or gradient D2H, from the moment the previous
            backward ended.
        compute_ms: one forward and one backward of every layer, plus the head (ms).
        recompute_ms: re-forwards in backward (ms): each non-retained layer's forward with grad, plus the
            no-grad re-runs that rebuild segment inputs (x_i).
        gpu_optim_ms: on-GPU optimizer compute (ms).
        exposed_optimizer_ms: step time lost to waiting for CPU optimizer updates (ms): step_ms minus the step
            time with instant CPU updates.
        exposed_transfer_ms: the rest of the stall time (ms): step_ms - compute - recompute - gpu optimizer -
            exposed optimizer.
        peak_gpu_bytes, pinned_host_bytes, nvme_bytes: memory bounds (bytes).
        event_times: per unit name, (H2D end, compute end, D2H end, disk end) in ms, for warm starts.
    """

    step_ms: float
    compute_ms: float
    recompute_ms: float
    gpu_optim_ms: float
    exposed_optimizer_ms: float
    exposed_transfer_ms: float
    peak_gpu_bytes: float
    pinned_host_bytes: float
    nvme_bytes: float
    event_times: dict[str, tuple[float, float, float, float]] = field(default_factory=dict)

    def as_predicted(self, tokens_per_step: int) -> dict[str, Any]:
        """The `Schedule.predicted` dict (ms, bytes, tokens/s)."""
        return {"step_ms": self.step_ms, "peak_gpu_bytes": int(round(self.peak_gpu_bytes)),
                "pinned_host_bytes": int(round(self.pinned_host_bytes)), "nvme_bytes": int(round(self.nvme_bytes)),
                "compute_ms": self.compute_ms, "recompute_ms": self.recompute_ms,
                "gpu_optim_ms": self.gpu_optim_ms, "exposed_transfer_ms": self.exposed_transfer_ms,
                "exposed_optimizer_ms": self.exposed_optimizer_ms,
                "tokens_per_s": tokens_per_step / (self.step_ms / 1e3) if self.step_ms > 0 else 0.0}


def workspace_slack_ms(cm: CostModel, t: UnitTerms) -> float:
    """M_i (ms), the small big-M of the two-workspace rule for forward unit F(i): when layer i updates on the CPU,
    its loads may still not end more than M_i before the D2H of unit F(i-2) is done. M_i = the unit's largest
    H2D time plus the previous layer's forward, so the rule costs a CPU-updated layer nothing in practice (its
    compute waits for that D2H anyway: two D2H buffers), while the LP relaxation stays tight (a huge M would let
    a fractional o_i ignore the rule)."""
    ones: dict[Key, float] = {}
    for b in t.h2d:
        for k in b.terms:
            ones[k] = 1.0
    return max(b.value(ones) for b in t.h2d) + (cm.fwd_ms[t.layer - 1] if t.layer > 0 else 0.0)


def _event_times(cm: CostModel, units: list[UnitTerms], vals: Mapping[Key, float], depth: int,
                 cpu_optim: bool = True) -> tuple[float, dict[str, tuple[float, float, float, float]]]:
    """The max-plus recursion the MILP's event constraints encode; returns (step end ms, per-unit times)."""
    L = cm.num_layers
    lus = layer_units(L)
    slot_pred = {u: lus[v - depth - 1] for v, u in enumerate(lus) if v - depth - 1 >= 0}
    E: list[float] = []
    HE: list[float] = []
    DE: list[float] = []
    DK: list[float] = []
    opt_done = cm.resident_optim_ms if cpu_optim else 0.0  # O_{-1}
    times: dict[str, tuple[float, float, float, float]] = {}
    for u, t in enumerate(units):
        e_prev = E[u - 1] if u else 0.0
        he_prev = HE[u - 1] if u else 0.0
        de_prev = DE[u - 1] if u else 0.0
        dk_prev = DK[u - 1] if u else 0.0
        c = t.compute.value(vals)
        h = t.h2d_ms(vals)
        d = t.d2h_ms(vals)
        is_fwd, is_head = u < L, u == L
        dk = dk_prev + t.disk_read.value(vals) if not is_fwd else 0.0
        if is_head:
            he = he_prev
        else:
            starts = [he_prev]
            if u in slot_pred:
                starts.append(E[slot_pred[u]])
            after = 0.0  # a release that already includes the transfer time
            if is_fwd:
                i = t.layer
                if vals.get(("o", i), 0.0) < 0.5 and cpu_optim:
                    opt_done += cm.cpu_optim_ms(i)
                starts.append(opt_done)
                if vals.get(("o", i), 0.0) > 0.5:
                    if i:
                        after = e_prev - cm.fwd_ms[i - 1] + cm.gpu_optim_load_ms(i)
                    if i >= 2:
                        starts.append(DE[u - 2])
                elif i >= 2:
                    after = max(after, DE[u - 2] + h - workspace_slack_ms(cm, t))
            else:
                starts.append(dk)
            he = max(max(starts) + h, after)
        starts = [e_prev, DE[u - 2] if u >= 2 else 0.0]
        if u == 0:
            starts.append(cm.resident_optim_ms if cpu_optim else 0.0)  # resident parameters are updated first
        if not is_head:
            starts.append(he)
        e = max(starts) + c
        de = max(de_prev + d, e - t.d2h_early_ms + d, e + t.stash.value(vals))
        if is_fwd:
            writes = t.layer + 1 < L and vals.get(("n", t.layer + 1), 0.0) > 0.5
            dk = (max(dk_prev, de) if writes else dk_prev) + t.disk_write.value(vals)
        E.append(e)
        HE.append(he)
        DE.append(de)
        DK.append(dk)
        times[t.name] = (he, e, de, dk)
    return max(E[-1], DE[-1]), times


def evaluate(cm: CostModel, schedule: Schedule, *, units: list[UnitTerms] | None = None) -> PlanEstimate:
    """The linear model's step time and memory for `schedule` (what the MILP objective would be for it).
    `units`: `unit_terms(cm)` when the caller has it already.

    Raises:
        ValueError: the schedule's layer count differs from the cost model's.
    """
    if schedule.num_layers != cm.num_layers:
        raise ValueError(f"schedule has {schedule.num_layers} layers but the cost model has {cm.num_layers}")
    vals = decision_values(schedule)
    d = schedule.prefetch_depth
    units = unit_terms(cm) if units is None else units
    step, times = _event_times(cm, units, vals, d)
    step_no_opt, _ = _event_times(cm, units, vals, d, cpu_optim=False)
    compute = cm.compute_ms()
    # re-forwards: each non-retained layer's forward with grad in backward, plus segment rebuilds (x_i)
    recompute = sum(cm.fwd_ms[i] * (1.0 + vals[("x", i)] - vals[("r", i)]) for i in range(cm.num_layers))
    gopt = sum(cm.gpu_optim_ms(i) * vals[("o", i)] for i in range(cm.num_layers))
    exposed_opt = max(0.0, step - step_no_opt)
    exposed_transfer = max(0.0, step - compute - recompute - gopt - exposed_opt)
    mem = memory_terms(cm, d)
    peak, _ = peak_bytes(mem, vals, cm.num_layers)
    return PlanEstimate(step, compute, recompute, gopt, exposed_opt, exposed_transfer, peak,
                        mem.host.value(vals), mem.nvme.value(vals), times)


def op_times(cm: CostModel, schedule: Schedule, ops: list[tuple[str, int]]) -> dict[str, dict[str, float]]:
    """The compute the plan prices per executor op and layer kind (ms per micro-batch), to set against the GPU time
    the executor measures per op (streaming/stats.py `OpTimer`): {"fwd" | "recompute" | "bwd": {kind: ms}, "head":
    {"all": ms}}. `ops`: the step's op list (streaming/layer_calls.py `plan_ops`). A non-retained layer's "bwd"
    holds its re-forward with grad; "head" includes the embedding, which the executor's head op does not."""
    out: dict[str, dict[str, float]] = {"fwd": {}, "recompute": {}, "bwd": {}}
    for op, i in ops:
        if op == "load":
            continue
        ms = cm.fwd_ms[i] if op != "bwd" else cm.bwd_ms[i] + (0.0 if schedule.layers[i].retain else cm.fwd_ms[i])
        kind = cm.layer_kind[i]
        out[op][kind] = out[op].get(kind, 0.0) + ms
    out["head"] = {"all": cm.head_ms}
    return out


def peak_bytes(mem: MemoryTerms, vals: Mapping[Key, float], num_layers: int) -> tuple[float, str]:
    """Static peak GPU bound (bytes) and where it occurs ("F3", "H", "B3")."""
    q = 0.0
    m = 0.0
    best = (0.0, "")
    qs: list[float] = []
    ms: list[float] = []
    for i in range(num_layers):
        q += mem.stored[i].value(vals)
        if vals.get(("c", i), 0.0) > 0.5:
            m = mem.fetched[i].value(vals)
        else:
            m += mem.recomputed_input[i].value(vals)
        qs.append(q)
        ms.append(m)
    for i in range(num_layers):
        best = max(best, (mem.base + qs[i] + mem.fwd[i].value(vals), f"F{i}"))
        best = max(best, (mem.base + qs[i] + ms[i] + mem.bwd[i].value(vals), f"B{i}"))
    best = max(best, (mem.base + qs[-1] + mem.head.value(vals), "H"))
    return best
