"""LoRA (PEFT) and frozen decoder layers through LazyTrainer equal the stock Trainer + PEFT (fp32): loss, logged
grad_norm and final adapter weights; base weights bit-unchanged; the saved adapter loads with PEFT; resume is
exact."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from transformers import Trainer, TrainingArguments

import lazytrain_hf  # noqa: F401  (registers optim="lazytrain_hybrid8")
from lazytrain_hf import LazyTrainer, LazyTrainingArguments
from lazytrain_hf.models import load_model

from ..conftest import random_batch, rel_err
from .test_trainer import EXACT, NOISE_ONLY, _collate, _common, _logs
from .tiny_data import tiny_dataset

peft = pytest.importorskip("peft")

HYBRID8 = dict(optim="lazytrain_hybrid8")  # with EXACT's state_dtype fp32
ADAMW = dict(optim="adamw_torch")


def _lora(arch: str, seed: int = 3, **cfg):
    """A PEFT LoRA model (r 8, all linear layers of the decoder; B initialized randomly so that the first steps
    have gradients large enough to clip)."""
    kw = dict(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    kw.update(cfg)
    torch.manual_seed(seed)
    return peft.get_peft_model(load_model(arch, "float32", seed=seed), peft.LoraConfig(**kw))


def _pair(tmp_path, model, lazy_cfg=None, optim=ADAMW, ds=None, **kw):
    ds = ds if ds is not None else tiny_dataset(model.config.vocab_size)
    stock = Trainer(model=copy.deepcopy(model),
                    args=TrainingArguments(**_common(tmp_path, "stock", optim="adamw_torch", **kw)),
                    train_dataset=ds, data_collator=_collate)
    stock.train()
    lazy = LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, "lazy", **optim, **kw),
                                                               lazytrain_config=dict(lazy_cfg or EXACT)),
                       train_dataset=ds, data_collator=_collate)
    lazy.train()
    return stock, lazy


def _assert_equal_runs(stock, lazy, clipped=True):
    assert len(_logs(lazy, "loss")) == len(_logs(stock, "loss")) > 0
    for key in ("loss", "grad_norm"):
        for a, b in zip(_logs(lazy, key), _logs(stock, key), strict=True):
            assert math.isclose(a, b, rel_tol=1e-5), (key, a, b)
    if clipped:
        assert any(g > 1.0 for g in _logs(stock, "grad_norm")), "the test must exercise clipping"
    ref = dict(stock.model.named_parameters())
    trained = 0
    for name, p in lazy.model.named_parameters():
        trained += p.requires_grad
        if name.endswith(NOISE_ONLY):
            continue
        assert rel_err(p.detach().cpu(), ref[name].detach()) < 1e-5, name
    assert trained > 0


@pytest.mark.parametrize("arch", ["qwen2-tiny", "qwen3-tiny"])
@pytest.mark.parametrize("policy", ["fixed", "milp"])
@pytest.mark.parametrize("optim", ["adamw_torch", "hybrid8"])
def test_lora_equals_stock_trainer_with_peft(tmp_path, arch, policy, optim):
    model = _lora(arch)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    stock, lazy = _pair(tmp_path, model, {**EXACT, "policy": policy}, ADAMW if optim == "adamw_torch" else HYBRID8)
    _assert_equal_runs(stock, lazy)
    for name, p in lazy.model.named_parameters():  # the base weights: the same bits
        if name in base:
            assert torch.equal(p.detach(), base[name]), name
    ex = lazy.executor
    assert all(ex.frozen) and ex.store.grad_bytes == 0 and ex.stats.d2h_grad_bytes == 0
    assert not any(ex.is_streamed(p) for p in lazy.model.parameters() if p.requires_grad)


@pytest.mark.parametrize("arch", ["qwen2-tiny", "qwen3-tiny"])
def test_lora_on_the_lm_head_equals_stock(tmp_path, arch):
    """LoRA on the LM head (target_modules naming lm_head): the chunked loss multiplies by the head's weight alone,
    so the loss runs through the head module's own forward (the user-loss path); training and evaluation equal the
    stock Trainer + PEFT, and the head's adapter trains."""
    model = _lora(arch, target_modules=["q_proj", "lm_head"])
    head_a = model.get_base_model().lm_head.lora_A["default"].weight.detach().clone()
    stock, lazy = _pair(tmp_path, model, optim=HYBRID8)
    assert any("LM head" in r for r in lazy.user_loss)
    _assert_equal_runs(stock, lazy)
    assert not torch.equal(lazy.model.get_base_model().lm_head.lora_A["default"].weight.detach(), head_a)
    ds = tiny_dataset(model.config.vocab_size, n=4, seed=1)
    a, b = lazy.evaluate(ds)["eval_loss"], stock.evaluate(ds)["eval_loss"]
    assert math.isclose(a, b, rel_tol=1e-5), (a, b)


