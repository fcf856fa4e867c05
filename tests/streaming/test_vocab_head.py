"""vocab_chunked_lm_loss against plain autograd through F.cross_entropy(h @ W.T) and against head.py's chunked_lm_loss,
on random inputs (fp32 on the CPU unless stated)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lazytrain_hf.streaming.head import chunked_lm_loss
from lazytrain_hf.streaming.vocab_head import vocab_chunked_lm_loss

N, H, V = 13, 8, 37


def _inputs(seed: int = 0, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g)
    t = torch.randint(0, V, (N,), generator=g)
    t[[1, 4, 9]] = -100
    return h.to(dtype), w.to(dtype), t


def _reference(h, w, t, denom):
    """Loss, dh and dW of F.cross_entropy(h @ W.T, t, ignore_index=-100, reduction='sum') / denom, fp32 autograd."""
    h = h.float().clone().requires_grad_()
    w = w.float().clone().requires_grad_()
    loss = F.cross_entropy(h @ w.t(), t, ignore_index=-100, reduction="sum") / denom
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _vocab(h, w, t, denom, vc, chunk_tokens=2048, backward=True, frozen=False):
    """Run vocab_chunked_lm_loss with slices of `w`; assemble dW from the callback (each slice exactly once)."""
    dw = torch.zeros_like(w)
    seen: list[int] = []

    def grad_slice(c, g):
        assert g.dtype == w.dtype and g.shape == w[c * vc:(c + 1) * vc].shape
        seen.append(c)
        dw[c * vc:(c + 1) * vc] += g

    loss, dh = vocab_chunked_lm_loss(h, t, lambda c: w[c * vc:(c + 1) * vc], V, vc, denom, chunk_tokens,
                                     backward, None if frozen else grad_slice)
    if backward and not frozen and t.ne(-100).any():
        assert seen == list(range(-(-V // vc)))
    return loss, dh, dw


def _close(a, b, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("vc", [5, 10, 36, V, 1000])  # V % vc != 0, one slice equal to V, one larger than V
@pytest.mark.parametrize("chunk_tokens", [3, 2048])
@pytest.mark.parametrize("mean", [True, False])
def test_matches_autograd_cross_entropy(vc, chunk_tokens, mean):
    h, w, t = _inputs()
    valid = int(t.ne(-100).sum())
    denom = valid if mean else torch.tensor(valid + 3.0)  # a window's count, larger than this micro-batch's
    ref_loss, ref_dh, ref_dw = _reference(h, w, t, denom)
    loss, dh, dw = _vocab(h, w, t, denom, vc, chunk_tokens)
    assert loss.dtype == torch.float32 and not loss.requires_grad and dh.dtype == h.dtype
    _close(loss, ref_loss)
    _close(dh, ref_dh)
    _close(dw, ref_dw)
    assert torch.count_nonzero(dh[t.eq(-100)]) == 0


def test_all_targets_in_one_slice():
    h, w, t = _inputs(seed=1)
    t = torch.where(t.eq(-100), t, 20 + t % 5)  # every target in slice 2 of [10, 10, 10, 7]
    ref_loss, ref_dh, ref_dw = _reference(h, w, t, 7.0)
    loss, dh, dw = _vocab(h, w, t, 7.0, vc=10, chunk_tokens=4)
    _close(loss, ref_loss)
    _close(dh, ref_dh)
    _close(dw, ref_dw)


def test_large_logits_stay_finite():
    """The running max keeps exp() in range where a plain sum of exponentials overflows fp32."""
    h, w, t = _inputs(seed=2)
    h = h * 40.0
    ref_loss, ref_dh, ref_dw = _reference(h, w, t, 1.0)
    assert torch.isinf(torch.exp(h @ w.t()).sum(1)).any()
    loss, dh, dw = _vocab(h, w, t, 1.0, vc=6)
    _close(loss, ref_loss)
    _close(dh, ref_dh, rtol=1e-5, atol=1e-4)
    _close(dw, ref_dw, rtol=1e-5, atol=1e-4)


def test_bf16_weights_accumulate_in_fp32():
    h, w, t = _inputs(seed=3, dtype=torch.bfloat16)
    ref_loss, ref_dh, ref_dw = _reference(h, w, t, 10.0)  # fp32 reference of the same (bf16-rounded) values
    loss, dh, dw = _vocab(h, w, t, 10.0, vc=8, chunk_tokens=4)
    assert loss.dtype == torch.float32 and dh.dtype == dw.dtype == torch.bfloat16
    _close(loss, ref_loss, rtol=2e-2, atol=1e-2)
    _close(dh.float(), ref_dh, rtol=2e-2, atol=2e-2)
    _close(dw.float(), ref_dw, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("chunk_tokens", [4, 2048])
def test_equals_head_chunked_lm_loss(chunk_tokens):
    h, w, t = _inputs(seed=4)
    head = nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(w)
    want_loss, want_dh = chunked_lm_loss(h[None], t[None], nn.Identity(), head, 9.0, chunk_tokens=chunk_tokens)
    loss, dh, dw = _vocab(h, w, t, 9.0, vc=7, chunk_tokens=chunk_tokens)
    _close(loss, want_loss)
    _close(dh, want_dh[0])
    _close(dw, head.weight.grad)


def test_sweep_invariants():
    """Facts each sweep must meet on its own: equal logits give log(V) per token (the lse sweep's sum, not only its
    max), and each row's logit gradient sums to zero over the vocabulary (softmax mass 1 minus the target's one), so
    dW summed over the vocabulary is zero: without the minus one it is the valid rows' h sum / denominator."""
    h, w, t = _inputs(seed=5)
    valid = int(t.ne(-100).sum())
    loss, _, _ = _vocab(h, torch.zeros_like(w), t, 2.0, vc=6)
    _close(loss, torch.tensor(valid * torch.log(torch.tensor(float(V))).item() / 2.0))
    _, _, dw = _vocab(h, w, t, 2.0, vc=6, chunk_tokens=5)
    _close(dw.sum(0), torch.zeros(H), rtol=0, atol=1e-5)
    assert h[t.ne(-100)].sum(0).abs().max() > 1.0  # what a missing minus one would leave


