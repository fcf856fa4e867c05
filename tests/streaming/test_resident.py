"""The embedding and LM head in each placement (streaming/resident.py) give plain HF autograd's loss, gradients
and gradient norm, over gradient-accumulation windows and across placement switches."""

from __future__ import annotations

import copy

import pytest
import torch

from lazytrain_hf.config import LazyTrainConfig
from lazytrain_hf.models import load_model
from lazytrain_hf.planning.fixed import fixed_schedule
from lazytrain_hf.streaming.executor import StreamingExecutor

from ..conftest import random_batch, rel_err

CASES = [("qwen2-tiny", "host_embedding"), ("qwen2-tiny", "host"), ("qwen3-tiny", "host"),
         ("qwen3.5-tiny", "host_embedding"), ("qwen3.5-tiny", "host"), ("qwen3-tiny-untied", "gpu")]
#: vocabulary rows per head slice in these tests: several slices, the last one shorter (the tiny vocabularies are
#: not multiples of it)
SLICE_ROWS = 37


def _executor(model, placement, **cfg):
    sched = fixed_schedule(model.config.num_hidden_layers, 2)
    sched.resident = placement
    ex = StreamingExecutor(model, LazyTrainConfig(loss_chunk_tokens=8, **cfg), device="cpu", schedule=sched,
                           host_grad_dtype="fp32", data_parallel=None)
    ex.resident.vocab_slice_rows = SLICE_ROWS
    return ex


def _grads(ex, model):
    return {n: (ex.grad_source(p) if ex.is_streamed(p) else p.grad).reshape(p.shape).clone()
            for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch,placement", CASES)
def test_placement_equals_autograd_over_an_accumulation_window(arch, placement):
    model = load_model(arch, "float32", seed=1)
    ref = copy.deepcopy(model)
    batches = [random_batch(model.config.vocab_size, seed=s) for s in (0, 1)]
    denom = sum(int(labels[:, 1:].ne(-100).sum()) for _, _, labels in batches)
    ref_losses = []
    for ids, mask, labels in batches:
        logits = ref(input_ids=ids, attention_mask=mask).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 labels[:, 1:].reshape(-1), reduction="sum") / denom
        loss.backward()
        ref_losses.append(loss.detach())
    ex = _executor(model, placement)
    assert ex.resident.placement == placement
    host = {id(p) for p in ex.resident.host_parameters()}
    assert (id(model.model.embed_tokens.weight) in host) == (placement != "gpu")
    assert (id(model.lm_head.weight) in host) == (placement == "host" or
                                                   (placement != "gpu" and model.config.tie_word_embeddings))
    losses = [ex.forward_backward(ids, labels, mask, denominator=denom) for ids, mask, labels in batches]
    for a, b in zip(losses, ref_losses, strict=True):
        assert rel_err(a, b) < 1e-5
    got = _grads(ex, model)
    for name, p in ref.named_parameters():
        assert rel_err(got[name], p.grad) < 1e-5, name
    ref_norm = torch.sqrt(sum(p.grad.double().square().sum() for p in {id(q): q for q in ref.parameters()}.values()))
    assert rel_err(ex.grad_norm().double(), ref_norm) < 1e-5
    ex.close()


def _autograd_grads(model, batches, denom, dtype):
    """Plain HF autograd's loss per micro-batch and summed gradients, the model run in `dtype`."""
    m = copy.deepcopy(model).to(dtype)
    losses = []
    for ids, mask, labels in batches:
        logits = m(input_ids=ids, attention_mask=mask).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 labels[:, 1:].reshape(-1), reduction="sum") / denom
        loss.backward()
        losses.append(loss.detach().double())
    return losses, {n: p.grad.double() for n, p in m.named_parameters()}


