"""Chunked causal-LM head: final norm + lm_head + cross-entropy without ever holding the [B, T, V] logits.

Matches transformers' `ForCausalLMLoss` (loss_utils.py): logits are cast to fp32, labels are shifted left by
one with -100 padding, cross-entropy ignores -100, and the sum is divided by `denominator` (the Trainer's
`num_items_in_batch`, or the micro-batch's valid-label count for a mean). Only positions with a target are projected; each
chunk of `chunk_tokens` of them runs forward and backward at once. Peak memory of a chunk: 12 bytes per logit
(log-softmax output, the loss gradient and the logits' gradient, fp32) plus the bf16 logits; the LM head's weight
gradient is added into `.grad` in place (a [V, H] product per chunk otherwise: 2.5 GB at a 248k x 5120 head).

With a `compute_dtype` (the executor's autocast, bf16=True over fp32 weights) the head's products run in that dtype
from a copy of the weight made once per call, as the stock model's lm_head does under autocast; the weight gradient
is accumulated in the weight's dtype. An fp32 head's products in fp32 take several times their bf16 time: the fp32 head
of a Llama-3-70B QLoRA run takes 0.13 s per micro-batch of 16 x 1024 this way (benchmarks/results/lora-20261203.json).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["shift_labels", "chunked_lm_loss", "chunked_logits"]

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """[B, T] labels -> [B, T] targets of each position (labels[:, 1:] then one -100), as HF's ForCausalLMLoss."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def chunked_lm_loss(hidden: torch.Tensor, targets: torch.Tensor, norm: nn.Module, lm_head: nn.Module,
                    denominator: float | torch.Tensor, chunk_tokens: int = 2048, backward: bool = True,
                    compute_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Loss and, if `backward`, dL/dhidden, accumulating norm / lm_head parameter grads as a side effect.

    Args:
        hidden: [B, T, H] last decoder layer output (no grad needed; it is detached per chunk).
        targets: [B, T] int64 shifted targets (see `shift_labels`), -100 = ignored.
        norm, lm_head: the model's final norm and output projection (on hidden's device).
        denominator: divide the summed token losses by this (token-weighted mean across micro-batches).
        chunk_tokens: target-carrying rows of the flattened [B*T, H] hidden processed at once.
        compute_dtype: run the head's products in this dtype (autocast's; None: the weight's).

    Returns:
        (loss, grad_hidden): fp32 scalar loss (detached), and [B, T, H] gradient in hidden's dtype or None.
    """
    B, T, H = hidden.shape
    flat = hidden.reshape(B * T, H)
    tgt = targets.reshape(B * T)
    # Only rows with a target reach the V-wide projection: ignored rows (prompt, padding) contribute zero loss and
    # zero gradient exactly, and on SFT data they are often half the tokens.
    rows = tgt.ne(IGNORE_INDEX).nonzero().squeeze(1)
    loss = torch.zeros((), dtype=torch.promote_types(torch.float32, hidden.dtype), device=hidden.device)
    grad = torch.zeros_like(flat) if backward else None
    denom = denominator.to(hidden.device, torch.float32) if torch.is_tensor(denominator) else float(denominator)
    weight = lm_head.weight
    bias = getattr(lm_head, "bias", None)
    w, b = _compute_copies(weight, bias, compute_dtype)
    for c0 in range(0, rows.numel(), chunk_tokens):
        idx = rows[c0:c0 + chunk_tokens]
        with torch.enable_grad() if backward else torch.no_grad():
            x = flat.index_select(0, idx).detach().requires_grad_(backward)
            h = norm(x)
            hd = h.detach().requires_grad_(backward)
            # the linear outside autograd's weight path: its weight gradient is added into `.grad` in place below
            logits = F.linear(hd.to(w.dtype), w, b)
            if backward:
                logits.requires_grad_()
            # one expression: the fp32 copy is held by nothing but log_softmax's input (ForCausalLMLoss upcasts)
            part = F.cross_entropy(logits.float(), tgt.index_select(0, idx), reduction="sum") / denom
            if backward:
                (dlogits,) = torch.autograd.grad(part, logits)
                del logits
                _add_grad(weight, dlogits.t(), hd.detach().to(w.dtype))
                if bias is not None and bias.requires_grad:
                    _add_bias_grad(bias, dlogits.sum(0))
                h.backward((dlogits @ w).to(h.dtype))
                del dlogits
                grad.index_copy_(0, idx, x.grad)
        loss += part.detach()
    return loss, (grad.view(B, T, H) if backward else None)


@torch.no_grad()
def _add_grad(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """weight.grad += a @ b, in place (no [V, H] temporary per chunk, as autograd's accumulation makes)."""
    if not weight.requires_grad:
        return
    if weight.grad is None:
        weight.grad = torch.mm(a, b).to(weight.dtype)
    elif a.dtype == weight.grad.dtype:
        weight.grad.addmm_(a, b)
    else:  # a lower compute dtype (autocast): the product in it, accumulated in the gradient's dtype
        weight.grad.add_(torch.mm(a, b))


def _compute_copies(weight: torch.Tensor, bias: torch.Tensor | None, compute_dtype: torch.dtype | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The head's weight and bias as its products use them: detached, in `compute_dtype` where autocast would cast
    them (a float32 weight under a lower autocast dtype), else as they are."""
    cast = compute_dtype is not None and weight.dtype == torch.float32 and compute_dtype != torch.float32
    w = weight.detach().to(compute_dtype) if cast else weight.detach()
    b = None if bias is None else (bias.detach().to(compute_dtype) if cast else bias.detach())
    return w, b


@torch.no_grad()
def _add_bias_grad(bias: torch.Tensor, g: torch.Tensor) -> None:
    if bias.grad is None:
        bias.grad = g.to(bias.dtype)
    else:
        bias.grad.add_(g)


@torch.no_grad()
def chunked_logits(hidden: torch.Tensor, norm: nn.Module, lm_head: nn.Module, chunk_tokens: int = 2048,
                   out_device: torch.device | str | None = None, compute_dtype: torch.dtype | None = None
                   ) -> torch.Tensor:
    """[B, T, H] -> [B, T, V] logits in lm_head's dtype (`compute_dtype`'s under autocast, as `chunked_lm_loss`),
    computed chunk by chunk into `out_device` memory."""
    B, T, H = hidden.shape
    flat = hidden.reshape(B * T, H)
    w, b = _compute_copies(lm_head.weight, getattr(lm_head, "bias", None), compute_dtype)
    cast = w.dtype != lm_head.weight.dtype

    def head(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(w.dtype), w, b) if cast else lm_head(x)

    outs = [head(norm(flat[r0:r0 + chunk_tokens])).to(out_device or hidden.device)
            for r0 in range(0, B * T, chunk_tokens)]
    return torch.cat(outs).view(B, T, -1)
