"""The harness's QLoRA system (lazytrain_qlora) on the CPU: the 4-bit base built module by module equals what
transformers' from_pretrained with the same BitsAndBytesConfig gives for the same bf16 weights (packed data and
quantization state), holds one bf16 weight at a time, and its host bytes are what `quantized_host_bytes` counts; the
qlora-smoke suite trains it through LazyTrainer with logical parameter counts; the lora suite's 4-bit row; the
report's QLoRA targets."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch

from .conftest import requires_gsm8k

bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")


def _host_bytes(model) -> int:
    from lazytrain_hf.streaming.quant import quant_tensors

    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() * p.element_size() + sum(t.numel() * t.element_size() for _, t in quant_tensors(p))
               for p in params)


@pytest.mark.parametrize("arch", ["llama-tiny", "qwen3-tiny"])  # untied / tied embedding and LM head
def test_quantized_build_equals_from_pretrained_with_the_same_bitsandbytes_config(tmp_path, arch):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from benchmarks.common import fast_random_model, logical_numel, quantized_random_model
    from benchmarks.systems import QLORA_QUANT
    from lazytrain_hf.streaming.quant import is_4bit, quant_tensors

    built = quantized_random_model(arch, QLORA_QUANT)
    fast_random_model(arch).save_pretrained(str(tmp_path / "bf16"))  # the same bf16 weights, on disk
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), quantization_config=BitsAndBytesConfig(
        **QLORA_QUANT), device_map="cpu", dtype=torch.bfloat16)

    assert [(n, type(m)) for n, m in built.named_modules()] == [(n, type(m)) for n, m in ref.named_modules()]
    got, want = dict(built.named_parameters()), dict(ref.named_parameters())
    assert got.keys() == want.keys()
    four = [n for n, p in got.items() if is_4bit(p)]
    assert len(four) == 7 * built.config.num_hidden_layers  # every decoder projection; the LM head kept in bf16
    for name, p in got.items():
        q = want[name]
        assert (type(p), p.dtype, p.shape, p.device.type, p.requires_grad) == \
            (type(q), q.dtype, q.shape, "cpu", q.requires_grad), name
        assert torch.equal(p, q), name  # packed bytes, or the bf16 values
        if is_4bit(p):
            assert p.quant_state == q.quant_state, name  # shape, dtype, block sizes, type, nesting, tensors
            paths = [k for k, _ in quant_tensors(p)]
            assert paths == [k for k, _ in quant_tensors(q)] and "state2.absmax" in paths, name
            for (k, a), (_, b) in zip(quant_tensors(p), quant_tensors(q), strict=True):
                assert a.dtype == b.dtype and a.device.type == "cpu" and torch.equal(a, b), (name, k)
            module = built.get_submodule(name.removesuffix(".weight"))
            assert p.module is module and module.quant_state is p.quant_state
            assert {k: v for k, v in vars(p).items() if k not in ("quant_state", "module")} == \
                {k: v for k, v in vars(q).items() if k not in ("quant_state", "module")}, name
            assert logical_numel(p) == 2 * p.numel() == q.quant_state.shape.numel()
    if built.config.tie_word_embeddings:
        assert built.lm_head.weight is built.model.embed_tokens.weight
    for attr in ("is_quantized", "is_loaded_in_4bit", "quantization_method", "training"):
        assert getattr(built, attr) == getattr(ref, attr), attr
    assert type(built.hf_quantizer) is type(ref.hf_quantizer)
    assert built.config.quantization_config.to_dict() == ref.config.quantization_config.to_dict()
    assert not [n for n, t in (*built.named_parameters(), *built.named_buffers()) if t.device.type != "cpu"]
    rotary = built.model.rotary_emb
    assert torch.equal(rotary.inv_freq, ref.model.rotary_emb.inv_freq)


def test_quantized_build_holds_one_bf16_weight_at_a_time_and_counts_its_host_bytes(monkeypatch):
    """Each decoder weight is filled in bf16 only after the previous one's bf16 values are gone (so the host never
    holds the bf16 model: a 70B in bf16 would not fit a 128 GiB host), and the built model's host bytes equal
    `quantized_host_bytes`' count from the meta skeleton (the arithmetic behind the 70B estimate)."""
    from benchmarks import common
    from benchmarks.systems import QLORA_QUANT
    from lazytrain_hf import quantized

    live: list[weakref.ref] = []
    overlaps: list[str] = []
    fill = quantized.fill_random_

    def spy(name: str, p: torch.Tensor, bank: torch.Tensor) -> None:
        if ".layers." in name and p.dim() == 2:  # freed by reference counting, no collection needed
            if any(r() is not None for r in live):
                overlaps.append(name)
            live.append(weakref.ref(p))
        fill(name, p, bank)

    monkeypatch.setattr(quantized, "fill_random_", spy)
    model = common.quantized_random_model("llama-tiny:layers=3", QLORA_QUANT)
    gc.collect()
    assert len(live) == 7 * 3 and not overlaps and all(r() is None for r in live)
    for quant in (QLORA_QUANT, dict(QLORA_QUANT, bnb_4bit_use_double_quant=False, bnb_4bit_quant_type="fp4")):
        model = common.quantized_random_model("llama-tiny", quant)
        count = common.quantized_host_bytes("llama-tiny", quant)
        assert _host_bytes(model) == count["total"]
        assert count["four_bit_params"] == sum(common.logical_numel(p) for p in model.parameters()
                                               if type(p).__name__ == "Params4bit")
    with pytest.raises(ValueError, match="load_in_4bit"):
        common.quantized_random_model("llama-tiny", {"load_in_8bit": True})


