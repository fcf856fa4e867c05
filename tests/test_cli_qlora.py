"""`lazytrain-hf train` with model.quantization (QLoRA): a registry shape built in 4 bits and a local checkpoint loaded
in 4 bits train through the CLI on the CPU with the same losses, gradient norms and adapter weights as the Python
path (from_pretrained with the same BitsAndBytesConfig, prepare_model_for_kbit_training, get_peft_model,
LazyTrainer); the quantization section's mistakes are one error each, named with the fix, before any model loads."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lazytrain_hf import cli

from .conftest import GSM8K_DIR, requires_gsm8k

peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

REPO = Path(__file__).resolve().parents[1]
QLORA_RECIPE = REPO / "recipes" / "llama3-70b_qlora_24gib.yaml"
#: the shipped QLoRA recipe on a tiny model with the real Qwen vocabulary, fp32 compute, on the CPU, for two steps
#: (model.dtype per test)
_TINY = ["model.quantization.bnb_4bit_compute_dtype=float32", "tokenizer=qwen-offline",
         "training.bf16=false", "training.use_cpu=true", f"data.source={GSM8K_DIR}", "training.max_steps=2",
         "data.train_limit=16", "data.max_length=96", "training.per_device_train_batch_size=2",
         "training.gradient_accumulation_steps=2", "training.save_steps=1", "training.logging_steps=1",
         "training.seed=0", "peft.r=4", "peft.lora_dropout=0.0"]


def _sets(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def _bank_checkpoint(path: Path) -> Path:
    """qwen3-tiny-vocab in float32 with the registry's seed-0 random values (`quantized.random_bank`), saved
    unquantized: what the registry's 4-bit build quantizes."""
    from transformers import AutoModelForCausalLM

    from lazytrain_hf.models import resolve_config
    from lazytrain_hf.quantized import fill_random_, random_bank, rebuild_rotary

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(resolve_config("qwen3-tiny-vocab"), dtype=torch.float32)
    model = model.to_empty(device="cpu")
    bank = random_bank(torch.float32, seed=0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            fill_random_(n, p, bank)
        rebuild_rotary(model)
    model.tie_weights()
    model.save_pretrained(str(path))
    return path


def _python_run(recipe, checkpoint: Path, out: Path):
    """The Python path of docs/lora.md on the recipe's values: the base from `checkpoint` with from_pretrained in 4
    bits, prepared for k-bit training, wrapped with the recipe's LoraConfig, trained by LazyTrainer on the same
    data. Returns the trainer."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, set_seed

    from lazytrain_hf import LazyTrainer, LazyTrainingArguments
    from lazytrain_hf.data import load_math_dataset, load_tokenizer, make_collator, tokenize_for_sft

    d = recipe.data
    tokenizer = load_tokenizer("qwen-offline")
    train_ds = tokenize_for_sft(load_math_dataset(d.source, d.train_split, limit=d.train_limit, seed=d.seed),
                                tokenizer, d.max_length)
    base = AutoModelForCausalLM.from_pretrained(str(checkpoint), quantization_config=BitsAndBytesConfig(
        **recipe.model.quantization), device_map="cpu", dtype=getattr(torch, recipe.model.dtype))
    assert sum(type(p).__name__ == "Params4bit" for p in base.parameters()) == 7 * base.config.num_hidden_layers
    base = peft.prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    set_seed(0)
    model = peft.get_peft_model(base, peft.LoraConfig(**recipe.peft))
    args = LazyTrainingArguments(**{**recipe.training, "output_dir": str(out)}, lazytrain_config=recipe.lazytrain)
    trainer = LazyTrainer(model=model, args=args, train_dataset=train_ds, processing_class=tokenizer,
                          data_collator=make_collator(tokenizer, pad_to_multiple_of=8))
    trainer.train()
    return trainer


@requires_gsm8k
@pytest.mark.parametrize("source", ["registry", "local"])
def test_qlora_recipe_trains_on_the_cpu_as_the_python_path(tmp_path, source):
    """registry (float32): the CLI builds qwen3-tiny-vocab in 4 bits from random values (seed 0), never whole in
    float32; the Python path quantizes those same values, saved, with from_pretrained. local (bfloat16): both load
    one saved checkpoint with from_pretrained, and prepare_model_for_kbit_training casts the embedding, norms and
    LM head to float32. Either way the two runs do the same arithmetic: equal losses, gradient norms and adapters."""
    from safetensors.torch import load_file

    from lazytrain_hf.recipe import load_recipe

    checkpoint = _bank_checkpoint(tmp_path / "base")
    out = tmp_path / "out"
    sets = _TINY + [f"model.name_or_path={'qwen3-tiny-vocab' if source == 'registry' else checkpoint}",
                    f"model.dtype={'float32' if source == 'registry' else 'bfloat16'}", f"training.output_dir={out}"]
    # the registry run also evaluates (generation with the trained 4-bit model)
    sets += ["data.test_limit=2", "eval.max_new_tokens=4"] if source == "registry" else ["data.test_limit=0"]
    assert cli.main(["train", "--config", str(QLORA_RECIPE), *_sets(sets)]) == 0
    final = out / "final"
    assert (final / "adapter_model.safetensors").is_file() and not (final / "model.safetensors").exists()
    adapter_cfg = json.loads((final / "adapter_config.json").read_text())
    assert adapter_cfg["r"] == 4 and len(adapter_cfg["target_modules"]) == 7  # all-linear: q k v o gate up down
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert ("eval" in metrics) == (source == "registry")

    recipe = load_recipe(QLORA_RECIPE, sets)
    assert recipe.model.quantization == dict(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                             bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype="float32")
    trainer = _python_run(recipe, checkpoint, tmp_path / "py")
    for key in ("loss", "grad_norm"):
        got = [h[key] for h in metrics["log_history"] if key in h]
        want = [h[key] for h in trainer.state.log_history if key in h]
        assert len(got) == 2 and got == want, (key, got, want)
    saved = load_file(str(final / "adapter_model.safetensors"))
    ref = peft.get_peft_model_state_dict(trainer.model)
    assert saved.keys() == ref.keys() and len(saved) == 2 * 7 * 4
    for name, t in saved.items():
        assert torch.equal(t, ref[name].detach().cpu()), name
    assert all(t.abs().sum() > 0 for k, t in saved.items() if "lora_B" in k), "the adapters trained (B starts at 0)"


def test_registry_build_follows_the_seed_and_quantizes_on_the_cpu_without_cuda():
    from lazytrain_hf.models import load_model
    from lazytrain_hf.streaming.quant import is_4bit

    quant = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                 bnb_4bit_compute_dtype="bfloat16")
    a, b, c = (load_model("llama-tiny", "bfloat16", seed=s, quantization=quant) for s in (0, 0, 1))
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    four = [n for n, p in pa.items() if is_4bit(p)]
    assert len(four) == 7 * a.config.num_hidden_layers and a.is_loaded_in_4bit
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert not any(torch.equal(pa[n], pc[n]) for n in four)
    assert all(t.device.type == "cpu" for t in (*a.parameters(), *a.buffers()))


def _quantized_recipe_errors():
    return [
        ("model.quantization.bnb_4bit_quant_typ=nf4",
         r"model\.quantization\.bnb_4bit_quant_typ'\]: not transformers\.BitsAndBytesConfig fields \(\[.*"
         r"'bnb_4bit_quant_type'.*\]\) \(did you mean model\.quantization\.bnb_4bit_quant_type\?\)"),
        ("model.quantization.load_in_8bit=true",
         r"load_in_8bit: the executor cannot stream bitsandbytes 8-bit weights; load the base in 4 bits "
         r"\(load_in_4bit: true, load_in_8bit: false\) or in bfloat16 \(drop model\.quantization\).*policy 'none'"),
        ("peft=null", r"a 4-bit base trains adapters only.*add a peft section"),
        ("peft.merge_on_save=true", r"peft\.merge_on_save with model\.quantization.*set peft\.merge_on_save: false"),
        ("model.quantization.load_in_4bit=false", r"model\.quantization needs load_in_4bit: true"),
        ("model.quantization.bnb_4bit_quant_type=nf5", r"bnb_4bit_quant_type must be one of \['nf4', 'fp4'\]"),
        ("model.quantization.bnb_4bit_compute_dtype=bf16", r"bnb_4bit_compute_dtype must be one of \['bfloat16'"),
        ("model.quantization.bnb_4bit_use_double_quant=maybe", r"bnb_4bit_use_double_quant must be true or false"),
    ]


@pytest.fixture
def no_model_load(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the model was loaded before the input error was raised")
    monkeypatch.setattr("lazytrain_hf.models.load_model", boom)


@pytest.mark.parametrize("override, match", _quantized_recipe_errors())
def test_quantization_mistakes_are_one_clear_error_before_the_model_loads(capsys, no_model_load, override, match):
    assert cli.main(["train", "--config", str(QLORA_RECIPE), "--set", override]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and err.count("\n  - ") == 1 and re.search(match, err), err


def test_without_bitsandbytes_the_recipe_and_the_loader_name_the_install(capsys, no_model_load, monkeypatch):
    from lazytrain_hf.quantized import require_bitsandbytes

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # importing it raises ImportError
    assert cli.main(["train", "--config", str(QLORA_RECIPE)]) == 2
    err = capsys.readouterr().err
    assert "model.quantization needs bitsandbytes, which is not installed: pip install bitsandbytes" in err, err
    with pytest.raises(ValueError, match="needs bitsandbytes, which is not importable .*: pip install bitsandbytes"):
        require_bitsandbytes()


def test_quantization_section_is_read_and_overridden():
    from lazytrain_hf.recipe import load_recipe

    recipe = load_recipe(QLORA_RECIPE, ["model.quantization.bnb_4bit_use_double_quant=no",
                                        "model.quantization.bnb_4bit_quant_type=fp4"])
    assert recipe.model.quantization == dict(load_in_4bit=True, bnb_4bit_quant_type="fp4",
                                             bnb_4bit_use_double_quant=False, bnb_4bit_compute_dtype="bfloat16")
    assert (recipe.model.name_or_path, recipe.peft["r"], recipe.merge_on_save) == ("llama3-70b", 16, False)
    assert (recipe.training["per_device_train_batch_size"], recipe.training["gradient_accumulation_steps"]) == (16, 2)
    assert recipe.lazytrain["gpu_memory_budget"] == "24GiB"
    assert load_recipe(QLORA_RECIPE, ["model.quantization=null"]).model.quantization is None  # a bf16 base
    assert load_recipe(REPO / "recipes" / "qwen2.5-32b_lora_24gib.yaml").model.quantization is None


def test_bnb_config_fields_are_transformers_own():
    """Read from transformers' source without importing it; they are BitsAndBytesConfig's keyword arguments."""
    from transformers import BitsAndBytesConfig

    from lazytrain_hf.recipe import bnb_config_fields

    params = inspect.signature(BitsAndBytesConfig.__init__).parameters.values()
    assert bnb_config_fields() == {p.name for p in params if p.name != "self" and p.kind is not p.VAR_KEYWORD}
    assert {"load_in_4bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant"} <= bnb_config_fields()


def test_unknown_quantization_key_fails_without_importing_torch_transformers_or_bitsandbytes():
    code = f"""
        import sys
        from lazytrain_hf import cli
        code = cli.main(["train", "--config", {str(QLORA_RECIPE)!r}, "--set", "model.quantization.load_in_4bits=true"])
        print(code, *(m in sys.modules for m in ("torch", "transformers", "bitsandbytes", "peft")))
    """
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert res.stdout.split() == ["2", "False", "False", "False", "False"], res.stdout + res.stderr
    assert "did you mean model.quantization.load_in_4bit?" in res.stderr


def test_host_check_counts_the_4bit_base(monkeypatch):
    """Before anything is built: the 70B recipe's base counts its 4-bit bytes (packed weights and quantization state,
    `quantized_host_bytes`) and the other parameters in float32 (after prepare_model_for_kbit_training), 40.7 GiB,
    not its 131 GiB in bfloat16; a limit below that is one error naming the need."""
    from lazytrain_hf.hf import preflight
    from lazytrain_hf.models import resolve_config
    from lazytrain_hf.profiling.limits import Limit, ResourceLimitError
    from lazytrain_hf.quantized import quantized_host_bytes
    from lazytrain_hf.recipe import load_recipe

    quant = load_recipe(QLORA_RECIPE).model.quantization
    config = resolve_config("llama3-70b")
    q = quantized_host_bytes(config, quant, "bfloat16")
    need = q["packed"] + q["state"] + 4 * q["other_params"]
    assert 40 << 30 < need < 41 << 30 and q["four_bit_params"] > 0.97 * (q["four_bit_params"] + q["other_params"])
    monkeypatch.setattr(preflight, "host_limit_per_rank", lambda: Limit(48 << 30, "a test limit"))
    preflight.check_host_before_building(config, "bfloat16", "llama3-70b", quantization=quant)
    with pytest.raises(ResourceLimitError, match=r"building 'llama3-70b' \(70\.55 B parameters in bfloat16\)"):
        preflight.check_host_before_building(config, "bfloat16", "llama3-70b")
    monkeypatch.setattr(preflight, "host_limit_per_rank", lambda: Limit(32 << 30, "a test limit"))
    with pytest.raises(ResourceLimitError, match=r"building 'llama3-70b' \(70\.55 B parameters, 68\.45 B of them in "
                                                 r"4 bits, the rest in float32\) needs 40\.72 GiB"):
        preflight.check_host_before_building(config, "bfloat16", "llama3-70b", quantization=quant)

