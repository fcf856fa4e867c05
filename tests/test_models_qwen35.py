"""The Qwen3.5 / Qwen3.6 registry shapes (lazytrain_hf/models.py) against their published text configs."""

from __future__ import annotations

import pytest
import torch

from lazytrain_hf.models import ARCHITECTURES, resolve_config
from lazytrain_hf.profiling.analytic import model_shape

# name: (hidden, intermediate, layers, heads, kv heads, linear value heads, tied embeddings), from the Hub configs
PUBLISHED = {
    "qwen3.5-0.8b": (1024, 3584, 24, 8, 2, 16, True),
    "qwen3.5-4b": (2560, 9216, 32, 16, 4, 32, True),
    "qwen3.5-9b": (4096, 12288, 32, 16, 4, 32, False),
    "qwen3.6-27b": (5120, 17408, 64, 24, 4, 48, False),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_family_configs_equal_the_published_ones(name):
    c = resolve_config(name)
    hidden, inter, layers, heads, kv, lin_v, tied = PUBLISHED[name]
    assert c.model_type == "qwen3_5_text"
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (hidden, inter, layers)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (heads, kv, 256)
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
            c.linear_conv_kernel_dim) == (16, lin_v, 128, 128, 4)
    assert c.tie_word_embeddings is tied and c.vocab_size == 248320 and c.rms_norm_eps == 1e-6
    assert c.max_position_embeddings == 262144
    rope = c.rope_parameters
    assert rope["rope_theta"] == 1e7 and rope["partial_rotary_factor"] == 0.25 and rope["rope_type"] == "default"
    assert rope["mrope_section"] == [11, 11, 10] and rope["mrope_interleaved"] is True
    assert c.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4)
    shape = model_shape(c, name)  # instantiates on the meta device
    assert shape.num_layers == layers and shape.zero_centered_norm
    assert (shape.lm_head_params == 0) is tied


def test_rotary_table_follows_the_published_rope():
    """Theta 1e7 on 64 of the 256 head dims: the inverse frequencies a model built from the registry uses."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    rotary = Qwen3_5TextRotaryEmbedding(resolve_config("qwen3.6-27b"))
    expect = 1.0 / (1e7 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))
    torch.testing.assert_close(rotary.inv_freq, expect)
    assert rotary.mrope_section == [11, 11, 10]


def test_a_tiny_version_runs_forward_and_backward_on_cpu():
    from transformers import AutoModelForCausalLM

    c = resolve_config("qwen3.6-27b", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                       num_attention_heads=2, num_key_value_heads=1, linear_num_key_heads=2,
                       linear_num_value_heads=4, vocab_size=512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(c)
    ids = torch.randint(0, 512, (2, 70))  # not a multiple of the 64-token chunk
    out = model(ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_registry_dicts_are_not_shared_between_configs():
    a = resolve_config("qwen3.5-4b")
    a.rope_parameters["rope_theta"] = 1.0
    assert resolve_config("qwen3.5-9b").rope_parameters["rope_theta"] == 1e7
    assert ARCHITECTURES["qwen3.5-4b"][1]["rope_parameters"]["rope_theta"] == 1e7
