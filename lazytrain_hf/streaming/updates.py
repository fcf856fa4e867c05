"""Deferred per-layer optimizer updates, overlapped with the next forward.

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

Prepared moments (`set_prepare`): once a step's CPU updates are done, the worker dequantizes the next step's
CPU-updated layers' 8-bit moments into fp32 host buffers (`Hybrid8bitOptimizer.prepare_states`, layer 0 first,
within a byte budget, `LazyTrainConfig.prepared_states_budget`, default off), while the CPU would idle through
the rest of the forward and the backward; the next step's update of those layers then skips half of its table reads
(same bits). The next `optimizer.step()` (or any `wait_all`) stops a preparation still running; the layers it did
not reach update as before.

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
    """Args: optimizer (a Hybrid8bitOptimizer), layer_params (the parameters of each streamed layer the optimizer
    updates, in order; empty for a frozen layer),
    owned (the layers this rank updates; None: all), on_step (called at each step, before any update starts)."""

    def __init__(self, optimizer: Any, layer_params: list[list[torch.Tensor]], owned: set[int] | None = None,
                 on_step: Callable[[], None] | None = None) -> None:
        self.optimizer = optimizer
        self.layer_params = layer_params
        # a layer with nothing to update (frozen) is never pending, so its slot keeps its weights across steps
        self.owned = {i for i in (range(len(layer_params)) if owned is None else owned) if layer_params[i]}
        self.on_step = on_step
        self.device_layers: set[int] = set()
        self.device_pending: dict[int, dict[str, Any]] = {}  # layer -> snapshot of the step that deferred it
        # per layer, the host-weight writes this updater made or started (CPU updates, pending device updates applied
        # on the host); a GPU-side update writes the slot and its host copy alike and does not count (Note [slot
        # reuse] in streaming/executor.py)
        self.host_writes = [0] * len(layer_params)
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
        # prepared moments: layers the worker prepares after a step's updates (bytes budget: 8 per element)
        self.prepare_budget = 0
        self.prepare_threads: int | None = None
        self._stop = threading.Event()
        self._prepared: set[int] = set()  # layers whose every 8-bit parameter was prepared by the last run
        self.last_prepare_s: float | None = None  # wall time of the last preparation (s), None: none ran
        self.last_prepare_params = 0  # elements it prepared
        self.last_prepare_complete = False  # it reached every layer it was meant to
        self.last_run_prepared_s = 0.0  # of last_run_s: the updates of prepared layers (s) ...
        self.last_run_prepared_params = 0  # ... and their parameters (count)
        optimizer.set_deferred([p for ps in layer_params for p in ps], self._start)

    def set_device_layers(self, layers: set[int]) -> None:
        """Layers whose updates run on the GPU at their next load, for the steps that start from now on. Pending
        updates stay where their step put them: the CPU worker's layers were fixed when the step started
        (`_start`), and a GPU-deferred update stays pending for its layer's next load (the executor applies those of
        layers leaving the set on the CPU first: `StreamingExecutor.set_schedule`). So a switch between two bucket
        plans keeps the overlap; waiting for every update there exposed the whole CPU update at each switch (a 3B
        soak's first step after a switch ran 1.2-1.45x its bucket's median: benchmarks/results/soak-20261205.json).
        With prepared moments (`set_prepare`) the pending updates are applied first: the prepared layers follow the
        set."""
        layers = set(layers)
        if layers == self.device_layers:
            return
        if self.prepare_budget:
            self.wait_all()
        self.device_layers = layers

    def set_prepare(self, budget_bytes: int, threads: int | None = None) -> None:
        """Prepare the next step's CPU-updated layers' moments after each step's updates (layer 0 first, as long
        as 8 bytes per element fit in `budget_bytes`; 0: off) on `threads` OpenMP threads (None: the optimizer's)."""
        self.prepare_budget = max(0, int(budget_bytes))
        self.prepare_threads = threads

    def prepare_layers(self) -> list[int]:
        """The layers the worker prepares (CPU-updated, owned, in update order, within the budget)."""
        out, used = [], 0
        for i in range(len(self.layer_params)):
            if i in self.device_layers or i not in self.owned:
                continue
            need = 8 * sum(p.numel() for p in self.layer_params[i])
            if used + need > self.prepare_budget:
                break
            out.append(i)
            used += need
        return out

    def _prepare(self) -> None:
        """After a step's updates: prepare `prepare_layers` until done or told to stop (`_stop`)."""
        layers = self.prepare_layers()
        if hasattr(self.optimizer, "release_prepared"):  # buffers of layers no longer prepared (re-plan, budget)
            keep = set(layers)
            self.optimizer.release_prepared([p for i, ps in enumerate(self.layer_params) if i not in keep
                                             for p in ps])
        if not layers:
            return
        t0, n, ok = time.perf_counter(), 0, set()
        for i in layers:
            if self._stop.is_set():
                break
            n += self.optimizer.prepare_states(self.layer_params[i], threads=self.prepare_threads,
                                               stop=self._stop.is_set)
            if not self._stop.is_set():  # (parameters without 8-bit states are skipped, not missed)
                ok.add(i)
        self._prepared = ok
        self.last_prepare_s, self.last_prepare_params = time.perf_counter() - t0, n
        self.last_prepare_complete = ok == set(layers)

    def _start(self, snapshot: dict[str, Any]) -> None:
        self.wait_all()  # stops a preparation still running: the layers it did not reach update as before
        self.wait_s = self.stall_ms = 0.0
        if self.on_step is not None:
            self.on_step()
        todo = []  # this step's CPU-updated layers, fixed now: the device set may change before the worker reads it
        for i in sorted(self.owned):
            if i in self.device_layers:
                self.device_pending[i] = snapshot
            else:
                todo.append(i)
                self._done[i].clear()
                self.host_writes[i] += 1  # counted before the worker writes
        self._thread = threading.Thread(target=self._run, args=(snapshot, todo), name="lazytrain-updates",
                                        daemon=True)
        self._thread.start()

    def take_device(self, layer: int) -> dict[str, Any] | None:
        """The snapshot of `layer`'s pending device update (the caller runs it, then calls `device_done`), or None.
        The layer stays pending until then, so its host gradient stays readable (Note [deferred gradients])."""
        return self.device_pending.get(layer)

    def device_done(self, layer: int) -> None:
        self.device_pending.pop(layer, None)

    def _run(self, snapshot: dict[str, Any], todo: list[int]) -> None:
        t0, n = time.perf_counter(), 0
        prepared, self._prepared = self._prepared, set()
        prep_s, prep_n = 0.0, 0
        try:
            if not todo:
                self.last_run_s, self.last_run_params = 0.0, 0
                self.last_run_prepared_s, self.last_run_prepared_params = 0.0, 0
            for j, i in enumerate(todo):
                t1 = time.perf_counter()
                self.optimizer.step_deferred(self.layer_params[i], snapshot)
                k = sum(p.numel() for p in self.layer_params[i])
                n += k
                if i in prepared:
                    prep_s, prep_n = prep_s + time.perf_counter() - t1, prep_n + k
                if j == len(todo) - 1:  # before the last layer is released: a waiter then reads this run's figures
                    self.last_run_s, self.last_run_params = time.perf_counter() - t0, n
                    self.last_run_prepared_s, self.last_run_prepared_params = prep_s, prep_n
                self._done[i].set()
            self._prepare()
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
        """Every deferred update applied (before weights or optimizer state are read: save, evaluate, ...); a
        preparation still running is stopped."""
        for i in range(len(self._done)):
            self.wait(i)
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._stop.clear()
            if self._error is not None:  # from the preparation, after every update landed
                err, self._error = self._error, None
                raise RuntimeError("preparing optimizer states for the next step failed") from err
        self.apply_on_cpu(list(self.device_pending))  # not streamed in since: update on the CPU

    def apply_on_cpu(self, layers: list[int]) -> None:
        """Run the pending GPU-deferred updates of `layers` now, on the CPU, in this thread (their host gradients
        must hold the gradient: a kept device gradient is materialized first, streaming/grads.py)."""
        for i in sorted(layers):
            if i in self.device_pending:
                self.host_writes[i] += 1
                self.optimizer.step_deferred(self.layer_params[i], self.device_pending[i])
                del self.device_pending[i]

    def detach(self) -> None:
        self.wait_all()
        self.optimizer.set_deferred(None)
