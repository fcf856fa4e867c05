"""`import lazytrain_hf` + `optim="lazytrain_hybrid8"` in an unchanged stock-Trainer script."""

from __future__ import annotations

import subprocess
import sys

import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer_optimizer import _OPTIMIZER_HANDLERS
from transformers.training_args import OptimizerNames

import lazytrain_hf
from lazytrain_hf.hf.register import OPTIM_NAME, is_registered, register
from lazytrain_hf.models import load_model

from .test_trainer import _collate, _dataset


def test_registered_in_enum_and_handler_table():
    register()  # idempotent
    assert is_registered()
    assert OptimizerNames(OPTIM_NAME).value == OPTIM_NAME
    assert OPTIM_NAME in _OPTIMIZER_HANDLERS
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(
        TrainingArguments(output_dir="unused", optim=OPTIM_NAME, optim_args="block_size=128", report_to=[]))
    assert cls is lazytrain_hf.Hybrid8bitOptimizer and kwargs["block_size"] == 128


def test_stock_trainer_trains_saves_resumes(tmp_path):
    model = load_model("qwen3-tiny", "float32", seed=0)
    ds = _dataset(model.config.vocab_size, n=16)

    def args(max_steps):
        return TrainingArguments(output_dir=str(tmp_path), optim="lazytrain_hybrid8", max_steps=max_steps,
                                 per_device_train_batch_size=2, learning_rate=1e-3, max_grad_norm=1.0,
                                 save_steps=2, logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True)

    t = Trainer(model=model, args=args(2), train_dataset=ds, data_collator=_collate)
    t.train()
    assert isinstance(t.optimizer.optimizer, lazytrain_hf.Hybrid8bitOptimizer)
    losses = [h["loss"] for h in t.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    ckpt = tmp_path / "checkpoint-2"
    assert (ckpt / "optimizer.pt").is_file()
    t2 = Trainer(model=model, args=args(4), train_dataset=ds, data_collator=_collate)
    t2.train(resume_from_checkpoint=str(ckpt))
    assert t2.state.global_step == 4

    # training_args.bin must load in a process that never imports the plugin
    code = ("import sys, torch; a = torch.load(sys.argv[1], weights_only=False); "
            "assert 'lazytrain_hf' not in sys.modules; print(a.optim)")
    out = subprocess.run([sys.executable, "-c", code, str(ckpt / "training_args.bin")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == OPTIM_NAME
