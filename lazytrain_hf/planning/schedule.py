"""The schedule: the per-layer plan the streaming executor runs (plain data, JSON round-trippable).

Boundary i is the input activation of decoder layer i ([B, T, H] hidden states); boundary 0 is always
materialized. A segment is the run of layers between two consecutive materialized boundaries: in backward its
inputs are recomputed from the segment's first boundary (the activation-checkpointing convention of
MegaTrain, arXiv 2604.05091, and LazyTrain, arXiv 2608.11919 §3).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LayerPlan", "Schedule", "TIERS", "fingerprint"]

TIERS = ("gpu", "cpu", "nvme")


@dataclass
class LayerPlan:
    """Decisions for decoder layer i.

    Attributes:
        checkpoint: boundary i (this layer's input) is materialized in forward; otherwise it is recomputed.
        tier: where a materialized boundary lives: "gpu" (compute device), "cpu" (pinned host), "nvme" (file).
        retain: keep this layer's full autograd activations from forward (no re-forward in backward).
        optimizer_device: where this layer's optimizer update runs: "cpu" or "gpu".
    """

    checkpoint: bool = False
    tier: str = "gpu"
    retain: bool = False
    optimizer_device: str = "cpu"


@dataclass
class Schedule:
    """A complete per-step plan for a model with `num_layers` decoder layers.

    Attributes:
        policy: "fixed" or "milp" (who made it).
        layers: one LayerPlan per decoder layer.
        prefetch_depth: decoder layers whose weights are streamed ahead of compute (slots = depth + 1).
        fingerprint: hash of (model config, batch shape, budgets, hardware) the plan was made for.
        solver: status, mip_gap, solve_ms (MILP only).
        predicted: predicted step_ms, peak_gpu_bytes, exposed_transfer_ms, ... (planner's cost model).
    """

    policy: str
    layers: list[LayerPlan]
    prefetch_depth: int = 1
    fingerprint: str = ""
    solver: dict[str, Any] = field(default_factory=dict)
    predicted: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.layers = [lp if isinstance(lp, LayerPlan) else LayerPlan(**lp) for lp in self.layers]
        problems = []
        if not self.layers:
            problems.append("a schedule needs at least one layer")
        elif not self.layers[0].checkpoint:
            problems.append("boundary 0 (the embedding output) must be materialized (layers[0].checkpoint=True)")
        for i, lp in enumerate(self.layers):
            if lp.tier not in TIERS:
                problems.append(f"layers[{i}].tier must be one of {TIERS}, but got {lp.tier!r}")
            if lp.optimizer_device not in ("cpu", "gpu"):
                problems.append(f"layers[{i}].optimizer_device must be 'cpu' or 'gpu', but got {lp.optimizer_device!r}")
        if not 1 <= self.prefetch_depth <= 8:
            problems.append(f"prefetch_depth must be in [1, 8], but got {self.prefetch_depth}")
        if problems:
            raise ValueError("Invalid schedule: " + "; ".join(problems))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def segments(self) -> list[tuple[int, int]]:
        """Half-open layer ranges [s, e) between consecutive materialized boundaries, in forward order."""
        starts = [i for i, lp in enumerate(self.layers) if lp.checkpoint]
        return list(zip(starts, starts[1:] + [self.num_layers]))

    def recomputed_layers(self) -> int:
        """Layers re-run in backward only to rebuild the next layer's input (the executor's `plan_ops` rule:
        layer j is re-run iff neither j nor j+1 is retained), not counting each layer's own forward-with-grad."""
        n = 0
        for s, e in self.segments():
            n += sum(1 for j in range(s, e - 1) if not self.layers[j].retain and not self.layers[j + 1].retain)
        return n

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:  # atomic, and safe with concurrent writers: a unique temp file, then rename
            fd, tmp = tempfile.mkstemp(dir=Path(path).parent, prefix=Path(path).name + ".", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                os.chmod(tmp, 0o644)  # mkstemp creates 0600; a plan is meant to be shared
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        return text

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Schedule:
        return cls(**d)

    @classmethod
    def from_json(cls, path_or_text: str | Path) -> Schedule:
        p = Path(path_or_text)
        try:
            is_file = len(str(path_or_text)) < 4096 and p.is_file()
        except OSError:  # JSON text is not a valid path (a "file name too long" on most systems)
            is_file = False
        text = p.read_text() if is_file else str(path_or_text)
        return cls.from_dict(json.loads(text))


def fingerprint(*parts: Any) -> str:
    """Stable 16-hex-digit hash of JSON-serializable parts (model config dict, shapes, budgets, hardware)."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
