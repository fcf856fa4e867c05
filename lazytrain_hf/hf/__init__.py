"""Hugging Face integration: optimizer registration, LazyTrainingArguments, LazyTrainer, LazyTrainCallback.

The classes are imported on first use (they pull in torch and transformers); `register` is light.
"""

from .register import OPTIM_NAME, is_registered, register, register_on_import

__all__ = ["LazyTrainingArguments", "LazyTrainCallback", "LazyTrainer", "LazyTrainerMixin", "OPTIM_NAME",
           "register", "register_on_import", "is_registered"]

_LAZY = {"LazyTrainingArguments": ".args", "LazyTrainCallback": ".callback", "LazyTrainer": ".trainer",
         "LazyTrainerMixin": ".trainer"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
