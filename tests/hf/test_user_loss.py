"""The user's loss runs behind the executor: `compute_loss` overrides, `compute_loss_func` and label smoothing train
exactly as with the stock Trainer (fp32, gradient accumulation 2, clipping); what cannot run is refused at build."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer, TrainingArguments

from lazytrain_hf import LazyTrainer, LazyTrainingArguments
from lazytrain_hf.models import load_model

from ..conftest import rel_err
from .test_trainer import EXACT, NOISE_ONLY, _collate, _common, _dataset, _logs


def _position_weights(labels: torch.Tensor) -> torch.Tensor:
    """Per-target weights 1, 1.5, 2, 1, ... by position: a loss the executor's cross-entropy does not compute."""
    T = labels.shape[1] - 1
    return (1.0 + 0.5 * (torch.arange(T, device=labels.device) % 3)).expand(labels.shape[0], T)


class WeightedLoss:
    """A `compute_loss` override: position-weighted token cross-entropy over the whole accumulation window."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.calls = getattr(self, "calls", 0) + 1
        labels = inputs["labels"]
        out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        logits = out.logits[:, :-1].float()
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), reduction="none")
        loss = (nll * _position_weights(labels).reshape(-1)).sum() / num_items_in_batch
        return (loss, out) if return_outputs else loss


class ReferenceLoss:
    """A loss using a no-grad forward of the same model first (as reference log-probabilities are), then the
    forward with grad: cross-entropy plus the cross-entropy against the reference distribution."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with torch.no_grad():
            ref = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits.float()
        out = model(**inputs, num_items_in_batch=num_items_in_batch)
        mask = inputs["labels"][:, 1:].ne(-100)
        soft = -(ref[:, :-1].softmax(-1) * out.logits[:, :-1].float().log_softmax(-1)).sum(-1)
        loss = out.loss + 0.5 * soft[mask].sum() / num_items_in_batch
        return (loss, out) if return_outputs else loss


class ReferenceAfterLoss(ReferenceLoss):
    """The loss with the no-grad forward after the forward with grad, while its backward is still to come (as TRL's
    DPOTrainer computes a PEFT policy's reference), and on other token ids (shifted by one position), so that what
    the inner forward looks up differs from what the pass looked up."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs, num_items_in_batch=num_items_in_batch)
        with torch.no_grad():
            ref = model(input_ids=inputs["input_ids"].roll(1, dims=1),
                        attention_mask=inputs["attention_mask"]).logits.float()
        mask = inputs["labels"][:, 1:].ne(-100)
        soft = -(ref[:, :-1].softmax(-1) * out.logits[:, :-1].float().log_softmax(-1)).sum(-1)
        loss = out.loss + 0.5 * soft[mask].sum() / num_items_in_batch
        return (loss, out) if return_outputs else loss


def z_loss_func(outputs, labels, num_items_in_batch=None):
    """A `compute_loss_func`: token cross-entropy plus a z-loss on the logits' log-partition."""
    logits = outputs.logits[:, :-1].float()
    tgt = labels[:, 1:].reshape(-1)
    flat = logits.reshape(-1, logits.shape[-1])
    ce = F.cross_entropy(flat, tgt, reduction="sum", ignore_index=-100)
    z = flat.logsumexp(-1).pow(2)[tgt.ne(-100)].sum()
    return (ce + 1e-2 * z) / num_items_in_batch


class StockWeighted(WeightedLoss, Trainer):
    pass


class LazyWeighted(WeightedLoss, LazyTrainer):
    pass


class StockReference(ReferenceLoss, Trainer):
    pass


class LazyReference(ReferenceLoss, LazyTrainer):
    pass


class StockReferenceAfter(ReferenceAfterLoss, Trainer):
    pass


class LazyReferenceAfter(ReferenceAfterLoss, LazyTrainer):
    pass


