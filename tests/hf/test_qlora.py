"""A bitsandbytes 4-bit base (QLoRA) is refused by LazyTrainer before training with one error naming the fixes; the
named fix (policy 'none', the stock path) trains it."""

from __future__ import annotations

import pytest
import torch

from lazytrain_hf import LazyTrainer, LazyTrainingArguments
from lazytrain_hf.models import load_model

from .test_trainer import _collate, _common
from .tiny_data import tiny_dataset

peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")


def _qlora(tmp_path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    load_model("qwen2-tiny", "float32", seed=3).save_pretrained(str(tmp_path / "base"))
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), quantization_config=quant, device_map="cpu",
                                                dtype=torch.float32)
    base = peft.prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    return peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False))


def test_a_4bit_base_is_refused_before_training_and_policy_none_trains_it(tmp_path):
    model = _qlora(tmp_path)
    assert any(type(p).__name__ == "Params4bit" for p in model.parameters())
    ds = tiny_dataset(model.config.vocab_size)
    with pytest.raises(ValueError, match=r"cannot stream bitsandbytes-quantized weights yet \(.*layers\.0\..*"
                                         r"is Params4bit\).*policy='none'"):
        LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, "lazy", optim="adamw_torch")),
                    train_dataset=ds, data_collator=_collate)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    stock = LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, "none", optim="adamw_torch",
                                                                          max_steps=1),
                                                                lazytrain_config={"policy": "none"}),
                        train_dataset=ds, data_collator=_collate)
    stock.train()
    assert any(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters() if n in before)
