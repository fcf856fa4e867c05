"""PEFT (LoRA) and frozen decoder layers under `LazyTrainer`: which optimizers may run, and clipping for them.

The executor's frozen-layer path (streaming/executor.py, Note [frozen layers]) keeps every trainable parameter of
a frozen layer on the compute device. When no decoder layer is fully trainable, the optimizer updates resident
parameters only, so any Trainer optimizer works (`adamw_torch` for LoRA adapters, as with the stock Trainer);
Hybrid8 (`lazytrain_hybrid8`, the default) is needed only for streamed trainable layers, whose gradients and
states live in host memory.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from ..streaming.executor import StreamingExecutor, find_decoder
from ..streaming.layer_calls import unwrap_peft
from ..streaming.quant import quant_tensors
from .register import OPTIM_NAME

__all__ = ["is_hybrid8", "check_peft_method", "check_quantized", "check_optimizer", "host_adapter_switches",
           "clip_resident", "frozen_costs", "frozen_layout", "model_frozen_costs", "planned_lora_costs", "layout_of",
           "four_bit_bytes"]


def is_hybrid8(optimizer: Any) -> bool:
    """Whether `optimizer` reads the executor's gradient buffers (`Hybrid8bitOptimizer`)."""
    return callable(getattr(optimizer, "set_grad_source", None))


def check_peft_method(model: Any, peft_config: Any = None) -> None:
    """Refuse, before training, a PEFT method the executor cannot run: prompt learning (prefix tuning, prompt
    tuning, P-tuning: virtual tokens the PeftModel's own forward prepends) and adaption prompts (attention modules
    swapped in and out of the model). The executor runs the embedding, the decoder layers and the head itself and
    never the PeftModel's forward; adapters inside the layers (LoRA and its kin) run in the streamed layers.

    Args:
        model: the model given to the trainer (a PeftModel, or the base a trainer's `peft_config` will wrap).
        peft_config: a trainer's `peft_config=` (TRL), or None.

    Raises:
        ValueError: naming the method and the fixes.
    """
    configs = list((getattr(model, "peft_config", None) or {}).values()) if hasattr(model, "get_base_model") else []
    for cfg in configs + ([peft_config] if peft_config is not None else []):
        if getattr(cfg, "is_prompt_learning", False) or getattr(cfg, "is_adaption_prompt", False):
            kind = getattr(getattr(cfg, "peft_type", None), "value", type(cfg).__name__)
            raise ValueError(f"PEFT {kind} cannot run under the LazyTrain executor: its virtual tokens or swapped "
                             "attention modules live in the PeftModel's forward, which the executor never calls (it "
                             "runs the embedding, decoder layers and head itself). Use an adapter inside the layers "
                             "(peft.LoraConfig, for one), or set lazytrain_config.policy='none' (the stock Trainer "
                             "path).")


@contextlib.contextmanager
def host_adapter_switches(executor: StreamingExecutor) -> Iterator[None]:
    """Inside the block the decoder layers run with the PEFT adapter switches the model's layers hold now (peft's
    `disable_adapter()` and `set_adapter`: which adapters are active, or none), restored after. The layers run as the
    slots' template modules, copies made when the executor was built, which a switch on the model does not reach."""
    saved = []
    for key, pool in executor.streamer.pools.items():
        host = dict(executor.layers[executor.keys.index(key)].named_modules())
        for slot in pool:
            for name, m in slot.module.named_modules():
                h = host.get(name)
                if h is not None and hasattr(h, "_active_adapter") and hasattr(h, "_disable_adapters"):
                    saved.append((m, m._active_adapter, m._disable_adapters))
                    m._active_adapter, m._disable_adapters = h._active_adapter, h._disable_adapters
    try:
        yield
    finally:
        for m, active, disabled in saved:
            m._active_adapter, m._disable_adapters = active, disabled


def check_trainable(model: torch.nn.Module) -> None:
    """Refuse, before training, a model with no parameter to train (a PeftModel loaded with
    `PeftModel.from_pretrained(base, path)`, which freezes its adapters unless `is_trainable=True`, or every
    parameter frozen by hand): the run would take every step with a zero gradient and change nothing.

    Raises:
        ValueError: naming the cause and the fixes.
    """
    if any(p.requires_grad for p in model.parameters()):
        return
    peft = hasattr(model, "get_base_model")
    raise ValueError("no parameter of the model requires a gradient, so training would change nothing"
                     + (": its PEFT adapters are frozen (inference_mode=True: a PeftModel loaded with "
                        "PeftModel.from_pretrained(base, path) has it unless is_trainable=True, and a LoraConfig may "
                        "set it). Fix: PeftModel.from_pretrained(base, path, is_trainable=True), or "
                        "LoraConfig(inference_mode=False)" if peft else
                        ". Fix: set requires_grad=True on the parameters to train (or wrap the model with "
                        "peft.get_peft_model)") + ".")