@pytest.mark.parametrize("policy", ["fixed", "milp"])
def test_lora_with_explicit_targets_and_modules_to_save_on_a_tied_lm_head(tmp_path, policy):
    """modules_to_save on the LM head of a tied model: PEFT trains an untied copy of the head (the embedding, which
    the original head shares, stays frozen), the same as the stock Trainer; the MILP prices the head it runs
    (untied), so every placement it tries, "host_embedding" included, plans."""
    model = _lora("qwen3-tiny", target_modules=["q_proj", "v_proj", "down_proj"], modules_to_save=["lm_head"])
    assert model.config.tie_word_embeddings
    embed = model.get_base_model().model.embed_tokens.weight.detach().clone()
    stock, lazy = _pair(tmp_path, model, {**EXACT, "policy": policy}, optim=HYBRID8)
    assert lazy.executor.schedule.policy == policy
    _assert_equal_runs(stock, lazy)
    inner = lazy.model.get_base_model()
    assert torch.equal(inner.model.embed_tokens.weight, embed)
    head = inner.lm_head.modules_to_save["default"].weight
    assert head.requires_grad and not torch.equal(head.detach(), embed)


def test_several_adapters_train_the_active_one(tmp_path):
    model = _lora("qwen2-tiny")
    model.add_adapter("other", peft.LoraConfig(r=4, target_modules=["o_proj", "up_proj"], init_lora_weights=False))
    model.set_adapter("other")
    other = {n: p.detach().clone() for n, p in model.named_parameters() if ".default." in n}
    assert other and not any(p.requires_grad for n, p in model.named_parameters() if ".default." in n)
    stock, lazy = _pair(tmp_path, model)
    _assert_equal_runs(stock, lazy, clipped=False)
    for n, p in lazy.model.named_parameters():
        if n in other:
            assert torch.equal(p.detach(), other[n]), n


def test_saved_adapter_loads_with_peft_and_gives_the_trained_outputs(tmp_path):
    model = _lora("qwen3-tiny-untied")
    lazy = LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, "lazy", max_steps=2),
                                                               lazytrain_config=dict(EXACT)),
                       train_dataset=tiny_dataset(model.config.vocab_size), data_collator=_collate)
    lazy.train()
    out = tmp_path / "adapter"
    lazy.save_model(str(out))
    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()
    assert not (out / "model.safetensors").exists()
    loaded = peft.PeftModel.from_pretrained(load_model("qwen3-tiny-untied", "float32", seed=3), str(out))
    ids, mask, _ = random_batch(model.config.vocab_size, seed=5)
    lazy.model.eval()
    loaded.eval()
    with torch.no_grad():
        want = lazy.model(input_ids=ids, attention_mask=mask).logits
        got = loaded(input_ids=ids, attention_mask=mask).logits
        streamed = lazy.streaming_model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(got, want)
    assert rel_err(streamed, want) < 1e-6

    # an adapter loaded to train on (is_trainable=True) trains on as with the stock Trainer
    again = peft.PeftModel.from_pretrained(load_model("qwen3-tiny-untied", "float32", seed=3), str(out),
                                           is_trainable=True)
    stock, cont = _pair(tmp_path / "more", again, optim=HYBRID8)
    _assert_equal_runs(stock, cont)


