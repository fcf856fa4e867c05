"""Dropout in layers that run more than once per micro-batch.

Note [dropout in recompute]: a streamed decoder layer runs several times per micro-batch (its forward, a recompute
rebuilding a later layer's input, backward's re-forward with grad); each run must draw the same dropout masks, or
the gradient is not that of the loss the forward computed. `LayerRng` records the RNG state at a (layer, first row)
call's first run and replays it at the others inside `fork_rng`, so the re-runs draw the forward's masks and leave
the RNG where the forward left it, as `torch.utils.checkpoint` does with `preserve_rng_state`. Layers without
randomness (no Dropout with p > 0, no attention / hidden dropout in the config: every base Qwen model) skip it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["LayerRng", "has_dropout"]


def has_dropout(layers: Any, config: Any) -> bool:
    """Whether decoder layers in training mode draw random numbers: a Dropout module with p > 0 (LoRA's
    `lora_dropout`, for one) or an attention / hidden dropout in the config."""
    if any(isinstance(m, nn.Dropout) and m.p > 0 for layer in layers for m in layer.modules()):
        return True
    return any(float(getattr(config, k, 0.0) or 0.0) > 0 for k in ("attention_dropout", "hidden_dropout"))


class LayerRng:
    """The RNG states of one micro-batch's layer calls, keyed by (layer, first row of the chunk)."""

    def __init__(self, layers: Any, config: Any, device: torch.device) -> None:
        self.active = has_dropout(layers, config)
        self.device = device
        self._states: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}

    def clear(self) -> None:
        """A new micro-batch: its layers' first runs record again."""
        self._states.clear()

    @contextlib.contextmanager
    def replay(self, key: tuple[int, int] | None, training: bool) -> Iterator[None]:
        """Around one layer call: record the RNG state at the first run of `key`, replay it at later runs (None:
        a call that is never re-run, e.g. inference)."""
        if key is None or not (self.active and training):
            yield
            return
        cuda = self.device.type == "cuda"
        saved = self._states.get(key)
        if saved is None:
            self._states[key] = (torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if cuda else None)
            yield
            return
        with torch.random.fork_rng(devices=[self.device] if cuda else [], device_type="cuda"):
            torch.set_rng_state(saved[0])
            if cuda:
                torch.cuda.set_rng_state(saved[1], self.device)
            yield