@pytest.mark.parametrize("arch", ["qwen3.5-tiny", "qwen3-tiny", "qwen2-tiny"])
def test_the_sliced_head_is_as_exact_as_fp32_autograd(arch):
    """"host_sliced": the LM head's loss over 14 vocabulary slices of 37 rows (the last one 31), over a window of 2
    micro-batches. Its online log-sum-exp and per-slice sums round differently from autograd's log-softmax, so it is
    measured as fp32 autograd is, against fp64 autograd: per parameter no more than 3x fp32 autograd's own error (or
    1e-6). The Qwen3.5 linear-attention gates (A_log, dt_bias: gradients 1e-7..1e-5 from cancelling sums) are 3e-5
    off in fp32 autograd itself, so a plain 1e-5 against fp32 autograd measures rounding order there."""
    model = load_model(arch, "float32", seed=1)
    batches = [random_batch(model.config.vocab_size, seed=s) for s in (0, 1)]
    denom = sum(int(labels[:, 1:].ne(-100).sum()) for _, _, labels in batches)
    _, ref32 = _autograd_grads(model, batches, denom, torch.float32)
    losses64, ref64 = _autograd_grads(model, batches, denom, torch.float64)
    ex = _executor(model, "host_sliced")
    host = {id(p) for p in ex.resident.host_parameters()}
    assert id(model.lm_head.weight) in host and id(model.model.embed_tokens.weight) in host
    losses = [ex.forward_backward(ids, labels, mask, denominator=denom) for ids, mask, labels in batches]
    for a, b in zip(losses, losses64, strict=True):
        assert rel_err(a, b) < 1e-6
    got = _grads(ex, model)
    for name, want in ref64.items():
        assert rel_err(got[name], want) <= max(1e-6, 3 * rel_err(ref32[name], want)), name
    head = next(n for n, p in model.named_parameters() if p is model.lm_head.weight)  # tied: the embedding's name
    assert rel_err(got[head], ref32[head]) < 1e-5
    norm64 = torch.sqrt(sum(g.square().sum() for g in ref64.values()))
    assert rel_err(ex.grad_norm().double(), norm64) < 1e-5
    loss, logits = ex.forward_inference(*batches[0][:2], labels=batches[0][2])
    out = model(input_ids=batches[0][0], attention_mask=batches[0][1], labels=batches[0][2])
    assert rel_err(loss, out.loss) < 1e-6 and rel_err(logits, out.logits) < 1e-6
    ex.close()