@pytest.mark.parametrize("optim", ["adamw_torch", "hybrid8"])
def test_resume_from_a_checkpoint_equals_an_uninterrupted_run(tmp_path, optim):
    args = ADAMW if optim == "adamw_torch" else HYBRID8
    ds = tiny_dataset(128, n=16, seed=2)
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2)

    def trainer(model):
        return LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, "run", **args, **kw),
                                                                   lazytrain_config=dict(EXACT)),
                           train_dataset=ds, data_collator=_collate)

    model = _lora("qwen2-tiny")
    assert model.config.vocab_size >= 128
    fresh = copy.deepcopy(model)
    straight = trainer(model)
    straight.train()
    ckpt = tmp_path / "run" / "checkpoint-2"
    assert (ckpt / "adapter_model.safetensors").is_file() and (ckpt / "adapter_config.json").is_file()
    final = {n: p.detach().clone() for n, p in straight.model.named_parameters() if p.requires_grad}
    resumed = trainer(fresh)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == 4
    for name, p in resumed.model.named_parameters():
        if name in final:
            assert rel_err(p.detach(), final[name]) < 1e-6, name
    assert _logs(resumed, "loss")[-1] == pytest.approx(_logs(straight, "loss")[-1], rel=1e-6)


def _freeze_some(model):
    for p in model.model.layers[0].parameters():  # a whole layer
        p.requires_grad_(False)
    for p in model.model.layers[2].self_attn.parameters():  # part of one
        p.requires_grad_(False)


@pytest.mark.parametrize("arch", ["qwen2-tiny", "qwen3-tiny"])
def test_plain_freezing_of_decoder_parameters_equals_stock(tmp_path, arch):
    model = load_model(arch, "float32", seed=3)
    _freeze_some(model)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    stock, lazy = _pair(tmp_path, model, optim=HYBRID8)
    _assert_equal_runs(stock, lazy)
    for name, p in lazy.model.named_parameters():
        if name in frozen:
            assert torch.equal(p.detach(), frozen[name]), name
    assert lazy.executor.frozen == [True, False, True, False]


def test_another_optimizer_with_trainable_streamed_layers_is_refused_before_training(tmp_path):
    model = load_model("qwen3-tiny", "float32", seed=3)
    _freeze_some(model)
    with pytest.raises(ValueError, match=r"optim='adamw_torch' cannot update parameters streamed from host memory: "
                                         r"2 decoder layers \(model\.layers\.1, model\.layers\.3\)"):
        LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, "x", **ADAMW)),
                    train_dataset=tiny_dataset(model.config.vocab_size), data_collator=_collate)


def test_a_model_prepared_for_kbit_training_is_accepted_and_recomputation_taken_over(tmp_path, caplog):
    base = load_model("qwen2-tiny", "float32", seed=3)
    # freezes the base; gradient checkpointing as it turns it on for a quantized base
    base = peft.prepare_model_for_kbit_training(base)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert base.is_gradient_checkpointing
    torch.manual_seed(3)
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False))
    with caplog.at_level(logging.INFO, logger="lazytrain_hf.streaming.executor"):
        stock, lazy = _pair(tmp_path, model, optim=HYBRID8)
    assert [r for r in caplog.records if "gradient checkpointing" in r.getMessage()]
    assert not lazy.model.get_base_model().is_gradient_checkpointing
    _assert_equal_runs(stock, lazy)


