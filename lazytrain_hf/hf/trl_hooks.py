"""TRL trainer hooks under the executor: DPOTrainer's reference log-probabilities.

Precomputed (`precompute_ref_log_probs=True`): DPOTrainer computes them in its constructor, with the model's own
forward, before `LazyTrainerMixin` has built the executor, and on a GPU that forward cannot run: the model stays in
host memory. So the precompute is deferred until the executor holds the model, and then runs TRL's own
`_precompute_ref_logps` (its batching, caching and columns) with the model's forward replaced by the streamed model's
no-grad forward (TRL's fused head over the streamed hidden states, hf/user_loss.py): no gradient, no executor state
left behind.

A PEFT policy without `ref_model`: DPOTrainer's loss computes the reference inside `compute_loss`, after the
policy's forward, by calling the trainer's PeftModel under `use_adapter` (`disable_adapter()`, or the frozen "ref"
copy of a given adapter) and `torch.no_grad()`. Inside `compute_loss` those calls go to the streamed model
(`compute_loss_context_manager`): a no-grad streamed forward with the adapters as PEFT switched them
(`peft_support.host_adapter_switches`), run while the policy's pass waits for its loss's gradient and leaving that
pass as it was (`StreamingExecutor.forward_hidden`).

A separate `ref_model=` (a second full model, which TRL would run whole on the device) and a full-model policy whose
reference TRL would load again by name are refused when the trainer is built (`check_reference`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from ..streaming.layer_calls import unwrap_peft

__all__ = ["TRLHooks", "check_reference"]

#: the alternatives a refused reference names
_REFERENCE_FIXES = ("precompute_ref_log_probs=True (the reference is the policy before training: its log-probabilities "
                    "computed once, through the executor), or train a PEFT policy (peft_config=, or a PeftModel: the "
                    "reference is the base with the adapters disabled), or set lazytrain_config.policy='none' (the "
                    "stock Trainer path)")


def check_reference(trainer: str, named: dict[str, Any]) -> None:
    """Refuse, before a TRL trainer taking `ref_model` (DPOTrainer, KTOTrainer) is built, a reference the executor
    cannot stream: a `ref_model=`, or no reference at all for a full-model policy without precomputed
    log-probabilities (TRL then loads a second copy of the model by its name). Other trainers: a no-op.

    Args:
        trainer: the trainer class's name, for the message.
        named: the trainer's bound constructor arguments.

    Raises:
        ValueError: naming the argument and the alternatives.
    """
    if "ref_model" not in named:
        return
    args, model = named.get("args"), named.get("model")
    if named.get("ref_model") is not None:
        raise ValueError(f"{trainer}: ref_model= (a second full model) is not supported with the LazyTrain executor: "
                         "TRL would run it whole on the device, outside the streamed layers. Drop ref_model and use "
                         + _REFERENCE_FIXES)
    peft = named.get("peft_config") is not None or (model is not None and unwrap_peft(model) is not model)
    if not peft and hasattr(args, "precompute_ref_log_probs") and not args.precompute_ref_log_probs:
        raise ValueError(f"{trainer} without ref_model, a PEFT policy or precompute_ref_log_probs=True loads a second "
                         "copy of the model by its name as the reference and runs it whole on the device, outside the "
                         "streamed layers. Set " + _REFERENCE_FIXES)


class TRLHooks:
    """Methods TRL's trainers call, deferred or redirected to the executor; a no-op for other Trainers."""

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        if getattr(self, "executor", None) is None and self.lazy_config.policy != "none":
            self._deferred_ref_logps.append((dataset, name, batch_size))  # run by run_deferred_ref_logps
            return dataset
        return super()._precompute_ref_logps(dataset, name, batch_size)

    def compute_ref_log_probs(self, model: Any, inputs: dict[str, Any]) -> Any:
        if getattr(self, "user_loss_model", None) is not None and model is self.model:
            model = self.user_loss_model  # the reference is the policy before training: its streamed forward
        return super().compute_ref_log_probs(model, inputs)

    def compute_loss_context_manager(self) -> contextlib.ExitStack:
        stack = super().compute_loss_context_manager()
        streamed = getattr(self, "user_loss_model", None)
        if streamed is not None and self.model is not streamed.module:  # a PEFT model around the streamed one
            stack.enter_context(_calls_to(self.model, streamed))
        return stack

    def run_deferred_ref_logps(self) -> None:
        """The precomputes deferred while the trainer was built, into the datasets they were asked for."""
        deferred, self._deferred_ref_logps = self._deferred_ref_logps, []
        for dataset, name, batch_size in deferred:
            done = super()._precompute_ref_logps(dataset, name, batch_size)
            if dataset is self.train_dataset:
                self.train_dataset = done
            elif isinstance(self.eval_dataset, dict) and self.eval_dataset.get(name) is dataset:
                self.eval_dataset[name] = done
            elif self.eval_dataset is dataset:
                self.eval_dataset = done


@contextlib.contextmanager
def _calls_to(model: nn.Module, streamed: nn.Module) -> Iterator[None]:
    """Inside the block a call of `model` (the trainer's PeftModel: DPOTrainer's reference forward) runs `streamed`
    (its own forward would run the decoder layers where they are stored, in host memory)."""
    own = vars(model).get("forward")
    model.forward = streamed.__call__  # an instance attribute (a module assigned would register as a submodule)
    try:
        yield
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own
