"""TRL trainer hooks under the executor: DPOTrainer's precomputed reference log-probabilities.

DPOTrainer (`precompute_ref_log_probs=True`) computes them in its constructor, with the model's own forward, before
`LazyTrainerMixin` has built the executor, and on a GPU that forward cannot run: the model stays in host memory. So
the precompute is deferred until the executor holds the model, and then runs TRL's own `_precompute_ref_logps`
(its batching, caching and columns) with the model's forward replaced by the streamed model's no-grad forward
(TRL's fused head over the streamed hidden states, hf/user_loss.py): no gradient, no executor state left behind.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TRLHooks"]


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
