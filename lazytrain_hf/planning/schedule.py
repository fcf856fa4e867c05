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
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ..config import did_you_mean

__all__ = ["LayerPlan", "Schedule", "TIERS", "RESIDENT_PLACEMENTS", "HEAD_VOCAB_SLICE_ROWS", "fingerprint", "plan_inputs", "plan_fingerprint", "input_hashes",
           "differing_inputs"]

TIERS = ("gpu", "cpu", "nvme")
#: where the embedding and the LM head live (`Schedule.resident`): "gpu" (weights, gradients and optimizer states on
#: the GPU), "host_embedding" (the embedding's on the host: looked up and updated there), "host" (the LM head's too:
#: updated on the CPU, its bf16 weights copied to the GPU once per optimizer step for the head), "host_sliced" (as
#: "host", but the head multiplies by slices of `HEAD_VOCAB_SLICE_ROWS` vocabulary rows streamed from host memory, each
#: slice's weight gradient sent back as it is made: no GPU copy of the whole head; streaming/vocab_head.py)
RESIDENT_PLACEMENTS = ("gpu", "host_embedding", "host", "host_sliced")
#: vocabulary rows of one LM-head slice under "host_sliced": 16384 x 5120 bf16 is 160 MiB, two in flight
HEAD_VOCAB_SLICE_ROWS = 16384


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
        keep_grads: the GPU-updated layers' gradients stay on the GPU from their backward to the update at the
            next load (no D2H and H2D of them: 2 bytes per parameter each way); the plan counts their memory
            (`CostModel.kept_grad_bytes`). False in files written before this field existed.
        resident: where the embedding and LM head live (`RESIDENT_PLACEMENTS`); "gpu" in files written before this
            field existed.
        rows_per_pass: sequences of the micro-batch a decoder layer processes at once (the executor runs it over
            the micro-batch in row chunks); None: as `lazytrain_config.max_rows_per_pass` says (all rows if unset).
        fingerprint: `plan_fingerprint` of what the plan was made for (model, batch shape, budgets, hardware, the
            plan-shaping options); `solver["fingerprint_inputs"]` holds a hash per input, to name what differs.
        solver: status, mip_gap, solve_ms (MILP only).
        predicted: predicted step_ms, peak_gpu_bytes, exposed_transfer_ms, ... (planner's cost model).
    """

    policy: str
    layers: list[LayerPlan]
    prefetch_depth: int = 1
    keep_grads: bool = False
    resident: str = "gpu"
    rows_per_pass: int | None = None
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
        if not isinstance(self.keep_grads, bool):
            problems.append(f"keep_grads must be true or false, but got {self.keep_grads!r}")
        if self.resident not in RESIDENT_PLACEMENTS:
            problems.append(f"resident must be one of {RESIDENT_PLACEMENTS}, but got {self.resident!r}")
        if self.rows_per_pass is not None and (not isinstance(self.rows_per_pass, int) or self.rows_per_pass < 1):
            problems.append(f"rows_per_pass must be a whole number >= 1 or null, but got {self.rows_per_pass!r}")
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
        """A schedule from its `to_dict` form.

        Raises:
            ValueError: unknown keys (a hand-edited or newer file; a close known key is suggested) or invalid
                values (`__post_init__`).
        """
        problems = _unknown_keys(d, {f.name for f in fields(cls)}, "schedule")
        for i, lp in enumerate(d.get("layers") or []):
            if isinstance(lp, dict):
                problems += _unknown_keys(lp, {f.name for f in fields(LayerPlan)}, f"layers[{i}]")
        if problems:
            raise ValueError("Invalid schedule: " + "; ".join(problems))
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


def _unknown_keys(d: dict[str, Any], known: set[str], where: str) -> list[str]:
    """One problem naming the keys of `d` outside `known` (with a close known key, if any), or none."""
    bad = sorted(set(map(str, d)) - known)
    return [f"{where} has unknown keys {bad}{did_you_mean(bad, known)}"] if bad else []


def fingerprint(*parts: Any) -> str:
    """Stable 16-hex-digit hash of JSON-serializable parts (model config dict, shapes, budgets, hardware)."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


#: Config keys that describe a checkpoint, not the model's shape: left out so that the CLI's config (from the
#: registry or Hub) and a loaded model's config give the same fingerprint.
_CONFIG_METADATA = frozenset({"transformers_version", "torch_dtype", "dtype", "architectures", "use_cache",
                              "name_or_path", "id2label", "label2id",
                              # special token ids: the Trainer copies the tokenizer's into the config; no cost
                              "pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id",
                              "decoder_start_token_id",
                              # a 4-bit base's settings: its bytes per layer are the frozen layout's input
                              "quantization_config"})
#: Hardware profile fields that describe, not measure.
_HARDWARE_TEXT = frozenset({"measured", "source", "device_name", "notes"})


def plan_inputs(model_config: dict[str, Any], batch_size: int, seq_len: int, gpu_bytes: int | None,
                host_bytes: int | None, nvme_bytes: int | None, hardware: dict[str, Any], *, policy: str = "milp",
                rows_per_pass: int | None = None,
                gpu_optimizer: bool = True, loss_chunk_tokens: int = 2048, state_dtype: str = "8bit",
                master_weights: str = "fp32", block_size: int = 256, gpu_memory_margin: float = 0.12,
                fixed: dict[str, Any] | None = None, kept_grads: bool = True,
                resident: str = "auto", frozen: dict[str, Any] | None = None,
                resident_states: str = "fp32", host_weight_ranks: int = 1) -> dict[str, Any]:
    """Everything a plan depends on, by name: the one definition of a schedule's fingerprint, shared by the
    `plan` CLI and the Trainer (`plan_fingerprint`). Budgets in bytes as the user asked for them (before the GPU
    margin), None where the default was taken: the defaults are resolved differently by the CLI (the profile's
    total memory, free disk) and the Trainer (free GPU memory at plan time), so a plan made with `lazytrain-hf plan`
    and defaults matches the Trainer's run with the same defaults. `hardware`: `HardwareProfile.to_dict()`;
    `fixed`: the fixed policy's knobs (policy "fixed" only); `resident`: the embedding / LM head placement asked
    for ("auto": the planner's choice); `frozen`: the frozen layout of a run with frozen decoder layers (LoRA:
    {"layers": frozen layer indices, "adapter_params": trainable parameters kept resident by them}), None when every
    layer trains (an input only then, so full-training fingerprints do not depend on it); `resident_states`: the
    embedding / LM head optimizer states, an input only when not the default "fp32"; `host_weight_ranks`: the ranks on
    this host sharing one host copy of the streamed weights, an input only when more than 1."""
    def size(b: int | None) -> int | None:
        return None if b is None else int(b)

    inputs = {
        "model": _model_identity(model_config), "batch_size": batch_size, "seq_len": seq_len,
        "gpu_bytes": size(gpu_bytes), "host_bytes": size(host_bytes), "nvme_bytes": size(nvme_bytes),
        "hardware": {k: v for k, v in hardware.items() if k not in _HARDWARE_TEXT},
        "policy": policy, "fixed": fixed if policy == "fixed" else None, "rows_per_pass": rows_per_pass,
        "gpu_optimizer": bool(gpu_optimizer), "loss_chunk_tokens": loss_chunk_tokens, "state_dtype": state_dtype,
        "master_weights": master_weights, "block_size": block_size, "gpu_memory_margin": float(gpu_memory_margin),
        "kept_grads": bool(kept_grads), "resident": resident,
    }
    if frozen is not None:
        inputs["frozen"] = dict(frozen)
    if resident_states != "fp32":
        inputs["resident_states"] = resident_states
    if host_weight_ranks != 1:
        inputs["host_weight_ranks"] = int(host_weight_ranks)
    return inputs


def _model_identity(config: dict[str, Any]) -> dict[str, Any]:
    """`config` without metadata keys (private "_..." ones included), nested configs too."""
    return {k: _model_identity(v) if isinstance(v, dict) else v for k, v in config.items()
            if not (isinstance(k, str) and (k.startswith("_") or k in _CONFIG_METADATA))}


def plan_fingerprint(inputs: dict[str, Any]) -> str:
    """The fingerprint of `plan_inputs(...)`."""
    return fingerprint(inputs)


def input_hashes(inputs: dict[str, Any]) -> dict[str, str]:
    """A short hash per input of `plan_inputs(...)`, stored with a schedule so a mismatch can be named."""
    return {k: fingerprint(v)[:8] for k, v in inputs.items()}


def differing_inputs(stored: dict[str, str], inputs: dict[str, Any]) -> list[str]:
    """Names of the inputs whose hash in `stored` (`input_hashes`) differs from `inputs`' (missing ones count)."""
    now = input_hashes(inputs)
    return sorted(k for k in now.keys() | stored.keys() if stored.get(k) != now.get(k))