def check_quantized(model: torch.nn.Module) -> None:
    """Refuse, before training, a base quantized with bitsandbytes to 8 bits (`load_in_8bit`): its `Int8Params`
    keep their scales (SCB) as attributes the layer streaming does not move. 4-bit bases (nf4 / fp4, with or
    without double quantization) stream with their quantization state (streaming/quant.py).

    Raises:
        ValueError: naming the first 8-bit parameter and the fixes.
    """
    for name, p in model.named_parameters():
        if type(p).__name__ == "Int8Params":
            raise ValueError(f"the layer-streaming executor cannot stream bitsandbytes 8-bit weights ({name} is "
                             "Int8Params): load the base in 4 bits (BitsAndBytesConfig(load_in_4bit=True)) or in "
                             "bfloat16 for LoRA through LazyTrainer, or set lazytrain_config.policy='none' to train "
                             "the quantized model on the stock path (the whole model on the GPU).")


def check_optimizer(executor: StreamingExecutor, args: Any) -> None:
    """Refuse, before training, an optimizer other than lazytrain_hybrid8 when decoder layers are streamed with
    trainable parameters (their gradients and states live in host memory, which only Hybrid8 reads).

    Raises:
        ValueError: naming the optimizer, the first trainable streamed layers and the fixes.
    """
    optim = str(getattr(args.optim, "value", args.optim))
    if optim == OPTIM_NAME:
        return
    streamed = [i for i, ps in enumerate(executor._layer_trainables()) if ps]
    if streamed:
        names = ", ".join(f"{executor.layer_prefix}{i}" for i in streamed[:3]) + (", ..." if len(streamed) > 3 else "")
        raise ValueError(f"optim={optim!r} cannot update parameters streamed from host memory: {len(streamed)} "
                         f"decoder layers ({names}) are trainable and streamed. Use optim='{OPTIM_NAME}' "
                         "(lazytrain_config.state_dtype='fp32' gives plain fp32 AdamW states), train adapters only "
                         "(PEFT / LoRA: every decoder layer then has frozen weights), or set "
                         "lazytrain_config.policy='none'.")


def clip_resident(executor: StreamingExecutor, max_norm: float, norm: torch.Tensor) -> torch.Tensor:
    """Clip the resident parameters' gradients (every trainable one, `check_optimizer`) to `max_norm` given their
    global `norm`, as `torch.nn.utils.clip_grad_norm_` does; returns `norm`."""
    grads = [p for p in executor.resident_parameters() if p.grad is not None]
    if grads:
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, norm)
    return norm


def frozen_costs(executor: StreamingExecutor) -> dict[str, Any]:
    """`analytic_cost_model`'s frozen-part arguments for what `executor` runs (`model_frozen_costs` of its model:
    the executor streams the model's own parameters, so the layout is the same before and after it is built)."""
    if getattr(executor, "store", None) is None:  # a stand-in executor of planning code: every layer trains
        return {}
    return model_frozen_costs(executor.model)


def model_frozen_costs(model: torch.nn.Module) -> dict[str, Any]:
    """`frozen_costs` from the model alone, before an executor exists (the host-memory preflight): a decoder layer
    with any requires_grad=False parameter is frozen (Note [frozen layers]), its trainable parameters are
    adapters; a 4-bit weight counts its packed data and its quantization state."""
    model = unwrap_peft(model)
    base, _ = find_decoder(model)
    frozen, adapters, quantized = [], 0, []
    for layer in base.layers:
        params = list(layer.parameters())
        f = not all(p.requires_grad for p in params)
        frozen.append(f)
        adapters += sum(p.numel() for p in params if f and p.requires_grad)
        q = [p for p in params if getattr(p, "quant_state", None) is not None]
        quantized.append((sum(math.prod(p.quant_state.shape) for p in q),
                          sum(p.numel() * p.element_size()
                              + sum(t.numel() * t.element_size() for _, t in quant_tensors(p)) for p in q)))
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    out = {"frozen": frozen, "adapter_params": adapters,
           "frozen_embed": not embed.requires_grad, "frozen_head": not head.requires_grad}
    if any(q for q, _ in quantized):
        out["quantized"] = quantized
    # the hidden states carry the embedding's dtype (fp32 after peft's prepare_model_for_kbit_training, even under
    # bf16 autocast), and a frozen embedding / head keeps its own weight dtype: priced as bf16, a Llama-3-70B QLoRA
    # plan held half its boundaries' bytes (benchmarks/results/qlora-b32-before-fixes-20261203.json)
    sizes = {"hidden_itemsize": embed.element_size(), "embed_itemsize": embed.element_size(),
             "head_itemsize": head.element_size()}
    out.update({k: v for k, v in sizes.items() if v != 2})
    return out


