"""`lazytrain-hf train`: the main job end to end on a tiny budget, and one clear error per bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from lazytrain_hf import cli

from .conftest import GSM8K_DIR, requires_gsm8k

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "cpu_default.yaml"


def _small(tmp_path: Path) -> list[str]:
    return ["--set", f"training.output_dir={tmp_path / 'out'}", "--set", f"data.source={GSM8K_DIR}",
            "--set", "training.max_steps=3", "--set", "data.train_limit=24", "--set", "data.test_limit=4",
            "--set", "eval.max_new_tokens=8", "--set", "training.save_steps=2", "--set", "training.logging_steps=1"]


@requires_gsm8k
def test_main_job_end_to_end(tmp_path, capsys):
    assert cli.main(["train", "--config", str(RECIPE), *_small(tmp_path)]) == 0
    final = tmp_path / "out" / "final"
    model, info = AutoModelForCausalLM.from_pretrained(str(final), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied weights still tied
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert 0.0 <= metrics["eval"]["exact_match"] <= 1.0 and metrics["eval"]["num_examples"] == 4
    losses = [h["loss"] for h in metrics["log_history"] if "loss" in h]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert list((tmp_path / "out").glob("checkpoint-*/lazytrain_schedule.json")), "schedule saved with checkpoints"
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["checkpoint"] == str(final)


@pytest.fixture
def no_model_load(monkeypatch):
    """Errors must come before any model is loaded."""
    def boom(*a, **k):
        raise AssertionError("the model was loaded before the input error was raised")
    monkeypatch.setattr("lazytrain_hf.models.load_model", boom)


def _write_recipe(tmp_path: Path, **changes) -> Path:
    raw = yaml.safe_load(RECIPE.read_text())
    raw["training"]["output_dir"] = str(tmp_path / "out")
    raw["data"]["source"] = str(GSM8K_DIR)
    for dotted, value in changes.items():
        sec, key = dotted.split("__")
        raw.setdefault(sec, {})
        if isinstance(raw[sec], str):  # the short form `tokenizer: NAME`
            raw[sec] = {"name_or_path": raw[sec]}
        if value is None:
            raw[sec].pop(key, None)
        else:
            raw[sec][key] = value
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _bad_jsonl(tmp_path: Path) -> str:
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"text": "hello", "label": 1}) + "\n")
    return str(p)


@requires_gsm8k
@pytest.mark.parametrize("changes, match", [
    ({"training__learning_rat": 1e-3}, r"training\.learning_rat"),
    ({"model__nam": "x"}, r"model\.nam"),
    ({"lazytrain__policy": "fastest"}, "policy must be one of"),
    ({"training__gradient_checkpointing": True}, "gradient_checkpointing=True conflicts"),
    ({"data__source": "/nonexistent/gsm8k"}, "/nonexistent/gsm8k"),
    ({"model__name_or_path": "gpt2-tiny-unknown-arch"}, None),
    # a misspelt tokenizer: no Hub request (before: ~64 s of huggingface_hub retries without network)
    ({"tokenizer__name_or_path": "qwen-ofline"}, r"tokenizer\.name_or_path: .*did you mean 'qwen-offline'"),
    # every example filtered out by the length limit: the data set and the recipe key named
    ({"data__max_length": 8, "data__train_limit": 16},
     r"data\.source '.*gsm8k' \(split 'train'\): .*all 16 examples were dropped.*raise data\.max_length \(now 8\)"),
])
def test_bad_input_one_clear_error(tmp_path, capsys, no_model_load, changes, match):
    recipe = _write_recipe(tmp_path, **changes)
    code = cli.main(["train", "--config", str(recipe)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("error:") == 1
    if match:
        import re
        assert re.search(match, err), err


@requires_gsm8k
def test_device_cuda_on_a_cpu_torch_is_one_error_before_the_model_loads(tmp_path, capsys, no_model_load, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    recipe = _write_recipe(tmp_path, lazytrain__device="cuda")
    assert cli.main(["train", "--config", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "lazytrain.device" in err and "set device to 'cpu'" in err, err
    assert "CUDA build of torch" in err and "AssertionError" not in err, err


@requires_gsm8k
def test_data_with_neither_schema(tmp_path, capsys, no_model_load):
    recipe = _write_recipe(tmp_path)
    assert cli.main(["train", "--config", str(recipe), "--set", f"data.source={_bad_jsonl(tmp_path)}"]) == 2
    err = capsys.readouterr().err
    assert "question" in err and "query" in err, err


@requires_gsm8k
@pytest.mark.parametrize("key", ["packing", "padding_free"])
def test_a_packed_recipe_trains(tmp_path, key):
    small = _small(tmp_path) + ["--set", f"data.{key}=true", "--set", "data.test_limit=0",
                                "--set", "training.save_strategy=no"]
    assert cli.main(["train", "--config", str(RECIPE), *small]) == 0
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    losses = [h["loss"] for h in metrics["log_history"] if "loss" in h]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))


@requires_gsm8k
def test_packing_a_linear_attention_model_is_refused_before_the_model_loads(tmp_path, capsys, no_model_load):
    recipe = _write_recipe(tmp_path, model__name_or_path="qwen3.5-tiny", data__packing=True)
    assert cli.main(["train", "--config", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "data.packing: true" in err and "Gated DeltaNet" in err, err
    assert "data.packing and data.padding_free: false" in err, err


def test_packing_and_padding_free_together_are_refused(tmp_path, capsys, no_model_load):
    recipe = _write_recipe(tmp_path, data__packing=True, data__padding_free=True)
    assert cli.main(["train", "--config", str(recipe)]) == 2
    assert "set one of them to false" in capsys.readouterr().err


def test_unsupported_architecture_before_training(tmp_path, capsys, no_model_load, monkeypatch):
    from transformers import GPT2Config

    monkeypatch.setattr("lazytrain_hf.models.resolve_config", lambda *a, **k: GPT2Config())
    data = tmp_path / "data"  # a local GSM8K-format folder: the data check passes wherever the shared copy is missing
    data.mkdir()
    row = json.dumps({"question": "1 + 1?", "answer": "2\n#### 2"}) + "\n"
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text(row * 4)
    recipe = _write_recipe(tmp_path, data__source=str(data))
    assert cli.main(["train", "--config", str(recipe)]) == 2
    assert "does not support model_type='gpt2'" in capsys.readouterr().err


def test_missing_recipe(capsys):
    assert cli.main(["train", "--config", "recipes/nope.yaml"]) == 2
    assert "no recipe at" in capsys.readouterr().err


@requires_gsm8k
@pytest.mark.parametrize("override, match", [
    ("tokenizer.name_or_path=/nonexistent/tok", "/nonexistent/tok"),
    ("data.max_length=abc", r"data\.max_length must be int"),
    ("model.dtype=fp32", r"model\.dtype must be one of"),
    ("lazytrain=/nonexistent/lazy.yaml", "no YAML file"),
])
def test_override_mistakes_are_one_clear_error(tmp_path, capsys, no_model_load, override, match):
    import re

    recipe = _write_recipe(tmp_path)
    assert cli.main(["train", "--config", str(recipe), "--set", override]) == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err


@pytest.mark.parametrize("recipe", sorted(p.name for p in (Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml")))
def test_every_shipped_recipe_validates(recipe):
    """Each recipe in recipes/ passes the loader's checks against the installed transformers (three of them named
    `warmup_ratio`, which transformers 5 removed: they failed before any training started)."""
    from lazytrain_hf.recipe import load_recipe

    load_recipe(Path(__file__).resolve().parents[1] / "recipes" / recipe)


def test_probe_command_defaults_and_bad_device(capsys, monkeypatch):
    """`lazytrain-hf probe` with no options (--device auto) reports the profile (here, without CUDA: the defaults,
    measured false) instead of passing "auto" to torch.device; an unknown device is one clear error."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["probe"]) == 0
    prof = json.loads(capsys.readouterr().out)
    assert prof["measured"] is False and prof["h2d_gbps"] > 0
    for bad in ("banana", "mps"):
        assert cli.main(["probe", "--device", bad]) == 2
        assert "--device must be cuda, cuda:N, cpu or auto" in capsys.readouterr().err


