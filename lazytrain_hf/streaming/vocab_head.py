"""Causal-LM cross-entropy over vocabulary slices of the LM head: only a [Vc, H] slice of the head weight on the device.

`chunked_lm_loss` (head.py) multiplies each token chunk by the whole [V, H] head weight, so a host-placed head keeps a
GPU working copy of all of it (2.5 GB at a 248k x 5120 bf16 head). `vocab_chunked_lm_loss` takes the weight one
vocabulary slice at a time from a callable (the executor can stream the slices from host memory) and runs two sweeps
over them:

1. per token, the log-sum-exp of its logits (a running max and a rescaled sum of exponentials, fp32) and its target
   logit;
2. per slice, the logits' gradient p = (softmax - one_hot(target)) / denominator = (exp(logits - lse) - [v == target])
   / denominator; dL/dh += p @ W_c (summed over slices in fp32) and dL/dW_c = p^T @ h goes to a callback.

Same loss as head.py (ForCausalLMLoss): fp32 logits, -100 ignored, the summed token losses divided by `denominator`;
only rows with a target are projected. Each slice's logits are computed twice (once per sweep): 8 N V H FLOPs with
the weight gradient, against head.py's 6 N V H, and the slices are fetched twice. Peak workspace per token
chunk: [chunk_tokens, Vc] logits in the weight's dtype plus two fp32 copies, [N, H] fp32 for dL/dh and, with more than
one token chunk, [Vc, H] fp32 for dL/dW_c. The head's bias is not supported (resident placement 'host' rejects one).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .head import IGNORE_INDEX

__all__ = ["vocab_chunked_lm_loss"]


@torch.no_grad()  # gradients by hand: a slice of a Parameter builds no graph
def vocab_chunked_lm_loss(hidden: torch.Tensor, targets: torch.Tensor, weight_slice: Callable[[int], torch.Tensor],
                          vocab_size: int, vocab_chunk: int, denominator: float | torch.Tensor,
                          chunk_tokens: int = 2048, backward: bool = True,
                          grad_slice: Callable[[int, torch.Tensor], None] | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Loss and, if `backward`, dL/dhidden of the LM head over vocabulary slices; dL/dW per slice to `grad_slice`.

    Args:
        hidden: [N, H] final hidden states, after the final norm (no grad needed; gradients are computed by hand).
        targets: [N] int64 shifted targets (see `head.shift_labels`), -100 = ignored.
        weight_slice: `weight_slice(c)` returns rows [c * vocab_chunk, min((c + 1) * vocab_chunk, vocab_size)) of the
            [V, H] head weight, on hidden's device. Called twice per slice when `backward` (once per sweep).
        vocab_size: V, the head's rows.
        vocab_chunk: Vc, rows per slice (the last slice may be shorter).
        denominator: divide the summed token losses by this (the Trainer's `num_items_in_batch`, or the valid count).
        chunk_tokens: target-carrying rows processed at once inside a slice (`loss_chunk_tokens`).
        backward: compute the gradients (the second sweep); False returns the loss only.
        grad_slice: `grad_slice(c, dW_c)` receives slice c's weight gradient [Vc_c, H] in the weight's dtype, once
            per slice (the caller adds it where the head's gradient lives); never when no row has a target, as
            head.py then leaves `.grad` untouched. None: a frozen head, no weight gradient.

    Returns:
        (loss, grad_hidden): fp32 scalar loss, and [N, H] dL/dhidden in hidden's dtype (None without `backward`).

    Raises:
        ValueError: non-positive sizes, a slice of the wrong shape, or a target outside [0, vocab_size).
    """
    if vocab_size <= 0 or vocab_chunk <= 0 or chunk_tokens <= 0:
        raise ValueError(f"vocab_chunked_lm_loss: vocab_size, vocab_chunk and chunk_tokens must be positive, but got "
                         f"{vocab_size}, {vocab_chunk} and {chunk_tokens}")
    N, H = hidden.shape
    if targets.shape != (N,):
        raise ValueError(f"vocab_chunked_lm_loss: targets must be [N] = [{N}] like hidden's rows, but got "
                         f"{tuple(targets.shape)}")
    dev = hidden.device
    rows = targets.ne(IGNORE_INDEX).nonzero().squeeze(1)
    tgt = targets.index_select(0, rows)
    if tgt.numel() and (int(tgt.min()) < 0 or int(tgt.max()) >= vocab_size):
        raise ValueError(f"vocab_chunked_lm_loss: targets must lie in [0, {vocab_size}) or be {IGNORE_INDEX}, but got "
                         f"values in [{int(tgt.min())}, {int(tgt.max())}]: check vocab_size against the tokenizer")
    n = rows.numel()
    every = n == N  # every row has a target (resident.py's sliced loss passes only those): no row copy or scatter
    h = hidden.detach() if every else hidden.index_select(0, rows).detach()  # [n, H]
    n_slices = -(-vocab_size // vocab_chunk)
    denom = denominator.to(dev, torch.float32) if torch.is_tensor(denominator) else float(denominator)
    loss = torch.zeros((), dtype=torch.float32, device=dev)
    if n == 0:  # no weight is fetched and no gradient handed on
        return loss, (torch.zeros_like(hidden) if backward else None)
    token_chunks = [(t0, min(t0 + chunk_tokens, n)) for t0 in range(0, n, chunk_tokens)]

    def fetch(c: int) -> tuple[torch.Tensor, int]:
        w = weight_slice(c)
        v0 = c * vocab_chunk
        want = (min(vocab_chunk, vocab_size - v0), H)
        if tuple(w.shape) != want:
            raise ValueError(f"vocab_chunked_lm_loss: weight_slice({c}) must return rows [{v0}, {v0 + want[0]}) of "
                             f"the head weight, shape {want}, but got {tuple(w.shape)}")
        return w, v0

    def logits_of(hc: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # the product in the weight's dtype (as head.py's F.linear), then fp32 as ForCausalLMLoss upcasts
        return torch.mm(hc.to(w.dtype), w.t()).float()  # [tokens, Vc]

    # sweep 1: running max m, sum of exp(logit - m) and the target logit, per token (fp32)
    m = torch.full((n,), float("-inf"), dtype=torch.float32, device=dev)
    s = torch.zeros(n, dtype=torch.float32, device=dev)
    z_tgt = torch.zeros(n, dtype=torch.float32, device=dev)
    for c in range(n_slices):
        w, v0 = fetch(c)
        for t0, t1 in token_chunks:
            z = logits_of(h[t0:t1], w)
            local, inside = _local_targets(tgt[t0:t1], v0, w.shape[0])
            z_tgt[t0:t1] = torch.where(inside, z.gather(1, local[:, None]).squeeze(1), z_tgt[t0:t1])
            m_new = torch.maximum(m[t0:t1], z.amax(1))
            s[t0:t1] = s[t0:t1] * torch.exp(m[t0:t1] - m_new) + torch.exp(z - m_new[:, None]).sum(1)
            m[t0:t1] = m_new
            del z
        del w
    lse = m + torch.log(s)
    loss = (lse - z_tgt).sum() / denom
    if not backward:
        return loss.detach(), None

    # sweep 2: p = (exp(logits - lse) - one_hot) / denominator; dh += p @ W_c, dW_c = p^T @ h
    dh = torch.zeros(n, H, dtype=torch.float32, device=dev)
    for c in range(n_slices):
        w, v0 = fetch(c)
        dw_acc: torch.Tensor | None = None  # fp32 sum over token chunks (only with more than one)
        dw: torch.Tensor | None = None
        for t0, t1 in token_chunks:
            hc = h[t0:t1].to(w.dtype)
            p = torch.exp(logits_of(hc, w) - lse[t0:t1, None])
            local, inside = _local_targets(tgt[t0:t1], v0, w.shape[0])
            p.scatter_add_(1, local[:, None], -inside[:, None].to(p.dtype))  # the one-hot's minus one at the target
            p = p.div_(denom).to(w.dtype)
            dh[t0:t1] += torch.mm(p, w)
            if grad_slice is not None:
                dw = torch.mm(p.t(), hc)  # [Vc, H]
                if len(token_chunks) > 1:
                    dw_acc = dw.float() if dw_acc is None else dw_acc.add_(dw)
            del p
        if grad_slice is not None:
            grad_slice(c, dw if dw_acc is None else dw_acc.to(w.dtype))
        del w, dw, dw_acc
    if every:
        return loss.detach(), dh.to(hidden.dtype)
    grad = torch.zeros_like(hidden)
    grad.index_copy_(0, rows, dh.to(hidden.dtype))
    return loss.detach(), grad


def _local_targets(t: torch.Tensor, v0: int, vc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets as column indices into the slice [v0, v0 + vc) (clamped where outside) and whether each is inside."""
    local = t - v0
    inside = (local >= 0) & (local < vc)
    return local.clamp(0, vc - 1), inside