def _pair(tmp_path, stock_cls=Trainer, lazy_cls=LazyTrainer, arch="qwen3-tiny", trainer_kw=None, lazy_cfg=None,
          **kw):
    model = load_model(arch, "float32", seed=3)
    ds = _dataset(model.config.vocab_size)
    stock = stock_cls(model=copy.deepcopy(model), args=TrainingArguments(**_common(tmp_path, "stock",
                                                                                    optim="adamw_torch", **kw)),
                      train_dataset=ds, data_collator=_collate, **(trainer_kw or {}))
    stock.train()
    lazy = lazy_cls(model=model, args=LazyTrainingArguments(**_common(tmp_path, "lazy", **kw),
                                                            lazytrain_config={**EXACT, **(lazy_cfg or {})}),
                    train_dataset=ds, data_collator=_collate, **(trainer_kw or {}))
    lazy.train()
    return stock, lazy


def _assert_equal_runs(stock, lazy, keys=("loss", "grad_norm")):
    """Three logged steps; `keys` equal within 1e-5 relative; clipping exercised; final parameters within 1e-5."""
    assert len(_logs(lazy, "loss")) == 3
    for key in keys:
        for a, b in zip(_logs(lazy, key), _logs(stock, key), strict=True):
            assert math.isclose(a, b, rel_tol=1e-5), (key, a, b)
    assert any(g > 1.0 for g in _logs(stock, "grad_norm")), "the test must exercise clipping"
    stock_params = dict(stock.model.named_parameters())
    for name, p in lazy.model.named_parameters():
        if not name.endswith(NOISE_ONLY):
            assert rel_err(p.detach(), stock_params[name].detach()) < 1e-5, name


@pytest.mark.parametrize("arch, placement", [("qwen3-tiny", "gpu"), ("qwen3-tiny-untied", "host_embedding"),
                                             ("qwen3-tiny", "host")])
def test_a_compute_loss_override_trains_as_with_the_stock_trainer(tmp_path, arch, placement):
    """Every placement of the embedding / LM head: the head's gradient reaches a host head after the loss's
    backward, the embedding's after the layers'."""
    stock, lazy = _pair(tmp_path, StockWeighted, LazyWeighted, arch=arch, lazy_cfg={"resident_placement": placement})
    assert lazy.executor.resident.placement == placement
    assert lazy.user_loss == ["compute_loss of WeightedLoss"]
    assert lazy.calls == stock.calls == 6  # 3 steps x 2 micro-batches
    _assert_equal_runs(stock, lazy)


@pytest.mark.parametrize("classes, arch, placement", [((StockReference, LazyReference), "qwen3-tiny", "gpu"),
                                                       ((StockReferenceAfter, LazyReferenceAfter), "qwen3-tiny", "gpu"),
                                                       ((StockReferenceAfter, LazyReferenceAfter), "qwen3-tiny-untied",
                                                        "host_embedding")],
                         ids=["before", "after", "after-host-embedding"])
def test_a_compute_loss_with_a_no_grad_reference_forward_trains_as_with_the_stock_trainer(tmp_path, classes, arch,
                                                                                         placement):
    """Before the forward with grad, or after it while its pass waits for the loss's gradient (a host embedding's
    lookup for the reference must not take the pass's ids or boundary)."""
    stock, lazy = _pair(tmp_path, *classes, arch=arch, lazy_cfg={"resident_placement": placement})
    _assert_equal_runs(stock, lazy)


def test_compute_loss_func_trains_as_with_the_stock_trainer(tmp_path):
    stock, lazy = _pair(tmp_path, trainer_kw={"compute_loss_func": z_loss_func}, include_num_input_tokens_seen="all")
    assert lazy.user_loss == ["compute_loss_func"]
    _assert_equal_runs(stock, lazy)
    assert lazy.state.num_input_tokens_seen == stock.state.num_input_tokens_seen > 0


