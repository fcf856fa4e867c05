"""Where the embedding and the LM head live (`Schedule.resident`), and how their compute and gradients reach them.

- "gpu": both on the compute device with their gradients and optimizer states (the optimizer updates them there).
- "host_embedding": the input embedding in host memory. The lookup runs on the host and its [B, T, H] output goes
  up; the gradient of that output comes back and is index-added into the host gradient (rows of `padding_idx`
  excluded, as `nn.Embedding`'s backward does). The optimizer sees a host parameter with a host gradient and
  updates it on the CPU. Both directions go through one reused page-locked staging buffer of [B, T, H]: a fresh
  [B, T, H] host tensor per call page-faulted at ~0.6 GB/s on 2 cores (5.2 ms a lookup into a reused buffer
  against 43-99 ms into new ones at 8192 x 3584 bf16), and pageable copies block.
- "host": the LM head too (a tied weight is both at once). The head multiplies by a GPU working copy of the host
  weights, refreshed once per optimizer step on a side stream while the forward runs; its weight gradient goes back
  to the host right after the head. The final norm stays on the compute device in every placement.
- "host_sliced": as "host", but the head never has a GPU copy of the whole weight: its loss runs over vocabulary
  slices (`vocab_head.vocab_chunked_lm_loss`), each slice copied up on a side stream while the one before computes
  (two slices in flight, fetched once per sweep: twice per micro-batch with backward), and each slice's weight
  gradient sent back to the host buffer as it is made. The [V, H] copy and its gradient (2 x 2.5 GB at a 248k x 5120
  head) become two [`HEAD_VOCAB_SLICE_ROWS`, H] slices and one slice gradient, for 8 instead of 6 N V H FLOPs and
  3 V H bf16 bytes over PCIe. Only the executor's own loss runs this way; the inference logits
  (`forward_inference(return_logits=True)`) multiply by a temporary whole copy.

Host weights and gradient buffers are page-locked at their exact size (`Registrations`, cudaHostRegister): the caching
host allocator's power-of-two rounding locked a 2.5 GB embedding as 4 GiB. Their optimizer states stay pageable
(hybrid8's `_alloc_like`). A host part's gradient buffer is allocated once and reused: a window starts where the
parameter's `.grad` is None (whoever cleared it), at which point the embedding rows touched in the last window are
zeroed, so the buffer is never cleared whole.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..planning.schedule import HEAD_VOCAB_SLICE_ROWS, RESIDENT_PLACEMENTS
from .head import IGNORE_INDEX
from .host_store import Registrations, sq_norm
from .vocab_head import vocab_chunked_lm_loss

__all__ = ["ResidentParts", "initial_placement", "resident_gpu_bytes"]

logger = logging.getLogger(__name__)


class _HeadCopy(nn.Module):
    """The LM head as the chunked loss calls it, multiplying by a GPU copy of the host weights."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class _SliceFetcher:
    """`weight_slice` for `vocab_chunked_lm_loss` under "host_sliced": the k-th call returns slice `order[k]` of the
    host head weight on the compute device and starts the copy of `order[k + 1]` into the other of its two device
    buffers on the side stream. A buffer is overwritten only after the compute stream has queued everything that reads
    it (the side stream waits for the compute stream when the copy is issued). On a CPU device: views, no copies.
    The buffers are the head's workspace: they go with the fetcher (`done`), not held through the layers' passes."""

    def __init__(self, parts: ResidentParts, order: list[int]) -> None:
        self.parts, self.order, self.k = parts, order, 0
        self.ready: dict[int, torch.cuda.Event] = {}  # call index -> its copy's event
        w = parts.head.weight
        rows = min(parts.vocab_slice_rows, w.shape[0])
        self.buffers = [] if parts._side is None else [
            torch.empty(rows, w.shape[1], dtype=w.dtype, device=parts.device) for _ in range(2)]

    def _rows(self, c: int) -> slice:
        r = self.parts.vocab_slice_rows
        return slice(c * r, min((c + 1) * r, self.parts.head.weight.shape[0]))

    def _issue(self, k: int) -> None:
        parts = self.parts
        src = parts.head.weight.data[self._rows(self.order[k])]
        buf = self.buffers[k % 2][:src.shape[0]]
        parts._side.wait_stream(torch.cuda.current_stream(parts.device))
        with torch.cuda.stream(parts._side):
            buf.copy_(src, non_blocking=True)
            self.ready[k] = torch.cuda.Event()
            self.ready[k].record(parts._side)

    def __call__(self, c: int) -> torch.Tensor:
        k = self.k
        if k >= len(self.order) or self.order[k] != c:
            raise RuntimeError(f"head slices asked out of order: call {k} wants slice {c}, planned {self.order}")
        self.k += 1
        parts = self.parts
        if parts._side is None:
            return parts.head.weight.detach()[self._rows(c)]
        if k not in self.ready:
            self._issue(k)
        torch.cuda.current_stream(parts.device).wait_event(self.ready.pop(k))
        out = self.buffers[k % 2][:self._rows(c).stop - self._rows(c).start]
        if k + 1 < len(self.order):
            self._issue(k + 1)
        return out

    def done(self) -> None:
        """Drop copies issued for calls that never came (a loss with no target row fetches nothing) and the two
        buffers."""
        self.ready.clear()
        for buf in self.buffers:  # allocated on the compute stream, written on the side stream
            buf.record_stream(self.parts._side)
        self.buffers = []