def test_the_cost_model_counts_no_gradient_or_optimizer_work_for_frozen_layers():
    from lazytrain_hf.planning.milp import solve_milp
    from lazytrain_hf.profiling.analytic import analytic_cost_model

    config = load_model("qwen2-tiny", "float32").config
    budgets = dict(gpu_bytes=2**30, host_bytes=2**32)
    full = analytic_cost_model(config, 4, 64, **budgets)
    frozen = [True, True, False, True]
    lora = analytic_cost_model(config, 4, 64, **budgets, frozen=frozen, adapter_params=1000)
    for i, f in enumerate(frozen):
        assert (lora.grad_bytes[i] == 0) == f and (lora.num_params[i] == 0) == f
        assert (lora.gpu_optim_h2d_bytes[i] == lora.gpu_optim_work_bytes[i] == 0) == f
        assert lora.param_bytes[i] == full.param_bytes[i] and lora.fwd_ms[i] == full.fwd_ms[i]
        assert lora.cpu_optim_ms(i) == (0.0 if f else full.cpu_optim_ms(i))
    p = sum(full.num_params[i] for i in range(4) if frozen[i])
    # a frozen layer keeps its bf16 weights only: no bf16 gradient, 8-bit moments (+ fp32 absmax per 256) or master
    assert full.host_fixed_bytes - lora.host_fixed_bytes == pytest.approx(p * (2 + 2 + 8 / 256 + 4), abs=2)
    assert lora.resident_bytes > full.resident_bytes and lora.head_optim_params == full.head_optim_params + 1000
    assert solve_milp(lora).predicted["step_ms"] < solve_milp(full).predicted["step_ms"]
    with pytest.raises(ValueError, match="frozen must have one entry per layer"):
        analytic_cost_model(config, 4, 64, **budgets, frozen=[True])


def test_a_lora_runs_plan_costs_no_gradient_traffic(tmp_path):
    from lazytrain_hf.hf.plan import cost_model_for_trainer

    model = _lora("qwen3-tiny")
    lazy = LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, "lazy", max_steps=1),
                                                               lazytrain_config={**EXACT, "policy": "milp"}),
                       train_dataset=tiny_dataset(model.config.vocab_size), data_collator=_collate)
    lazy.train()
    cm, _, _ = cost_model_for_trainer(lazy, 16)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert cm.grad_bytes == [0] * 4 and cm.num_params == [0] * 4 and cm.meta["adapter_params"] == adapters
    assert cm.meta["frozen_embed"] and cm.embed_optim_params == 0  # PEFT freezes the (tied) embedding and head


def test_the_host_preflight_counts_a_frozen_base_by_its_weights(tmp_path):
    """Before the executor exists, the host-memory preflight reads the frozen layout off the model, as the plan
    reads it off the executor: a LoRA base costs its weights only (it refused a Qwen2.5-32B LoRA run on a 128 GiB
    host for 291.5 GiB of gradients and states it would never allocate)."""
    from lazytrain_hf.hf.peft_support import frozen_costs, model_frozen_costs
    from lazytrain_hf.hf.preflight import fixed_host_bytes

    def trainer(model):
        return LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, "lazy", max_steps=1),
                                                                   lazytrain_config=dict(EXACT)),
                           train_dataset=tiny_dataset(model.config.vocab_size), data_collator=_collate)
    lora = _lora("qwen3-tiny")
    before = model_frozen_costs(lora)
    lazy = trainer(lora)
    assert before == frozen_costs(lazy.executor) and all(before["frozen"]) and before["adapter_params"] > 0
    full = trainer(load_model("qwen3-tiny", "float32", seed=3))
    assert not any(model_frozen_costs(full.model)["frozen"])
    params = sum(p.numel() for layer in full.executor.layers for p in layer.parameters())
    # EXACT: fp32 states, no master weights: weight + gradient + 2 moments = 12 bytes per parameter; frozen: 2
    assert (fixed_host_bytes(full), fixed_host_bytes(lazy)) == ((2 + 2 + 8) * params, 2 * params)


