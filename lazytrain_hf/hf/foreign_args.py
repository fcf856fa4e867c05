"""Other Trainers' argument classes under the executor: `SFTConfig`, `DPOConfig` (TRL) and any TrainingArguments.

`lazy_args_class(SFTConfig)` is the dataclass `LazySFTConfig(LazyTrainingArguments, SFTConfig)`: every field of
both, `lazytrain_config` included, and the LazyTrainingArguments behaviour (the executor owns device placement, one
GPU per process, the Hybrid 8-bit optimizer's settings). `LazyTrainerMixin` converts the `args` it is given into it,
with the values the given instance holds (as `dataclasses.replace` copies them).

Two of TRL's defaults are the executor's business, told apart from the user's choice by the config class's own field
default (TRL documents `gradient_checkpointing=True` as its default): a value equal to the class default is taken
over with one log line — `gradient_checkpointing` off (the executor plans recomputation itself), `optim`
lazytrain_hybrid8 (streamed trainable layers need it). A value the user set to anything else is kept, and checked as
in LazyTrainingArguments; `gradient_checkpointing=True` set on a class whose default is False stays refused.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import sys
from typing import Any

from transformers import TrainingArguments

from ..config import LazyTrainConfig
from .args import LazyTrainingArguments
from .register import OPTIM_NAME

__all__ = ["lazy_args_class", "to_lazy_args"]

logger = logging.getLogger(__name__)

_CLASSES: dict[type, type] = {}


def lazy_args_class(cls: type[TrainingArguments]) -> type[LazyTrainingArguments]:
    """The dataclass `Lazy<cls.__name__>(LazyTrainingArguments, cls)`, built once per class (picklable: it is
    registered in this module, and TRL's classes rebuild by name in a fresh process)."""
    if issubclass(cls, LazyTrainingArguments):
        return cls
    if cls is TrainingArguments:
        return LazyTrainingArguments
    if not issubclass(cls, TrainingArguments):
        raise TypeError(f"{cls.__name__} is not a transformers.TrainingArguments subclass")
    if cls not in _CLASSES:
        name = f"Lazy{cls.__name__}"
        # cls's fields declared again, so that its defaults win over the TrainingArguments defaults that
        # LazyTrainingArguments' inherited fields carry; optim (lazytrain_hybrid8) and gradient_checkpointing (False:
        # the executor owns recomputation) keep LazyTrainingArguments' defaults
        ns: dict[str, Any] = {"__module__": __name__, "__qualname__": name, "__annotations__": {},
                              "__doc__": f"{cls.__name__} plus `lazytrain_config`, for LazyTrainerMixin."}
        for f in dataclasses.fields(cls):
            if f.name in ("optim", "lazytrain_config", "gradient_checkpointing") or not f.init:
                continue
            ns["__annotations__"][f.name] = f.type
            default = {"default": f.default} if f.default_factory is dataclasses.MISSING else \
                {"default_factory": f.default_factory}
            ns[f.name] = dataclasses.field(**default, repr=f.repr, metadata=f.metadata)
        lazy = dataclasses.dataclass(type(name, (LazyTrainingArguments, cls), ns))
        _CLASSES[cls] = lazy
        if name not in vars(sys.modules[__name__]):  # two classes of one name: the first one is picklable by name
            setattr(sys.modules[__name__], name, lazy)
    return _CLASSES[cls]


def __getattr__(name: str) -> Any:  # unpickling a TRL config's Lazy class in a fresh process
    if name.startswith("Lazy"):
        try:
            import trl

            return lazy_args_class(getattr(trl, name[4:]))
        except (ImportError, AttributeError):
            pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _default(cls: type, name: str) -> Any:
    f = {f.name: f for f in dataclasses.fields(cls)}.get(name)
    if f is None or f.default is dataclasses.MISSING:
        return dataclasses.MISSING
    return f.default


def to_lazy_args(args: TrainingArguments, lazytrain_config: Any = None) -> LazyTrainingArguments:
    """`args` as a LazyTrainingArguments (returned as is when it already is one and `lazytrain_config` is None).

    Raises:
        TypeError: `args` is not a TrainingArguments.
        ValueError: `lazytrain_config` given both here and in `args`, or what LazyTrainingArguments refuses.
    """
    if isinstance(args, LazyTrainingArguments):
        if lazytrain_config is not None:
            raise ValueError("lazytrain_config is given both to the trainer and in its LazyTrainingArguments; "
                             "set it in one place")
        return args
    if not isinstance(args, TrainingArguments):
        raise TypeError("LazyTrainer needs `args=LazyTrainingArguments(...)` or another TrainingArguments (e.g. "
                        f"TRL's SFTConfig) with `lazytrain_config=` given to the trainer, but got {type(args).__name__}")
    cls = type(args)
    # the resolved values, as dataclasses.replace copies them (to_dict masks every *_token field, eos_token too)
    values = {f.name: copy.deepcopy(getattr(args, f.name)) for f in dataclasses.fields(cls) if f.init}
    cfg = LazyTrainConfig.from_any(lazytrain_config)
    values["lazytrain_config"] = cfg.to_dict()
    if cfg.policy != "none":
        if args.gradient_checkpointing and _default(cls, "gradient_checkpointing") is True:
            # transformers 5 resolves it into activation_checkpointing, which to_dict carries as well
            values.update({k: False for k in ("gradient_checkpointing", "activation_checkpointing") if k in values})
            logger.info("LazyTrain: gradient_checkpointing=True (%s's default) is taken over by the executor, which "
                        "plans checkpoints and recomputation itself (lazytrain_config)", cls.__name__)
        optim = str(getattr(args.optim, "value", args.optim))
        if optim == str(getattr(_default(cls, "optim"), "value", _default(cls, "optim"))):
            values["optim"] = OPTIM_NAME
            logger.info("LazyTrain: optim=%r (%s's default) is replaced by %r, the executor's optimizer for "
                        "streamed layers; set optim explicitly to keep another one", optim, cls.__name__, OPTIM_NAME)
    return lazy_args_class(cls)(**values)
