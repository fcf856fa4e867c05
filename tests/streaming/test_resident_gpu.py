"""GPU: host-placed embedding / LM head (pinned buffers, the side-stream copy and gradient D2H) equal HF autograd
on the same GPU, and a placement switch moves the optimizer's states with the parameters."""

from __future__ import annotations

import copy

import pytest
import torch

from lazytrain_hf.config import LazyTrainConfig
from lazytrain_hf.kernels import select_linear_attention
from lazytrain_hf.models import load_model
from lazytrain_hf.optim import Hybrid8bitOptimizer
from lazytrain_hf.planning.fixed import fixed_schedule
from lazytrain_hf.streaming.executor import StreamingExecutor

from ..conftest import random_batch, rel_err, requires_cuda
from .test_executor_gpu import _no_tf32  # noqa: F401  (fixture: exact fp32 matmuls)

pytestmark = [pytest.mark.gpu, requires_cuda]


def _sched(model, placement):
    s = fixed_schedule(model.config.num_hidden_layers, 2)
    s.resident = placement
    return s


@pytest.mark.parametrize("arch,placement", [("qwen3.5-tiny", "host"), ("qwen3.5-tiny", "host_embedding"),
                                            ("qwen3-tiny", "host")])
def test_cuda_host_placement_equals_autograd_over_two_micro_batches(arch, placement):
    model = load_model(arch, "float32", seed=1)
    select_linear_attention(model, "cuda")  # the reference too: fla's backward refuses Hopper with Triton < 3.7.1
    ref = copy.deepcopy(model).cuda()
    batches = [random_batch(model.config.vocab_size, seed=s) for s in (0, 1)]
    for ids, mask, labels in batches:
        (ref(input_ids=ids.cuda(), attention_mask=mask.cuda(), labels=labels.cuda()).loss / 2).backward()
    ex = StreamingExecutor(model, LazyTrainConfig(loss_chunk_tokens=2048), "cuda", _sched(model, placement),
                           host_grad_dtype="fp32", data_parallel=None)
    assert model.model.embed_tokens.weight.device.type == "cpu" and model.model.embed_tokens.weight.is_pinned()
    for ids, mask, labels in batches:
        denom = labels[:, 1:].ne(-100).sum() * 2
        ex.forward_backward(ids, labels, mask, denominator=denom)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g = ex.grad_source(p) if ex.is_streamed(p) else p.grad
        assert rel_err(g.reshape(p.shape).cpu().float(), ref_params[name].grad.cpu()) < 1e-5, name
    ex.close()


@pytest.mark.parametrize("arch", ["qwen3-tiny", "qwen2-tiny"])
def test_cuda_sliced_head_equals_autograd_over_two_micro_batches(arch):
    """"host_sliced" on CUDA: 37-row slices through the two device buffers and the side stream (prefetch of the next
    slice while one computes, each slice's gradient D2H into the pinned buffer, the second micro-batch's through the
    staging buffer), against autograd on the same GPU. Dense archs: their gradients hold no cancelling sums, so the
    slices' summation order stays within 1e-5 of autograd (tests/streaming/test_resident.py measures the others
    against fp64)."""
    model = load_model(arch, "float32", seed=1)
    ref = copy.deepcopy(model).cuda()
    batches = [random_batch(model.config.vocab_size, seed=s) for s in (0, 1)]
    for ids, mask, labels in batches:
        (ref(input_ids=ids.cuda(), attention_mask=mask.cuda(), labels=labels.cuda()).loss / 2).backward()
    ex = StreamingExecutor(model, LazyTrainConfig(loss_chunk_tokens=16), "cuda", _sched(model, "host_sliced"),
                           host_grad_dtype="fp32", data_parallel=None)
    ex.resident.vocab_slice_rows = 37
    assert model.lm_head.weight.device.type == "cpu" and model.lm_head.weight.is_pinned()
    for ids, mask, labels in batches:
        ex.forward_backward(ids, labels, mask, denominator=labels[:, 1:].ne(-100).sum() * 2)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g = ex.grad_source(p) if ex.is_streamed(p) else p.grad
        assert rel_err(g.reshape(p.shape).cpu().float(), ref_params[name].grad.cpu()) < 1e-5, name
    ex.close()


def test_cuda_placement_switch_moves_optimizer_states():
    model = load_model("qwen3.5-tiny", "float32", seed=2)
    ex = StreamingExecutor(model, LazyTrainConfig(), "cuda", _sched(model, "gpu"), data_parallel=None)
    opt = Hybrid8bitOptimizer(ex.resident_parameters(), lr=1e-3, state_dtype="fp32")
    ex.reserve_states(opt)
    ids, mask, labels = random_batch(model.config.vocab_size, seed=3)
    ex.forward_backward(ids, labels, mask)
    opt.step()
    emb = model.model.embed_tokens.weight
    before = {k: v.clone().cpu() for k, v in opt.state[emb].items() if torch.is_tensor(v) and v.dim()}
    assert all(v.device.type == "cuda" for k, v in opt.state[emb].items() if torch.is_tensor(v) and v.dim())
    ex.set_schedule(_sched(model, "host"))
    assert emb.device.type == "cpu" and model.lm_head.weight.device.type == "cpu"
    for k, v in opt.state[emb].items():
        if torch.is_tensor(v) and v.dim():
            assert v.device.type == "cpu" and not v.is_pinned() and torch.equal(v, before[k]), k
    assert ex.pinned_bytes["resident"] == ex.resident._reg.bytes > 0  # host weights + buffers, exact sizes
    ex.zero_grad()
    ex.forward_backward(ids, labels, mask)
    opt.step()  # the CPU kernel on host states
    assert torch.isfinite(emb).all()
    ex.close()
