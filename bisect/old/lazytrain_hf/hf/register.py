"""Registers ``optim="lazytrain_hybrid8"`` with transformers, so an unchanged HF script can select it.

transformers validates `TrainingArguments.optim` against the `OptimizerNames` enum (training_args.py) and
dispatches through `_OPTIMIZER_HANDLERS` (trainer_optimizer.py), which `Trainer.get_optimizer_cls_and_kwargs`
consults; both need the entry (verified on transformers 5.17 and 5.24).

Pickle compatibility: the Trainer saves `TrainingArguments` with `torch.save` (training_args.bin). The added enum
member pickles as the plain string "lazytrain_hybrid8", so the file loads in a process that never imports this
plugin.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

__all__ = ["OPTIM_NAME", "register", "is_registered"]

logger = logging.getLogger(__name__)

OPTIM_NAME = "lazytrain_hybrid8"
_MEMBER_NAME = "LAZYTRAIN_HYBRID8"
_SUPPORTED = "transformers 5.x (checked: 5.17, 5.24)"


def _handler(ctx: Any) -> tuple[Any, dict[str, Any]]:
    """transformers optimizer handler: (optimizer class, kwargs) from the Trainer's OptimizerContext.

    `optim_args` keys understood: block_size, min_8bit_size, state_dtype (8bit|fp32), master_weights
    (auto|fp32|kahan|none). Embedding and lm_head parameters keep fp32 states.
    """
    from ..optim import Hybrid8bitOptimizer

    kwargs: dict[str, Any] = dict(ctx.optimizer_kwargs)
    kwargs.update(ctx.adam_kwargs)
    casts = {"block_size": int, "min_8bit_size": int, "state_dtype": str, "master_weights": str}
    for key, value in (ctx.optim_args or {}).items():
        if key not in casts:
            raise ValueError(f"optim_args key {key!r} is not understood by {OPTIM_NAME}; allowed: {sorted(casts)}")
        kwargs[key] = casts[key](value)
    model = ctx.model
    if model is not None:
        fp32 = []
        for getter in ("get_input_embeddings", "get_output_embeddings"):
            mod = getattr(model, getter, lambda: None)()
            if mod is not None and getattr(mod, "weight", None) is not None:
                fp32.append(mod.weight)
        kwargs["fp32_state_params"] = fp32
    return Hybrid8bitOptimizer, kwargs


class _PlainStrReduce:
    """`__reduce_ex__` for OptimizerNames that pickles our member as a plain str (see module docstring)."""

    def __init__(self, original: Any) -> None:
        self.original = original

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        original = self.original.__get__(obj, objtype)
        if getattr(obj, "_value_", None) == OPTIM_NAME:
            return lambda protocol=None: (str, (OPTIM_NAME,))
        return original


def register() -> None:
    """Add "lazytrain_hybrid8" to transformers' OptimizerNames and optimizer handler table (idempotent).

    Raises:
        ImportError: this transformers version lacks `OptimizerNames` or `_OPTIMIZER_HANDLERS` (version drift);
            the message names the versions this plugin supports.
    """
    try:
        from transformers import trainer_optimizer
        from transformers.training_args import OptimizerNames
        handlers = trainer_optimizer._OPTIMIZER_HANDLERS
    except (ImportError, AttributeError) as e:
        import transformers

        raise ImportError(
            f"lazytrain_hf cannot register optim={OPTIM_NAME!r} with transformers {transformers.__version__}: "
            f"{e}. Supported: {_SUPPORTED}; install a supported version (pip install 'transformers>=5,<6')."
        ) from e
    if not issubclass(OptimizerNames, enum.Enum) or not isinstance(handlers, dict):
        raise ImportError(f"transformers' OptimizerNames / _OPTIMIZER_HANDLERS changed shape; supported: {_SUPPORTED}")
    if OPTIM_NAME not in OptimizerNames._value2member_map_:
        member = str.__new__(OptimizerNames, OPTIM_NAME)
        member._name_ = _MEMBER_NAME
        member._value_ = OPTIM_NAME
        member.__objclass__ = OptimizerNames
        member._sort_order_ = len(OptimizerNames._member_names_)
        OptimizerNames._member_map_[_MEMBER_NAME] = member
        OptimizerNames._value2member_map_[OPTIM_NAME] = member
        OptimizerNames._member_names_.append(_MEMBER_NAME)
        type.__setattr__(OptimizerNames, _MEMBER_NAME, member)
        if not isinstance(OptimizerNames.__dict__.get("__reduce_ex__"), _PlainStrReduce):
            type.__setattr__(OptimizerNames, "__reduce_ex__", _PlainStrReduce(enum.Enum.__reduce_ex__))
    handlers[OptimizerNames(OPTIM_NAME)] = _handler
    from transformers import Trainer

    if not getattr(Trainer._clip_grad_norm, "_lazytrain_fused", False):
        Trainer._clip_grad_norm = _fused_clip_grad_norm(Trainer._clip_grad_norm)


def _fused_clip_grad_norm(original: Any) -> Any:
    """Wrap `Trainer._clip_grad_norm`: with a Hybrid8bitOptimizer on a plain single-device or DDP run (gradients
    already reduced, no fp16 loss scaler), the optimizer computes the pre-clip global norm and folds the clip
    coefficient into its next update instead of the Trainer scaling every gradient in a separate pass. Anything
    else (FSDP, DeepSpeed, XLA, mixed device meshes, fp16 scaling, other optimizers) takes the original path."""

    def _clip_grad_norm(self: Any, model: Any) -> Any:
        from accelerate.utils import DistributedType

        from ..optim import Hybrid8bitOptimizer

        opt = getattr(self.optimizer, "optimizer", self.optimizer)
        plain = (self.accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_GPU,
                                                       DistributedType.MULTI_CPU)
                 and getattr(self.accelerator, "scaler", None) is None
                 and not getattr(self, "is_fsdp_enabled", False) and not getattr(self, "is_deepspeed_enabled", False)
                 and not (hasattr(self, "_has_mixed_mesh_grads") and self._has_mixed_mesh_grads(model)))
        if isinstance(opt, Hybrid8bitOptimizer) and plain:
            return opt.clip_grad_norm(self.args.max_grad_norm)
        return original(self, model)

    _clip_grad_norm._lazytrain_fused = True  # type: ignore[attr-defined]
    return _clip_grad_norm


def is_registered() -> bool:
    try:
        from transformers import trainer_optimizer
        from transformers.training_args import OptimizerNames
    except ImportError:
        return False
    return OPTIM_NAME in OptimizerNames._value2member_map_ and OPTIM_NAME in trainer_optimizer._OPTIMIZER_HANDLERS
