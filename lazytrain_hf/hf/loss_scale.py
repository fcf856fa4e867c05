"""`LossScaler`: the dynamic loss scale of ``fp16=True`` under `LazyTrainer`, as ``torch.amp.GradScaler``.

The stock Trainer's fp16 path (accelerate) multiplies the loss by the scale S before backward, unscales the
gradients in place, skips the optimizer step when any gradient is inf / NaN, and updates S. Under the executor the
gradients live in its buffers and the optimizer (`Hybrid8bitOptimizer`) reads them there, so the same steps are:

- backward: the loss divided by ``denominator / S`` (the chunked head) or multiplied by S (a user's loss), so that
  every gradient buffer holds S x the gradient;
- `Hybrid8bitOptimizer.clip_grad_norm(..., grad_scale=S)`: the global norm of the scaled gradients is non-finite ->
  the step is skipped with no weight, state or step-counter change; else the clip coefficient is that of the
  unscaled norm ``norm / S`` and the update multiplies each gradient by ``clip_coef / S`` inside its kernel (exact
  for a power-of-two S, which the defaults keep);
- `update(skipped)` after the step: S x 0.5 on a skipped step, S x 2 after 2000 steps in a row without one.

The state dict is GradScaler's (``scaler.pt`` in checkpoints, as the stock Trainer writes it).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["LossScaler"]


class LossScaler:
    """Dynamic loss scale with ``torch.amp.GradScaler``'s rule and defaults.

    Args:
        init_scale: the first scale (2**16).
        growth_factor: multiplies the scale after `growth_interval` steps in a row without a skip (2.0).
        backoff_factor: multiplies the scale at a skipped step (0.5).
        growth_interval: steps without a skip before the scale grows (2000).

    Raises:
        ValueError: a non-positive scale or interval, growth_factor <= 1 or backoff_factor outside (0, 1).
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        problems = []
        if not (math.isfinite(init_scale) and init_scale > 0):
            problems.append(f"init_scale must be a positive finite number, got {init_scale!r}")
        if not growth_factor > 1.0:
            problems.append(f"growth_factor must be > 1, got {growth_factor!r}")
        if not 0.0 < backoff_factor < 1.0:
            problems.append(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if not (isinstance(growth_interval, int) and growth_interval > 0):
            problems.append(f"growth_interval must be a positive integer, got {growth_interval!r}")
        if problems:
            raise ValueError("Invalid LossScaler arguments: " + "; ".join(problems))
        self.scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self._growth_tracker = 0  # steps in a row without a skip since the last change

    def update(self, skipped: bool) -> None:
        """After an optimizer step: back off on a skipped one, else count it and grow every `growth_interval`
        (GradScaler keeps its scale in fp32 and never grows it to inf)."""
        if skipped:
            self.scale = _fp32(self.scale * self.backoff_factor)
            self._growth_tracker = 0
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            grown = _fp32(self.scale * self.growth_factor)
            if math.isfinite(grown):
                self.scale = grown
            self._growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's state dict (the stock Trainer's ``scaler.pt``)."""
        return {"scale": self.scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict` (ours or a stock GradScaler's).

        Raises:
            ValueError: `state` has no ``scale`` (an empty GradScaler's state dict, or another file).
        """
        if "scale" not in state:
            raise ValueError(f"a loss-scaler state needs 'scale', got keys {sorted(state)}")
        scale = state["scale"]
        self.scale = float(scale.item() if torch.is_tensor(scale) else scale)
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))
        tracker = state.get("_growth_tracker", 0)
        self._growth_tracker = int(tracker.item() if torch.is_tensor(tracker) else tracker)


def _fp32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))
