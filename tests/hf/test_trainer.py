"""LazyTrainer equals the stock Trainer (fp32, fp32 optimizer states), saves HF checkpoints, resumes exactly."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import lazytrain_hf  # noqa: F401  (registers optim="lazytrain_hybrid8")
from lazytrain_hf import LazyTrainer, LazyTrainingArguments
from lazytrain_hf.models import load_model
from lazytrain_hf.planning.fixed import fixed_schedule

from ..conftest import rel_err
from .tiny_data import tiny_dataset

# The key-projection bias gets an exactly-zero gradient in exact arithmetic (softmax is invariant to adding
# q.b_k to every logit of a row), so its computed gradient is pure rounding noise that Adam's per-element
# normalization turns into +-lr steps; no two implementations agree on it unless bitwise identical.
NOISE_ONLY = ("self_attn.k_proj.bias",)

EXACT = {"state_dtype": "fp32", "master_weights": "none", "checkpoint_every": 2, "loss_chunk_tokens": 16}


_dataset = tiny_dataset


def _collate(rows):
    T = max(len(r["input_ids"]) for r in rows)
    pad = lambda key, v: torch.tensor([r[key] + [v] * (T - len(r[key])) for r in rows])  # noqa: E731
    return {"input_ids": pad("input_ids", 0), "attention_mask": pad("attention_mask", 0), "labels": pad("labels", -100)}


def _common(tmp_path, name, **kw):
    base = dict(output_dir=str(tmp_path / name), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                max_steps=3, learning_rate=1e-3, weight_decay=0.1, max_grad_norm=1.0, lr_scheduler_type="constant",
                logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0,
                dataloader_num_workers=0, disable_tqdm=True)
    base.update(kw)
    return base


def _train_pair(tmp_path, arch, lazy_cfg=None, prepare=None, **kw):
    model = load_model(arch, "float32", seed=3)
    if prepare is not None:
        prepare(model)
    ds = _dataset(model.config.vocab_size)
    stock_model = copy.deepcopy(model)
    stock = Trainer(model=stock_model, args=TrainingArguments(**_common(tmp_path, "stock", optim="adamw_torch", **kw)),
                    train_dataset=ds, data_collator=_collate)
    stock.train()
    lazy = LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, "lazy", **kw),
                                                               lazytrain_config=dict(lazy_cfg or EXACT)),
                       train_dataset=ds, data_collator=_collate)
    lazy.train()
    return stock, lazy


def _buckets_run(monkeypatch) -> list:
    """The sequence-length bucket of every schedule the executor is given from now on (appended as it runs)."""
    from lazytrain_hf.streaming.executor import StreamingExecutor

    used: list = []
    original = StreamingExecutor.set_schedule

    def spy(self, schedule):
        used.append(schedule.solver.get("seq_len_bucket"))
        return original(self, schedule)

    monkeypatch.setattr(StreamingExecutor, "set_schedule", spy)
    return used


def _logs(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


@pytest.mark.parametrize("arch", ["qwen2-tiny", "qwen2-tiny-tied", "qwen3-tiny", "qwen3-tiny-untied"])
def test_lazytrainer_equals_stock_trainer(tmp_path, arch):
    stock, lazy = _train_pair(tmp_path, arch)
    assert len(_logs(lazy, "loss")) == 3
    for a, b in zip(_logs(lazy, "loss"), _logs(stock, "loss")):
        assert math.isclose(a, b, rel_tol=1e-5), (a, b)
    for a, b in zip(_logs(lazy, "grad_norm"), _logs(stock, "grad_norm")):
        assert math.isclose(a, b, rel_tol=1e-5), (a, b)
    assert any(g > 1.0 for g in _logs(stock, "grad_norm")), "the test must exercise clipping"
    stock_params = dict(stock.model.named_parameters())
    for name, p in lazy.model.named_parameters():
        if name.endswith(NOISE_ONLY):
            continue
        assert rel_err(p.detach(), stock_params[name].detach()) < 1e-5, name
    if lazy.model.config.tie_word_embeddings:
        assert lazy.model.lm_head.weight is lazy.model.model.embed_tokens.weight


def test_a_frozen_embedding_trains_as_with_the_stock_trainer(tmp_path):
    """Fine-tuning with the input embedding frozen: no gradient for it (the executor's backward into it crashed),
    the rest exactly as the stock Trainer."""
    def freeze(model):
        model.model.embed_tokens.weight.requires_grad_(False)

    stock, lazy = _train_pair(tmp_path, "qwen3-tiny-untied", prepare=freeze)
    for a, b in zip(_logs(lazy, "grad_norm"), _logs(stock, "grad_norm"), strict=True):
        assert math.isclose(a, b, rel_tol=1e-5), (a, b)
    stock_params = dict(stock.model.named_parameters())
    for name, p in lazy.model.named_parameters():
        assert rel_err(p.detach(), stock_params[name].detach()) < 1e-5, name
    frozen = load_model("qwen3-tiny-untied", "float32", seed=3).model.embed_tokens.weight
    assert torch.equal(lazy.model.model.embed_tokens.weight, frozen)


def test_a_fresh_run_reserves_the_optimizer_states_at_their_exact_size(tmp_path):
    """Pinned locked == planned through the Trainer: the reservation made when the optimizer is created
    survives accelerate's wrapping (which reloads the optimizer's own, empty, state: that reload once cleared it)."""
    model = load_model("qwen3-tiny", "float32", seed=3)
    lazy = LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, "lazy", max_steps=1)),
                       train_dataset=_dataset(model.config.vocab_size), data_collator=_collate)
    lazy.train()
    ex, opt = lazy.executor, lazy._inner_optimizer(lazy.optimizer)
    n = sum(torch.is_tensor(v) for p in model.parameters() if ex.is_streamed(p) for v in opt.state[p].values())
    arena = ex.state_arena
    assert n > 0 and not arena._next
    assert 0 < arena.used_bytes <= arena.reserved_bytes <= arena.used_bytes + 64 * n


def test_milp_policy_plans_per_length_bucket_and_equals_stock(tmp_path, monkeypatch):
    """policy "milp": one plan per sequence-length bucket at train begin; each batch runs its bucket's plan; the
    result still equals the stock Trainer."""
    used = _buckets_run(monkeypatch)
    stock, lazy = _train_pair(tmp_path, "qwen3-tiny", lazy_cfg={**EXACT, "policy": "milp"})
    assert lazy.plans.bucket_plans.buckets == [8, 16, 24]  # data up to 20 tokens, rounded up to 24
    assert all(s.policy == "milp" for s in lazy.plans.bucket_plans.schedules.values())
    assert all(s.solver["layer_costs"] == "analytic" for s in lazy.plans.bucket_plans.schedules.values())  # CPU
    assert all(s.solver["compute_scale"] == 1.0 for s in lazy.plans.bucket_plans.schedules.values())  # off on CPU
    assert len({b for b in used if b is not None}) >= 2, used  # batches of different lengths, different plans
    for a, b in zip(_logs(lazy, "loss"), _logs(stock, "loss")):
        assert math.isclose(a, b, rel_tol=1e-5), (a, b)
    stock_params = dict(stock.model.named_parameters())
    for name, p in lazy.model.named_parameters():
        assert rel_err(p.detach(), stock_params[name].detach()) < 1e-5, name


def test_milp_plan_is_recalibrated_from_measured_steps_and_still_equals_stock(tmp_path):
    """calibrate_steps=1: step 2's measured time against the plan's prediction (H200 figures: far off on this CPU)
    rescales the compute costs and every bucket is planned again; training still equals the stock Trainer."""
    stock, lazy = _train_pair(tmp_path, "qwen3-tiny", lazy_cfg={**EXACT, "policy": "milp", "calibrate_steps": 1})
    cal = lazy.calibration
    assert cal.done and len(cal.k) == 1 and cal.cpu_rate == cal.measured_cpu_rate() > 0
    scales = {s.solver["compute_scale"] for s in lazy.plans.bucket_plans.schedules.values()}
    assert len(scales) == 1 and scales.pop() == pytest.approx(cal.k[0])
    # the re-plan used the update worker's measured rate (this CPU: far from the H200 figures planned first)
    assert {s.solver["cpu_optim_params_per_s"] for s in lazy.plans.bucket_plans.schedules.values()} == {cal.cpu_rate}
    for a, b in zip(_logs(lazy, "loss"), _logs(stock, "loss")):
        assert math.isclose(a, b, rel_tol=1e-5), (a, b)
    stock_params = dict(stock.model.named_parameters())
    for name, p in lazy.model.named_parameters():
        assert rel_err(p.detach(), stock_params[name].detach()) < 1e-5, name


@pytest.mark.parametrize("slower", [True, False])
def test_a_recalibrated_plan_that_runs_slower_is_switched_back(tmp_path, monkeypatch, slower):
    """The calibration's switch is a trial (Calibration.trial_verdict): when the new plans' measured steps put them
    no faster than the replaced plans (here: the replaced plan valued at 1 ms, so any measured step is slower), the
    run goes back to the plans of train begin; otherwise (valued at 1e9 ms) it keeps the new ones. Either way the
    training equals the stock Trainer."""
    from lazytrain_hf.hf.calibrate import Calibration

    original = Calibration.start_trial
    monkeypatch.setattr(Calibration, "start_trial",
                        lambda self, running_ms, new_ms: original(self, 1.0 if slower else 1e9, new_ms))
    stock, lazy = _train_pair(tmp_path, "qwen3-tiny", lazy_cfg={**EXACT, "policy": "milp", "calibrate_steps": 1},
                              max_steps=6)
    cal, plans = lazy.calibration, lazy.plans.bucket_plans
    assert cal.done and cal.scale is not None and len(cal.trial) == 1  # switched at step 3, one trial step (5)
    assert cal.reverted is slower
    scales = [s.solver["compute_scale"] for s in plans.schedules.values()]
    assert scales == [1.0 if slower else pytest.approx(cal.scale)] * len(scales)  # train begin's plans, or re-planned
    assert lazy.executor.schedule in plans.schedules.values()
    for a, b in zip(_logs(lazy, "loss"), _logs(stock, "loss"), strict=True):
        assert math.isclose(a, b, rel_tol=1e-5), (a, b)


def test_a_replan_not_clearly_faster_keeps_the_running_plan(tmp_path, monkeypatch):
    """When the re-plan does not beat the running plan, both valued at the measured figures, by more than
    SWITCH_GAIN (Calibration.worth_switching), the running plans stay (compute scale 1) and both predictions are
    recorded; training still equals the stock Trainer."""
    from lazytrain_hf.hf.calibrate import SWITCH_GAIN, Calibration

    assert Calibration.worth_switching(1000.0, 1000.0 * (1 - SWITCH_GAIN) - 1e-6)
    assert not Calibration.worth_switching(1000.0, 1000.0 * (1 - SWITCH_GAIN))
    seen = []

    def never(running_ms, replanned_ms):
        seen.append((running_ms, replanned_ms))
        return False

    monkeypatch.setattr(Calibration, "worth_switching", staticmethod(never))
    stock, lazy = _train_pair(tmp_path, "qwen3-tiny", lazy_cfg={**EXACT, "policy": "milp", "calibrate_steps": 1})
    cal = lazy.calibration
    assert cal.done and len(seen) == 1 and (cal.kept_running_ms, cal.replanned_ms) == seen[0]
    assert seen[0][0] > 0 and seen[0][1] > 0 and cal.scale is None
    assert all(s.solver["compute_scale"] == 1.0 for s in lazy.plans.bucket_plans.schedules.values())
    for a, b in zip(_logs(lazy, "loss"), _logs(stock, "loss")):
        assert math.isclose(a, b, rel_tol=1e-5), (a, b)


def test_a_failed_recalibration_keeps_the_plan_and_the_run(tmp_path, monkeypatch):
    from lazytrain_hf.hf import plan

    original, calls = plan.plan_buckets_for_trainer, []

    def first_only(trainer, compute_scale=1.0, cpu_optim_params_per_s=None, **kw):
        calls.append(compute_scale)
        if len(calls) > 1:
            raise plan.InfeasiblePlanError("no schedule fits (test)")
        return original(trainer, compute_scale, cpu_optim_params_per_s, **kw)

    monkeypatch.setattr(plan, "plan_buckets_for_trainer", first_only)
    stock, lazy = _train_pair(tmp_path, "qwen3-tiny", lazy_cfg={**EXACT, "policy": "milp", "calibrate_steps": 1,
                                                                 "overlap_optimizer": False})
    assert len(calls) == 2 and lazy.calibration.scale is None and lazy.state.global_step == 3
    assert all(s.solver["compute_scale"] == 1.0 for s in lazy.plans.bucket_plans.schedules.values())
    for a, b in zip(_logs(lazy, "loss"), _logs(stock, "loss")):
        assert math.isclose(a, b, rel_tol=1e-5), (a, b)


def test_unequal_micro_batches_equal_one_full_batch(tmp_path):
    """Token-weighted loss across the accumulation window: GA=2 x 2 rows == GA=1 x 4 rows (different padding)."""
    model = load_model("qwen3-tiny", "float32", seed=5)
    ds = _dataset(model.config.vocab_size, n=8, seed=1)
    runs = {}
    for name, bs, ga in (("split", 2, 2), ("full", 4, 1)):
        m = copy.deepcopy(model)
        args = LazyTrainingArguments(**_common(tmp_path, name, per_device_train_batch_size=bs,
                                               gradient_accumulation_steps=ga, max_steps=2),
                                     lazytrain_config=dict(EXACT))
        t = LazyTrainer(model=m, args=args, train_dataset=ds, data_collator=_collate)
        t.train()
        runs[name] = t
    for a, b in zip(_logs(runs["split"], "grad_norm"), _logs(runs["full"], "grad_norm")):
        assert math.isclose(a, b, rel_tol=1e-5), (a, b)
    full = dict(runs["full"].model.named_parameters())
    for name, p in runs["split"].model.named_parameters():
        if name.endswith(NOISE_ONLY):
            continue
        assert rel_err(p.detach(), full[name].detach()) < 1e-5, name


# 8-bit: uint8 codes, fp32 absmax and (bf16 model) Kahan buffers from the executor's pinned arena must save with
# torch.save and reload with weights_only=True (mixed dtypes on one storage would not: one pool per dtype)
@pytest.mark.parametrize("states", ["fp32", "8bit"])
def test_checkpoint_loads_with_plain_transformers_and_resume_is_exact(tmp_path, states, monkeypatch):
    import transformers.trainer

    warnings: list[str] = []
    monkeypatch.setattr(transformers.trainer.logger, "warning", lambda msg, *a, **k: warnings.append(str(msg)))
    model = load_model("qwen3-tiny", "float32", seed=7)  # tied embeddings
    ds = _dataset(model.config.vocab_size, n=16, seed=2)
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2)
    cfg = dict(EXACT) if states == "fp32" else {**EXACT, "state_dtype": "8bit", "min_8bit_size": 256,
                                                 "master_weights": "fp32"}
    straight = LazyTrainer(model=copy.deepcopy(model),
                           args=LazyTrainingArguments(**_common(tmp_path, "straight", **kw),
                                                      lazytrain_config=cfg),
                           train_dataset=ds, data_collator=_collate)
    straight.train()
    ckpt = tmp_path / "straight" / "checkpoint-2"
    assert (ckpt / "lazytrain_schedule.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "straight" / "checkpoint-4"))
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    final = dict(straight.model.named_parameters())
    for name, p in loaded.named_parameters():
        assert torch.equal(p.detach(), final[name].detach()), name

    saved = torch.load(ckpt / "optimizer.pt", weights_only=True)
    codes = [v for st in saved["state"].values() for k, v in st.items() if k == "state1"]
    # (8-bit: the streamed matrices; embeddings and small tensors keep fp32 states by design)
    assert codes and any(c.dtype == torch.uint8 for c in codes) == (states == "8bit")
    resumed = LazyTrainer(model=copy.deepcopy(model),
                          args=LazyTrainingArguments(**_common(tmp_path, "straight", **kw),
                                                     lazytrain_config=cfg),
                          train_dataset=ds, data_collator=_collate)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == 4
    # the tied lm_head is not in the checkpoint by design: no "missing keys" warning for it
    assert not [w for w in warnings if "missing keys" in w], warnings
    for name, p in resumed.model.named_parameters():
        assert rel_err(p.detach(), final[name].detach()) < 1e-6, name


def test_eval_loss_through_streaming_model(tmp_path):
    model = load_model("qwen2-tiny", "float32", seed=9)
    ds = _dataset(model.config.vocab_size, n=6)
    ref = Trainer(model=copy.deepcopy(model), args=TrainingArguments(**_common(tmp_path, "ref")),
                  eval_dataset=ds, data_collator=_collate).evaluate()
    lazy = LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, "lazy"),
                                                               lazytrain_config=dict(EXACT)),
                       eval_dataset=ds, data_collator=_collate).evaluate()
    assert math.isclose(lazy["eval_loss"], ref["eval_loss"], rel_tol=1e-5)


def test_metrics_in_logs(tmp_path):
    model = load_model("qwen3-tiny", "float32", seed=1)
    t = LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, "m", max_steps=2),
                                                            lazytrain_config=dict(EXACT)),
                    train_dataset=_dataset(model.config.vocab_size), data_collator=_collate)
    t.train()
    logs = [h for h in t.state.log_history if "loss" in h]
    for key in ("loss", "grad_norm", "learning_rate", "tokens_per_second", "tflops", "step_time_s",
                "pinned_host_gib"):
        assert key in logs[-1], key
    assert logs[-1]["tokens_per_second"] > 0 and logs[-1]["tflops"] > 0


@pytest.mark.parametrize("bad, match", [
    (dict(gradient_checkpointing=True), "gradient_checkpointing=True conflicts"),
    (dict(activation_checkpointing=True), "gradient_checkpointing=True conflicts"),
    (dict(lazytrain_config={"polcy": "fixed"}), r"Unknown lazytrain_config key\(s\) \['polcy'\]"),
    (dict(lazytrain_config={"prefetch_depth": 9, "activation_tier": "disk"}), "prefetch_depth must be"),
    # optim_args are checked here, before LazyTrainer builds the executor (not when train() creates the optimizer)
    (dict(optim_args="block_size=100,blocksize=3"), r"(?s)'blocksize' is not understood.*power of two"),
    (dict(optim_args="block_size"), "comma-separated key=value pairs"),
    # ';' as separator (was "too many values to unpack"): the format, what was read and the corrected string
    (dict(optim_args="block_size=256,master_weights=kahan;state_dtype=fp32"),
     r"the format is comma-separated key=value pairs \(as TrainingArguments.optim_args.*"
     r"\['master_weights=kahan;state_dtype=fp32'\] is not one key=value pair \(';' is no separator\); read so far: "
     r"\{'block_size': '256'\}. Fix: optim_args='block_size=256,master_weights=kahan,state_dtype=fp32'"),
])
def test_bad_arguments_fail_before_training(tmp_path, bad, match):
    kw = _common(tmp_path, "bad")
    kw.update(bad)
    with pytest.raises(ValueError, match=match):
        LazyTrainingArguments(**kw)


def test_plain_training_arguments_convert_and_their_explicit_gradient_checkpointing_is_refused(tmp_path):
    """TrainingArguments' default gradient_checkpointing is off, so True there is the user's choice: refused."""
    model = load_model("qwen3-tiny", "float32")
    with pytest.raises(TypeError, match="LazyTrainingArguments"):
        LazyTrainer(model=model, args=None)
    with pytest.raises(ValueError, match="gradient_checkpointing=True conflicts"):
        LazyTrainer(model=model, args=TrainingArguments(**_common(tmp_path, "x"), gradient_checkpointing=True))
    lazy = LazyTrainer(model=model, args=TrainingArguments(**_common(tmp_path, "y")), lazytrain_config=dict(EXACT),
                       train_dataset=_dataset(model.config.vocab_size), data_collator=_collate)
    assert type(lazy.args) is LazyTrainingArguments and lazy.lazy_config.checkpoint_every == 2


def test_overlapped_updates_equal_serial_with_lr_schedule(tmp_path):
    """Deferred layer updates (overlapped with the next forward) use the LR of the step that deferred them."""
    model = load_model("qwen3-tiny-untied", "float32", seed=13)
    ds = _dataset(model.config.vocab_size, n=16, seed=4)
    kw = dict(max_steps=4, lr_scheduler_type="linear", warmup_steps=1, save_strategy="steps", save_steps=2)
    stock = Trainer(model=copy.deepcopy(model), args=TrainingArguments(**_common(tmp_path, "stock",
                                                                                 optim="adamw_torch", **kw)),
                    train_dataset=ds, data_collator=_collate)
    stock.train()
    # "device": layers 0 and 2 updated on the compute device at their next load (optimizer_device "gpu"; on the CPU
    # the same staging, kernel and copy-back path runs with CPU tensors)
    placed = fixed_schedule(model.config.num_hidden_layers, EXACT["checkpoint_every"])
    for i in (0, 2):
        placed.layers[i].optimizer_device = "gpu"
    placed.to_json(str(tmp_path / "placed.json"))
    runs, trainers = {}, {}
    for overlap in (True, False, "device"):
        cfg = {**EXACT, "overlap_optimizer": bool(overlap)}
        if overlap == "device":
            cfg["schedule_path"] = str(tmp_path / "placed.json")
        t = LazyTrainer(model=copy.deepcopy(model),
                        args=LazyTrainingArguments(**_common(tmp_path, f"overlap{overlap}", **kw), lazytrain_config=cfg),
                        train_dataset=ds, data_collator=_collate)
        t.train()
        runs[overlap], trainers[overlap] = dict(t.model.named_parameters()), t
    assert len({h["learning_rate"] for h in stock.state.log_history if "learning_rate" in h}) > 2
    assert trainers["device"].executor.device_updates >= 2 * 2  # 2 layers x (steps whose update met a next load)
    for name, p in stock.model.named_parameters():
        assert torch.equal(runs[True][name], runs[False][name]), name
        assert torch.equal(runs["device"][name], runs[False][name]), name
        assert rel_err(runs[True][name].detach(), p.detach()) < 1e-5, name
    # a checkpoint taken mid-run holds the step's weights: deferred updates landed before the save
    saved = {o: dict(AutoModelForCausalLM.from_pretrained(str(tmp_path / f"overlap{o}" / "checkpoint-2"))
                     .named_parameters()) for o in (True, False, "device")}
    for name, p in saved[False].items():
        assert torch.equal(saved[True][name], p), name
        assert torch.equal(saved["device"][name], p), name
    assert not torch.equal(saved[True]["model.layers.3.mlp.up_proj.weight"], model.model.layers[3].mlp.up_proj.weight)


def test_a_loaded_schedules_kept_gradients_follow_this_runs_settings(tmp_path):
    """A schedule file planned with kept gradients (`keep_grads`) keeps them only where this run allows it:
    `keep_gpu_grads=False` or gradient accumulation send the GPU-updated layers' gradients to the host."""
    model = load_model("qwen3-tiny", "float32", seed=3)
    ds = _dataset(model.config.vocab_size)
    sched = fixed_schedule(model.config.num_hidden_layers, EXACT["checkpoint_every"])
    for i in (0, 2):
        sched.layers[i].optimizer_device = "gpu"
    sched.keep_grads = True
    sched.to_json(str(tmp_path / "kept.json"))
    for name, ga, keep, kept in (("ga1", 1, True, {0, 2}), ("off", 1, False, set()), ("ga2", 2, True, set())):
        cfg = {**EXACT, "schedule_path": str(tmp_path / "kept.json"), "keep_gpu_grads": keep}
        t = LazyTrainer(model=copy.deepcopy(model), train_dataset=ds, data_collator=_collate,
                        args=LazyTrainingArguments(**_common(tmp_path, name, gradient_accumulation_steps=ga,
                                                             max_steps=1), lazytrain_config=cfg))
        t.train()
        assert t.executor.schedule.keep_grads == bool(kept) and t.executor.grads.keep_layers == kept, name