class ResidentParts:
    """The embedding and LM head of `model` and their placement.

    Args:
        model: the HF causal LM (its decoder layers are streamed elsewhere).
        base: its base model (`embed_tokens`, `norm`).
        device: the compute device.
        pin: page-lock host copies and buffers (CUDA runs).
    """

    def __init__(self, model: nn.Module, base: nn.Module, device: torch.device, pin: bool) -> None:
        self.device, self.pin = device, pin
        self.embed: nn.Embedding = base.embed_tokens
        self.head: nn.Module = model.get_output_embeddings()
        self.tied = self.head.weight is self.embed.weight
        self.placement = "gpu"
        self.padding_idx = getattr(self.embed, "padding_idx", None)
        self._grad_bufs: dict[int, torch.Tensor] = {}  # id(param) -> its host gradient buffer, reused
        self._touched: torch.Tensor | None = None  # embedding rows with gradient in the buffer (host int64)
        self._ids: torch.Tensor | None = None  # this micro-batch's input ids on the host (host embedding)
        self._copy: _HeadCopy | None = None  # the head's GPU working copy (host head)
        self._stale = True  # the working copy is older than the host weights
        self._copy_done: torch.cuda.Event | None = None  # the working copy's refresh (side stream)
        self._grad_done: torch.cuda.Event | None = None  # the head gradient's D2H
        self._head_stage: torch.Tensor | None = None  # D2H target when the window already has a head gradient
        self._stage_pending = False  # `_head_stage` holds a gradient still to be added
        self._head_sq: torch.Tensor | None = None  # the head gradient's squared norm, computed on the device
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._reg = Registrations()  # page-locked host weights and buffers, exact sizes
        self._flat: dict[int, torch.Tensor] = {}  # data_ptr -> the registered flat buffer under a host tensor
        self._stage: torch.Tensor | None = None  # host embedding: the lookup's output / its gradient, reused
        self._stage_read: torch.cuda.Event | None = None  # the last copy out of `_stage` (a non-blocking H2D)
        #: vocabulary rows per head slice under "host_sliced" (tests set fewer, to run several slices)
        self.vocab_slice_rows = HEAD_VOCAB_SLICE_ROWS

    # ---- placement -----------------------------------------------------------------------------------------
    @property
    def embed_on_host(self) -> bool:
        return self.placement != "gpu"

    @property
    def head_on_host(self) -> bool:
        return self.placement in ("host", "host_sliced")

    @property
    def head_sliced(self) -> bool:
        """The head's loss runs over vocabulary slices streamed from host memory (`sliced_loss`)."""
        return self.placement == "host_sliced"

    def host_parameters(self) -> list[nn.Parameter]:
        """The parameters in host memory under the current placement (a tied weight once)."""
        out = [self.embed.weight] if self.embed_on_host else []
        if self.head_on_host and not self.tied:
            out.append(self.head.weight)
        return out

    def allowed(self) -> tuple[str, ...]:
        """The placements this model can run (`check`)."""
        out = []
        for p in RESIDENT_PLACEMENTS:
            try:
                self.check(p)
            except ValueError:
                continue
            out.append(p)
        return tuple(out)

    def check(self, placement: str) -> None:
        """Raise one clear error when `placement` cannot run for this model.

        Raises:
            ValueError: an unknown placement, "host_embedding" with a tied LM head, or an LM head with a bias.
        """
        if placement not in RESIDENT_PLACEMENTS:
            raise ValueError(f"resident placement must be one of {RESIDENT_PLACEMENTS}, but got {placement!r}")
        if placement == "host_embedding" and self.tied:
            raise ValueError("resident placement 'host_embedding' needs an untied LM head: this model ties it to the "
                             "embedding (one weight for both); use 'gpu' or 'host'")
        if placement in ("host", "host_sliced") and getattr(self.head, "bias", None) is not None:
            raise ValueError(f"resident placement {placement!r} streams the LM head's weight only, but this model's "
                             "head has a bias; use 'gpu' or 'host_embedding'")

    def apply(self, placement: str, optimizer: Any = None) -> None:
        """Move the embedding / LM head weights (and their optimizer states in `optimizer`, if any) to where
        `placement` keeps them; drops their gradients. A no-op when nothing changes."""
        self.check(placement)
        if placement == self.placement:
            return
        self.placement = placement
        host = {id(p) for p in self.host_parameters()}
        for p in {id(q): q for q in (self.embed.weight, self.head.weight)}.values():
            target = torch.device("cpu") if id(p) in host else self.device
            p.grad = None
            ours = p.device.type == "cpu" and p.data.data_ptr() in self._flat
            if id(p) in host and not ours:  # into exact-size host pages, whatever the device (CPU runs too)
                old = p.data
                p.data = self._host_copy(old)
                self._free(old)
            elif id(p) not in host and (p.device != target or ours):
                old = p.data
                p.data = old.to(target, copy=True)
                self._free(old)
            states = getattr(optimizer, "state", {}).get(p) if optimizer is not None else None
            for k, v in (states or {}).items():
                if torch.is_tensor(v) and v.dim() > 0 and v.device != target:
                    states[k] = v.to(target)  # host states stay pageable: the CPU updates them in place
        for k in [k for k in self._grad_bufs if k not in host]:
            self._free(self._grad_bufs.pop(k))
        if not self.embed_on_host:
            self._free(self._stage)
            self._stage = None
        self._touched = None
        self._copy = None
        self._stale = True
        head = ("in host memory (streamed in vocabulary slices)" if self.head_sliced else
                "in host memory (GPU copy per step)" if self.head_on_host else "on the GPU")
        logger.info("LazyTrain: embedding %s, LM head %s", "in host memory" if self.embed_on_host else "on the GPU",
                    head)

    def _host_empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Zeroed host memory of `shape`, in pages of its own, page-locked at its exact size when pinning."""
        flat = self._reg.empty(shape.numel(), dtype, pin=self.pin)
        self._flat[flat.data_ptr()] = flat
        return flat.view(shape)

    def _host_copy(self, t: torch.Tensor) -> torch.Tensor:
        return self._host_empty(t.shape, t.dtype).copy_(t)

    def _free(self, t: torch.Tensor | None) -> None:
        """Unregister a host tensor made by `_host_empty` (no-op for others) before it is dropped."""
        flat = self._flat.pop(t.data_ptr(), None) if t is not None and t.device.type == "cpu" else None
        if flat is not None:
            self._reg.drop(flat)

    @property
    def pinned_bytes(self) -> int:
        """Host bytes of the host-placed weights, gradient buffers and the embedding's staging buffer (page-locked
        when pinning)."""
        return sum(t.numel() * t.element_size() for t in self._flat.values())

    def mark_stale(self) -> None:
        """The host weights may have changed (an optimizer step, a load): refresh the head's copy before use."""
        self._stale = True

    # ---- embedding ---------------------------------------------------------------------------------------------
    def embed_input(self, input_ids: torch.Tensor, keep_ids: bool = True) -> torch.Tensor | None:
        """The embedding output on the compute device when the embedding lives on the host (else None: the
        model's own forward looks it up). `keep_ids`: the ids are kept for `embed_backward` (False: a no-grad
        forward, which may run inside another pass, before that pass's embedding backward)."""
        if not self.embed_on_host:
            return None
        ids = input_ids.detach().cpu()
        if keep_ids:
            self._ids = ids
        with torch.no_grad():
            if self._plain_lookup():
                out = torch.index_select(self.embed.weight, 0, ids.reshape(-1),
                                         out=self._staging(ids.numel(), self.embed.weight))
                out = out.view(*ids.shape, -1)
            else:  # the module itself: its hooks or a subclass's forward run as in the model's own forward
                out = self.embed(ids)
        if self.device.type != "cuda" or not out.is_pinned():
            # a copy on the CPU device too: the staging buffer is reused by the next lookup, which may come while
            # this output is still a stashed boundary (a forward inside another pass)
            return out.to(self.device, copy=True)
        up = out.to(self.device, non_blocking=True)
        self._stage_read = torch.cuda.Event()
        self._stage_read.record(torch.cuda.current_stream(self.device))
        return up

    def _plain_lookup(self) -> bool:
        """The embedding's forward is a row lookup (a plain `nn.Embedding` without hooks or max_norm)."""
        e = self.embed
        return (type(e) is nn.Embedding and e.max_norm is None and not e._forward_hooks
                and not e._forward_pre_hooks and not nn.modules.module._global_forward_hooks
                and not nn.modules.module._global_forward_pre_hooks)

    def _staging(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        """A [rows, H] view of the reused host staging buffer (grown, never shrunk; page-locked when pinning), once
        the last copy out of it has finished (a forward without backward, e.g. evaluation, looks up again while the
        last upload may still run)."""
        if self._stage_read is not None:
            self._stage_read.synchronize()
            self._stage_read = None
        need = rows * like.shape[-1]
        if self._stage is None or self._stage.numel() < need or self._stage.dtype != like.dtype:
            self._free(self._stage)
            self._stage = self._host_empty(torch.Size([need]), like.dtype)
        return self._stage[:need].view(rows, like.shape[-1])

    def embed_backward(self, grad: torch.Tensor) -> None:
        """Add the gradient of the looked-up rows ([B, T, H] on the compute device) into the host gradient."""
        p = self.embed.weight
        ids = self._ids.reshape(-1)
        g = grad.reshape(-1, grad.shape[-1])
        if g.device.type == "cpu":
            rows = g.to(p.dtype)
        else:  # into the staging buffer: a blocking copy (the rows are needed now) at page-locked speed
            rows = self._staging(g.shape[0], p).copy_(g)
        if self.padding_idx is not None:
            keep = ids.ne(self.padding_idx)
            ids, rows = ids[keep], rows[keep]
        buf = self._window_grad(p)
        buf.index_add_(0, ids, rows)
        self._touched = ids if self._touched is None else torch.cat([self._touched, ids])
        self._ids = None

    def _window_grad(self, p: nn.Parameter) -> torch.Tensor:
        """`p.grad` as the reused host buffer; a new window (`p.grad` None) first zeroes the rows left from the last."""
        buf = self._grad_bufs.get(id(p))
        embed = p is self.embed.weight
        if buf is None:
            buf = self._grad_bufs[id(p)] = self._host_empty(p.shape, p.dtype)
        elif p.grad is None and embed and self._touched is not None:
            buf.index_fill_(0, torch.unique(self._touched), 0)
        if p.grad is None:
            if embed:
                self._touched = None
            p.grad = buf
        return buf

    # ---- LM head ---------------------------------------------------------------------------------------------
    def start_refresh(self) -> None:
        """Begin copying the host head weights to the GPU (before the forward, so the copy overlaps it)."""
        if self.placement != "host" or not self._stale:
            return
        w = self.head.weight
        if self._copy is None:
            self._copy = _HeadCopy(torch.empty(w.shape, dtype=w.dtype, device=self.device))
        self._copy.weight.requires_grad_(w.requires_grad)  # a frozen head (LoRA's base) gets no gradient
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.device))  # the last use of the copy is done
            with torch.cuda.stream(self._side):
                self._copy.weight.data.copy_(w.data, non_blocking=True)
                self._copy_done = torch.cuda.Event()
                self._copy_done.record(self._side)
        else:
            self._copy.weight.data.copy_(w.data)
        self._stale = False

    def head_module(self) -> nn.Module:
        """The module the head multiplies by: the model's LM head, or the refreshed GPU copy of a host head (a
        temporary one under "host_sliced", whose loss goes through `sliced_loss` instead)."""
        if not self.head_on_host:
            return self.head
        if self.head_sliced:
            return _HeadCopy(self.head.weight.detach().to(self.device, copy=True).requires_grad_(False))
        self.start_refresh()
        if self._copy_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copy_done)
            self._copy_done = None
        return self._copy

    def head_backward_done(self) -> None:
        """After the head's backward: send the working copy's weight gradient to the host (D2H on a side stream),
        keep its squared norm, free it on the device. Nothing under "host_sliced" (`sliced_loss` sent it)."""
        if self.placement != "host":
            return
        g = self._copy.weight.grad
        self._copy.weight.grad = None
        if g is None:
            return
        p = self.head.weight
        first = p.grad is None
        self._head_sq = sq_norm(g) if first else None  # more than one micro-batch: the host sums, norm from there
        if first:
            dst = self._window_grad(p)
        else:
            dst = self._head_stage_buffer()
            self._stage_pending = True
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._side):
                dst.copy_(g, non_blocking=True)
                self._grad_done = torch.cuda.Event()
                self._grad_done.record(self._side)
            g.record_stream(self._side)
        else:
            dst.copy_(g)

    def sliced_loss(self, hidden: torch.Tensor, targets: torch.Tensor, norm: nn.Module,
                    denominator: float | torch.Tensor, chunk_tokens: int, backward: bool = True,
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`head.chunked_lm_loss` under "host_sliced": the same loss and dL/dhidden (the final norm's gradient
        accumulated in its `.grad`), the head's weight gradient added slice by slice into its host buffer.

        The final norm runs without grad over the target rows at once (the slices need them all for each sweep),
        and again with grad per `chunk_tokens` rows to take dL/dnormed back through it.
        """
        B, T, H = hidden.shape
        flat = hidden.reshape(B * T, H)
        tgt = targets.reshape(B * T)
        rows = tgt.ne(IGNORE_INDEX).nonzero().squeeze(1)
        with torch.no_grad():
            x = flat.index_select(0, rows)
            normed = torch.empty_like(x)
            for a in range(0, x.shape[0], chunk_tokens):  # the norm's fp32 internals one chunk at a time
                normed[a:a + chunk_tokens] = norm(x[a:a + chunk_tokens])
        w = self.head.weight
        train_head = backward and w.requires_grad and rows.numel() > 0  # no target row: `.grad` left untouched
        first = w.grad is None  # the window's first micro-batch: slices go straight into the buffer
        order = list(range(-(-w.shape[0] // self.vocab_slice_rows))) * (2 if backward else 1)
        fetch = _SliceFetcher(self, order)
        sq = [] if train_head and first else None
        if train_head:
            dst = self._window_grad(w) if first else self._head_stage_buffer()
        send = self._slice_sender(dst, sq) if train_head else None
        loss, g_normed = vocab_chunked_lm_loss(normed, tgt.index_select(0, rows), fetch, w.shape[0],
                                               self.vocab_slice_rows, denominator, chunk_tokens, backward, send)
        del normed
        if train_head:
            self._stage_pending = not first  # `finish` adds the staged slices into the window's gradient
            self._head_sq = torch.stack(sq).sum() if sq else None
            if self._side is not None:
                self._grad_done = torch.cuda.Event()
                self._grad_done.record(self._side)
        fetch.done()
        if not backward:
            return loss, None
        grad = torch.zeros_like(flat)
        for a in range(0, rows.numel(), chunk_tokens):  # dL/dnormed back through the norm, chunk by chunk
            with torch.enable_grad():
                xc = x[a:a + chunk_tokens].detach().requires_grad_()
                norm(xc).backward(g_normed[a:a + chunk_tokens])
            grad.index_copy_(0, rows[a:a + chunk_tokens], xc.grad)
        return loss, grad.view(B, T, H)

    def _head_stage_buffer(self) -> torch.Tensor:
        """The host buffer a later micro-batch's head gradient goes to before `finish` adds it into the window's."""
        p = self.head.weight
        if self._head_stage is None:
            self._head_stage = self._host_empty(p.shape, p.dtype)
        return self._head_stage

    def _slice_sender(self, dst: torch.Tensor, sq: list[torch.Tensor] | None):
        """`grad_slice` for `vocab_chunked_lm_loss`: slice c's weight gradient into rows of `dst` on the host (a
        D2H on the side stream; `finish` waits for it), its squared norm into `sq` (on the device)."""
        rows = self.vocab_slice_rows

        def send(c: int, dw: torch.Tensor) -> None:
            if sq is not None:
                sq.append(sq_norm(dw))
            out = dst[c * rows:c * rows + dw.shape[0]]
            if self._side is None:
                out.copy_(dw)
                return
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._side):
                out.copy_(dw, non_blocking=True)
            dw.record_stream(self._side)

        return send

    def finish(self, embed_grad: torch.Tensor | None) -> None:
        """End of a micro-batch's backward: the head gradient has reached the host (added into the window's), then
        the embedding gradient `embed_grad` (dL/d embedding output) is added."""
        if self._grad_done is not None:
            self._grad_done.synchronize()
            self._grad_done = None
        if self._stage_pending:
            self.head.weight.grad.add_(self._head_stage)
            self._stage_pending = False
        if embed_grad is not None and self.embed_on_host:
            self.embed_backward(embed_grad)

    def grad_sq_norm(self, p: nn.Parameter) -> torch.Tensor | None:
        """Squared norm of a host part's gradient (fp64 scalar), from what the device or the touched
        rows already give when possible; None for parameters not in host memory."""
        if id(p) not in {id(q) for q in self.host_parameters()} or p.grad is None:
            return None
        if p is self.head.weight and self._head_sq is not None and not (self.tied and self._touched is not None):
            return self._head_sq  # on the device, where the global norm is summed: no round trip
        if p is self.embed.weight and not self.tied and self._touched is not None:
            return sq_norm(p.grad.index_select(0, torch.unique(self._touched)))
        return sq_norm(p.grad)

    def zero_grad(self) -> None:
        """Drop the window's gradients (the buffers' touched rows are zeroed when the next window starts) and
        mark the head copy stale (an optimizer step ran, or is about to be skipped: either way cheap to redo)."""
        for p in self.host_parameters():
            p.grad = None
        self._head_sq = None
        self._stage_pending = False  # a micro-batch cut short (an out-of-memory abort) staged a gradient for nothing
        self._stale = True


def resident_gpu_bytes(parts: ResidentParts) -> int:
    """GPU bytes of the embedding and LM head kept on the GPU: weights, gradients, fp32 moments (8 bytes per
    parameter) and, for 16-bit weights, fp32 master weights (the optimizer's defaults for these parameters); a
    frozen one, its weights only."""
    total = 0
    for p in {id(q): q for q in (parts.embed.weight, parts.head.weight)}.values():
        if not p.requires_grad:  # frozen (LoRA's base): its weights only
            total += p.numel() * p.element_size()
            continue
        master = 4 if p.dtype in (torch.bfloat16, torch.float16) else 0
        total += p.numel() * (2 * p.element_size() + 8 + master)
    return total


def initial_placement(config: Any, parts: ResidentParts, device: torch.device, data_parallel: bool) -> str:
    """The placement before any plan (and the fixed policy's): `config.resident_placement` when given; else
    "gpu" in data parallel; else `planning.fixed.fixed_resident` against `gpu_memory_budget` (or the device's
    memory; 80 GiB on a CPU device, the planner's default there)."""
    from ..planning.fixed import fixed_resident

    choice = getattr(config, "resident_placement", "auto")
    if choice != "auto":
        return choice
    if data_parallel:
        return "gpu"
    budget = config.gpu_memory_budget
    if not budget:
        budget = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 80 * 1024**3
    return fixed_resident(resident_gpu_bytes(parts), budget, parts.allowed())
