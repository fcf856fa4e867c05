"""The user's loss over the streamed model: `compute_loss` overrides, `compute_loss_func`, label smoothing.

`StreamedCausalLM` is the model a `compute_loss` receives. Its forward runs the executor's streamed decoder stack
as one autograd node (`_StreamedStack`): the forward streams the layers without grad (keeping only the plan's
checkpoints and retained layers), then the final norm and the LM head run under ordinary autograd and return a
`CausalLMOutputWithPast` with the full logits, as the HF model does. The backward of whatever loss the caller
computed reaches the node with dL/d(last hidden state), and the node streams the layers backward from it
(`StreamingExecutor.stream_pass`). The embedding's backward and the gradient flush run when the trainer finishes
the pass after `loss.backward()` (`UserLossPass.finish`).

Memory: the logits are materialized whole, [B, T, V] in the head's dtype, plus whatever fp32 copies the loss makes
(HF's cross-entropy upcasts: 4 more bytes per logit, and its gradient as much again): at B x T = 16k tokens and a
152k vocabulary that is 10 GB in bf16 before the loss. The executor's own chunked loss (no `compute_loss`
override) never holds them.
"""

from __future__ import annotations

from collections.abc import Generator
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutputWithPast

from .peft_support import host_adapter_switches

__all__ = ["StreamedCausalLM", "UserLossPass", "fused_forward", "user_loss_reasons"]

#: keyword arguments of an HF causal LM's forward that change nothing here
_IGNORED_KWARGS = {"use_cache", "return_dict", "output_attentions", "cache_position"}


def head_adapter(model: Any) -> str | None:
    """The PEFT tuner class on the model's LM head (LoRA, IA3, ... in `target_modules`), or None. The executor's
    chunked loss multiplies by the head's weight alone; such a head's output also needs its adapter, which only the
    module's own forward applies (`modules_to_save`, a trained copy of the weight, needs nothing)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return None
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return type(head).__qualname__ if isinstance(head, BaseTunerLayer) else None


def user_loss_reasons(trainer: Any, stock_compute_loss: Any) -> list[str]:
    """What makes the loss the user's rather than the executor's cross-entropy: a `compute_loss` other than the
    stock Trainer's, `compute_loss_func`, `label_smoothing_factor` > 0, a PEFT adapter on the LM head (the head's
    own forward applies it). Empty: the executor's chunked loss runs."""
    out = []
    method = type(trainer).compute_loss
    if method is not stock_compute_loss:
        out.append(f"compute_loss of {method.__qualname__.rsplit('.', 1)[0]}")
    if getattr(trainer, "compute_loss_func", None) is not None:
        out.append("compute_loss_func")
    if getattr(trainer, "label_smoother", None) is not None:
        out.append(f"label_smoothing_factor={trainer.args.label_smoothing_factor}")
    adapter = head_adapter(getattr(trainer, "model", None))
    if adapter is not None:
        out.append(f"an adapter on the LM head ({adapter})")
    return out


class UserLossPass:
    """One streamed pass in flight: the generator of `StreamingExecutor.stream_pass` and where it stands
    ("forward": waiting for dL/dh; "backward": layers done, head and embedding to finish)."""

    def __init__(self, run: Generator) -> None:
        self.run = run
        self.state = "start"

    def forward(self) -> torch.Tensor:
        h = next(self.run)
        self.state = "forward"
        return h

    def backward(self, grad: torch.Tensor) -> None:
        self.run.send(grad.contiguous())
        self.state = "backward"

    def finish(self, executor: Any) -> None:
        """After the loss's backward: the head's gradient to where it lives, then the embedding's backward."""
        executor.resident.head_backward_done()
        next(self.run, None)
        self.state = "done"

    def close(self) -> None:
        self.run.close()
        self.state = "done"


