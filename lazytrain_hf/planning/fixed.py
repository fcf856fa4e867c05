"""The `fixed` policy: MegaTrain's heuristic (arXiv 2604.05091), kept as the baseline the MILP is measured against.

A checkpoint every k layers, every checkpoint in one tier, every non-checkpointed layer re-forwarded in backward,
no retention, optimizer updates on the CPU.
"""

from __future__ import annotations

from .schedule import LayerPlan, Schedule

__all__ = ["fixed_schedule", "checkpoint_interval", "checkpoint_tier", "fixed_resident"]


def fixed_schedule(num_layers: int, checkpoint_every: int = 4, tier: str = "gpu", prefetch_depth: int = 1,
                   fingerprint: str = "") -> Schedule:
    """Checkpoint the input of layers 0, k, 2k, ... in `tier`.

    Raises:
        ValueError: num_layers < 1 or checkpoint_every < 1.
    """
    if num_layers < 1 or checkpoint_every < 1:
        raise ValueError(f"fixed_schedule needs num_layers >= 1 and checkpoint_every >= 1, "
                         f"but got {num_layers} and {checkpoint_every}")
    layers = [LayerPlan(checkpoint=(i % checkpoint_every == 0), tier=tier) for i in range(num_layers)]
    return Schedule(policy="fixed", layers=layers, prefetch_depth=prefetch_depth, fingerprint=fingerprint)


def checkpoint_interval(schedule: Schedule) -> int:
    """The k of a `fixed_schedule` (the distance between its first two checkpoints; the layer count if one)."""
    starts = [i for i, lp in enumerate(schedule.layers) if lp.checkpoint]
    return starts[1] - starts[0] if len(starts) > 1 else schedule.num_layers


def checkpoint_tier(schedule: Schedule) -> str:
    """The boundary tier of a `fixed_schedule` (every layer carries it; callers may move layer 0's to the GPU)."""
    return schedule.layers[-1].tier


def fixed_resident(resident_gpu_bytes: int, gpu_budget_bytes: int, allowed: tuple[str, ...]) -> str:
    """The fixed policy's embedding / LM head placement (`Schedule.resident`): "gpu" when they take at most half
    the GPU budget with their gradients and optimizer states (bytes), else the first of "host", "host_embedding"
    in `allowed` (the placements the model can run); "gpu" when neither is."""
    if resident_gpu_bytes <= gpu_budget_bytes / 2:
        return "gpu"
    return next((p for p in ("host", "host_embedding") if p in allowed), "gpu")