def frozen_layout(executor: StreamingExecutor) -> dict[str, Any] | None:
    """The frozen layout a plan depends on (`planning.schedule.plan_inputs`' `frozen`): the frozen decoder layers'
    indices, the trainable parameters they keep resident, a frozen embedding / LM head and, with a 4-bit base, each
    layer's (4-bit parameters, streamed bytes); None when everything trains."""
    return layout_of(frozen_costs(executor))


def layout_of(costs: dict[str, Any]) -> dict[str, Any] | None:
    """`frozen_layout` of frozen-part arguments (`model_frozen_costs`, `planned_lora_costs`)."""
    if not any(costs.get("frozen", ())):
        return None
    out = {"layers": [i for i, f in enumerate(costs["frozen"]) if f], "adapter_params": int(costs["adapter_params"]),
           "embed": bool(costs["frozen_embed"]), "head": bool(costs["frozen_head"])}
    if "quantized" in costs:
        out["quantized"] = [list(q) for q in costs["quantized"]]
    out.update({k: int(costs[k]) for k in ("hidden_itemsize", "embed_itemsize", "head_itemsize") if k in costs})
    return out


#: bitsandbytes' 4-bit layout (`bnb.functional.quantize_4bit`): elements per absmax block, and with double
#: quantization (`bnb_4bit_use_double_quant`) absmax values per block of the nested 8-bit quantization
_BNB_BLOCK, _BNB_NESTED_BLOCK = 64, 256


def four_bit_bytes(numel: int, double_quant: bool = False) -> int:
    """Bytes of one weight of `numel` elements held as a bitsandbytes 4-bit `Params4bit` (nf4 or fp4), as the
    executor streams it (`streaming/quant.py`): the packed data (2 elements per byte), the fp32 absmax per block of
    64 and the 16-entry fp32 code; with double quantization the absmax in 8 bits plus the nested state (its fp32
    offset, absmax per 256 blocks and 256-entry code)."""
    packed = (numel + 1) // 2
    blocks = -(-numel // _BNB_BLOCK)
    if not double_quant:
        return packed + 4 * blocks + 4 * 16
    return packed + blocks + 4 * 16 + 4 + 4 * -(-blocks // _BNB_NESTED_BLOCK) + 4 * 256


def planned_lora_costs(config: Any, r: int, target_modules: str | list[str] | None = None,
                       load_in_4bit: bool = False, double_quant: bool = False) -> dict[str, Any]:
    """`model_frozen_costs` of the model of `config` wrapped as a recipe's peft section wraps it (`get_peft_model`
    with ``LoraConfig(r, target_modules, task_type="CAUSAL_LM")``), built on the meta device (nothing allocated):
    for `lazytrain-hf plan --lora-r`. With `load_in_4bit` (QLoRA: `BitsAndBytesConfig(load_in_4bit=True)`) every
    nn.Linear weight of the decoder layers counts as 4-bit (`four_bit_bytes`); biases and norms stay 2 bytes, and
    the embedding, LM head and hidden states count 4 bytes an element (fp32, as peft's
    `prepare_model_for_kbit_training` leaves them).

    Raises:
        ValueError: PEFT refuses the LoraConfig (e.g. target modules this model does not have).
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        quantized = None
        if load_in_4bit:
            quantized = []
            for layer in find_decoder(model)[0].layers:
                weights = [m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear)]
                quantized.append((sum(weights), sum(four_bit_bytes(n, double_quant) for n in weights)))
        try:
            model = get_peft_model(model, LoraConfig(r=r, target_modules=target_modules, task_type="CAUSAL_LM"))
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(str(e).splitlines()[0]) from e
    out = model_frozen_costs(model)
    for k in ("hidden_itemsize", "embed_itemsize", "head_itemsize"):  # the meta build's fp32; a bf16 load's are 2
        out.pop(k, None)
    if quantized is not None:
        out["quantized"] = quantized
        # QLoRA as PEFT's recipe prepares it (prepare_model_for_kbit_training): embedding, norms and LM head in
        # fp32, so the hidden states between layers too
        out.update(hidden_itemsize=4, embed_itemsize=4, head_itemsize=4)
    return out