def _tiny_llama_lora_flops(config, lora: dict, tokens: int, seq_len: int, fwd: float) -> tuple[float, float, int, int]:
    """(executed, model FLOPs, trainable, base parameters) of one step of LoRA on llama-tiny from its config, every
    4-bit weight counted by its original shape: q / k / v / o, gate / up / down, two RMSNorms per layer; rank-r
    adapters on every projection; an untied embedding and LM head (the head frozen)."""
    H, inter, L, V = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    hd = H // heads
    shapes = [(H, heads * hd), (H, kv * hd), (H, kv * hd), (heads * hd, H), (H, inter), (H, inter), (inter, H)]
    base_layer = sum(i * o for i, o in shapes) + 2 * H
    adapters = sum(lora["r"] * (i + o) for i, o in shapes)
    n_layer = base_layer + adapters
    attn = 2 * tokens * seq_len * heads * hd
    executed = L * (fwd * (2 * n_layer * tokens + attn) + 2 * n_layer * tokens + 2 * adapters * tokens + 2 * attn) \
        + 4 * V * H * tokens
    base = L * base_layer + 2 * V * H + H
    return executed, (4 * base + 6 * L * adapters) * tokens, L * adapters, base


@requires_gsm8k
def test_qlora_smoke_suite_trains_the_4bit_base_and_counts_logical_parameters(tmp_path):
    """lazytrain_qlora end to end on the CPU (llama-tiny in nf4 with double quantization, seq 32, 128 tokens per
    optimizer step: batch 2 x 2 micro-batches): the row is ok, records the quantization and the build, counts
    parameters and FLOPs with each 4-bit weight at its original shape, and the report shows the QLoRA table and
    targets."""
    from benchmarks import report, run
    from benchmarks.common import GIB
    from benchmarks.systems import LORA_DEFAULTS
    from lazytrain_hf.models import resolve_config

    out = tmp_path / "qlora.json"
    run.main(["--suite", "qlora-smoke", "--out", str(out)])
    doc = json.loads(out.read_text())
    (r,) = doc["rows"]
    suite = run.SUITES["qlora-smoke"]
    e = r["extra"]
    assert (r["system"], r["batch_size"], r["status"]) == ("lazytrain_qlora", 2, "ok"), r["reason"]
    assert e["gradient_accumulation_steps"] == 2 and e["tokens_per_step"] == suite["tokens_per_step"]
    assert e["rows_per_step"] == [4] * (suite["steps"] + suite["warmup"])
    assert e["lora"] == LORA_DEFAULTS and r["tflops_6nd"] is None and e["lora_of"] == "lazytrain_milp"
    assert e["lazytrain_config"] == {"policy": "milp"} and e["configuration"] == "product defaults"
    assert e["quantization"] == {"quant_type": "nf4", "double_quant": True, "compute_dtype": "bfloat16",
                                 "blocksize": 64, "nested_blocksize": 256, "quant_storage": "uint8",
                                 "quantized_on": "cpu", "four_bit_params": e["quantization"]["four_bit_params"],
                                 "prepare_model_for_kbit_training": True}
    b = e["base_build"]
    assert b["build_s"] > 0 and b["peak_rss_gib"] > b["base_host_gib"] > 0
    config = resolve_config("llama-tiny")
    executed, model_flops, trainable, base = _tiny_llama_lora_flops(config, LORA_DEFAULTS, e["tokens_per_step"],
                                                                     suite["seq_len"], e["fwd_passes_per_layer"])
    assert e["quantization"]["four_bit_params"] == base - 2 * config.vocab_size * config.hidden_size \
        - (2 * config.num_hidden_layers + 1) * config.hidden_size  # every decoder projection, nothing else
    assert (e["trainable_params"], e["base_params"], e["total_params"], r["params"]) == \
        (trainable, base, base + trainable, base + trainable)
    assert r["tflops_executed"] * 1e12 * r["step_s_median"] == pytest.approx(executed, rel=1e-9)
    assert e["tflops_model"] * 1e12 * r["step_s_median"] == pytest.approx(model_flops, rel=1e-9)
    base_rss = r["peak_host_rss_gib"] * GIB - e["cpu_tier_activation_gib"] * GIB
    assert e["host_bytes_per_base_param"] == pytest.approx(base_rss / base)

    md, _ = report.main([str(out), "--md", str(tmp_path / "B.md"), "--png", str(tmp_path / "p.png")])
    text = md.read_text()
    assert "## llama-tiny, GPU cap uncapped (QLoRA)" in text and "| lazytrain_qlora | 2 | 2 | 128 | ok |" in text
    assert "nf4, double quant, bf16 compute, block 64, quantized on cpu, built in" in text
    assert "a 4-bit weight counted by its original shape" in text and "## Targets: QLoRA on llama-tiny" in text
    assert "| 24 GiB: lazytrain_qlora (nf4, LoRA r 16 on all linear layers, >= 32k tokens per optimizer step) >= " \
           "800 tokens/s | - | not measured |" in text
    assert "## Targets: LoRA on" not in text  # the LoRA (bf16 base) targets are not the QLoRA rows'