def test_device_cuda_without_a_cuda_torch_is_one_error_naming_the_fix(tmp_path, monkeypatch):
    """Before: the executor's first copy to the GPU raised "AssertionError: Torch not compiled with CUDA enabled"."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for cfg in ({"device": "cuda"}, {"streaming": {"device": "cuda"}}):
        with pytest.raises(ValueError, match=r"lazytrain_config.device='cuda' \(recipe: lazytrain.device\), but "
                                             r"this torch .*Fix: set device to 'cpu'.*install a CUDA build of torch"):
            LazyTrainingArguments(**_common(tmp_path, "cuda"), lazytrain_config=cfg)
    assert LazyTrainingArguments(**_common(tmp_path, "cpu"), lazytrain_config={"device": "cpu"}).lazy_config.device \
        == "cpu"


def test_token_ids_outside_the_vocabulary_are_one_error_at_the_first_batch(tmp_path):
    """Before: "IndexError: index out of range in self" from the embedding deep in the step (as the stock Trainer)."""
    model = load_model("qwen3-tiny", "float32", seed=3)
    vocab = model.config.vocab_size
    ds = _dataset(vocab + 1000, seed=1)
    top = max(max(r) for r in ds["input_ids"])
    assert top >= vocab
    lazy = LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, "ids"),
                                                               lazytrain_config=dict(EXACT)),
                       train_dataset=ds, data_collator=_collate)
    with pytest.raises(ValueError, match=rf"input_ids hold token id \d+, outside the model's vocabulary: "
                                         rf"vocab_size={vocab} .*resize_token_embeddings"):
        lazy.train()
    assert lazy.state.global_step == 0
    # labels alone out of range (input_ids fine): named as labels
    batch = _collate([{"input_ids": [1, 2, 3], "attention_mask": [1, 1, 1], "labels": [-100, 2, vocab]}])
    from lazytrain_hf.hf.trainer import check_token_ids

    with pytest.raises(ValueError, match=rf"labels hold token id {vocab},"):
        check_token_ids(batch, model)
    check_token_ids(_collate([{"input_ids": [0, vocab - 1], "attention_mask": [1, 1], "labels": [-100, vocab - 1]}]),
                    model)


def test_an_empty_train_dataset_is_refused_before_the_executor_is_built(tmp_path, monkeypatch):
    """Before: the executor copied the model to host memory, then train() failed in the sampler with "num_samples
    should be a positive integer value, but got num_samples=0" (the stock Trainer's error too)."""
    import lazytrain_hf.hf.trainer as trainer_module

    def no_executor(*a, **k):
        raise AssertionError("the executor was built before the empty data set was refused")
    monkeypatch.setattr(trainer_module, "StreamingExecutor", no_executor)
    model = load_model("qwen3-tiny", "float32")
    empty = _dataset(model.config.vocab_size).filter(lambda r: len(r["input_ids"]) > 10_000)
    with pytest.raises(ValueError, match=r"train_dataset \(Dataset.*\) has no rows.*filtered out"):
        LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, "empty"),
                                                            lazytrain_config=dict(EXACT)),
                    train_dataset=empty, data_collator=_collate)


