"""Named architectures built from config with random weights, and the set of architectures the executor supports.

Names such as ``qwen3-tiny`` (tests, the CPU recipe) or ``qwen2.5-7b`` (benchmarks: the real shape, random
weights, nothing downloaded) resolve to a transformers config; anything else is treated as a Hub id or a local
path and loaded with `AutoConfig` / `AutoModelForCausalLM`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ARCHITECTURES", "SUPPORTED_MODEL_TYPES", "resolve_config", "load_model", "check_supported"]

#: model_type values whose decoder layers the streaming executor runs (tested on Qwen2, Qwen3, Qwen3.5 text).
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_5_text", "llama")

_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048)

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
    # Qwen3.6-27B class: the Qwen3.5 hybrid architecture (3 linear-attention : 1 full-attention layers) at
    # about 27B parameters. The shape is our approximation, not a published config: use the Hub id when you
    # have the weights.
    "qwen3.6-27b": ("qwen3_5_text", dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                                         num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                                         linear_num_key_heads=16, linear_num_value_heads=48,
                                         linear_key_head_dim=128, linear_value_head_dim=128,
                                         vocab_size=248320, tie_word_embeddings=False)),
}


def resolve_config(name_or_path: str, **overrides: Any):
    """A transformers `PretrainedConfig` for a registry name, a Hub id or a local path.

    Raises:
        ValueError: the name is neither a registry name, a local directory nor a reachable Hub id.
    """
    from transformers import AutoConfig

    if name_or_path in ARCHITECTURES:
        model_type, kwargs = ARCHITECTURES[name_or_path]
        config = AutoConfig.for_model(model_type, **{**kwargs, **overrides})
    else:
        try:
            config = AutoConfig.from_pretrained(name_or_path, **overrides)
        except (OSError, ValueError) as e:
            raise ValueError(
                f"model {name_or_path!r} is not a registry name ({', '.join(ARCHITECTURES)}), a local model "
                f"directory, or a reachable Hub id: {str(e).splitlines()[0]}") from e
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


def load_model(name_or_path: str, dtype: str = "bfloat16", seed: int = 0, **overrides: Any):
    """Load (Hub id / local path) or build from config with random weights (registry name), on the CPU.

    Args:
        name_or_path: registry name (see `ARCHITECTURES`), Hub id, or local directory.
        dtype: "bfloat16", "float32" or "float16".
        seed: seed for random initialization of registry models.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    if name_or_path in ARCHITECTURES:
        config = resolve_config(name_or_path, **overrides)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype, **overrides)
    return model
