"""`lazytrain-hf train` with a recipe's peft section: LoRA adapters trained end to end and written as PEFT writes them,
the merged model (peft.merge_on_save) loading as a plain checkpoint, and one clear error per bad peft key."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lazytrain_hf import cli
from lazytrain_hf.models import load_model

from .conftest import GSM8K_DIR, random_batch, rel_err, requires_gsm8k

peft = pytest.importorskip("peft")

REPO = Path(__file__).resolve().parents[1]
LORA_RECIPE = REPO / "recipes" / "qwen2.5-32b_lora_24gib.yaml"
#: the shipped LoRA recipe on a tiny model with the real vocabulary, on the CPU, for a few steps
_TINY = ["model.name_or_path=qwen3-tiny-vocab", "model.dtype=float32", "training.bf16=false", "training.use_cpu=true",
         f"data.source={GSM8K_DIR}", "training.max_steps=3", "data.train_limit=24", "data.test_limit=4",
         "eval.max_new_tokens=8", "data.max_length=96", "training.per_device_train_batch_size=4",
         "training.gradient_accumulation_steps=2", "training.save_steps=2", "training.logging_steps=1",
         "training.seed=0", "peft.r=4", "peft.lora_dropout=0.0", "peft.merge_on_save=true"]


def _sets(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


@requires_gsm8k
def test_lora_recipe_trains_end_to_end_and_writes_the_adapter_and_the_merged_model(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["train", "--config", str(LORA_RECIPE), *_sets(_TINY + [f"training.output_dir={out}"])]) == 0
    final = out / "final"
    assert (final / "adapter_model.safetensors").is_file() and (final / "adapter_config.json").is_file()
    assert not (final / "model.safetensors").exists()
    adapter_cfg = json.loads((final / "adapter_config.json").read_text())
    assert adapter_cfg["r"] == 4 and adapter_cfg["task_type"] == "CAUSAL_LM" and adapter_cfg["peft_type"] == "LORA"
    assert len(adapter_cfg["target_modules"]) == 7  # all-linear: q k v o gate up down
    assert list(out.glob("checkpoint-*/adapter_model.safetensors"))
    metrics = json.loads((out / "metrics.json").read_text())
    losses = [h["loss"] for h in metrics["log_history"] if "loss" in h]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert metrics["merged_checkpoint"] == str(out / "merged")

    # the adapter on the same random base, and the merged plain model, give the same outputs
    trained = peft.PeftModel.from_pretrained(load_model("qwen3-tiny-vocab", "float32", seed=0), str(final))
    merged, info = AutoModelForCausalLM.from_pretrained(str(out / "merged"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not any("lora" in n for n, _ in merged.named_parameters())
    ids, mask, _ = random_batch(merged.config.vocab_size, seed=3)
    trained.eval()
    merged.eval()
    with torch.no_grad():
        want = trained(input_ids=ids, attention_mask=mask).logits
        got = merged(input_ids=ids, attention_mask=mask).logits
    assert rel_err(got, want) < 1e-5
    base = load_model("qwen3-tiny-vocab", "float32", seed=0)
    with torch.no_grad():
        untrained = base(input_ids=ids, attention_mask=mask).logits
    assert rel_err(untrained, want) > 1e-4, "the adapter trained: the merged model differs from the base"


@pytest.fixture
def no_model_load(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the model was loaded before the input error was raised")
    monkeypatch.setattr("lazytrain_hf.models.load_model", boom)


@pytest.mark.parametrize("override, match", [
    ("peft.lora_alpah=32", r"peft\.lora_alpah.*neither peft\.LoraConfig fields \(\[.*'lora_alpha'.*\]\) nor "
                           r"merge_on_save .*\(did you mean peft\.lora_alpha\?\)"),
    ("peft.r=0", r"peft\.r must be a positive integer"),
    ("peft.lora_dropout=1.5", r"peft\.lora_dropout must be a number in \[0, 1\)"),
    ("peft.task_type=CAUSAL_LN", r"peft\.task_type must be one of .*did you mean peft\.task_type\.CAUSAL_LM"),
    ("peft.task_type=SEQ_CLS", r"peft\.task_type 'SEQ_CLS' is not what a recipe trains .*set CAUSAL_LM"),
    ("peft.modules_to_save=lm_head", r"peft\.modules_to_save must be a list"),
    ("peft.merge_on_save=maybe", r"peft\.merge_on_save must be true or false"),
    ("peft.inference_mode=true", r"peft\.inference_mode: true freezes the adapters"),
    ("peft.layers_to_transform=[1]", r"peft\.layers_to_transform needs peft\.target_modules as a list"),
    ("peft.peft_type=IA3", r"peft\.peft_type 'IA3': the peft section is a LoRA configuration"),
])
def test_peft_mistakes_are_one_clear_error_before_the_model_loads(capsys, no_model_load, override, match):
    assert cli.main(["train", "--config", str(LORA_RECIPE), "--set", override]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and re.search(match, err), err


def test_peft_section_is_read_and_overridden():
    from lazytrain_hf.recipe import load_recipe

    recipe = load_recipe(LORA_RECIPE, ["peft.r=32", "peft.target_modules=[q_proj, v_proj]", "peft.task_type=causal_lm"])
    assert recipe.peft == dict(r=32, lora_alpha=32, lora_dropout=0.05, target_modules=["q_proj", "v_proj"],
                               task_type="CAUSAL_LM")
    assert recipe.merge_on_save is False
    assert peft.LoraConfig(**recipe.peft).r == 32
    assert load_recipe(REPO / "recipes" / "cpu_default.yaml").peft is None  # no section: the whole model trains


def test_lora_config_fields_are_peft_s_own():
    """The recipe reads LoraConfig's fields from PEFT's source (no import); they are the dataclass's fields less the
    ones PEFT sets itself."""
    import dataclasses

    from lazytrain_hf.recipe import lora_config_fields

    assert lora_config_fields() == {f.name for f in dataclasses.fields(peft.LoraConfig)} - {
        "peft_type", "auto_mapping", "peft_version"}


def test_unknown_peft_key_fails_without_importing_torch_or_peft():
    code = f"""
        import sys
        from lazytrain_hf import cli
        code = cli.main(["train", "--config", {str(LORA_RECIPE)!r}, "--set", "peft.rank=8"])
        print(code, "torch" in sys.modules, "peft" in sys.modules)
    """
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert res.stdout.split() == ["2", "False", "False"], res.stdout + res.stderr
    assert "peft.rank" in res.stderr
