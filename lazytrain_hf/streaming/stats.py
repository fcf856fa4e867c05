"""Per-micro-batch counters of the streaming executor (`StreamingExecutor.stats`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["OpTimer", "StepStats", "UPDATE_COUNTERS", "step_extra"]

#: `StepStats.extra` keys about the deferred CPU updates (ms, ms, count, ms): the training thread's wait on them, the
#: worker's wall time for the previous step's updates and their parameters, the GPU idle time during the waits (the
#: waits summed over the optimizer step's micro-batches so far: with accumulation the first one waits);
#: and the weight copies' H2D GB/s, which the updates' host-memory traffic may lower (instrumented CUDA runs)
UPDATE_COUNTERS = ("optimizer_wait_ms", "cpu_update_ms", "cpu_update_params", "exposed_update_wait_ms",
                   "h2d_weight_gbps")


@dataclass
class StepStats:
    """Counters of the last micro-batch (bytes, counts, seconds)."""

    tokens: int = 0
    h2d_weight_bytes: int = 0
    d2h_grad_bytes: int = 0
    act_d2h_bytes: int = 0
    act_h2d_bytes: int = 0
    weight_loads: int = 0
    recomputed_layers: int = 0
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
    #: instrumented CUDA runs: GPU time of each op on the compute stream (ms), `OpTimer.totals`; empty otherwise
    op_ms: dict[str, list[float]] = field(default_factory=dict)


class OpTimer:
    """GPU time of each executor op of a micro-batch on the compute stream (CUDA events; a no-op unless `on` and
    CUDA). An op is timed from when the stream reaches it, after its waits on weight loads and gradient buffers, to
    its end: the sum over ops is the stream's busy time for the layers and the head, set against the plan's
    per-layer forward / backward times (benchmarks/systems.py `op_times`) to tell a profile that is off from
    idle gaps between the ops."""

    OPS = ("fwd", "recompute", "bwd", "head")

    def __init__(self, device: torch.device, on: bool, num_layers: int) -> None:
        self.on = bool(on) and device.type == "cuda"
        self.num_layers = num_layers
        self._events: list[tuple[str, int, Any, Any]] = []
        self._open: tuple[str, int, Any] | None = None

    def start(self, op: str, layer: int) -> None:
        if self.on:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self._open = (op, layer, e)

    def stop(self) -> None:
        if self.on and self._open is not None:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            op, layer, s = self._open
            self._events.append((op, layer, s, e))
            self._open = None

    def totals(self) -> dict[str, list[float]]:
        """{op: ms per layer} for fwd / recompute / bwd (summed over a layer's runs), {"head": [ms]}; empty when
        off. Call after the stream reached the last op (the instrumented step end synchronizes)."""
        if not self.on:
            return {}
        out = {op: [0.0] * self.num_layers for op in self.OPS[:3]}
        out["head"] = [0.0]
        for op, layer, s, e in self._events:
            out[op][max(layer, 0)] += s.elapsed_time(e)
        self._events.clear()
        return out


def step_extra(up: Any, streamer: Any, grads: Any, update_stalls: list, device: torch.device,
               h2d0: int) -> dict[str, float]:
    """`StepStats.extra` at the end of a micro-batch: the deferred updates' counters of `up` (a LayerUpdater or
    None) and, on an instrumented CUDA run, the exposed transfer times (this consumes the recorded events:
    `streamer.stalls` / `copies`, `grads.stalls`, `update_stalls`). `h2d0`: `streamer.h2d_bytes` at the start."""
    # the training thread blocked on deferred CPU updates (an upper bound of their exposed time: the GPU may
    # still run queued work meanwhile), and how long the CPU worker took for the last step's updates
    extra = {"optimizer_wait_ms": up.wait_s * 1e3 if up is not None else 0.0,
             "kept_grad_bytes": float(grads.kept_bytes)}  # held on the device into the next step
    if up is not None and up.last_run_s is not None:
        extra["cpu_update_ms"] = up.last_run_s * 1e3
        extra["cpu_update_params"] = float(up.last_run_params)
        extra["cpu_update_prepared_ms"] = up.last_run_prepared_s * 1e3
        extra["cpu_update_prepared_params"] = float(up.last_run_prepared_params)
    if up is not None and up.last_prepare_s is not None:  # the preparation for this step's update
        extra["prepare_ms"] = up.last_prepare_s * 1e3
        extra["prepare_params"] = float(up.last_prepare_params)
        extra["prepare_complete"] = float(up.last_prepare_complete)
    if device.type == "cuda" and streamer.instrument:
        torch.cuda.synchronize(device)
        for key, owner in (("exposed_h2d_ms", streamer), ("exposed_d2h_ms", grads)):
            extra[key] = sum(a.elapsed_time(b) for a, b in owner.stalls)
            owner.stalls.clear()
        if up is not None:  # (events exist only with an updater)
            up.stall_ms += sum(a.elapsed_time(b) for a, b in update_stalls)
        extra["exposed_update_wait_ms"] = up.stall_ms if up is not None else 0.0
        update_stalls.clear()
        copy_ms = sum(a.elapsed_time(b) for a, b in streamer.copies)
        streamer.copies.clear()
        if copy_ms > 0:  # weight bytes over the copies' own time: the H2D rate next to this step's other work
            extra["h2d_weight_gbps"] = (streamer.h2d_bytes - h2d0) / copy_ms / 1e6
    return extra