def test_the_sliced_head_leaves_the_gradient_alone_without_a_target_and_trains_frozen_parts_not():
    """A micro-batch whose labels are all -100 sends no head gradient (the buffer keeps the window's); a frozen
    host head under "host_sliced" gets none and adds nothing to the global norm."""
    model = load_model("qwen3.5-tiny", "float32", seed=3)
    ref = copy.deepcopy(model)
    ex = _executor(model, "host_sliced")
    ids, mask, labels = random_batch(model.config.vocab_size, seed=4)
    ex.forward_backward(ids, labels, mask)
    ref(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    before = model.lm_head.weight.grad.clone()
    assert rel_err(before, ref.lm_head.weight.grad) < 1e-5
    loss = ex.forward_backward(ids, torch.full_like(labels, -100), mask, denominator=1.0)
    assert float(loss) == 0.0 and torch.equal(model.lm_head.weight.grad, before)
    ex.close()

    model = load_model("qwen3-tiny-untied", "float32", seed=1)
    model.lm_head.weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    ref(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    ex = _executor(model, "host_sliced")
    ex.forward_backward(ids, labels, mask)
    assert model.lm_head.weight.grad is None
    assert rel_err(model.model.embed_tokens.weight.grad, ref.model.embed_tokens.weight.grad) < 1e-5
    ref_norm = torch.sqrt(sum(p.grad.double().square().sum() for p in ref.parameters() if p.grad is not None))
    assert rel_err(ex.grad_norm().double(), ref_norm) < 1e-5
    ex.close()


def test_a_frozen_embedding_and_head_on_the_host_get_no_gradient():
    """LoRA's base embedding and LM head (requires_grad False) placed on the host: the head's GPU working copy takes
    no gradient, so nothing reaches the host head, embedding or the global norm; the other gradients are
    autograd's."""
    model = load_model("qwen3-tiny-untied", "float32", seed=1)
    model.lm_head.weight.requires_grad_(False)
    model.model.embed_tokens.weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    ids, mask, labels = random_batch(model.config.vocab_size)
    ref(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    ex = _executor(model, "host")
    ex.forward_backward(ids, labels, mask)
    assert model.lm_head.weight.grad is None and model.model.embed_tokens.weight.grad is None
    got = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        if p.requires_grad:
            g = got[name]
            assert rel_err(ex.grad_source(g) if ex.is_streamed(g) else g.grad, p.grad) < 1e-5, name
    ref_norm = torch.sqrt(sum(p.grad.double().square().sum() for p in ref.parameters() if p.grad is not None))
    assert rel_err(ex.grad_norm().double(), ref_norm) < 1e-5


def test_a_new_window_starts_from_zero_gradients_whoever_cleared_them():
    """The host buffers are reused across windows: rows touched in the last window must not leak into the next,
    also when `.grad` was set to None by other code than the executor (e.g. an optimizer's zero_grad)."""
    model = load_model("qwen3.5-tiny", "float32", seed=2)
    ref = copy.deepcopy(model)
    ex = _executor(model, "host")
    first = random_batch(model.config.vocab_size, seed=3)
    ex.forward_backward(first[0], first[2], first[1])
    for p in model.parameters():
        p.grad = None  # not through ex.zero_grad
    ex.grads.zero()
    ids, mask, labels = random_batch(model.config.vocab_size, seed=4)
    ex.forward_backward(ids, labels, mask)
    out = ref(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        got = dict(model.named_parameters())[name].grad
        assert rel_err(got, dict(ref.named_parameters())[name].grad) < 1e-5, name
    ex.close()


def test_padding_rows_get_no_gradient_as_with_nn_embedding():
    model = load_model("qwen2-tiny", "float32", seed=5)
    model.model.embed_tokens.padding_idx = 0
    ref = copy.deepcopy(model)
    ids, mask, labels = random_batch(model.config.vocab_size, seed=6)
    ids[:, :4] = 0
    ex = _executor(model, "host_embedding")
    ex.forward_backward(ids, labels, mask)
    ref(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert torch.count_nonzero(model.model.embed_tokens.weight.grad[0]) == 0
    assert rel_err(model.model.embed_tokens.weight.grad, ref.model.embed_tokens.weight.grad) < 1e-5
    ex.close()


def test_switching_placement_keeps_results_and_the_inference_forward():
    model = load_model("qwen3-tiny-untied", "float32", seed=7)
    ref = copy.deepcopy(model)
    ex = _executor(model, "gpu")
    ids, mask, labels = random_batch(model.config.vocab_size, seed=8)
    for placement in ("host", "host_embedding", "host_sliced", "gpu", "host_sliced", "host"):
        ex.set_schedule(dataclass_copy(ex.schedule, placement))
        assert ex.resident.placement == placement
        loss, logits = ex.forward_inference(ids, mask, labels)
        out = ref(input_ids=ids, attention_mask=mask, labels=labels)
        assert rel_err(loss, out.loss) < 1e-5 and rel_err(logits, out.logits) < 1e-5
    ex.close()


def dataclass_copy(schedule, placement):
    s = copy.deepcopy(schedule)
    s.resident = placement
    return s


def test_refused_placements_name_the_fix():
    tied = load_model("qwen3-tiny", "float32")
    with pytest.raises(ValueError, match="untied"):
        _executor(tied, "host_embedding")
    with pytest.raises(ValueError, match="resident_placement"):
        ex = _executor(load_model("qwen3-tiny-untied", "float32"), "gpu")
        ex.dp = object()  # a data-parallel run
        ex.set_resident("host")