def test_group_by_length_batches_run_their_length_buckets_plan_and_equal_stock(tmp_path, monkeypatch):
    """`train_sampling_strategy="group_by_length"` (`group_by_length=True` before transformers 5.2x; HF's
    LengthGroupedSampler: batches of similar length): each batch runs the plan of its sequence-length bucket, and
    the run equals the stock Trainer with the same sampler."""
    used = _buckets_run(monkeypatch)
    stock, lazy = _train_pair(tmp_path, "qwen3-tiny", lazy_cfg={**EXACT, "policy": "milp"},
                              train_sampling_strategy="group_by_length", max_steps=4)
    assert type(lazy._get_train_sampler()).__name__ == "LengthGroupedSampler"
    assert len({b for b in used if b is not None}) >= 2, used
    for a, b in zip(_logs(lazy, "loss"), _logs(stock, "loss"), strict=True):
        assert math.isclose(a, b, rel_tol=1e-5), (a, b)
    stock_params = dict(stock.model.named_parameters())
    for name, p in lazy.model.named_parameters():
        assert rel_err(p.detach(), stock_params[name].detach()) < 1e-5, name


def test_a_batch_longer_than_the_planned_buckets_gets_its_own_plan_and_equals_stock(tmp_path, monkeypatch, caplog):
    """A collator padding past the data's longest row (here to a multiple of 32: 32-token batches of data up to 20
    tokens) ran under the longest bucket's plan (24 tokens) without a word, its peak under-planned; now it gets a
    bucket of its own, said once, and the run still equals the stock Trainer."""
    used = _buckets_run(monkeypatch)

    def padded(rows):
        T = 32
        pad = lambda key, v: torch.tensor([r[key] + [v] * (T - len(r[key])) for r in rows])  # noqa: E731
        return {"input_ids": pad("input_ids", 0), "attention_mask": pad("attention_mask", 0),
                "labels": pad("labels", -100)}

    model = load_model("qwen3-tiny", "float32", seed=3)
    ds = _dataset(model.config.vocab_size)
    stock = Trainer(model=copy.deepcopy(model), args=TrainingArguments(**_common(tmp_path, "stock", optim="adamw_torch")),
                    train_dataset=ds, data_collator=padded)
    stock.train()
    lazy = LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, "lazy"),
                                                               lazytrain_config={**EXACT, "policy": "milp"}),
                       train_dataset=ds, data_collator=padded)
    with caplog.at_level("WARNING"):
        lazy.train()
    assert lazy.plans.bucket_plans.buckets[-1] == 32 and 32 in used
    assert caplog.text.count("longer than the longest planned (24") == 1, caplog.text
    for a, b in zip(_logs(lazy, "loss"), _logs(stock, "loss"), strict=True):
        assert math.isclose(a, b, rel_tol=1e-5), (a, b)


