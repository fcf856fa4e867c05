"""Saving a LoRA run: `save_model` writes the adapter files exactly as PEFT's `save_pretrained` does, and the trained
model merged (`merge_and_unload`) saves as a plain checkpoint that `from_pretrained` loads with the same outputs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lazytrain_hf import LazyTrainer, LazyTrainingArguments
from lazytrain_hf.cli import merged_model

from ..conftest import random_batch, rel_err
from .test_lora import _lora
from .test_trainer import EXACT, _collate, _common
from .tiny_data import tiny_dataset

peft = pytest.importorskip("peft")


def _trained(tmp_path, arch: str, **lora):
    model = _lora(arch, **lora)
    lazy = LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, "lazy", max_steps=2),
                                                               lazytrain_config=dict(EXACT)),
                       train_dataset=tiny_dataset(model.config.vocab_size), data_collator=_collate)
    lazy.train()
    return lazy, model


@pytest.mark.parametrize("arch, lora", [("qwen2-tiny", {}), ("qwen3-tiny", dict(modules_to_save=["lm_head"]))])
def test_save_model_writes_the_adapter_as_peft_does(tmp_path, arch, lora):
    lazy, model = _trained(tmp_path, arch, **lora)
    ours, theirs = tmp_path / "save_model", tmp_path / "peft"
    lazy.save_model(str(ours))
    model.save_pretrained(str(theirs))
    peft_files = {p.name for p in theirs.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= peft_files
    assert peft_files <= {p.name for p in ours.iterdir()}  # the Trainer adds training_args.bin
    assert json.loads((ours / "adapter_config.json").read_text()) == json.loads(
        (theirs / "adapter_config.json").read_text())
    a, b = load_file(ours / "adapter_model.safetensors"), load_file(theirs / "adapter_model.safetensors")
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert len(a) == len(trained)  # the trainable parameters, nothing of the frozen base


def test_merged_model_saves_and_loads_as_a_plain_model_with_the_trained_outputs(tmp_path):
    lazy, model = _trained(tmp_path, "qwen3-tiny-untied")
    ids, mask, _ = random_batch(model.config.vocab_size, seed=5)
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    merged = merged_model(lazy, model)
    assert not isinstance(merged, peft.PeftModel) and not any("lora" in n for n, _ in merged.named_parameters())
    merged.save_pretrained(str(tmp_path / "merged"))
    loaded, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    loaded.eval()
    with torch.no_grad():
        got = loaded(input_ids=ids, attention_mask=mask).logits
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("arch, lora", [("qwen2-tiny", {}), ("qwen3-tiny", dict(modules_to_save=["lm_head"]))])
def test_a_lora_checkpoint_is_sized_by_its_adapters_not_the_frozen_base(tmp_path, arch, lora):
    """The free-space check before each save and the saved-size log line count the adapter weights save_model
    writes (its safetensors file less the file's JSON header), not the frozen base: a 70B LoRA run's checkpoint is a few hundred MB,
    not the base's hundreds of GB."""
    from lazytrain_hf.hf import preflight

    lazy, model = _trained(tmp_path, arch, **lora)
    lazy.save_model(str(tmp_path / "saved"))
    written = (tmp_path / "saved" / "adapter_model.safetensors").stat().st_size
    weights = preflight.saved_model_bytes(model)
    assert weights <= written <= weights + 65536, (weights, written)
    base = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    assert weights < base / 2
    assert preflight.checkpoint_bytes(lazy) - preflight.CHECKPOINT_OVERHEAD_BYTES < base
