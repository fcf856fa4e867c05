"""bitsandbytes 4-bit bases (QLoRA): registry shapes built in 4 bits without the whole model ever existing in bf16,
Hub ids and local checkpoints loaded quantized, and their host bytes counted from a meta-device skeleton.

A registry shape's weights come from a bank of N(0, 0.02) values seeded by `seed` and tiled over every matrix
(memory-bound copies instead of minutes of RNG for a 70B); norms are 1, other vectors 0.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["random_bank", "fill_random_", "rebuild_rotary", "require_bitsandbytes", "quantized_skeleton",
           "quantized_host_bytes", "quantized_random_model"]


def random_bank(dtype: torch.dtype, seed: int = 0, device: str | torch.device = "cpu") -> torch.Tensor:
    """2**24 N(0, 0.02) values from a generator seeded with `seed`, in `dtype` on `device`."""
    return torch.randn(1 << 24, generator=torch.Generator().manual_seed(seed)).mul_(0.02).to(dtype).to(device)


def fill_random_(name: str, p: torch.Tensor, bank: torch.Tensor) -> None:
    """One parameter's value, in place: a matrix tiles `bank` from its first element (so a parameter's values depend
    on its shape alone, not on the order parameters are filled), a norm is 1, the rest 0."""
    if p.dim() >= 2:
        flat = p.view(-1)
        for a in range(0, flat.numel(), bank.numel()):
            b = min(a + bank.numel(), flat.numel())
            flat[a:b].copy_(bank[: b - a])
    elif "norm" in name:
        p.fill_(1.0)
    else:
        p.zero_()


def rebuild_rotary(model: Any) -> None:
    """Rotary modules built anew on the CPU (to_empty / the meta device left their tables uninitialized)."""
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if hasattr(child, "inv_freq") and hasattr(child, "config"):
                setattr(parent, child_name, type(child)(child.config))


def require_bitsandbytes() -> None:
    """Import bitsandbytes.

    Raises:
        ValueError: it is not importable (the import error and the fix).
    """
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        raise ValueError(f"model.quantization needs bitsandbytes, which is not importable ({e}): "
                         "pip install bitsandbytes") from e


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def quantized_skeleton(config: Any, quantization: dict[str, Any], dtype: str | torch.dtype = torch.bfloat16):
    """(model of `config` on the meta device with transformers' Linear4bit modules in place of nn.Linear, as
    from_pretrained with `BitsAndBytesConfig(**quantization)` builds them; its HfQuantizer).

    Raises:
        ValueError: `quantization` is not a 4-bit one.
    """
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.quantizers.auto import AutoHfQuantizer

    dtype = _dtype(dtype)
    quant = BitsAndBytesConfig(**quantization)
    if not quant.load_in_4bit:
        raise ValueError(f"quantization {quantization}: only load_in_4bit=True bases are built here")
    hfq = AutoHfQuantizer.from_config(quant, pre_quantized=False)
    hfq.validate_environment(device_map={"": "cpu"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    hfq.preprocess_model(model=model, dtype=dtype, device_map={"": "cpu"})  # nn.Linear -> Linear4bit, on meta
    return model, hfq


def quantized_host_bytes(config: Any, quantization: dict[str, Any], dtype: str | torch.dtype = torch.bfloat16
                         ) -> dict[str, int]:
    """Host bytes of the 4-bit model of `config` (`quantized_random_model`, or from_pretrained with the same
    quantization), from its meta skeleton (nothing is allocated): per 4-bit weight of n parameters (block size b,
    bitsandbytes' layout) n / 2 packed bytes, then the state: with double quantization one uint8 absmax per block,
    an fp32 offset, the 16-entry fp32 code, and the nested state's fp32 absmax per 256 blocks and 256-entry fp32
    code; without it one fp32 absmax per block and the code. The other parameters (embedding, norms, LM head; tied
    ones once) at `dtype`'s size.

    Returns four_bit_params, packed, state, other_params, other_bytes, total."""
    import bitsandbytes as bnb

    dtype = _dtype(dtype)
    model, hfq = quantized_skeleton(config, quantization, dtype)
    q = hfq.quantization_config
    block = 64  # Params4bit's default, the one transformers' Linear4bit weights keep
    out = dict.fromkeys(("four_bit_params", "packed", "state", "other_params", "other_bytes"), 0)
    seen: set[int] = set()
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if isinstance(module, bnb.nn.Linear4bit) and pname == "weight":
                n = p.numel()
                blocks = -(-n // block)
                out["four_bit_params"] += n
                out["packed"] += -(-n // 2)
                out["state"] += (blocks + 4 + 16 * 4 + 4 * -(-blocks // 256) + 256 * 4
                                 if q.bnb_4bit_use_double_quant else 4 * blocks + 16 * 4)
            else:
                out["other_params"] += p.numel()
                out["other_bytes"] += p.numel() * dtype.itemsize
    out["total"] = out["packed"] + out["state"] + out["other_bytes"]
    return out


def quantized_random_model(name: str, quantization: dict[str, Any], dtype: str | torch.dtype = torch.bfloat16,
                           seed: int = 0, device: str | torch.device | None = None, **overrides: Any):
    """The registry shape `name` (config fields `overrides`) with `random_bank(dtype, seed)`'s weights, its linear
    layers in bitsandbytes 4 bits as `AutoModelForCausalLM.from_pretrained(..., quantization_config=
    BitsAndBytesConfig(**quantization), device_map="cpu", dtype=dtype)` gives them for those `dtype` weights: the
    same Linear4bit modules (transformers' replace_with_bnb_linear; the LM head and tied weights kept in `dtype`),
    each weight quantized by the same `Params4bit(value, **meta.__dict__).to(device)`, and the model's
    `hf_quantizer`, `is_quantized`, `quantization_method`, `is_loaded_in_4bit` and `config.quantization_config`.

    Built without the whole model in `dtype` ever existing (a bf16 70B would not fit a 128 GiB host): the skeleton
    on the meta device, then module by module one weight at a time is filled in `dtype` on `device`, quantized there
    and its packed data and quantization state moved to the CPU, so host memory peaks at the built model plus one
    linear's packed weights (on `device` "cpu": plus bitsandbytes' fp32 temporaries of one weight). `device` "cuda"
    fills and quantizes on the GPU (bitsandbytes' CUDA kernel: minutes faster for a 70B; its bits may differ from
    the CPU kernel's, as from_pretrained's would with device_map="cuda"); None: "cuda" when CUDA is available, else
    "cpu". Every tensor of the result is on the CPU.

    Raises:
        ValueError: `quantization` is not a 4-bit one, or bitsandbytes is not importable.
    """
    require_bitsandbytes()
    import bitsandbytes as bnb

    from .models import resolve_config

    dtype = _dtype(dtype)
    model, hfq = quantized_skeleton(resolve_config(name, **overrides), quantization, dtype)
    qdev = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    cpu = torch.device("cpu")
    banks = {cpu: random_bank(dtype, seed)}
    if qdev.type != "cpu":
        banks[qdev] = banks[cpu].to(qdev)
    done: dict[int, torch.nn.Parameter] = {}  # meta parameter -> its built one (tied weights stay one parameter)
    with torch.no_grad():
        for prefix, module in model.named_modules():
            for pname, p in list(module.named_parameters(recurse=False)):
                if id(p) in done:
                    setattr(module, pname, done[id(p)])
                    continue
                full = f"{prefix}.{pname}" if prefix else pname
                if isinstance(module, bnb.nn.Linear4bit) and pname == "weight":
                    value = torch.empty(p.shape, dtype=dtype, device=qdev)
                    fill_random_(full, value, banks[qdev])
                    # transformers' Bnb4bitQuantize.convert: quantized by Params4bit.to, the module's quant_state set
                    new = bnb.nn.Params4bit(value, requires_grad=False, **p.__dict__).to(qdev)
                    del value
                    if qdev.type != "cpu":
                        new.data = new.data.cpu()
                        new.quant_state.to("cpu")  # in place: the module's quant_state is the same object
                    module._is_hf_initialized = new._is_hf_initialized = True
                else:
                    new = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                    fill_random_(full, new.data, banks[cpu])
                done[id(p)] = new
                setattr(module, pname, new)
        rebuild_rotary(model)
    model.tie_weights()
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"{name}: tensors left on the meta device after the build: {left[:5]}")
    del banks
    if qdev.type == "cuda":
        torch.cuda.empty_cache()
    model.hf_quantizer = hfq
    hfq.postprocess_model(model)  # config.quantization_config, is_loaded_in_4bit
    return model.eval()  # as from_pretrained returns it
