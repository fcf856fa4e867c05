"""GPU-side optimizer updates (schedule: optimizer_device "gpu"): a layer's deferred update is staged next to the
weights just streamed into a slot and runs on the compute device before the layer's forward.

Hooked into the executor's weight streamer: `stage` after a load was enqueued (`WeightStreamer.after_load`),
`run_staged` before compute first uses the slot (`WeightStreamer.before_compute`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..optim import functional as F
from .weights import Slot

if TYPE_CHECKING:
    from .executor import StreamingExecutor

__all__ = ["DeviceUpdater"]


class DeviceUpdater:
    """Stages and runs the GPU-side updates of `executor`'s streamed layers (reads its current `updater`, `streamer`,
    `grads`, `store` and `device`).

    One staging set per slot (depth + 1 per structure), so the next layer's states go H2D while the previous
    layer's copy back D2H (one shared set serialized both directions: 2.08 s measured vs 1.57 s predicted); updates
    staged at load time run at the layer's first compute access (`run_staged`); the sets are freed at the end of
    forward (`release_staging`).
    """

    def __init__(self, executor: StreamingExecutor) -> None:
        self.ex = executor
        self.staging: dict[int, dict[tuple, torch.Tensor]] = {}  # id(slot) -> its staging copies
        self.launches: dict[int, tuple] = {}  # id(slot) -> (slot, layer, queued update, copy-back list)
        self.staging_layer: int | None = None  # the layer whose GPU-side update is being staged
        self.count = 0  # layer updates run on the compute device

    def run_staged(self, slot: Slot) -> None:
        """Compute is about to use `slot` (current stream, after its weights and staged inputs arrived): run its
        queued GPU-side update and copy the results back."""
        pending = self.launches.pop(id(slot), None)
        if pending is not None:
            self._finish(*pending)

    def run_pending(self) -> None:
        """Queued GPU-side updates of loads compute never reached (before the slots are forgotten or read)."""
        for slot, layer, launches, back in list(self.launches.values()):
            if slot.ready is not None:
                torch.cuda.current_stream(self.ex.device).wait_event(slot.ready)
            self._finish(slot, layer, launches, back)
        self.launches.clear()

    def release_staging(self) -> None:
        """Free the GPU-side updates' staging copies once forward has run them all: the cost model counts their
        workspaces in forward only (estimate.memory_terms), and kept through backward they held ~1.4 GB per slot
        of a 7B layer. They were read on the compute stream (the update) and the D2H stream (the copy-back): the
        allocator reuses the memory only after that work (`record_stream`)."""
        if not self.staging:
            return
        if self.ex.device.type == "cuda":
            users = (torch.cuda.current_stream(self.ex.device), self.ex.grads.d2h_stream)
            for bufs in self.staging.values():
                for t in bufs.values():
                    for st in users:
                        t.record_stream(st)
        self.staging.clear()

    def stage(self, slot: Slot, layer: int) -> None:
        """Stage `layer`'s deferred optimizer update for the compute device, next to the weights just streamed in
        (schedule: optimizer_device "gpu"): its host gradient and optimizer
        states go H2D into the slot's staging copies on the H2D stream; the update itself is queued
        (`functional.deferred_launches`) and runs in `run_staged`.

        Note [GPU-side update ordering]: the update runs on the compute stream right before the layer's forward,
        not on the H2D stream. bitsandbytes launches its optimizer kernel on the legacy default stream whatever the
        current stream is; launched from the H2D stream it ran unordered with the staging copies and with its own
        write-back (non-finite gradient norms on an H200, 2026-11-29). On the compute stream,
        which is the default stream, it runs in order: after `slot.ready` (staged inputs arrived), before the
        forward that reads the updated weights. The staging set belongs to the slot: the next load into the slot
        waits for the copy-back (`WeightStreamer.slot_read`), so a set is never overwritten while in use."""
        ex = self.ex
        updater = ex.updater
        snapshot = updater.take_device(layer) if updater is not None else None
        if snapshot is None:
            return
        cuda = ex.device.type == "cuda"
        bufs = self.staging.setdefault(id(slot), {})
        back: list[tuple[torch.Tensor, torch.Tensor, dict, dict]] = []

        def staged(name: str, what: str, src: torch.Tensor) -> torch.Tensor:
            t = bufs.get((name, what))
            if t is None or t.shape != src.shape or t.dtype != src.dtype:
                t = bufs[(name, what)] = torch.empty(src.shape, dtype=src.dtype, device=ex.device)
            return t.copy_(src, non_blocking=cuda)

        kept = ex.grads.is_kept(layer)  # g is then the kept device gradient (`grad_source`): no H2D

        def stage(p: torch.Tensor, g: torch.Tensor, state: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
            sp = ex._param_specs[id(p)][1]  # the executor's parameter -> (layer, spec) map, built once
            name = sp.name
            on_device = slot.weights[sp.dtype][sp.offset:sp.offset + sp.numel].view(sp.shape)
            dev_state = {k: staged(name, k, v) if torch.is_tensor(v) and v.dim() > 0 else v
                         for k, v in state.items()}
            back.append((p, on_device, state, dev_state))
            return on_device, g if kept else staged(name, "grad", g), dev_state

        self.staging_layer = layer
        params = updater.layer_params[layer]
        opt_state = updater.optimizer.state
        steps = {id(p): opt_state[p].get("step", 0) for p in params if p in opt_state}
        try:
            with F.deferred_launches() as launches:
                updater.optimizer.step_deferred(params, snapshot, stage)
        except BaseException:
            # nothing ran yet (the launches are only queued): the update stays pending with its gradient, for a
            # retry (an out-of-memory staging copy, hf/recovery.py); the step counters it advanced go back (states
            # it created keep their initial values, step 0)
            for q in params:
                if "step" in opt_state.get(q, {}):
                    opt_state[q]["step"] = steps.get(id(q), 0)
            raise
        finally:
            self.staging_layer = None
        ex.grads.drop(layer)  # the queued launches hold the views they read
        updater.device_done(layer)
        self.count += 1
        if back:  # else: skipped step (non-finite norm) or no gradients
            self.launches[id(slot)] = (slot, layer, launches, back)

    def _finish(self, slot: Slot, layer: int, launches: list, back: list) -> None:
        """Run a staged GPU-side update on the current stream, then copy weights and states back to the host store
        (CUDA: on the D2H stream, idle in forward, while compute goes on); later loads of the layer and into the
        slot wait for the copy-back (`WeightStreamer.host_written` / `slot_read`)."""
        for launch in launches:
            launch()
        ex = self.ex
        cuda = ex.device.type == "cuda"

        def copy_back() -> None:
            for p, on_device, state, dev_state in back:
                p.data.copy_(on_device, non_blocking=cuda)
                for k, v in dev_state.items():
                    if torch.is_tensor(v) and v.dim() > 0:  # the staged tensors ("step" is an int)
                        state[k].copy_(v, non_blocking=cuda)

        if not cuda:
            copy_back()
            return
        d2h = ex.grads.d2h_stream
        d2h.wait_stream(torch.cuda.current_stream(ex.device))
        with torch.cuda.stream(d2h):
            copy_back()
            done = torch.cuda.Event()
            done.record(d2h)
        ex.streamer.host_written[layer] = done
        ex.streamer.slot_read[id(slot)] = done
