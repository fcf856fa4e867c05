"""chunked_lm_loss / chunked_logits / shift_labels against transformers' ForCausalLMLoss and plain autograd through
norm + lm_head, on random inputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from lazytrain_hf.streaming.head import chunked_lm_loss, chunked_logits, shift_labels

B, T, H, V = 2, 7, 8, 11


def _parts(bias: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    norm = nn.LayerNorm(H)
    nn.init.normal_(norm.weight, 1.0, 0.2)
    nn.init.normal_(norm.bias, 0.0, 0.2)
    head = nn.Linear(H, V, bias=bias)
    hidden = torch.randn(B, T, H)
    labels = torch.randint(0, V, (B, T))
    labels[0, :2] = -100
    labels[1, 5:] = -100
    return norm, head, hidden, labels


def _named(norm, head) -> dict[str, nn.Parameter]:
    return {**{"norm." + n: p for n, p in norm.named_parameters()}, **{"head." + n: p for n, p in head.named_parameters()}}


def _reference(norm, head, hidden, labels, num_items):
    h = hidden.clone().requires_grad_()
    loss = ForCausalLMLoss(head(norm(h)), labels, V, num_items_in_batch=num_items)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in _named(norm, head).items() if p.grad is not None}
    for p in [*norm.parameters(), *head.parameters()]:
        p.grad = None
    return loss.detach(), h.grad, grads


def _chunked(norm, head, hidden, labels, denom, chunk):
    loss, g = chunked_lm_loss(hidden, shift_labels(labels), norm, head, denom, chunk_tokens=chunk)
    grads = {n: p.grad.clone() for n, p in _named(norm, head).items() if p.grad is not None}
    return loss, g, grads


def test_shift_labels():
    labels = torch.randint(0, V, (B, T))
    want = torch.cat([labels[:, 1:], torch.full((B, 1), -100)], dim=1)
    assert torch.equal(shift_labels(labels), want)


@pytest.mark.parametrize("chunk", [1, 3, 5, 1000])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("mean", [False, True])
def test_loss_and_grads_match_for_causal_lm_loss(chunk, bias, mean):
    norm, head, hidden, labels = _parts(bias)
    valid = int(shift_labels(labels).ne(-100).sum())
    num_items = None if mean else torch.tensor(valid + 3)  # a window's count, larger than this micro-batch's
    ref_loss, ref_g, ref_grads = _reference(norm, head, hidden, labels, num_items)
    denom = valid if mean else num_items
    loss, g, grads = _chunked(norm, head, hidden, labels, denom, chunk)
    assert loss.dtype == torch.float32 and not loss.requires_grad
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g, ref_g, rtol=1e-5, atol=1e-6)
    assert sorted(grads) == sorted(ref_grads) == sorted(["norm.weight", "norm.bias", "head.weight"]
                                                        + (["head.bias"] if bias else []))
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-6)


def test_ignored_rows_get_zero_gradient_and_all_ignored_is_zero():
    norm, head, hidden, labels = _parts()
    _, g = chunked_lm_loss(hidden, shift_labels(labels), norm, head, 1.0, chunk_tokens=4)
    ignored = shift_labels(labels).eq(-100)
    assert torch.count_nonzero(g[ignored]) == 0 and torch.count_nonzero(g[~ignored]) > 0
    norm2, head2, hidden2, _ = _parts(seed=1)
    loss, g2 = chunked_lm_loss(hidden2, torch.full((B, T), -100), norm2, head2, 1.0)
    assert loss.item() == 0.0 and torch.count_nonzero(g2) == 0
    assert head2.weight.grad is None and norm2.weight.grad is None


def test_frozen_weights_get_no_grad_and_hidden_grad_is_unchanged():
    norm, head, hidden, labels = _parts(bias=True)
    ref_loss, ref_g, _ = _reference(norm, head, hidden, labels, None)
    for p in [*norm.parameters(), *head.parameters()]:
        p.requires_grad_(False)
    valid = int(shift_labels(labels).ne(-100).sum())
    loss, g = chunked_lm_loss(hidden, shift_labels(labels), norm, head, valid, chunk_tokens=3)
    assert all(p.grad is None for p in [*norm.parameters(), *head.parameters()])
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g, ref_g, rtol=1e-5, atol=1e-6)


def test_grads_accumulate_into_existing_grad():
    norm, head, hidden, labels = _parts(bias=True)
    _, _, ref = _reference(norm, head, hidden, labels, torch.tensor(20))
    params = _named(norm, head)
    prior = {n: torch.randn_like(p) for n, p in params.items()}
    for n, p in params.items():
        p.grad = prior[n].clone()
    chunked_lm_loss(hidden, shift_labels(labels), norm, head, torch.tensor(20), chunk_tokens=4)
    for n, p in params.items():
        torch.testing.assert_close(p.grad, prior[n] + ref[n], rtol=1e-5, atol=1e-6)


def test_no_backward_returns_the_loss_only():
    norm, head, hidden, labels = _parts()
    ref_loss, _, _ = _reference(norm, head, hidden, labels, torch.tensor(9))
    loss, g = chunked_lm_loss(hidden, shift_labels(labels), norm, head, 9.0, chunk_tokens=2, backward=False)
    assert g is None
    assert all(p.grad is None for p in [*norm.parameters(), *head.parameters()])
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_chunked_logits_match_lm_head(chunk):
    norm, head, hidden, _ = _parts(bias=True)
    with torch.no_grad():
        want = head(norm(hidden))
    got = chunked_logits(hidden, norm, head, chunk_tokens=chunk)
    assert got.shape == (B, T, V)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bias", [False, True])
def test_compute_dtype_runs_the_head_as_autocast_does(bias):
    """compute_dtype=bf16 over fp32 weights (bf16=True on an fp32 model): loss, dL/dhidden and the fp32 weight and
    bias gradients equal the stock model's under torch.autocast (lm_head in bf16, the loss upcast to fp32), and
    differ from the fp32 head's; the logits come out in bf16, as autocast's lm_head gives them."""
    norm, head, hidden, labels = _parts(bias=bias)
    num_items = int(shift_labels(labels).ne(-100).sum())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref_dh, ref_grads = _reference(norm, head, hidden, labels, num_items)
    fp32_loss, _ = chunked_lm_loss(hidden, shift_labels(labels), norm, head, num_items, chunk_tokens=B * T)
    for p in [*norm.parameters(), *head.parameters()]:
        p.grad = None
    loss, dh = chunked_lm_loss(hidden, shift_labels(labels), norm, head, num_items, chunk_tokens=B * T,
                               compute_dtype=torch.bfloat16)
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0) and not torch.allclose(loss, fp32_loss, rtol=1e-6, atol=0)
    assert torch.allclose(dh, ref_dh, rtol=1e-5, atol=1e-7)
    for name, p in _named(norm, head).items():
        assert p.grad.dtype == torch.float32
        assert torch.allclose(p.grad, ref_grads[name], rtol=1e-5, atol=1e-7), name
    logits = chunked_logits(hidden, norm, head, 4, compute_dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        ref = head(norm(hidden))
    assert logits.dtype == torch.bfloat16 and torch.equal(logits, ref)
