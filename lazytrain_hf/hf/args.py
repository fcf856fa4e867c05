"""`LazyTrainingArguments`: `TrainingArguments` plus one field, `lazytrain_config` (like `fsdp_config`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from ..config import LazyTrainConfig
from .register import OPTIM_NAME, parse_optim_args_text, register

logger = logging.getLogger(__name__)

__all__ = ["LazyTrainingArguments"]

register()


@dataclass
class LazyTrainingArguments(TrainingArguments):
    """TrainingArguments for `LazyTrainer`.

    Args:
        lazytrain_config (dict or str, defaults to None): a dict or a YAML path validated into a
            `LazyTrainConfig` (see lazytrain_hf.config for every key); None = defaults.
        optim (str, defaults to "lazytrain_hybrid8"): the executor's optimizer. Another HF optimizer is
            accepted when every parameter it updates stays on the compute device (LoRA adapters, frozen decoder
            layers; `LazyTrainer` checks this with the model), or with `lazytrain_config.policy="none"`.

    The executor owns host/device placement, so the Trainer does not move the model to the device.

    Raises:
        ValueError: invalid `lazytrain_config` (every problem listed), `gradient_checkpointing=True` with the
            executor (it owns recomputation), `lazytrain_config.device="cuda"` with a torch that has no CUDA
            device, or `optim_args` the
            lazytrain_hybrid8 handler would refuse at `train()` (unknown keys, bad values).
    """

    lazytrain_config: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "LazyTrain config: a dict or a YAML path (see lazytrain_hf.config)."})
    optim: str = field(default=OPTIM_NAME, metadata={"help": "Optimizer; streamed trainable layers need lazytrain_hybrid8."})

    def __post_init__(self) -> None:
        cfg = LazyTrainConfig.from_any(self.lazytrain_config)
        self.lazytrain_config = cfg.to_dict()  # normalized, JSON-serializable (to_json_string, logging)
        problems = []
        if cfg.policy != "none":
            if self.gradient_checkpointing or getattr(self, "activation_checkpointing", False):
                problems.append("gradient_checkpointing=True conflicts with the LazyTrain executor, which owns "
                                f"recomputation (lazytrain_config.policy={cfg.policy!r}; activation_checkpointing "
                                "is the same switch). Set gradient_checkpointing=False / activation_checkpointing="
                                "False, or lazytrain_config.policy='none' for the plain path.")
            if cfg.device == "cuda":
                problems.extend(_cuda_problems())
        if str(getattr(self.optim, "value", self.optim)) == OPTIM_NAME and self.optim_args:
            # here, not when train() creates the optimizer: by then the executor has copied the model to host memory
            problems.extend(_optim_args_problems(self.optim_args))
        if problems:
            raise ValueError("Invalid LazyTrainingArguments:\n  - " + "\n  - ".join(problems))
        super().__post_init__()

    @property
    def lazy_config(self) -> LazyTrainConfig:
        """The validated LazyTrainConfig."""
        return LazyTrainConfig.from_any(dict(self.lazytrain_config))

    @property
    def n_gpu(self) -> int:
        """GPUs this process uses: 1 with the executor. The Trainer would otherwise run torch DataParallel over every
        visible GPU (and hand the loss a per-GPU token count); the executor drives one GPU per process, and data
        parallelism is one process per GPU (accelerate launch / torchrun, streaming/comm.py)."""
        n = super().n_gpu
        if n > 1 and self.lazytrain_config.get("policy", "milp") != "none":
            if not getattr(self, "_warned_n_gpu", False):
                logger.warning("%d GPUs are visible to this one process; LazyTrain uses %s only. Launch one process "
                               "per GPU (accelerate launch --num_processes %d ... or torchrun --nproc_per_node %d) "
                               "to train on all of them.", n, self.device, n, n)
                object.__setattr__(self, "_warned_n_gpu", True)
            return 1
        return n

    @property
    def place_model_on_device(self) -> bool:
        # The executor places resident parts on the device and keeps decoder layers in host memory.
        return self.lazytrain_config.get("policy", "milp") == "none"


def _cuda_problems() -> list[str]:
    """[] when torch sees a CUDA device, else the message for `lazytrain_config.device="cuda"` (which would fail
    deep in the executor with torch's "Torch not compiled with CUDA enabled" assertion)."""
    import torch

    if torch.cuda.is_available():
        return []
    why = (f"this torch ({torch.__version__}) is a CPU-only build" if torch.version.cuda is None
           else f"this torch (CUDA {torch.version.cuda}) sees no CUDA device")
    return [f"lazytrain_config.device='cuda' (recipe: lazytrain.device), but {why}. Fix: set device to 'cpu' (or "
            "'auto': cuda when available), or install a CUDA build of torch on a machine with an NVIDIA GPU "
            "(https://pytorch.org/get-started/locally/)"]


def _optim_args_problems(optim_args: str) -> list[str]:
    """`optim_args` read as the Trainer's optimizer handler will read it: [] or one message listing its problems."""
    try:
        parse_optim_args_text(optim_args)
    except ValueError as e:
        return [str(e)]
    return []
