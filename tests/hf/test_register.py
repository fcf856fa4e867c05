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


def test_stock_trainer_fused_clipping_equals_adamw(tmp_path, monkeypatch):
    """Stock Trainer + lazytrain_hybrid8 (fp32 states): the clip coefficient folded into the update gives the same
    loss, logged pre-clip grad_norm and parameters as adamw_torch with the Trainer's own clipping pass."""
    import copy
    import math

    from ..conftest import rel_err

    model = load_model("qwen3-tiny", "float32", seed=4)
    ds = _dataset(model.config.vocab_size, n=12)
    runs = {}
    passes = []
    original = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: passes.append(1) or original(*a, **k))
    for optim, optim_args in (("adamw_torch", None), (OPTIM_NAME, "state_dtype=fp32,master_weights=none")):
        args = TrainingArguments(output_dir=str(tmp_path / optim), optim=optim, optim_args=optim_args, max_steps=3,
                                 per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-3,
                                 weight_decay=0.1, max_grad_norm=1.0, lr_scheduler_type="constant", logging_steps=1,
                                 save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
        t = Trainer(model=copy.deepcopy(model), args=args, train_dataset=ds, data_collator=_collate)
        passes.clear()
        t.train()
        runs[optim] = (t, len(passes))
    (ref, ref_passes), (ours, our_passes) = runs["adamw_torch"], runs[OPTIM_NAME]
    assert ref_passes == 3 and our_passes == 0, "hybrid8 must fold clipping into its update (no scaling pass)"
    norms = [(h["grad_norm"], g["grad_norm"]) for h, g in zip(ref.state.log_history, ours.state.log_history)
             if "grad_norm" in h]
    assert norms and any(a > 1.0 for a, _ in norms), "clipping must be active"
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in norms), norms
    mine = dict(ours.model.named_parameters())
    for name, p in ref.model.named_parameters():
        assert rel_err(mine[name].detach(), p.detach()) < 1e-5, name