@requires_gsm8k
def test_sigterm_exits_143_with_a_checkpoint_and_resume_last_continues_exactly(tmp_path, monkeypatch, capsys):
    import os
    import signal

    from lazytrain_hf.hf.checkpoint import checkpoint_problems
    from lazytrain_hf.hf.longrun import LongRunCallback

    common = ["train", "--config", str(RECIPE), "--set", f"data.source={GSM8K_DIR}", "--set", "training.max_steps=4",
              "--set", "data.train_limit=24", "--set", "data.test_limit=2", "--set", "eval.max_new_tokens=4",
              "--set", "training.save_steps=100", "--set", "training.logging_steps=1"]
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert cli.main([*common, "--set", f"training.output_dir={ref}"]) == 0
    want = {h["step"]: h["loss"] for h in json.loads((ref / "metrics.json").read_text())["log_history"] if "loss" in h}

    def term_at_step_2(self, args, state, control, **kw):
        if state.global_step == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    with monkeypatch.context() as m:
        m.setattr(LongRunCallback, "on_step_begin", term_at_step_2, raising=False)
        assert cli.main([*common, "--set", f"training.output_dir={out}"]) == 143
    assert not (out / "final").exists() and not checkpoint_problems(str(out / "checkpoint-2"))
    assert cli.main([*common, "--set", f"training.output_dir={out}", "--resume", "last"]) == 0
    got = {h["step"]: h["loss"] for h in json.loads((out / "metrics.json").read_text())["log_history"]
           if "loss" in h and h["step"] > 2}
    assert sorted(got) == [3, 4]
    assert [got[s] for s in (3, 4)] == pytest.approx([want[s] for s in (3, 4)], rel=1e-6)
    # resuming a run that already reached max_steps is refused before it overwrites what that run wrote
    done = out / "checkpoint-done"
    done.mkdir()
    (done / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    before = (out / "metrics.json").read_bytes()
    capsys.readouterr()
    assert cli.main([*common, "--set", f"training.output_dir={out}", "--resume", str(done)]) == 2
    err = capsys.readouterr().err
    assert "already reached step 4 of training.max_steps=4" in err and "--set training.max_steps=" in err, err
    assert (out / "metrics.json").read_bytes() == before
