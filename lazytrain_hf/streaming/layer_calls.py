"""How the executor finds and calls a model's decoder layers: the decoder stack (a PEFT model unwrapped, the model's
own gradient checkpointing turned off), the stand-in layers that capture each layer's call arguments from the
model's own forward, the row slicing of those arguments, and a step's op list (`plan_ops`)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ..planning.schedule import Schedule

__all__ = ["find_decoder", "plan_ops", "Capture", "StopCapture", "slice_rows", "retained_output", "unwrap_peft",
           "take_over_recomputation"]

logger = logging.getLogger("lazytrain_hf.streaming.executor")  # its log lines, under the name users filter on


class StopCapture(Exception):
    pass


class Capture(nn.Module):
    """Stands in for decoder layer `index` during capture: records its call and passes hidden states through."""

    def __init__(self, index: int, sink: list, last: bool, attrs: dict[str, Any]) -> None:
        super().__init__()
        self.index, self.sink, self.last = index, sink, last
        for k, v in attrs.items():
            setattr(self, k, v)  # e.g. attention_type, which some model forwards read from the layer

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.sink.append((hidden_states, args, kwargs))
        if self.last:
            raise StopCapture
        return hidden_states


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The HF causal LM inside a PEFT model (its adapter modules injected in place), or `model` itself."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and hasattr(model, "peft_config") else model


def take_over_recomputation(model: nn.Module) -> None:
    """Turn the model's gradient checkpointing off (e.g. set by peft's `prepare_model_for_kbit_training`): the
    schedule decides what is recomputed, and a checkpointed layer inside a streamed slot would recompute again."""
    on = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    if not on:
        return
    if callable(getattr(model, "gradient_checkpointing_disable", None)):
        model.gradient_checkpointing_disable()
    for m in on:
        m.gradient_checkpointing = False
    logger.info("LazyTrain: the model had gradient checkpointing on; turned it off: the executor's schedule decides "
                "what is recomputed")


def find_decoder(model: nn.Module) -> tuple[nn.Module, str]:
    """The base model holding `.layers`, `.norm`, `.embed_tokens`, and the parameter-name prefix of its layers.

    Raises:
        ValueError: the model has no `model.layers` decoder stack (unsupported architecture).
    """
    base = getattr(model, "model", None)
    if base is None or not isinstance(getattr(base, "layers", None), nn.ModuleList) or not hasattr(base, "norm"):
        raise ValueError(f"{type(model).__name__} has no `model.layers` / `model.norm` decoder stack; the LazyTrain "
                         "executor streams decoder-only causal LMs such as Qwen2/Qwen3/Qwen3.5")
    return base, "model.layers."


def slice_rows(obj: Any, B: int, a: int, b: int) -> Any:
    """Rows a:b of every batch-indexed tensor in a layer call's arguments (tensors of >= 2 dims whose first dim
    is B: hidden states, rotary cos/sin [B, T, D], masks [B, 1, T, T] / [B, T]); anything else is shared."""
    if torch.is_tensor(obj):
        return obj[a:b] if obj.dim() >= 2 and obj.shape[0] == B else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(slice_rows(o, B, a, b) for o in obj)
    if isinstance(obj, dict):
        return {k: slice_rows(v, B, a, b) for k, v in obj.items()}
    return obj


def retained_output(parts: list[tuple]) -> torch.Tensor:
    """The detached [B, T, H] output of a retained layer from its per-row-chunk (input, output, rows) parts."""
    return parts[0][1].detach() if len(parts) == 1 else torch.cat([y.detach() for _, y, _ in parts])


def plan_ops(schedule: Schedule) -> list[tuple[str, int]]:
    """The step as a list of ops, the single source of truth for the executor and its weight prefetcher.

    Ops: ("fwd", i) layer i forward (stash boundary if checkpointed); ("recompute", j) no-grad forward of layer j
    to rebuild layer j+1's input; ("bwd", j) layer j forward-with-grad (or retained graph) + backward;
    ("load", s) fetch boundary s at the start of a segment's backward.
    """
    L = schedule.num_layers
    lay = schedule.layers
    ops: list[tuple[str, int]] = [("fwd", i) for i in range(L)]
    for s, e in reversed(schedule.segments()):
        ops.append(("load", s))
        for j in range(s, e - 1):
            if not lay[j].retain and not lay[j + 1].retain:
                ops.append(("recompute", j))
        ops.extend(("bwd", j) for j in range(e - 1, s - 1, -1))
    return ops