def test_loss_only_and_frozen_head():
    h, w, t = _inputs(seed=6)
    ref_loss, ref_dh, _ = _reference(h, w, t, 5.0)
    w = nn.Parameter(w)  # slices of a Parameter: no autograd graph, no .grad
    calls: list[int] = []

    def slice_(c):
        calls.append(c)
        return w[c * 10:(c + 1) * 10]

    loss, dh = vocab_chunked_lm_loss(h, t, slice_, V, 10, 5.0, backward=False)
    assert dh is None and calls == [0, 1, 2, 3] and not loss.requires_grad  # one sweep
    _close(loss, ref_loss)
    loss, dh, dw = _vocab(h, w, t, 5.0, vc=10, frozen=True)
    _close(loss, ref_loss)
    _close(dh, ref_dh)
    assert torch.count_nonzero(dw) == 0 and not dh.requires_grad and w.grad is None


def test_all_ignored_is_zero():
    h, w, _ = _inputs(seed=7)
    t = torch.full((N,), -100)

    def no_slice(c):
        raise AssertionError("no slice is needed when no row has a target")

    loss, dh = vocab_chunked_lm_loss(h, t, no_slice, V, 10, 1.0, grad_slice=no_slice)
    assert loss.item() == 0.0 and dh.shape == h.shape and torch.count_nonzero(dh) == 0


def test_bad_input_is_named():
    h, w, t = _inputs()
    with pytest.raises(ValueError, match="weight_slice\\(3\\) must return rows \\[30, 37\\)"):
        vocab_chunked_lm_loss(h, t, lambda c: w[:10], V, 10, 1.0)
    bad = t.clone()
    bad[0] = V
    with pytest.raises(ValueError, match="targets must lie in \\[0, 37\\)"):
        vocab_chunked_lm_loss(h, bad, lambda c: w[c * 10:(c + 1) * 10], V, 10, 1.0)
    with pytest.raises(ValueError, match="must be positive"):
        vocab_chunked_lm_loss(h, t, lambda c: w, V, 0, 1.0)