@pytest.mark.parametrize("arch, placement", [("qwen3-tiny", "gpu"), ("qwen3-tiny-untied", "host_embedding")])
def test_neftune_noise_trains_as_with_the_stock_trainer(tmp_path, arch, placement):
    """NEFTune's forward hook on the embedding runs in the executor's embedding lookup, once per micro-batch: also
    with the embedding in host memory, where a plain embedding is looked up into a staging buffer instead."""
    stock, lazy = _pair(tmp_path, arch=arch, lazy_cfg={"resident_placement": placement}, neftune_noise_alpha=5.0)
    assert lazy.executor.resident.placement == placement
    _assert_equal_runs(stock, lazy)
    plain = [h["loss"] for h in _pair(tmp_path / "plain")[0].state.log_history if "loss" in h]
    assert not math.isclose(plain[0], _logs(stock, "loss")[0], rel_tol=1e-5)  # the noise changes the loss


def test_label_smoothing_trains_as_with_the_stock_trainer(tmp_path):
    stock, lazy = _pair(tmp_path, label_smoothing_factor=0.1)
    assert lazy.user_loss == ["label_smoothing_factor=0.1"]
    _assert_equal_runs(stock, lazy)


def test_the_default_loss_stays_the_executors_chunked_loss(tmp_path, monkeypatch):
    from lazytrain_hf.streaming import executor

    calls = []
    original = executor.chunked_lm_loss
    monkeypatch.setattr(executor, "chunked_lm_loss", lambda *a, **k: calls.append(1) or original(*a, **k))
    model = load_model("qwen3-tiny", "float32", seed=3)
    lazy = LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, "lazy", max_steps=1),
                                                               lazytrain_config=dict(EXACT)),
                       train_dataset=_dataset(model.config.vocab_size), data_collator=_collate)
    assert lazy.user_loss == [] and lazy.user_loss_model is None
    lazy.train()
    assert len(calls) == 2


@pytest.mark.parametrize("stock_cls, lazy_cls, kw", [(StockWeighted, LazyWeighted, {}),
                                                     (Trainer, LazyTrainer, {"label_smoothing_factor": 0.1})])
def test_evaluation_computes_the_users_loss(tmp_path, stock_cls, lazy_cls, kw):
    model = load_model("qwen3-tiny", "float32", seed=9)
    ds = _dataset(model.config.vocab_size, n=6)
    ref = stock_cls(model=copy.deepcopy(model), args=TrainingArguments(**_common(tmp_path, "ref", **kw)),
                    eval_dataset=ds, data_collator=_collate).evaluate()
    lazy = lazy_cls(model=model, args=LazyTrainingArguments(**_common(tmp_path, "lazy", **kw),
                                                            lazytrain_config=dict(EXACT)),
                    eval_dataset=ds, data_collator=_collate).evaluate()
    assert math.isclose(lazy["eval_loss"], ref["eval_loss"], rel_tol=1e-5)


@pytest.mark.parametrize("stock_cls, lazy_cls", [(Trainer, LazyTrainer), (StockWeighted, LazyWeighted)])
def test_bf16_on_an_fp32_model_computes_the_layers_in_bf16_over_fp32_weights(tmp_path, monkeypatch, stock_cls,
                                                                            lazy_cls):
    """bf16=True as the stock Trainer means it (autocast): the layers' matmuls in bfloat16, weights float32; the
    losses within 1e-2 of the stock Trainer's bf16 run over 3 steps."""
    from lazytrain_hf.streaming.weights import WeightStreamer

    seen = set()
    original = WeightStreamer.acquire

    def spy(self, layer):
        slot = original(self, layer)
        if not slot.module.mlp.down_proj._forward_hooks:
            slot.module.mlp.down_proj.register_forward_hook(lambda m, a, out: seen.add(out.dtype))
        return slot

    monkeypatch.setattr(WeightStreamer, "acquire", spy)
    stock, lazy = _pair(tmp_path, stock_cls, lazy_cls, bf16=True)
    assert lazy.executor.autocast_dtype == torch.bfloat16 and seen == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in lazy.model.parameters())
    for a, b in zip(_logs(lazy, "loss"), _logs(stock, "loss"), strict=True):
        assert math.isclose(a, b, rel_tol=1e-2), (a, b)
    stock_params = dict(stock.model.named_parameters())
    for name, p in lazy.model.named_parameters():
        if not name.endswith(NOISE_ONLY):
            assert rel_err(p.detach(), stock_params[name].detach()) < 1e-2, name