class _StreamedStack(torch.autograd.Function):
    """Decoder stack as one autograd node: forward streams the layers, backward streams them backward from dL/dh.
    `anchor` is a fresh leaf requiring grad, so that the node is in the graph (the layers' parameters are not
    autograd inputs: their gradients go to the executor's host accumulators)."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, run: UserLossPass) -> torch.Tensor:
        ctx.run = run
        return run.forward()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        ctx.run.backward(grad)
        return None, None


class StreamedCausalLM(nn.Module):
    """The HF causal LM as `compute_loss` sees it while the executor trains it: `model(**inputs)` returns what the
    HF model returns (`loss` when given `labels`, full `logits`), and the loss's backward streams the layers.

    One forward with grad per micro-batch (the executor streams one pass at a time); forwards under
    `torch.no_grad()` (e.g. a reference model's log-probabilities) may run before or after it, a streamed no-grad
    forward that leaves the pass in flight as it was (`StreamingExecutor.forward_hidden`).

    Args:
        executor: the StreamingExecutor over `executor.model`.
    """

    def __init__(self, executor: Any) -> None:
        super().__init__()
        self.module = executor.model
        self.executor = executor
        self.pending: UserLossPass | None = None
        #: all-reduce the resident gradients after the pass (data parallel; the trainer sets it per micro-batch)
        self.sync_gradients = True

    @property
    def config(self) -> Any:
        return self.module.config

    @property
    def device(self) -> torch.device:
        """Where the inputs and the logits live: the executor's device."""
        return self.executor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.module.dtype

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # parameters, buffers and submodules nn.Module keeps
        except AttributeError:
            pass
        raise AttributeError(
            f"the model compute_loss receives under LazyTrain is the streamed causal LM, which has no attribute "
            f"{name!r}: call it as model(input_ids=..., attention_mask=..., labels=...) (its .config, .device, "
            ".dtype, get_input_embeddings() and get_output_embeddings() are the HF model's). The HF model's inner "
            "modules (model.model, model.lm_head) would run unstreamed; for them train with lazytrain_config "
            "policy 'none' (the stock Trainer path)")

    def _get_name(self) -> str:  # the Trainer's label smoother shifts labels for causal-LM class names
        return self.module._get_name()

    def get_input_embeddings(self) -> nn.Module:
        return self.module.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.module.get_output_embeddings()

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                logits_to_keep: int | torch.Tensor = 0, fused_lm_head: bool = False,
                **kwargs: Any) -> CausalLMOutputWithPast | Any:
        loss_kwargs = {k: kwargs.pop(k) for k in ("num_items_in_batch", "ignore_index", "shift_labels")
                       if k in kwargs}
        unknown = sorted(k for k, v in kwargs.items() if k not in _IGNORED_KWARGS and v is not None
                         and not (k == "output_hidden_states" and v is False))
        if input_ids is None and not unknown:
            unknown = ["no input_ids"]
        if unknown:
            raise ValueError(f"the LazyTrain executor's model forward takes input_ids, attention_mask, position_ids, "
                             f"labels and logits_to_keep, but compute_loss passed {unknown}; drop them or train with "
                             "lazytrain_config policy 'none' (the stock Trainer path)")
        if torch.is_grad_enabled() and self.pending is not None and self.pending.state != "done":
            raise RuntimeError("compute_loss ran the model with gradients a second time while its first forward's "
                               "backward is still to come: the executor streams one pass with gradients per "
                               "micro-batch. Run the other forwards (e.g. reference log-probabilities) under "
                               "torch.no_grad()")
        ex = self.executor
        dtype = ex.autocast_dtype
        autocast = torch.autocast(ex.device.type, dtype=dtype, enabled=dtype is not None)  # as the layers ran
        if fused_lm_head:
            return self._fused(input_ids, attention_mask, position_ids, labels, autocast, loss_kwargs)
        if not torch.is_grad_enabled():
            with host_adapter_switches(ex):
                _, logits = ex.forward_inference(input_ids, attention_mask, None, position_ids)
            logits = logits[:, _keep(logits_to_keep, logits.shape[1]), :]
        else:
            h = self._stream(input_ids, attention_mask, position_ids)
            with autocast:
                hidden = ex.base.norm(h)
                logits = ex.resident.head_module()(hidden[:, _keep(logits_to_keep, hidden.shape[1]), :])
        loss = None
        if labels is not None:
            loss = self.module.loss_function(logits=logits, labels=labels.to(logits.device),
                                             vocab_size=self.config.vocab_size, **loss_kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def _stream(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None) -> torch.Tensor:
        """The last decoder layer's output [B, T, H] (before the final norm): with grad, the streamed stack's autograd
        node (its backward streams the layers); without, a plain streamed forward, with the adapters the PEFT model
        has switched on now (a reference under `disable_adapter()`)."""
        ex = self.executor
        if not torch.is_grad_enabled():
            with host_adapter_switches(ex):
                return ex.forward_hidden(input_ids, attention_mask, position_ids)
        self.pending = UserLossPass(ex.stream_pass(input_ids, attention_mask, position_ids, self.sync_gradients))
        anchor = torch.empty(0, device=ex.device, requires_grad=True)
        return _StreamedStack.apply(anchor, self.pending)

    def _fused(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
               labels: torch.Tensor | None, autocast: Any, loss_kwargs: dict[str, Any]) -> Any:
        """`model(..., fused_lm_head=True)`: TRL's own fused forward (trl `add_fused_lm_head`: per-token
        log-probabilities, entropy, top-1 hits, computed tile by tile without the [B, T, V] logits) over the streamed
        hidden states and the executor's LM head."""
        fn = fused_forward(self.module)
        if fn is None:
            raise ValueError("compute_loss called the model with fused_lm_head=True, but the model has no fused LM "
                             "head (TRL's trl.trainer.utils.add_fused_lm_head patches it in; the TRL trainers do it "
                             "when they are built). Build the trainer on the model TRL patched, or drop "
                             "fused_lm_head")
        ex = self.executor
        h = self._stream(input_ids, attention_mask, position_ids)
        with autocast:
            hidden = ex.base.norm(h)
            return fn(_Backbone(hidden, ex.resident.head_module()), input_ids=input_ids, labels=labels,
                      fused_lm_head=True, **loss_kwargs)


def fused_forward(model: nn.Module) -> Any:
    """TRL's fused-LM-head forward function patched onto `model` (or onto a PEFT model's base), or None."""
    for m in (model, getattr(model, "get_base_model", lambda: None)()):
        bound = vars(m).get("forward") if m is not None else None
        fn = getattr(bound, "__func__", None)
        code = getattr(fn, "__code__", None)  # functools.wraps gave it the model forward's name and module
        if code is not None and code.co_name == "_fused_forward" and fn.__globals__["__name__"].startswith("trl."):
            return fn
    return None


class _Backbone:
    """What TRL's fused forward reads from `self`: the backbone (here: its output, the streamed hidden states after
    the final norm) and the LM head (the executor's)."""

    def __init__(self, hidden: torch.Tensor, head: nn.Module) -> None:
        self._hidden, self._head = hidden, head

    def base_model(self, *args: Any, **kwargs: Any) -> BaseModelOutput:
        return BaseModelOutput(last_hidden_state=self._hidden)

    def get_output_embeddings(self) -> Any:
        # what TRL reads of the head: its weight and bias (the executor's GPU copy of a host head has no bias)
        return SimpleNamespace(weight=self._head.weight, bias=getattr(self._head, "bias", None))


def _keep(logits_to_keep: int | torch.Tensor, T: int) -> slice | torch.Tensor:
    """HF's `logits_to_keep`: an int keeps the last n positions (0: all), a tensor the given positions."""
    if isinstance(logits_to_keep, int):
        return slice(-logits_to_keep, None) if logits_to_keep else slice(0, T)
    return logits_to_keep
