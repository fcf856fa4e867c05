"""Deferred per-layer optimizer updates, overlapped with the next forward (DESIGN.md §2, "optimizer").

At `optimizer.step()` the resident parameters are updated at once; the streamed layers' updates are handed to a
CPU worker thread that runs them layer 0 first. The weight streamer waits for layer i's update before it streams
layer i in (`wait(i)`), so the update of layer i overlaps the GPU's forward of layers < i instead of sitting
serially after backward. The learning rates and clip coefficient are those of the step that deferred them
(`Hybrid8bitOptimizer.step_snapshot`), even though the LR scheduler steps right after.

Note [deferred gradients]: the Trainer zeroes gradients right after `step()`; a layer whose update is still pending
keeps its host gradient readable (`is_pending`) until the worker has consumed it.

Device-placed layers (`device_layers`, the schedule's optimizer_device == "gpu"): the CPU worker skips them; their
update waits in `device_pending` until the executor streams the layer in for the next forward and runs it on the
GPU next to the freshly loaded weights (`take_device`). `wait_all` (save, evaluate, end) applies any still pending
on the CPU instead: bit for bit the GPU update where that runs the Triton kernel (`optim/_triton_kernel.py`),
within the kernels' rounding where it runs bitsandbytes'.

Sharded data parallel (`owned`, streaming/shard.py): only the owned layers are updated here; `on_step` is told
of each step so the other layers are broadcast from their owners at their next load.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["LayerUpdater"]


class LayerUpdater:
    """Args: optimizer (a Hybrid8bitOptimizer), layer_params (the parameters of each streamed layer, in order),
    owned (the layers this rank updates; None: all), on_step (called at each step, before any update starts)."""

    def __init__(self, optimizer: Any, layer_params: list[list[torch.Tensor]], owned: set[int] | None = None,
                 on_step: Callable[[], None] | None = None) -> None:
        self.optimizer = optimizer
        self.layer_params = layer_params
        self.owned = set(range(len(layer_params))) if owned is None else set(owned)
        self.on_step = on_step
        self.device_layers: set[int] = set()
        self.device_pending: dict[int, dict[str, Any]] = {}  # layer -> snapshot of the step that deferred it
        self._done = [threading.Event() for _ in layer_params]
        for e in self._done:
            e.set()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_run_s: float | None = None  # wall time of the last step's CPU updates (s)
        self.last_run_params = 0  # parameters those updates covered (count)
        # the training thread's time blocked on this run's updates (s) and the GPU's idle time meanwhile (ms,
        # measured by the executor when instrumented); both restart with each optimizer step
        self.wait_s = 0.0
        self.stall_ms = 0.0
        optimizer.set_deferred([p for ps in layer_params for p in ps], self._start)

    def set_device_layers(self, layers: set[int]) -> None:
        """Layers whose updates run on the GPU at their next load (pending ones are applied first when the set
        changes; an unchanged set keeps the overlap)."""
        if set(layers) == self.device_layers:
            return
        self.wait_all()
        self.device_layers = set(layers)

    def _start(self, snapshot: dict[str, Any]) -> None:
        self.wait_all()
        self.wait_s = self.stall_ms = 0.0
        if self.on_step is not None:
            self.on_step()
        for i in sorted(self.owned):
            if i in self.device_layers:
                self.device_pending[i] = snapshot
            else:
                self._done[i].clear()
        self._thread = threading.Thread(target=self._run, args=(snapshot,), name="lazytrain-updates", daemon=True)
        self._thread.start()

    def take_device(self, layer: int) -> dict[str, Any] | None:
        """The snapshot of `layer`'s pending device update (the caller runs it, then calls `device_done`), or None.
        The layer stays pending until then, so its host gradient stays readable (Note [deferred gradients])."""
        return self.device_pending.get(layer)

    def device_done(self, layer: int) -> None:
        self.device_pending.pop(layer, None)

    def _run(self, snapshot: dict[str, Any]) -> None:
        t0, n = time.perf_counter(), 0
        todo = [i for i in range(len(self.layer_params)) if i not in self.device_layers and i in self.owned]
        try:
            if not todo:
                self.last_run_s, self.last_run_params = 0.0, 0
            for j, i in enumerate(todo):
                self.optimizer.step_deferred(self.layer_params[i], snapshot)
                n += sum(p.numel() for p in self.layer_params[i])
                if j == len(todo) - 1:  # before the last layer is released: a waiter then reads this run's figures
                    self.last_run_s, self.last_run_params = time.perf_counter() - t0, n
                self._done[i].set()
        except BaseException as e:  # surfaced in the training thread by wait()
            self._error = e
            for ev in self._done:
                ev.set()

    def cpu_pending(self, layer: int) -> bool:
        """Whether `layer`'s update is still queued or running in the CPU worker (`wait` would block)."""
        return not self._done[layer].is_set()

    def is_pending(self, layer: int) -> bool:
        return not self._done[layer].is_set() or layer in self.device_pending

    def wait(self, layer: int) -> None:
        """Block until layer `layer`'s deferred update is applied.

        Raises:
            RuntimeError: the update failed in the worker thread (the original exception is chained).
        """
        self._done[layer].wait()
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("a deferred optimizer update failed") from err

    def wait_all(self) -> None:
        """Every deferred update applied (before weights or optimizer state are read: save, evaluate, ...)."""
        for i in range(len(self._done)):
            self.wait(i)
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for i in sorted(self.device_pending):  # not streamed in since: update on the CPU
            self.optimizer.step_deferred(self.layer_params[i], self.device_pending[i])
            del self.device_pending[i]

    def detach(self) -> None:
        self.wait_all()
        self.optimizer.set_deferred(None)
