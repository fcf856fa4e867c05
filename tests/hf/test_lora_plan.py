"""A plan's fingerprint includes the frozen layout: a schedule planned for full training, loaded into a LoRA run with
`schedule_path`, is used with a warning naming the frozen layout (and the reverse); full-training fingerprints do not
depend on it."""

from __future__ import annotations

import logging

import pytest

from lazytrain_hf import LazyTrainer, LazyTrainingArguments
from lazytrain_hf.models import load_model
from lazytrain_hf.planning.schedule import differing_inputs, input_hashes, plan_fingerprint, plan_inputs

from .test_lora import _lora
from .test_trainer import EXACT, _collate, _common
from .tiny_data import tiny_dataset

peft = pytest.importorskip("peft")


def test_the_frozen_layout_is_a_plan_input_only_when_layers_are_frozen():
    args = (dict(model_type="qwen2", hidden_size=64), 2, 64, None, None, None, {"h2d_gbps": 50.0})
    full = plan_inputs(*args)
    assert "frozen" not in full and plan_inputs(*args, frozen=None) == full
    lora = plan_inputs(*args, frozen={"layers": [0, 1, 2, 3], "adapter_params": 1000})
    assert plan_fingerprint(lora) != plan_fingerprint(full)
    assert differing_inputs(input_hashes(full), lora) == ["frozen"]
    other = plan_inputs(*args, frozen={"layers": [0, 1, 2, 3], "adapter_params": 2000})  # another rank r
    assert differing_inputs(input_hashes(lora), other) == ["frozen"]


def test_a_4bit_bases_quantization_config_is_not_a_model_input():
    """The plan of a 4-bit base reads its bytes from the frozen layout: the config's quantization_config (which
    `lazytrain-hf plan --load-in-4bit` has no copy of) does not make a CLI plan another run's."""
    args = (2, 64, None, None, None, {"h2d_gbps": 50.0})
    plain = dict(model_type="llama", hidden_size=64)
    quantized = dict(plain, quantization_config={"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"})
    assert plan_inputs(quantized, *args)["model"] == plan_inputs(plain, *args)["model"]


def _trainer(tmp_path, name, model, **lazy):
    return LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, name, max_steps=1),
                                                               lazytrain_config={**EXACT, **lazy}),
                       train_dataset=tiny_dataset(model.config.vocab_size), data_collator=_collate)


def _schedule_of(tmp_path, name, model):
    tr = _trainer(tmp_path, name, model, policy="milp")
    tr.train()
    path = tmp_path / f"{name}.json"
    tr.executor.schedule.to_json(path)
    return tr, path


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "planned for another run"
            in r.getMessage()]


def test_a_full_training_schedule_loaded_into_a_lora_run_warns_naming_the_frozen_layout(tmp_path, caplog):
    full, full_path = _schedule_of(tmp_path, "full", load_model("qwen2-tiny", "float32", seed=3))
    lora, lora_path = _schedule_of(tmp_path, "lora", _lora("qwen2-tiny"))
    layout = lora.plans.request.frozen
    adapters = sum(p.numel() for p in lora.model.parameters() if p.requires_grad)
    # the fp32 test model: its hidden states and frozen embedding / head are 4 bytes an element
    assert layout == {"layers": [0, 1, 2, 3], "adapter_params": adapters, "embed": True, "head": True,
                      "hidden_itemsize": 4, "embed_itemsize": 4, "head_itemsize": 4}
    assert full.plans.request.frozen is None

    cases = [(_lora("qwen2-tiny"), full_path, True), (_lora("qwen2-tiny"), lora_path, False),
             (load_model("qwen2-tiny", "float32", seed=3), lora_path, True),
             (load_model("qwen2-tiny", "float32", seed=3), full_path, False)]
    for i, (model, path, warns) in enumerate(cases):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lazytrain_hf.hf.plans"):
            _trainer(tmp_path, f"run{i}", model, schedule_path=str(path)).train()
        got = _warnings(caplog)
        assert len(got) == int(warns), (i, got)
        if warns:
            assert "these inputs differ: frozen" in got[0], got[0]