def test_lora_suite_runs_qlora_on_the_70b_shape(tmp_path):
    """The lora suite's 4-bit row as the GPU runs it: lazytrain_qlora alone on the Llama-3-70B shape under 24 GiB,
    32k tokens per optimizer step in two micro-batches of 16, the bf16 rows' adapters and LazyTrainer (product
    defaults), nf4 with double quantization and bf16 compute; it starts only with a whole call's budget left."""
    from benchmarks import run
    from benchmarks.systems import LORA_DEFAULTS, QLORA_QUANT, build_args, unsupported_reason
    from lazytrain_hf.models import resolve_config

    suite = run.SUITES["lora"]
    assert "llama3-70b" in suite["models"] and resolve_config("llama3-70b").model_type == "llama"
    assert run._systems_of(suite, "llama3-70b", suite["systems"]) == ["lazytrain_qlora"]
    assert "lazytrain_qlora" not in run._systems_of(suite, "qwen2.5-32b", suite["systems"])
    assert (suite["seq_len"], suite["tokens_per_step"]) == (1024, 32768)
    assert suite["batch"][24]["lazytrain_qlora"] == [16] and suite["batch"][None]["lazytrain_qlora"] == []
    args = run.parse_args(["--suite", "lora", "--out", str(tmp_path / "x.json"), "--device", "cpu"])
    assert run._min_start(args, suite, 24, "lazytrain_qlora") == 500 < suite["timeout"]["lazytrain_qlora"] <= 540
    assert run._min_start(args, suite, 24, "lazytrain_lora") == suite["row_s"][24]
    assert all("lazytrain_qlora" not in run.SUITES[s].get("systems", run.ORDER) for s in run.SUITES
               if s not in ("lora", "qlora-smoke"))
    spec = run._spec(args, suite, "lazytrain_qlora", "llama3-70b", 24, [16])
    assert spec["lora"] == LORA_DEFAULTS and spec["quantization"] == QLORA_QUANT == dict(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype="bfloat16")
    assert spec["device"] == "cpu" and args.device == "cpu"  # the suite's cuda: the worker quantizes on the GPU
    ta, extra = build_args("lazytrain_qlora", spec, 16, 10)
    assert ta.gradient_accumulation_steps == 2 and ta.bf16
    assert extra["lazytrain_config"] == {"policy": "milp", "gpu_memory_budget": "24GiB"}
    assert str(getattr(ta.optim, "value", ta.optim)) == "lazytrain_hybrid8" and extra["lora_of"] == "lazytrain_milp"
    assert unsupported_reason("lazytrain_qlora", "cpu") is None
    run.parse_args(["--suite", "qlora-smoke", "--out", str(tmp_path / "y.json")])