class NoModelCall:
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return torch.zeros((), requires_grad=True)


class TwoGradForwards:
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return model(**inputs).loss + model(**inputs).loss


class LogitsUnused:
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        model(**inputs)
        return torch.zeros((), requires_grad=True) * 1.0


class SelfModelCall:
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return self.model(**inputs).loss


class InnerModuleCall:
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return model.model(input_ids=inputs["input_ids"]).last_hidden_state.sum()


class EmbedsCall:
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return model(inputs_embeds=model.get_input_embeddings()(inputs["input_ids"]), labels=inputs["labels"]).loss


class DeviceAndDtype(WeightedLoss):
    """Loss code that reads model.device and model.dtype, as much of it does."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        assert torch.ones(1, device=model.device).device == torch.device("cpu") and model.dtype == torch.float32
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


@pytest.mark.parametrize("mixin, error, match", [
    (NoModelCall, RuntimeError, "never called the model"),
    (SelfModelCall, RuntimeError, r"never called the model.*the `model` argument.*self\.model is the HF model"),
    (TwoGradForwards, RuntimeError, "a second time"),
    (LogitsUnused, RuntimeError, "does not depend on the model's output"),
    (InnerModuleCall, AttributeError, r"no attribute 'model': call it as model\(input_ids=.*policy 'none'"),
    (EmbedsCall, ValueError, r"takes input_ids.*compute_loss passed \['inputs_embeds'\]"),
])
def test_a_loss_the_executor_cannot_train_through_is_an_error(tmp_path, mixin, error, match):
    cls = type("Lazy" + mixin.__name__, (mixin, LazyTrainer), {})
    model = load_model("qwen3-tiny", "float32", seed=3)
    lazy = cls(model=model, args=LazyTrainingArguments(**_common(tmp_path, "lazy", max_steps=1),
                                                       lazytrain_config=dict(EXACT)),
               train_dataset=_dataset(model.config.vocab_size), data_collator=_collate)
    with pytest.raises(error, match=match):
        lazy.train()


def test_loss_code_reading_model_device_and_dtype_trains_as_with_the_stock_trainer(tmp_path):
    stock_cls = type("StockDeviceAndDtype", (DeviceAndDtype, Trainer), {})
    lazy_cls = type("LazyDeviceAndDtype", (DeviceAndDtype, LazyTrainer), {})
    stock, lazy = _pair(tmp_path, stock_cls, lazy_cls)
    _assert_equal_runs(stock, lazy)


@pytest.mark.parametrize("kw, match", [({"torch_compile": True}, "torch_compile=True"),
                                       ({"use_liger_kernel": True}, "use_liger_kernel=True")])
def test_forward_options_the_executor_would_ignore_are_refused_at_build(tmp_path, kw, match):
    model = load_model("qwen3-tiny", "float32", seed=3)
    with pytest.raises(ValueError, match=match):
        LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, "lazy", **kw)),
                    train_dataset=_dataset(model.config.vocab_size), data_collator=_collate)


def test_a_hooked_model_forward_is_refused_at_build(tmp_path):
    model = load_model("qwen3-tiny", "float32", seed=3)
    model.register_forward_hook(lambda module, args, out: out)
    with pytest.raises(ValueError, match="forward hooks on Qwen3ForCausalLM"):
        LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, "lazy")),
                    train_dataset=_dataset(model.config.vocab_size), data_collator=_collate)
