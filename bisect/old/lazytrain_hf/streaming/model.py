"""`StreamingModel`: the nn.Module the Trainer sees in place of the HF model when the executor runs it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from .executor import StreamingExecutor

__all__ = ["StreamingModel"]


class StreamingModel(nn.Module):
    """Wraps a StreamingExecutor so HF code can call it like the model.

    `forward` is an inference/evaluation forward (no grad; training goes through `StreamingExecutor.
    forward_backward` from `LazyTrainer.training_step`). `zero_grad` clears the host gradient buffers too.
    `parameters()` yields the HF model's parameters (the wrapped model is a submodule).
    """

    def __init__(self, executor: StreamingExecutor) -> None:
        super().__init__()
        self.module = executor.model
        self.executor = executor

    @property
    def config(self):
        return self.module.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                num_items_in_batch: torch.Tensor | int | None = None, return_logits: bool = True,
                **kwargs: Any) -> CausalLMOutputWithPast:
        loss, logits = self.executor.forward_inference(input_ids, attention_mask, labels, position_ids,
                                                       return_logits=return_logits, denominator=num_items_in_batch)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.executor.zero_grad()