def test_compute_metrics_gets_the_stock_models_logits(tmp_path):
    """Evaluation with compute_metrics: the streamed forward hands it the [B, T, V] logits and labels the stock
    Trainer's model gives (bit-equal in fp32), so metrics on logits (accuracy here) are the same."""
    import numpy as np

    model = load_model("qwen3-tiny", "float32", seed=3)
    ds = tiny_dataset(model.config.vocab_size)
    seen = {}

    def metrics(name):
        def f(p):
            seen[name] = (p.predictions, p.label_ids)
            pred, lab = p.predictions[:, :-1].argmax(-1), p.label_ids[:, 1:]
            return {"acc": float((pred == lab)[lab != -100].mean())}
        return f

    stock = Trainer(model=copy.deepcopy(model), args=TrainingArguments(**_common(tmp_path, "s", optim="adamw_torch")),
                    eval_dataset=ds, data_collator=_collate, compute_metrics=metrics("stock"))
    lazy = LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, "l"), lazytrain_config=dict(EXACT)),
                       train_dataset=ds, eval_dataset=ds, data_collator=_collate, compute_metrics=metrics("lazy"))
    a, b = stock.evaluate(), lazy.evaluate()
    assert a["eval_acc"] == b["eval_acc"] and math.isclose(a["eval_loss"], b["eval_loss"], rel_tol=1e-6)
    (ls, ys), (ll, yl) = seen["stock"], seen["lazy"]
    assert ls.shape == ll.shape == (len(ds), ls.shape[1], model.config.vocab_size)
    assert np.array_equal(ys, yl) and np.abs(ls - ll).max() <= 1e-5 * np.abs(ls).max()


