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
    """Save at step 2, resume to step 4: the losses of steps 3-4 and the final weights equal an uninterrupted
    4-step run's."""
    import math

    model = load_model("qwen3-tiny", "float32", seed=0)
    fresh = load_model("qwen3-tiny", "float32", seed=0)
    ds = _dataset(model.config.vocab_size, n=16)

    def args(max_steps, out):
        return TrainingArguments(output_dir=str(tmp_path / out), optim="lazytrain_hybrid8", max_steps=max_steps,
                                 per_device_train_batch_size=2, learning_rate=1e-3, max_grad_norm=1.0,
                                 lr_scheduler_type="constant",  # the 2-step run's schedule is the 4-step run's
                                 save_steps=2, logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True)

    def losses(t):
        return [h["loss"] for h in t.state.log_history if "loss" in h]

    t = Trainer(model=model, args=args(2, "run"), train_dataset=ds, data_collator=_collate)
    t.train()
    assert isinstance(t.optimizer.optimizer, lazytrain_hf.Hybrid8bitOptimizer)
    assert len(losses(t)) == 2 and all(torch.isfinite(torch.tensor(losses(t))))
    ckpt = tmp_path / "run" / "checkpoint-2"
    assert (ckpt / "optimizer.pt").is_file()
    t2 = Trainer(model=model, args=args(4, "run"), train_dataset=ds, data_collator=_collate)
    t2.train(resume_from_checkpoint=str(ckpt))
    assert t2.state.global_step == 4
    ref = Trainer(model=fresh, args=args(4, "ref"), train_dataset=ds, data_collator=_collate)
    ref.train()
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(losses(t2)[-2:], losses(ref)[-2:])), \
        (losses(t2), losses(ref))
    mine = dict(t2.model.named_parameters())
    for name, p in ref.model.named_parameters():
        assert torch.equal(mine[name], p), name

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
    # the Trainer's scaling pass: accelerate < 1.16 calls clip_grad_norm_, later ones get_total_norm and
    # clip_grads_with_norm_ (each reaches torch's private helpers, not the other public function)
    for name in ("clip_grad_norm_", "clip_grads_with_norm_"):
        original = getattr(torch.nn.utils, name)
        monkeypatch.setattr(torch.nn.utils, name,
                            lambda *a, _f=original, **k: passes.append(1) or _f(*a, **k))
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


def test_optim_args_problems_are_reported_together():
    import pytest

    from lazytrain_hf.hf.register import parse_optim_args

    with pytest.raises(ValueError) as e:
        parse_optim_args({"block_size": "abc", "foo": "1", "state_dtype": "8bit"})
    msg = str(e.value)
    assert "block_size='abc' is not an integer" in msg and "'foo' is not understood" in msg and "Example:" in msg
    # values the optimizer would refuse come in the same message, not one round later
    with pytest.raises(ValueError) as e:
        parse_optim_args({"block_size": "100", "master_weights": "fp16", "state_dtype": "x", "min_8bit_size": "-1",
                          "fp32_state_modules": "q_proj", "foo": "1"})
    msg = str(e.value)
    for part in ("block_size must be a power of two", "master_weights must be one of", "state_dtype must be one of",
                 "min_8bit_size must be an integer >= 0", "'foo' is not understood"):
        assert part in msg, (part, msg)
    assert parse_optim_args({"master_weights": "KAHAN"}) == {"master_weights": "KAHAN"}
    assert parse_optim_args({"fp32_state_modules": "q_proj|k_proj", "block_size": "128"}) == \
        {"fp32_state_modules": ["q_proj", "k_proj"], "block_size": 128}


def test_stock_trainer_keeps_fp32_states_for_embeddings_and_named_modules(tmp_path):
    """The embedding and lm_head (always) and the parameters named by optim_args fp32_state_modules keep fp32
    states; every other tensor at or above min_8bit_size gets 8-bit codes."""
    model = load_model("qwen2-tiny", "float32", seed=0)  # untied embedding and lm_head
    ds = _dataset(model.config.vocab_size, n=4)
    args = TrainingArguments(output_dir=str(tmp_path), optim=OPTIM_NAME, max_steps=1, per_device_train_batch_size=2,
                             optim_args="min_8bit_size=0,fp32_state_modules=q_proj|o_proj", save_strategy="no",
                             report_to=[], use_cpu=True, disable_tqdm=True)
    t = Trainer(model=model, args=args, train_dataset=ds, data_collator=_collate)
    t.train()
    opt = t.optimizer.optimizer
    fp32 = {n for n, p in t.model.named_parameters() if opt.state[p]["state1"].dtype == torch.float32}
    eight = {n for n, p in t.model.named_parameters() if opt.state[p]["state1"].dtype == torch.uint8}
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= fp32
    named = {n for n in fp32 | eight if "q_proj" in n or "o_proj" in n}
    assert named and named <= fp32
    assert any("k_proj.weight" in n for n in eight) and any("mlp" in n for n in eight)
    assert fp32 == {"model.embed_tokens.weight", "lm_head.weight"} | named


