"""Hugging Face integration: optimizer registration, LazyTrainingArguments, LazyTrainer, LazyTrainCallback."""

from .args import LazyTrainingArguments
from .callback import LazyTrainCallback
from .register import OPTIM_NAME, is_registered, register
from .trainer import LazyTrainer, LazyTrainerMixin

__all__ = ["LazyTrainingArguments", "LazyTrainCallback", "LazyTrainer", "LazyTrainerMixin", "OPTIM_NAME",
           "register", "is_registered"]