def test_qlora_is_unsupported_without_bitsandbytes(monkeypatch):
    import sys

    from benchmarks.systems import unsupported_reason

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import raises ImportError
    assert unsupported_reason("lazytrain_qlora", "cuda").startswith("bitsandbytes not importable")
    assert unsupported_reason("lazytrain_lora", "cuda") is None


def _qrow(cap, status="ok", tokens_per_s=900.0, host=0.65, quant_type="nf4", r=16, tokens=32768, B=32):
    from benchmarks.common import row
    from benchmarks.systems import LORA_DEFAULTS

    ok = status == "ok"
    return row(system="lazytrain_qlora", model="llama3-70b", gpu_cap_gib=cap, batch_size=B, seq_len=1024,
               status=status, tokens_per_s=tokens_per_s if ok else None, step_s_median=1.0 if ok else None,
               extra={"lora": dict(LORA_DEFAULTS, r=r), "quantization": {"quant_type": quant_type},
                      "tokens_per_step": tokens, "gradient_accumulation_steps": 1, "base_params": 70_553_706_496,
                      **({"host_bytes_per_base_param": host} if ok else {})})


@pytest.mark.parametrize("rows, speed, host", [
    ([_qrow(24)], "met", "met"),
    ([_qrow(24, tokens_per_s=790.0, host=0.71)], "not met", "not met"),
    ([_qrow(24, tokens_per_s=2000.0, host=0.5), _qrow(24, B=16, tokens_per_s=700.0, host=0.72)], "met", "not met"),
    ([_qrow(24, quant_type="fp4"), _qrow(24, B=8, r=8), _qrow(24, B=4, tokens=16384)], "not measured", "met"),
    ([_qrow(24, status="timeout")], "not measured", "not measured"),
    ([_qrow(None)], "not measured", "met"),
])
def test_report_checks_the_qlora_targets(rows, speed, host):
    """>= 800 tokens/s counts only 24 GiB rows of the stated configuration (nf4, LoRA r 16 on all linear layers,
    >= 32k tokens per optimizer step), the best deciding; host bytes per base parameter <= 0.7 holds on every ok
    row (the largest deciding); without an ok row the rows' statuses are shown and the target is not measured."""
    from benchmarks.report import markdown, qlora_targets

    doc = {"suite": "lora", "date": "2026-12-03", "rows": rows}
    lines = qlora_targets(doc, "llama3-70b")
    assert lines[2].endswith(f"| {speed} |") and lines[3].endswith(f"| {host} |"), lines
    if any(r["status"] == "timeout" for r in rows):
        assert "24 GiB B=32: timeout" in lines[2]
    text = markdown(doc, None)
    assert "## Targets: QLoRA on llama3-70b" in text and "(QLoRA)" in text
