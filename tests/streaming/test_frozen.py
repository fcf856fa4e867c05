"""Frozen decoder layers (LoRA, plain freezing) in the streaming executor equal plain HF autograd: read-only
streamed weights, resident adapters with their gradients, every schedule and row chunking (fp32)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from lazytrain_hf.config import LazyTrainConfig
from lazytrain_hf.models import load_model
from lazytrain_hf.streaming.executor import StreamingExecutor

from ..conftest import random_batch, rel_err
from .test_executor import _schedules

peft = pytest.importorskip("peft")


def _lora(arch: str):
    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(load_model(arch, "float32", seed=1), cfg)


def _reference(model, ids, mask, labels):
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _check(model, ids, mask, labels, ex, ref_loss, ref_grads):
    loss = ex.forward_backward(ids, labels, mask)
    assert rel_err(loss, ref_loss) < 1e-6
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert rel_err(ex.grad_source(p), ref_grads[name]) < 1e-5, name
        else:
            assert p.grad is None and ex.grad_source(p) is None, name


@pytest.mark.parametrize("arch", ["qwen2-tiny", "qwen3-tiny", "qwen3.5-tiny"])
@pytest.mark.parametrize("sched_name", list(_schedules()))
def test_lora_gradients_equal_hf_autograd(arch, sched_name, tmp_path):
    model = _lora(arch)
    ids, mask, labels = random_batch(model.config.vocab_size, B=3)
    ref_loss, ref_grads = _reference(copy.deepcopy(model), ids, mask, labels)
    cfg = LazyTrainConfig(loss_chunk_tokens=2048 if arch.startswith("qwen3.5") else 7, nvme_dir=str(tmp_path),
                          max_rows_per_pass=2)
    ex = StreamingExecutor(model, cfg, "cpu", _schedules()[sched_name])
    _check(model, ids, mask, labels, ex, ref_loss, ref_grads)
    # read-only layers: no gradient buffers on either side, no gradient copies
    assert all(ex.frozen) and ex.store.grad_bytes == 0 and ex.stats.d2h_grad_bytes == 0
    assert all(not s.grads for s in ex.streamer.slots)
    adapters = [p for p in model.parameters() if p.requires_grad]
    assert adapters and not any(ex.is_streamed(p) for p in adapters)
    assert {id(p) for p in adapters} <= {id(p) for p in ex.resident_parameters()}


def test_lora_gradients_accumulate_over_micro_batches_and_zero():
    model = _lora("qwen3-tiny")
    ref = copy.deepcopy(model)
    batches = [random_batch(model.config.vocab_size, seed=s) for s in (1, 2)]
    for ids, mask, labels in batches:
        ref(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    ex = StreamingExecutor(model, LazyTrainConfig(), "cpu")
    for ids, mask, labels in batches:
        ex.forward_backward(ids, labels, mask)
    want = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert rel_err(ex.grad_source(p), want[n]) < 1e-5, n
    total = torch.stack([g.double().norm() for g in want.values()]).norm()
    assert rel_err(ex.grad_norm(), total) < 1e-6
    ex.zero_grad()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("sched_name", ["fixed-k2-gpu", "mixed-tiers-retain", "all-retained"])
def test_plain_freezing_equals_hf_autograd(sched_name, tmp_path):
    """A whole frozen layer, a partly frozen one (its trainable weights resident) and fully trainable ones
    (streamed with host gradients as before)."""
    model = load_model("qwen3-tiny", "float32", seed=1)
    for p in model.model.layers[1].parameters():
        p.requires_grad_(False)
    model.model.layers[2].mlp.up_proj.weight.requires_grad_(False)
    ids, mask, labels = random_batch(model.config.vocab_size)
    ref_loss, ref_grads = _reference(copy.deepcopy(model), ids, mask, labels)
    ex = StreamingExecutor(model, LazyTrainConfig(loss_chunk_tokens=7, nvme_dir=str(tmp_path)), "cpu",
                           _schedules()[sched_name])
    _check(model, ids, mask, labels, ex, ref_loss, ref_grads)
    assert ex.frozen == [False, True, True, False]
    assert [bool(b.grads) for b in ex.store.buffers] == [True, False, False, True]
    gate = model.model.layers[2].mlp.gate_proj.weight
    assert not ex.is_streamed(gate) and ex.is_streamed(model.model.layers[2].mlp.up_proj.weight)
    assert ex.stats.d2h_grad_bytes == sum(b.param_bytes for i, b in enumerate(ex.store.buffers) if i in (0, 3))


def test_gradient_checkpointing_on_the_model_is_taken_over(caplog):
    model = load_model("qwen2-tiny", "float32", seed=1)
    model.gradient_checkpointing_enable()
    ids, mask, labels = random_batch(model.config.vocab_size)
    ref = copy.deepcopy(model)
    ref.gradient_checkpointing_disable()
    ref_loss, ref_grads = _reference(ref, ids, mask, labels)
    with caplog.at_level(logging.INFO, logger="lazytrain_hf.streaming.executor"):
        ex = StreamingExecutor(model, LazyTrainConfig(), "cpu")
    assert len([r for r in caplog.records if "gradient checkpointing" in r.getMessage()]) == 1
    assert not model.is_gradient_checkpointing
    assert not any(getattr(m, "gradient_checkpointing", False) for s in ex.streamer.slots for m in s.module.modules())
    model.train()
    _check(model, ids, mask, labels, ex, ref_loss, ref_grads)