def test_stock_trainer_without_clipping_still_skips_a_non_finite_step(tmp_path):
    """max_grad_norm=0: the Trainer computes the norm only for logging; the optimizer computes it instead (infinite
    max norm), so a NaN gradient skips that step and never reaches the weights."""
    from transformers import TrainerCallback

    model = load_model("qwen3-tiny", "float32", seed=0)
    ds = _dataset(model.config.vocab_size, n=8)

    class NaNAtStep2(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            if self.state.global_step == 1:
                next(model.parameters()).grad.view(-1)[0] = float("nan")
            return loss

    skipped, before = [], {}

    class Watch(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kw):
            before[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()}

        def on_optimizer_step(self, args, state, control, optimizer=None, **kw):
            skipped.append(getattr(optimizer, "optimizer", optimizer).last_step_skipped)

    args = TrainingArguments(output_dir=str(tmp_path), optim=OPTIM_NAME, max_steps=3, per_device_train_batch_size=2,
                             learning_rate=1e-3, max_grad_norm=0.0, logging_steps=1, save_strategy="no",
                             report_to=[], use_cpu=True, disable_tqdm=True)
    t = NaNAtStep2(model=model, args=args, train_dataset=ds, data_collator=_collate, callbacks=[Watch()])
    t.train()
    assert skipped == [False, True, False]
    assert all(torch.isfinite(p).all() for p in t.model.parameters())
    norms = [h["grad_norm"] for h in t.state.log_history if "grad_norm" in h]
    assert len(norms) == 3 and norms[1] != norms[1] and all(n == n for n in (norms[0], norms[2]))  # NaN logged


def test_fp32_state_modules_matching_no_parameter_is_an_error():
    """A typo in fp32_state_modules used to leave those parameters on 8-bit states without a word."""
    import pytest

    from lazytrain_hf.hf.register import params_named

    model = load_model("qwen3-tiny", "float32", seed=0)
    assert len(params_named(model, ["q_proj", "k_proj"])) == 2 * model.config.num_hidden_layers
    with pytest.raises(ValueError, match=r"\['q_prj'\] match no parameter name.*'q_proj'"):
        params_named(model, ["q_proj", "q_prj"])
    # with the model known (the Trainer's handler), the typo is listed with the other bad entries, not one round later
    from lazytrain_hf.hf.register import parse_optim_args

    with pytest.raises(ValueError) as e:
        parse_optim_args({"block_size": "100", "master_weights": "foo", "fp32_state_modules": "q_prj"}, model=model)
    assert all(s in str(e.value) for s in ("block_size must be", "master_weights must be", "['q_prj'] match no"))


def test_lazytrain_config_fp32_state_modules_takes_the_optim_args_form():
    """lazytrain_config's fp32_state_modules as one string splits on '|', as in optim_args (whose error message
    suggests that form): it was one name that matched nothing."""
    from lazytrain_hf.config import LazyTrainConfig

    assert LazyTrainConfig(fp32_state_modules="q_proj|k_proj").fp32_state_modules == ["q_proj", "k_proj"]
    assert LazyTrainConfig(fp32_state_modules="q_proj").fp32_state_modules == ["q_proj"]


def test_lazytrain_config_takes_a_json_object_string():
    """HF's command line passes dict arguments as JSON strings; they were read as YAML paths."""
    import pytest

    from lazytrain_hf.config import LazyTrainConfig

    cfg = LazyTrainConfig.from_any('{"policy": "milp", "fp32_state_modules": "q_proj|k_proj"}')
    assert cfg.policy == "milp" and cfg.fp32_state_modules == ["q_proj", "k_proj"]
    with pytest.raises(ValueError, match="looks like JSON but does not parse"):
        LazyTrainConfig.from_any('{"policy": milp}')
    with pytest.raises(FileNotFoundError, match="no YAML file"):
        LazyTrainConfig.from_any("missing.yaml")
