"""LazyTrain for Hugging Face: layer-streaming fine-tuning with MILP-planned checkpointing and a Hybrid 8-bit
optimizer (arXiv 2608.11919 over MegaTrain, arXiv 2604.05091).

`import lazytrain_hf` registers ``optim="lazytrain_hybrid8"`` with transformers.
"""

from .config import LazyTrainConfig
from .hf import (
    OPTIM_NAME,
    LazyTrainCallback,
    LazyTrainer,
    LazyTrainerMixin,
    LazyTrainingArguments,
    register,
)

__version__ = "0.1.0"

register()

__all__ = ["LazyTrainConfig", "LazyTrainer", "LazyTrainerMixin", "LazyTrainingArguments", "LazyTrainCallback",
           "OPTIM_NAME", "Hybrid8bitOptimizer", "__version__"]


def __getattr__(name: str):
    if name == "Hybrid8bitOptimizer":
        from .optim import Hybrid8bitOptimizer

        return Hybrid8bitOptimizer
    raise AttributeError(name)
