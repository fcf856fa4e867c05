"""bitsandbytes 4-bit weights (`Params4bit`, QLoRA bases) in the layer streaming.

A 4-bit weight is its packed uint8 data plus a quantization state (absmax, code, offset and, with double
quantization, a nested state's absmax and code) held as an attribute of the parameter object. The host store keeps
those tensors beside the packed data in the layer's flat buffers and the slots view them the same way, so a load of
layer i into a slot copies layer i's state with its weights: a slot never computes with another layer's state.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

__all__ = ["is_4bit", "quant_tensors", "set_quant_tensor", "quant_key", "keep_packing", "template_copy", "logical_numel"]


def is_4bit(p: torch.Tensor) -> bool:
    """Whether `p` is a bitsandbytes 4-bit weight with its quantization state."""
    return type(p).__name__ == "Params4bit" and getattr(p, "quant_state", None) is not None


def _walk(qs: Any, prefix: str, out: list[tuple[str, torch.Tensor]]) -> None:
    for k, v in vars(qs).items():
        if isinstance(v, torch.Tensor):
            out.append((prefix + k, v))
        elif type(v).__name__ == "QuantState":
            _walk(v, f"{prefix}{k}.", out)


def quant_tensors(p: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A 4-bit weight's quantization-state tensors as (dotted path in its QuantState, tensor), in a fixed order;
    [] for any other parameter."""
    out: list[tuple[str, torch.Tensor]] = []
    if is_4bit(p):
        _walk(p.quant_state, "", out)
    return out


def set_quant_tensor(p: torch.Tensor, path: str, t: torch.Tensor) -> None:
    """Replace the tensor at `path` (from `quant_tensors`) of `p`'s quantization state with `t`."""
    obj = p.quant_state
    *owners, attr = path.split(".")
    for o in owners:
        obj = getattr(obj, o)
    setattr(obj, attr, t)


def quant_key(layer: nn.Module) -> tuple:
    """The non-tensor quantization settings of a layer's 4-bit weights (quant type, block sizes, original shape and
    dtype, nesting): layers sharing slots must agree on them, since only the state's tensors are streamed."""
    out = []
    for name, p in layer.named_parameters():
        if is_4bit(p):
            qs = p.quant_state
            nested = getattr(qs, "state2", None)
            out.append((name, qs.quant_type, qs.blocksize, tuple(qs.shape), qs.dtype, bool(qs.nested),
                        None if nested is None else nested.blocksize,
                        tuple((k, tuple(t.shape), t.dtype) for k, t in quant_tensors(p))))
    return tuple(out)


def keep_packing(layer: nn.Module) -> None:
    """Switch off bitsandbytes' CPU inference repacking in `layer`'s 4-bit linears: in eval mode, without input
    gradients, `Linear4bit.forward` on CPU replaces the weight's data and state with a repacked copy, which would
    leave the host store's and the slots' buffers. Weights repacked already are unpacked back first."""
    for m in layer.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
        w = getattr(m, "weight", None)
        if is_4bit(w) and getattr(w.quant_state, "packing_format_for_cpu", False):
            from bitsandbytes.nn.modules import _convert_weight_packed_for_cpu_inverse

            w.data, w.quant_state = _convert_weight_packed_for_cpu_inverse(w.data, w.quant_state)
            if hasattr(m, "quant_state"):
                m.quant_state = w.quant_state


def _clone_state(qs: Any) -> Any:
    new = copy.copy(qs)
    for k, v in vars(qs).items():
        if isinstance(v, torch.Tensor):
            setattr(new, k, v.clone())
        elif type(v).__name__ == "QuantState":
            setattr(new, k, _clone_state(v))
    return new


def template_copy(layer: nn.Module) -> nn.Module:
    """`copy.deepcopy(layer)` whose 4-bit weights and states are fresh copies of their own elements.

    Why: `Params4bit.__deepcopy__` deep-copies its data and state without the memo, and each of those tensors views
    the layer's whole flat host buffer: a plain deepcopy would copy that buffer once per 4-bit weight. The module's
    own `quant_state` attribute (bitsandbytes keeps it beside the weight's) maps to the weight's new state."""
    memo: dict[int, Any] = {}
    for p in layer.parameters():
        if is_4bit(p) and id(p) not in memo:
            qs = _clone_state(p.quant_state)
            new = copy.copy(p)  # Params4bit.__copy__: the same attributes, sharing data and state
            new.data = p.data.clone()
            new.quant_state = qs
            memo[id(p.quant_state)] = qs
            memo[id(p)] = new
    return copy.deepcopy(layer, memo)


def logical_numel(p: torch.Tensor) -> int:
    """Elements of the weight `p` stands for: a 4-bit weight's original shape (its packed data holds two per byte),
    else `p.numel()`."""
    return math.prod(p.quant_state.shape) if is_4bit(p) else p.numel()
