"""The dense registry shapes (lazytrain_hf/models.py) against the published Qwen2.5 / Qwen3 configs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lazytrain_hf.models import ARCHITECTURES, resolve_config

# name: (model_type, hidden, intermediate, layers, heads, kv heads, head_dim, vocab, max positions, rms eps, tied),
# from the models' config.json on the Hub
PUBLISHED = {
    "qwen2.5-3b": ("qwen2", 2048, 11008, 36, 16, 2, 128, 151936, 32768, 1e-6, True),
    "qwen2.5-7b": ("qwen2", 3584, 18944, 28, 28, 4, 128, 152064, 32768, 1e-6, False),
    "qwen2.5-14b": ("qwen2", 5120, 13824, 48, 40, 8, 128, 152064, 131072, 1e-5, False),
    "qwen3-8b": ("qwen3", 4096, 12288, 36, 32, 8, 128, 151936, 40960, 1e-6, False),
    "qwen3-14b": ("qwen3", 5120, 17408, 40, 40, 8, 128, 151936, 40960, 1e-6, False),
}
# parameters as the model cards state them (billions; the cards round some and cut others to the digits shown)
CARD_PARAMS_B = {"qwen2.5-3b": (3.09, 0.01), "qwen2.5-7b": (7.61, 0.01), "qwen2.5-14b": (14.7, 0.1),
                 "qwen3-8b": (8.2, 0.1), "qwen3-14b": (14.8, 0.1)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_dense_configs_equal_the_published_ones(name):
    c = resolve_config(name)
    mt, hidden, inter, layers, heads, kv, head_dim, vocab, positions, eps, tied = PUBLISHED[name]
    assert c.model_type == mt == ARCHITECTURES[name][0]
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (hidden, inter, layers)
    assert (c.num_attention_heads, c.num_key_value_heads, getattr(c, "head_dim", None) or hidden // heads) == \
        (heads, kv, head_dim)
    assert (c.vocab_size, c.max_position_embeddings, c.rms_norm_eps, c.tie_word_embeddings) == \
        (vocab, positions, eps, tied)
    assert c.rope_parameters["rope_theta"] == 1e6 and c.rope_parameters["rope_type"] == "default"


@pytest.mark.parametrize("name", sorted(CARD_PARAMS_B))
def test_dense_parameter_counts_match_the_model_cards(name):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(resolve_config(name))
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()) / 1e9
    card, rounding = CARD_PARAMS_B[name]  # rounding: one unit of the last digit shown
    assert abs(n - card) < rounding, (name, n)  # one decoder layer is > 0.07 B in each


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen2-tiny-tied"])
def test_large_registry_shapes_build_from_the_random_bank(monkeypatch, name):
    """At FAST_BUILD_PARAMS parameters and above a registry shape is built on the meta device and filled from the
    random bank (tiled N(0, 0.02) matrices, norms 1, other vectors 0), its rotary tables rebuilt and tied weights
    tied: the same module tree and buffers as the seeded build, a finite loss."""
    import torch

    from lazytrain_hf import models
    from lazytrain_hf.quantized import random_bank

    seeded = models.load_model(name, "float32", seed=3)
    monkeypatch.setattr(models, "FAST_BUILD_PARAMS", 0)
    fast = models.load_model(name, "float32", seed=3)
    bank = random_bank(torch.float32, 3)
    assert [n for n, _ in fast.named_parameters()] == [n for n, _ in seeded.named_parameters()]
    for n, p in fast.named_parameters():
        if p.dim() >= 2:
            k = min(p.numel(), bank.numel())
            assert torch.equal(p.detach().reshape(-1)[:k], bank[:k]), n
        else:
            assert torch.all(p == (1.0 if "norm" in n else 0.0)), n
    for (n, b), (_, ref) in zip(fast.named_buffers(), seeded.named_buffers(), strict=True):
        assert torch.equal(b, ref), n  # rotary tables built, not left uninitialized
    tied = getattr(fast.config, "tie_word_embeddings", False)
    assert (fast.lm_head.weight is fast.get_input_embeddings().weight) == tied
    ids = torch.randint(0, fast.config.vocab_size, (2, 16))
    assert torch.isfinite(fast(input_ids=ids, labels=ids).loss)