@pytest.mark.parametrize("resident", ["gpu", "host_embedding", "host"])
def test_a_frozen_embedding_and_head_cost_their_weights_only(resident):
    """LoRA's base embedding / LM head: 2 bytes per parameter wherever placed, no optimizer work, and the head's
    backward computes the hidden-state gradient only (a third less head compute)."""
    from lazytrain_hf.profiling import H200_DEFAULTS
    from lazytrain_hf.profiling.analytic import HOST_EMBED_ROWS_GBPS, analytic_cost_model

    config = load_model("qwen3-tiny-untied", "float32").config
    budgets = dict(gpu_bytes=2**30, host_bytes=2**32, resident=resident)
    full = analytic_cost_model(config, 4, 64, **budgets)
    frozen = analytic_cost_model(config, 4, 64, **budgets, frozen_embed=True, frozen_head=True)
    E, V, H = config.vocab_size * config.hidden_size, config.vocab_size, config.hidden_size
    trained_b = 2 + 2 + 8 + 4  # the plan's bf16 training: weight, gradient, fp32 moments, fp32 master
    saved = (full.resident_bytes - frozen.resident_bytes) + (full.host_fixed_bytes - frozen.host_fixed_bytes)
    assert saved == pytest.approx(2 * E * (trained_b - 2), rel=1e-6)  # embedding + head: 2 bytes each remain
    assert frozen.embed_optim_params == 0 and frozen.head_optim_params == full.head_optim_params - E
    # a host embedding's row work (the lookup, and for a trained one the gradient's download and index-add) is in
    # head_ms too
    hw, rows_mb = H200_DEFAULTS, 2 * 4 * 64 * H / 1e6

    def row_ms(frozen_embed):
        return 0 if resident == "gpu" else rows_mb * (1 / hw.h2d_gbps + (0 if frozen_embed else 1 / hw.d2h_gbps)
                                                      + (1 if frozen_embed else 2) / HOST_EMBED_ROWS_GBPS)
    assert frozen.head_ms - row_ms(True) == pytest.approx((full.head_ms - row_ms(False)) * 4 / 6)
    assert frozen.resident_cpu_params == 0
    assert frozen.embed_grad_bytes == 0 and frozen.head_grad_bytes == 0
    assert V * H == E


@pytest.mark.parametrize("policy", ["fixed", "milp"])
def test_lora_dropout_draws_the_forward_masks_when_layers_rerun(tmp_path, policy):
    """lora_dropout 0.1: each decoder layer runs again in backward (recompute / re-forward); it must draw the masks
    its forward drew (the executor replays the RNG state), or the gradients are not those of the computed loss. With
    one row chunk the masks are the stock forward's too, so the run equals stock Trainer + PEFT."""
    model = _lora("qwen3-tiny", lora_dropout=0.1)
    stock, lazy = _pair(tmp_path, model, {**EXACT, "policy": policy})
    _assert_equal_runs(stock, lazy)
    assert lazy.executor._rng.active


def test_a_model_with_nothing_to_train_is_refused_before_the_first_step(tmp_path):
    """An adapter loaded without is_trainable=True (PEFT freezes it) or a model frozen by hand: train() raises one
    error naming the fix before any step runs (the stock Trainer fails in backward; training on would change
    nothing)."""
    _lora("qwen2-tiny").save_pretrained(tmp_path / "adapter")
    frozen = peft.PeftModel.from_pretrained(load_model("qwen2-tiny", "float32", seed=3), tmp_path / "adapter")
    plain = load_model("qwen2-tiny", "float32", seed=3).requires_grad_(False)
    for model, fix in ((frozen, "is_trainable=True"), (plain, "requires_grad=True")):
        args = LazyTrainingArguments(**_common(tmp_path, "none", **ADAMW), lazytrain_config=dict(EXACT))
        tr = LazyTrainer(model=model, args=args, train_dataset=tiny_dataset(model.config.vocab_size),
                         data_collator=_collate)
        with pytest.raises(ValueError, match="no parameter of the model requires a gradient") as e:
            tr.train()
        assert fix in str(e.value) and tr.state.global_step == 0
