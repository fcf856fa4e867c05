"""LlamaForCausalLM's decoder layers (the Llama-3 shapes of the registry) through the streaming executor equal plain
HF autograd (fp32), fully trained and with LoRA adapters on a frozen base."""

from __future__ import annotations

import copy

import pytest
import torch

from lazytrain_hf.config import LazyTrainConfig
from lazytrain_hf.models import ARCHITECTURES, load_model, resolve_config
from lazytrain_hf.streaming.executor import StreamingExecutor

from ..conftest import random_batch, rel_err
from .test_executor import _schedules


def _reference(model, ids, mask, labels):
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("sched_name", ["fixed-k2-gpu", "mixed-tiers-retain", "all-retained"])
def test_llama_loss_and_grads_equal_hf_autograd(sched_name, tmp_path):
    model = load_model("llama-tiny", "float32", seed=1)
    assert type(model).__name__ == "LlamaForCausalLM"
    ids, mask, labels = random_batch(model.config.vocab_size, B=3)
    ref_loss, ref_grads = _reference(copy.deepcopy(model), ids, mask, labels)
    ex = StreamingExecutor(model, LazyTrainConfig(loss_chunk_tokens=7, nvme_dir=str(tmp_path), max_rows_per_pass=2),
                           "cpu", _schedules()[sched_name])
    loss = ex.forward_backward(ids, labels, mask)
    assert rel_err(loss, ref_loss) < 1e-6
    for name, p in model.named_parameters():
        assert rel_err(ex.grad_source(p), ref_grads[name]) < 1e-5, name


def test_llama_lora_gradients_equal_hf_autograd(tmp_path):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    model = peft.get_peft_model(load_model("llama-tiny", "float32", seed=1), cfg)
    ids, mask, labels = random_batch(model.config.vocab_size, B=2)
    ref_loss, ref_grads = _reference(copy.deepcopy(model), ids, mask, labels)
    ex = StreamingExecutor(model, LazyTrainConfig(loss_chunk_tokens=7, nvme_dir=str(tmp_path)), "cpu",
                           _schedules()["mixed-tiers-retain"])
    loss = ex.forward_backward(ids, labels, mask)
    assert rel_err(loss, ref_loss) < 1e-6 and all(ex.frozen)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert rel_err(ex.grad_source(p), ref_grads[name]) < 1e-5, name


@pytest.mark.parametrize("name, want", [
    ("qwen2.5-32b", dict(model_type="qwen2", hidden_size=5120, num_hidden_layers=64, num_attention_heads=40,
                         num_key_value_heads=8, intermediate_size=27648, vocab_size=152064, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, rope_theta=1e6, params=32.76e9)),
    ("llama3-70b", dict(model_type="llama", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, intermediate_size=28672, vocab_size=128256, rms_norm_eps=1e-5,
                        tie_word_embeddings=False, rope_theta=5e5, params=70.55e9)),
])
def test_large_registry_shapes_match_the_public_configs(name, want):
    """The shapes as published (Qwen/Qwen2.5-32B, meta-llama/Meta-Llama-3-70B: 32.8 B and 70.6 B parameters),
    counted on the meta device."""
    from transformers import AutoModelForCausalLM

    assert name in ARCHITECTURES
    config = resolve_config(name)
    want = dict(want)
    params, theta = want.pop("params"), want.pop("rope_theta")
    for k, v in want.items():
        assert getattr(config, k) == v, k
    assert config.rope_parameters["rope_theta"] == theta
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(params, rel=2e-3)
