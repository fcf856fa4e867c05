"""LazyTrain for Hugging Face: layer-streaming fine-tuning with MILP-planned checkpointing and a Hybrid 8-bit
optimizer (arXiv 2608.11919 over MegaTrain, arXiv 2604.05091).

`import lazytrain_hf` registers ``optim="lazytrain_hybrid8"`` with transformers: at once for the transformers
modules already imported, else as each is imported. The package itself imports neither torch nor transformers
(so `lazytrain-hf` checks its arguments in well under a second); `LazyTrainer`, `LazyTrainingArguments`,
`LazyTrainCallback`, `LazyTrainerMixin` and `Hybrid8bitOptimizer` import them on first access.
"""

from .config import LazyTrainConfig
from .hf.register import OPTIM_NAME, register, register_on_import

__version__ = "0.1.0"

register_on_import()

__all__ = ["LazyTrainConfig", "LazyTrainer", "LazyTrainerMixin", "LazyTrainingArguments", "LazyTrainCallback",
           "OPTIM_NAME", "Hybrid8bitOptimizer", "register", "__version__"]

_LAZY = {"LazyTrainer": ".hf.trainer", "LazyTrainerMixin": ".hf.trainer", "LazyTrainingArguments": ".hf.args",
         "LazyTrainCallback": ".hf.callback", "Hybrid8bitOptimizer": ".optim"}


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    if not name.startswith("__"):
        try:  # a subpackage reached as an attribute (lazytrain_hf.planning...) without importing it first
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
