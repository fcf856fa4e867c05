"""Deferred per-layer optimizer updates, overlapped with the next forward (DESIGN.md §2, "optimizer").

At `optimizer.step()` the resident parameters are updated at once; the streamed layers' updates are handed to a
CPU worker thread that runs them layer 0 first. The weight streamer waits for layer i's update before it streams
layer i in (`wait(i)`), so the update of layer i overlaps the GPU's forward of layers < i instead of sitting
serially after backward. The learning rates and clip coefficient are those of the step that deferred them
(`Hybrid8bitOptimizer.step_snapshot`), even though the LR scheduler steps right after.

Note [deferred gradients]: the Trainer zeroes gradients right after `step()`; a layer whose update is still pending
keeps its host gradient readable (`is_pending`) until the worker has consumed it.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["LayerUpdater"]


class LayerUpdater:
    """Args: optimizer (a Hybrid8bitOptimizer), layer_params (the parameters of each streamed layer, in order)."""

    def __init__(self, optimizer: Any, layer_params: list[list[torch.Tensor]]) -> None:
        self.optimizer = optimizer
        self.layer_params = layer_params
        self._done = [threading.Event() for _ in layer_params]
        for e in self._done:
            e.set()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        optimizer.set_deferred([p for ps in layer_params for p in ps], self._start)

    def _start(self, snapshot: dict[str, Any]) -> None:
        self.wait_all()
        for e in self._done:
            e.clear()
        self._thread = threading.Thread(target=self._run, args=(snapshot,), name="lazytrain-updates", daemon=True)
        self._thread.start()

    def _run(self, snapshot: dict[str, Any]) -> None:
        try:
            for i, params in enumerate(self.layer_params):
                self.optimizer.step_deferred(params, snapshot)
                self._done[i].set()
        except BaseException as e:  # surfaced in the training thread by wait()
            self._error = e
            for ev in self._done:
                ev.set()

    def is_pending(self, layer: int) -> bool:
        return not self._done[layer].is_set()

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

    def detach(self) -> None:
        self.wait_all()
        self.optimizer.set_deferred(None)