def test_expandable_segments_default_on_unless_the_allocator_conf_says_otherwise(monkeypatch):
    """memory.expandable_segments: None turns them on unless the user's allocator settings are set
    (PYTORCH_ALLOC_CONF, read first as torch does, else PYTORCH_CUDA_ALLOC_CONF), which then decide; True / False
    are applied with the user's other settings kept (torch resets those a settings string omits); the value is a
    bool or null."""
    from lazytrain_hf.config import LazyTrainConfig
    from lazytrain_hf.hf.trainer import use_expandable_segments

    applied = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", applied.append, raising=False)
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    assert use_expandable_segments(None) is True and applied == ["expandable_segments:True"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert use_expandable_segments(None) is False and len(applied) == 1  # the user's allocator settings stand
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6, expandable_segments:True")
    assert use_expandable_segments(None) is True and len(applied) == 1
    assert use_expandable_segments(False) is False
    assert applied[-1] == "garbage_collection_threshold:0.6,expandable_segments:False"
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")  # torch reads this one first
    assert use_expandable_segments(None) is False and len(applied) == 2
    for bad in ("yes", 1, "false"):
        with pytest.raises(ValueError, match="expandable_segments must be true or false"):
            LazyTrainConfig(expandable_segments=bad)
    assert LazyTrainConfig(expandable_segments=None).expandable_segments is None