@pytest.mark.parametrize("arch", ["qwen3-tiny", "qwen3.5-tiny"])
def test_plan_lora_costs_equal_the_trainers_on_the_real_model(tmp_path, arch):
    """`lazytrain-hf plan --lora-r` builds the frozen layout on the meta device (`planned_lora_costs`): it equals what
    the Trainer reads from the wrapped model (`model_frozen_costs`), so a plan's frozen input matches the run's; with
    --load-in-4bit the packed bytes equal bitsandbytes' own 4-bit layout (nf4, with and without double quantization)
    and the fp32 embedding, head and hidden states equal those of a base prepared as PEFT's QLoRA recipe does."""
    from lazytrain_hf.hf.peft_support import layout_of, model_frozen_costs, planned_lora_costs
    from lazytrain_hf.models import resolve_config

    config = resolve_config(arch)
    # (PEFT has no default target modules for Qwen3.5)
    for targets in ((None,) if arch == "qwen3-tiny" else ()) + ("all-linear", ["q_proj", "v_proj"]):
        real = peft.get_peft_model(load_model(arch, "bfloat16"),  # as a recipe loads it
                                   peft.LoraConfig(r=4, target_modules=targets, task_type="CAUSAL_LM"))
        planned = planned_lora_costs(config, 4, targets)
        assert planned == model_frozen_costs(real) and all(planned["frozen"]) and planned["adapter_params"] > 0
        assert layout_of(planned) == layout_of(model_frozen_costs(real))
    bnb = pytest.importorskip("bitsandbytes")  # noqa: F841  (its CPU backend quantizes the real base)
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    load_model(arch, "float32").save_pretrained(str(tmp_path / "base"))
    for double in (False, True):
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_use_double_quant=double,
                                   bnb_4bit_compute_dtype=torch.bfloat16)
        base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), quantization_config=quant,
                                                    device_map="cpu", dtype=torch.bfloat16)
        base = peft.prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)  # PEFT's QLoRA recipe
        real = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
        assert planned_lora_costs(config, 4, "all-linear", True, double) == model_frozen_costs(real)


def test_hidden_states_and_frozen_parts_are_priced_at_their_dtype(tmp_path, monkeypatch):
    """The plan prices the hidden states (boundaries, retained outputs) at the embedding's dtype and a frozen
    embedding / LM head at its own: 4 bytes for an fp32 base (as peft's prepare_model_for_kbit_training leaves a
    QLoRA one), 2 for bf16; and it profiles a frozen run's own layers under the executor's autocast."""
    import torch

    from lazytrain_hf.hf import plan
    from lazytrain_hf.hf.peft_support import frozen_costs
    from lazytrain_hf.profiling import analytic_cost_model

    seen = []
    real = plan.measured_layer_costs

    def spy(*a, **kw):
        seen.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr(plan, "measured_layer_costs", spy)
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        torch.manual_seed(0)
        model = peft.get_peft_model(load_model("qwen3-tiny", dtype, seed=3),
                                    peft.LoraConfig(r=4, target_modules="all-linear"))
        tr = _trainer(tmp_path, f"lora-{dtype}", model, policy="milp", resident_placement="gpu")
        tr.train()
        assert seen[-1]["layers"] is tr.executor.layers and seen[-1]["hidden_dtype"] == getattr(torch, dtype)
        req = tr.plans.request
        B, T, H = req.batch_size, req.seq_len, model.config.hidden_size
        costs = frozen_costs(tr.executor)
        resident, rows = plan.running_choices(tr)
        kw = dict(req.cost_model_kwargs(rows, resident), **costs)
        cm = analytic_cost_model(req.model, B, T, req.hardware, **kw)
        assert cm.act_bytes[0] == size * B * T * H
        assert plan.cost_model_for_trainer(tr, T)[0].act_bytes[0] == size * B * T * H
        bf16 = analytic_cost_model(req.model, B, T, req.hardware,
                                   **{k: v for k, v in kw.items() if not k.endswith("_itemsize")})
        embed = model.get_input_embeddings().weight.numel()
        head = model.get_output_embeddings().weight
        head = 0 if head is model.get_input_embeddings().weight else head.numel()
        assert cm.resident_bytes - bf16.resident_bytes == (size - 2) * (embed + head)
    full = _trainer(tmp_path, "full", load_model("qwen3-tiny", "float32", seed=3), policy="milp")
    full.train()
    assert seen[-1]["layers"] is None
