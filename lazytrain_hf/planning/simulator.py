"""Discrete-event replay of one steady-state step of a `Schedule` on a `CostModel`.

Unlike the MILP's linear model (`estimate.py`), the simulator issues tasks in the executor's real order: per lane a
static queue, a task starts when it heads its lane's queue and its dependencies are done.

Lanes and what they run:
    compute: on-GPU optimizer updates, forwards, the head, segment recomputes (at segment start), forward-with-
             grad and backward of each layer;
    h2d:     weight loads (forward, recompute, backward), on-GPU optimizer state uploads (two workspaces), boundary fetches;
    d2h:     boundary stashes, updated states / weights of on-GPU updates, parameter gradients;
    nvme:    boundary writes (after their D2H) and reads (before their H2D, two host staging buffers);
    cpu:     optimizer updates: resident parameters (embedding, lm_head, norm), then layers 0..L-1 (those on
             the CPU), as streaming/updates.py runs them.
Copies share PCIe fluidly: a direction runs at its one-way rate (h2d_gbps / d2h_gbps) while the other is idle
and at bidir_gbps while both are busy. Weight slots: per layer kind, `prefetch_depth + 1` slots; a load waits
for the compute that used its slot. Two D2H buffers: a unit's first compute waits for the D2H of the unit two
earlier. Time 0 is the end of the previous step's backward (its updates run on the cpu lane now), so the
predicted step time is the end of the last compute or D2H. GPU memory is tracked buffer by buffer (allocated
when the producing task starts, freed when the last task that needs it ends).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .cost_model import CostModel
from .estimate import recompute_flags
from .schedule import Schedule

__all__ = ["simulate", "SimulationResult", "LANES"]

LANES = ("compute", "h2d", "d2h", "nvme", "cpu")
_LINK = ("h2d", "d2h")


@dataclass
class SimulationResult:
    """What one simulated step looked like.

    Attributes:
        step_ms: end of the last compute or D2H (ms), from the end of the previous backward.
        peak_gpu_bytes: largest sum of live GPU buffers (bytes), including resident parts and weight slots.
        peak_at_ms: when the peak occurred (ms).
        events: (lane, start_ms, end_ms, label) for every task with non-zero duration, in start order.
        lane_busy_ms: busy time per lane (ms).
        memory: (time_ms, live GPU bytes) after every allocation or free, for plotting.
        compute_idle_ms: step_ms minus the compute lane's busy time (ms): stalls on transfers and updates.
    """

    step_ms: float
    peak_gpu_bytes: int
    peak_at_ms: float
    events: list[tuple[str, float, float, str]]
    lane_busy_ms: dict[str, float]
    memory: list[tuple[float, int]] = field(default_factory=list)
    compute_idle_ms: float = 0.0


class _Graph:
    """Tasks, lane queues and buffers under construction."""

    def __init__(self) -> None:
        self.lane: list[str] = []
        self.amount: list[float] = []  # ms on time lanes, bytes on link lanes
        self.deps: list[list[int]] = []
        self.label: list[str] = []
        self.order: dict[str, list[int]] = {lane: [] for lane in LANES}
        # buffers: (bytes, allocating task or None for time 0, tasks after all of which it is freed; [] = never)
        self.buffers: list[tuple[int, int | None, list[int]]] = []

    def task(self, lane: str, amount: float, label: str, deps: list[int | None] = ()) -> int:  # type: ignore[assignment]
        tid = len(self.lane)
        self.lane.append(lane)
        self.amount.append(max(0.0, float(amount)))
        self.deps.append([d for d in deps if d is not None])
        self.label.append(label)
        self.order[lane].append(tid)
        return tid

    def buffer(self, nbytes: int, alloc: int | None, release: list[int | None]) -> int:
        self.buffers.append((int(nbytes), alloc, [r for r in release if r is not None]))
        return len(self.buffers) - 1


def simulate(cm: CostModel, schedule: Schedule) -> SimulationResult:
    """Replay one steady-state step of `schedule` on `cm`.

    Raises:
        ValueError: the schedule's layer count differs from the cost model's.
        RuntimeError: the task graph deadlocks (a bug: the issue order contradicts a dependency).
    """
    if schedule.num_layers != cm.num_layers:
        raise ValueError(f"schedule has {schedule.num_layers} layers but the cost model has {cm.num_layers}")
    g = _build(cm, schedule)
    start, end = _run(cm, g)
    step = max([end[t] for t in g.order["compute"] + g.order["d2h"]] + [0.0])
    events = sorted(((g.lane[t], start[t], end[t], g.label[t]) for t in range(len(g.lane)) if end[t] > start[t]),
                    key=lambda e: (e[1], LANES.index(e[0])))
    busy = {lane: sum(end[t] - start[t] for t in g.order[lane]) for lane in LANES}
    memory, peak, peak_at = _memory(g, start, end)
    return SimulationResult(step, peak, peak_at, events, busy, memory, step - busy["compute"])


def _build(cm: CostModel, s: Schedule) -> _Graph:
    g = _Graph()
    L, d = cm.num_layers, s.prefetch_depth
    lp = s.layers
    x = recompute_flags(s)
    tiered = [p.checkpoint and p.tier != "gpu" for p in lp]
    nvme = [p.checkpoint and p.tier == "nvme" for p in lp]
    gpu_b = [p.checkpoint and p.tier == "gpu" for p in lp]
    on_gpu_opt = [p.optimizer_device == "gpu" for p in lp]

    # constant GPU memory: resident parts, allocator reserve, weight slots
    g.buffer(cm.resident_bytes + cm.gpu_reserve_bytes + cm.slot_bytes(d), None, [])

    # -- CPU optimizer lane (updates of the previous step) ------------------------------------------------------
    emb_opt = g.task("compute" if cm.resident_optim_on_gpu else "cpu", cm.resident_optim_ms, "opt resident")
    cpu_opt: list[int | None] = [None] * L
    for i in range(L):
        if not on_gpu_opt[i]:  # the CPU worker starts once the resident update is done
            cpu_opt[i] = g.task("cpu", cm.cpu_optim_ms(i), f"opt L{i}", [emb_opt])

    # weight-slot bookkeeping: per kind, the compute task that last used each slot, in use order
    slot_users: dict[str, list[int]] = {}

    def slot_dep(kind: str) -> int | None:
        users = slot_users.setdefault(kind, [])
        return users[-(d + 1)] if len(users) >= d + 1 else None

    unit_d2h: list[list[int]] = []  # per unit, its D2H tasks (two-buffer rule: unit u waits for unit u-2's)

    def d2h_dep() -> int | None:
        """The last D2H task issued up to unit u-2 (u = the unit being built)."""
        for tasks in reversed(unit_d2h[:-1]):
            if tasks:
                return tasks[-1]
        return None

    # -- forward ------------------------------------------------------------------------------------------------
    fwd: list[int] = []
    stash: list[int | None] = [None] * L
    write: list[int | None] = [None] * L
    gdown: list[int | None] = [None] * L
    out_buf: list[int | None] = [None] * (L + 1)  # boundary i's buffer (i = L: the final hidden state)
    out_buf[0] = g.buffer(cm.act_bytes[0], None, [])  # embedding output, boundary 0 (released below)
    retained_buf: dict[int, int] = {}
    gopt_done: list[tuple[int, int]] = []  # (update compute, states D2H) of GPU-updated layers so far
    for i in range(L):
        gcomp = None
        if on_gpu_opt[i]:
            # two state workspaces: upload after the previous GPU update ran and the one before it went back
            prev_comp = gopt_done[-1][0] if gopt_done else None
            prev2_down = gopt_done[-2][1] if len(gopt_done) >= 2 else None
            gup = g.task("h2d", cm.gpu_optim_up_bytes(i), f"opt state L{i}", [prev_comp, prev2_down])
            gcomp = g.task("compute", cm.gpu_optim_ms(i), f"opt L{i}", [gup, d2h_dep()])
            gdown[i] = g.task("d2h", cm.gpu_optim_d2h_bytes[i], f"opt state L{i}", [gcomp])
            gopt_done.append((gcomp, gdown[i]))
            g.buffer(cm.gpu_optim_workspace_bytes(i), gup, [gdown[i]])
            if cm.kept(i):  # kept in the previous backward, consumed by this update
                g.buffer(cm.kept(i), None, [gcomp])
        kind = cm.layer_kind[i]
        wf = g.task("h2d", cm.param_bytes[i], f"W L{i}", [cpu_opt[i], slot_dep(kind)])
        f = g.task("compute", cm.fwd_ms[i], f"fwd L{i}", [wf, gcomp, emb_opt if i == 0 else None,
                                                          None if on_gpu_opt[i] else d2h_dep()])
        slot_users[kind].append(f)
        fwd.append(f)
        g.buffer(cm.fwd_work_bytes[i], f, [f])
        if lp[i].retain:  # autograd activations and the output (it feeds layer i+1), until the layer's backward
            retained_buf[i] = g.buffer(cm.retained(i), f, [])
        out_buf[i + 1] = g.buffer(cm.act_bytes[i], f, [])
        tasks = [gdown[i]] if gdown[i] is not None else []
        if i + 1 < L and tiered[i + 1]:
            stash[i + 1] = g.task("d2h", cm.act_bytes[i + 1], f"stash A{i + 1}", [f])
            tasks.append(stash[i + 1])
            if nvme[i + 1]:
                write[i + 1] = g.task("nvme", cm.act_bytes[i + 1] / (cm.nvme_write_gbps * 1e6), f"write A{i + 1}",
                                      [stash[i + 1]])
        unit_d2h.append(tasks)
    # boundary i's buffer: kept to its backward if GPU tier, freed after forward and stash otherwise
    bwd_end: list[int | None] = [None] * L  # filled below
    for i in range(L):
        if not gpu_b[i]:
            rel = [fwd[i]] + ([stash[i]] if stash[i] is not None else [])
            nbytes, alloc, _ = g.buffers[out_buf[i]]  # type: ignore[index]
            g.buffers[out_buf[i]] = (nbytes, alloc, rel)  # type: ignore[index]

    # -- head ---------------------------------------------------------------------------------------------------
    head_deps = [fwd[-1], d2h_dep()]
    if cm.head_h2d_bytes:  # a host-placed LM head's weights, after its CPU update
        head_deps.append(g.task("h2d", cm.head_h2d_bytes, "head weights", [emb_opt]))
    head = g.task("compute", cm.head_ms, "head", head_deps)
    g.buffer(cm.head_work_bytes, head, [head])
    nbytes, alloc, _ = g.buffers[out_buf[L]]  # type: ignore[index]
    g.buffers[out_buf[L]] = (nbytes, alloc, [head])  # type: ignore[index]
    unit_d2h.append([g.task("d2h", cm.head_grad_bytes, "grad head", [head])] if cm.head_grad_bytes else [])

    # -- backward: segments in reverse ----------------------------------------------------------------------------
    starts = [i for i in range(L) if lp[i].checkpoint]
    segments = list(zip(starts, starts[1:] + [L]))
    fetches_nvme: list[int] = []  # fetch tasks of NVMe boundaries, in issue order (staging buffers)
    done: list[int] = []  # the last backward task of each segment, in backward order
    for n, (s_, e_) in enumerate(reversed(segments)):
        fetch = fetch_buf = None
        # at most `d` boundaries fetched ahead of the segment in backward (the planner's memory bound): segment n's
        # fetch waits for segment n - d - 1 (the head: for n = d)
        ahead = head if n == d else done[n - d - 1] if n > d else None
        if tiered[s_]:
            read = None
            if nvme[s_]:
                staging = fetches_nvme[-2] if len(fetches_nvme) >= 2 else None
                read = g.task("nvme", cm.act_bytes[s_] / (cm.nvme_read_gbps * 1e6), f"read A{s_}",
                              [write[s_], staging])
            fetch = g.task("h2d", cm.act_bytes[s_], f"fetch A{s_}", [read, fwd[-1], ahead])
            if nvme[s_]:
                fetches_nvme.append(fetch)
            fetch_buf = g.buffer(cm.act_bytes[s_], fetch, [])
        # recompute layers s..e-2 whose output is needed (x_j), in forward order
        rec_out: dict[int, int] = {}
        for j in range(s_, e_ - 1):
            if not x[j]:
                continue
            kind = cm.layer_kind[j]
            wr = g.task("h2d", cm.param_bytes[j], f"W L{j}", [slot_dep(kind)])
            r = g.task("compute", cm.fwd_ms[j], f"recompute L{j}", [wr, fetch])
            slot_users[kind].append(r)
            g.buffer(cm.fwd_work_bytes[j], r, [r])
            rec_out[j + 1] = g.buffer(cm.act_bytes[j + 1], r, [])
        for j in range(e_ - 1, s_ - 1, -1):
            kind = cm.layer_kind[j]
            wb = g.task("h2d", cm.param_bytes[j], f"W L{j}", [slot_dep(kind), gdown[j]])
            first = None
            if not lp[j].retain:
                first = g.task("compute", cm.fwd_ms[j], f"fwd+grad L{j}", [wb, fetch, d2h_dep()])
                saved = g.buffer(cm.saved_bytes[j], first, [])
            b = g.task("compute", cm.bwd_ms[j], f"bwd L{j}", [wb, fetch, d2h_dep() if first is None else None])
            slot_users[kind].append(b)
            bwd_end[j] = b
            g.buffer(cm.bwd_work_bytes[j], b, [b])
            if not lp[j].retain:
                g.buffers[saved] = (g.buffers[saved][0], first, [b])
            else:
                g.buffers[retained_buf[j]] = (g.buffers[retained_buf[j]][0], g.buffers[retained_buf[j]][1], [b])
            kept = cm.kept(j) if on_gpu_opt[j] else 0  # stays on the GPU for the next step's update
            grad = g.task("d2h", cm.grad_bytes[j] - kept + (cm.embed_grad_bytes if j == 0 else 0), f"grad L{j}", [b])
            g.buffer(cm.grad_bytes[j], b, [grad])
            if kept:
                g.buffer(kept, b, [])
            unit_d2h.append([grad])
            if j in rec_out:
                g.buffers[rec_out[j]] = (g.buffers[rec_out[j]][0], g.buffers[rec_out[j]][1], [b])
        if fetch is not None and fetch_buf is not None:
            g.buffers[fetch_buf] = (g.buffers[fetch_buf][0], fetch, [bwd_end[s_]])
        done.append(bwd_end[s_])
    # GPU-tier boundaries live until the backward of their layer
    for i in range(L):
        if gpu_b[i]:
            nbytes, alloc, _ = g.buffers[out_buf[i]]  # type: ignore[index]
            g.buffers[out_buf[i]] = (nbytes, alloc, [bwd_end[i]])  # type: ignore[index]
    return g


def _run(cm: CostModel, g: _Graph) -> tuple[list[float], list[float]]:
    """Event loop over lane queues with fluid PCIe sharing; returns (start_ms, end_ms) per task."""
    n = len(g.lane)
    start = [-1.0] * n
    end = [-1.0] * n
    pos = {lane: 0 for lane in LANES}
    active: dict[str, list[float]] = {}  # lane -> [task id, remaining amount]
    uni = {"h2d": cm.h2d_gbps * 1e6, "d2h": cm.d2h_gbps * 1e6}  # bytes per ms, one direction alone
    both = cm.bidir_gbps * 1e6  # bytes per ms per direction while both run
    t = 0.0
    while True:
        progressed = True
        while progressed:
            progressed = False
            for lane in LANES:
                if lane in active or pos[lane] >= len(g.order[lane]):
                    continue
                tid = g.order[lane][pos[lane]]
                if all(end[dep] >= 0 for dep in g.deps[tid]):
                    start[tid] = t
                    pos[lane] += 1
                    progressed = True
                    if g.amount[tid] <= 0:
                        end[tid] = t
                    else:
                        active[lane] = [tid, g.amount[tid]]
        if not active:
            if any(pos[lane] < len(g.order[lane]) for lane in LANES):
                stuck = {lane: g.label[g.order[lane][pos[lane]]] for lane in LANES if pos[lane] < len(g.order[lane])}
                raise RuntimeError(f"simulator deadlock at t={t:.3f} ms; lanes waiting on: {stuck}")
            break
        link_busy = sum(1 for lane in _LINK if lane in active)
        rate = {lane: (uni[lane] if link_busy < 2 else both) if lane in _LINK else 1.0 for lane in active}
        dt = min(rem / rate[lane] for lane, (_, rem) in active.items())
        t += dt
        for lane in list(active):
            tid, rem = active[lane]
            rem -= rate[lane] * dt
            if rem <= 1e-9 * max(1.0, g.amount[int(tid)]):
                end[int(tid)] = t
                del active[lane]
            else:
                active[lane][1] = rem
    return start, end


def _memory(g: _Graph, start: list[float], end: list[float]) -> tuple[list[tuple[float, int]], int, float]:
    deltas: list[tuple[float, int]] = []
    for nbytes, alloc, release in g.buffers:
        if nbytes <= 0:
            continue
        deltas.append((start[alloc] if alloc is not None else 0.0, nbytes))
        if release:
            deltas.append((max(end[r] for r in release), -nbytes))
    deltas.sort(key=lambda p: (p[0], p[1]))  # frees before allocations at equal times
    live, peak, peak_at = 0, 0, 0.0
    curve: list[tuple[float, int]] = []
    for t, delta in deltas:
        live += delta
        curve.append((t, live))
        if live > peak:
            peak, peak_at = live, t
    return curve, peak, peak_at
