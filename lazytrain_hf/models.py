"""Named architectures built from config with random weights, and the set of architectures the executor supports.

Names such as ``qwen3-tiny`` (tests, the CPU recipe) or ``qwen2.5-7b`` (benchmarks: the real shape, random
weights, nothing downloaded) resolve to a transformers config; anything else is treated as a Hub id or a local
path and loaded with `AutoConfig` / `AutoModelForCausalLM`.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["ARCHITECTURES", "SUPPORTED_MODEL_TYPES", "resolve_config", "load_model", "filled_from_bank",
           "check_supported"]

#: model_type values whose decoder layers the streaming executor runs (tested on Qwen2, Qwen3, Qwen3.5 text).
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_5_text", "llama")

_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048)

#: Qwen3.5 / Qwen3.6 rotary settings shared by the family's published configs: theta 1e7 on a quarter of each head
#: (partial_rotary_factor 0.25), interleaved multimodal sections, 262,144 positions.
_QWEN35_ROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10], "mrope_interleaved": True}
_QWEN35 = dict(max_position_embeddings=262144, rope_parameters=_QWEN35_ROPE)

#: name -> (model_type, config kwargs). Real shapes from the public configs on the Hub (random weights here).
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2-tiny": ("qwen2", dict(_TINY, tie_word_embeddings=False)),
    "qwen2-tiny-tied": ("qwen2", dict(_TINY, tie_word_embeddings=True)),
    "qwen3-tiny": ("qwen3", dict(_TINY, head_dim=16, tie_word_embeddings=True)),
    "qwen3-tiny-untied": ("qwen3", dict(_TINY, head_dim=16, tie_word_embeddings=False)),
    # A tiny model with the real Qwen vocabulary, for the CPU recipe with the real tokenizer.
    "qwen3-tiny-vocab": ("qwen3", dict(_TINY, hidden_size=64, intermediate_size=256, head_dim=16,
                                       vocab_size=151936, tie_word_embeddings=True)),
    "qwen3.5-tiny": ("qwen3_5_text", dict(_TINY, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
                                          linear_key_head_dim=16, linear_value_head_dim=16,
                                          tie_word_embeddings=False)),
    "qwen2.5-3b": ("qwen2", dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                                 num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
                                 max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                 max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3-8b": ("qwen3", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                               max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
                               rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # The 14B shapes, from the published config.json of Qwen/Qwen2.5-14B and Qwen/Qwen3-14B (as vendored in
    # citsjtu2020/LLM-Prof sglang/Model_Config.md): Qwen2.5-14B keeps rms_norm_eps 1e-5, unlike the smaller Qwen2.5.
    "qwen2.5-14b": ("qwen2", dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                                  num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                                  max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3-14b": ("qwen3", dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                                num_attention_heads=40, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # The Qwen3.5 / Qwen3.6 hybrid family (Gated DeltaNet linear attention, every 4th layer full attention with
    # an output gate), text configs as published on the Hub (Qwen/Qwen3.5-0.8B, -4B, -9B, Qwen/Qwen3.6-27B, whose
    # text shape is Qwen3.5-27B's). Unset fields are transformers' Qwen3_5TextConfig defaults, equal to the
    # published ones: head_dim 256, rms_norm_eps 1e-6, linear key heads 16 and key / value head dims 128, conv
    # kernel 4, vocab 248320, full_attention_interval 4.
    "qwen3.5-0.8b": ("qwen3_5_text", dict(_QWEN35, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                                          num_attention_heads=8, num_key_value_heads=2, linear_num_value_heads=16,
                                          tie_word_embeddings=True)),
    "qwen3.5-4b": ("qwen3_5_text", dict(_QWEN35, hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
                                        num_attention_heads=16, num_key_value_heads=4, linear_num_value_heads=32,
                                        tie_word_embeddings=True)),
    "qwen3.5-9b": ("qwen3_5_text", dict(_QWEN35, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                                        num_attention_heads=16, num_key_value_heads=4, linear_num_value_heads=32,
                                        tie_word_embeddings=False)),
    "qwen3.6-27b": ("qwen3_5_text", dict(_QWEN35, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                                         num_attention_heads=24, num_key_value_heads=4, linear_num_value_heads=48,
                                         tie_word_embeddings=False)),
}

#: Large shapes for adapter training (LoRA / QLoRA benchmarks), from the public configs of Qwen/Qwen2.5-32B and
#: meta-llama/Meta-Llama-3-70B.
ARCHITECTURES.update({
    "qwen2.5-32b": ("qwen2", dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                                  num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                                  max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "llama3-70b": ("llama", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                 num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                                 max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                 hidden_act="silu", attention_bias=False, mlp_bias=False,
                                 bos_token_id=128000, eos_token_id=128001,
                                 rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    "llama-tiny": ("llama", dict(_TINY, tie_word_embeddings=False)),
})


def resolve_config(name_or_path: str, **overrides: Any):
    """A transformers `PretrainedConfig` for a registry name, a Hub id or a local path.

    Offline first (`lazytrain_hf.sources.locate_model`): registry names and local directories never touch the
    network; a Hub id is checked with one short request (or the cache alone under HF_HUB_OFFLINE=1), so an unknown
    name fails in seconds instead of after huggingface_hub's retries.

    Raises:
        ValueError: the name is neither a registry name, a local directory nor a Hub id that can be reached or is
            cached; the message lists the registry names and how to pass a local path.
    """
    from .sources import locate_model

    kind, where = locate_model(name_or_path)
    from transformers import AutoConfig

    if kind == "registry":
        model_type, kwargs = ARCHITECTURES[name_or_path]
        # a deep copy: configs may normalize rope_parameters in place, and the registry's dicts are shared
        config = AutoConfig.for_model(model_type, **copy.deepcopy({**kwargs, **overrides}))
    else:
        try:
            config = AutoConfig.from_pretrained(where, local_files_only=kind == "cache", **overrides)
        except (OSError, ValueError) as e:
            raise ValueError(f"model {name_or_path!r}: could not read its config ({kind} {where!r}): "
                             f"{str(e).splitlines()[0]}") from e
        if config.model_type == "qwen3_5":  # the multimodal wrapper: train its text model
            config = config.text_config
    return config


def check_supported(config) -> None:
    """Raise one clear error when the LazyTrain executor cannot stream this architecture.

    Raises:
        ValueError: unsupported `model_type`; the message names the supported ones and the plain-Trainer fix.
    """
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"The LazyTrain executor does not support model_type={mt!r}; supported: {list(SUPPORTED_MODEL_TYPES)}. "
            "Use a supported architecture, or set lazytrain_config.policy='none' to train with the plain HF path.")


#: registry shapes with at least this many parameters are built on the meta device and filled from a bank of
#: N(0, 0.02) values (`quantized.fill_random_`: memory-bound copies) instead of transformers' per-module init, which
#: takes minutes for a 7B on the CPU (the benchmarks' builder: ~13 s for the 7B recipe's shape, benchmarks/NOTES.md)
FAST_BUILD_PARAMS = 1_000_000_000


def filled_from_bank(skeleton: Any, dtype: Any, seed: int = 0) -> Any:
    """`skeleton` (a meta-device model) on the CPU with every matrix tiled from `quantized.random_bank(dtype, seed)`,
    norms 1, other vectors 0, rotary tables rebuilt and tied weights tied."""
    import torch

    from .quantized import fill_random_, random_bank, rebuild_rotary

    model = skeleton.to_empty(device="cpu")
    bank = random_bank(dtype, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            fill_random_(name, p, bank)
    rebuild_rotary(model)
    model.tie_weights()
    return model


def load_model(name_or_path: str, dtype: str = "bfloat16", seed: int = 0, quantization: dict[str, Any] | None = None,
               quantize_on: Any = None, **overrides: Any):
    """Load (Hub id / local path) or build from config with random weights (registry name), on the CPU: seeded
    transformers init below `FAST_BUILD_PARAMS` parameters, a tiled bank of random values at and above it.

    Args:
        name_or_path: registry name (see `ARCHITECTURES`), Hub id, or local directory.
        dtype: "bfloat16", "float32" or "float16".
        seed: seed for random initialization of registry models.
        quantization: `transformers.BitsAndBytesConfig` fields with load_in_4bit=True: the linear layers in 4 bits,
            every tensor in host memory. A Hub id or local directory loads with `from_pretrained(...,
            quantization_config=BitsAndBytesConfig(**quantization), device_map="cpu")`, which quantizes each weight
            as it loads; a registry name is built by `quantized.quantized_random_model` (never whole in `dtype`),
            quantized on `quantize_on` (None: the GPU when CUDA is available, else the CPU).
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    if quantization is not None:
        from .quantized import quantized_random_model, require_bitsandbytes

        require_bitsandbytes()
        if name_or_path in ARCHITECTURES:
            return quantized_random_model(name_or_path, quantization, torch_dtype, seed=seed, device=quantize_on,
                                          **overrides)
        from transformers import BitsAndBytesConfig

        from .sources import locate_model

        kind, where = locate_model(name_or_path)
        return AutoModelForCausalLM.from_pretrained(where, quantization_config=BitsAndBytesConfig(**quantization),
                                                    device_map="cpu", dtype=torch_dtype,
                                                    local_files_only=kind == "cache", **overrides)
    if name_or_path in ARCHITECTURES:
        config = resolve_config(name_or_path, **overrides)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        if sum(p.numel() for p in skeleton.parameters()) >= FAST_BUILD_PARAMS:
            model = filled_from_bank(skeleton, torch_dtype, seed)
        else:
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    else:
        from .sources import locate_model

        kind, where = locate_model(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype, local_files_only=kind == "cache",
                                                     **overrides)
    return model
