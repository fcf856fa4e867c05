"""Per-layer measurement hook (lazytrain_hf/profiling/layer_costs.py): a no-op without CUDA, a measured CostModel
with it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lazytrain_hf.models import resolve_config
from lazytrain_hf.profiling import LayerMeasurement, analytic_cost_model, apply_layer_measurements, measure_layer_costs

GIB = 1024**3


def test_no_cuda_is_a_no_op():
    assert measure_layer_costs(resolve_config("qwen3-tiny"), 2, 32, "cpu") is None
    if not torch.cuda.is_available():
        assert measure_layer_costs(resolve_config("qwen3-tiny"), 2, 32, "cuda") is None


def test_cpu_path_measures_each_kind():
    m = measure_layer_costs(resolve_config("qwen3.5-tiny"), 1, 16, "cpu", allow_cpu=True, warmup=1, iters=1)
    assert set(m) == {"linear_attention", "full_attention"}
    assert m["full_attention"].layer_index == 3 and m["full_attention"].fwd_ms > 0
    assert m["linear_attention"].saved_bytes is None  # no allocator statistics on the CPU


def test_apply_replaces_values_by_kind():
    cm = analytic_cost_model(resolve_config("qwen3.5-tiny"), 1, 16, gpu_bytes=GIB, host_bytes=4 * GIB)
    meas = {"full_attention": LayerMeasurement("full_attention", 3, 1.5, 3.0, 12345, None, 77, "cuda:0")}
    out = apply_layer_measurements(cm, meas)
    assert out.fwd_ms[3] == 1.5 and out.bwd_ms[3] == 3.0 and out.saved_bytes[3] == 12345
    assert out.bwd_work_bytes[3] == 77 and out.fwd_work_bytes[3] == cm.fwd_work_bytes[3]
    assert out.fwd_ms[0] == cm.fwd_ms[0]  # linear-attention layers keep their analytic values
    assert dataclasses.replace(out, meta=cm.meta) != cm


def test_a_pass_that_does_not_fit_is_measured_at_fewer_rows_and_scaled(monkeypatch):
    """The planned pass (8 rows) runs out of memory in the profiler: it is measured at 4, then 2 rows, and the
    times scale to the micro-batch (B / 2), the per-pass memory to the planned pass (8 / 2), a retained layer's
    to the micro-batch; memory never drops below the analytic figure."""
    from types import SimpleNamespace

    from lazytrain_hf.hf import plan

    config = resolve_config("qwen3.5-tiny")
    cm = analytic_cost_model(config, 16, 32, gpu_bytes=GIB, host_bytes=4 * GIB, rows_per_pass=8)
    tried = []
    big = 10 * max(cm.saved_bytes)

    def fake(cfg, rows, T, device, memory=True, **kw):
        tried.append(rows)
        if rows > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return {"linear_attention": LayerMeasurement("linear_attention", 0, 2.0, 4.0, big, 0, 0, "cuda:0")}

    monkeypatch.setattr(plan, "measure_layer_costs", fake)
    cfg = SimpleNamespace(profile_layers=True, max_rows_per_pass=8, compile_linear_attention=False)
    out, how = plan.measured_layer_costs(cm, config, cfg, torch.device("cuda"), 16, 32, {})
    assert how == "measured" and tried == [8, 4, 2]
    assert out.fwd_ms[0] == 2.0 * 8 and out.bwd_ms[0] == 4.0 * 8  # B / r = 16 / 2
    assert out.saved_bytes[0] == big * 4  # planned rows / measured rows
    assert out.retained(0) == big * 8 + cm.act_bytes[0]
    assert out.fwd_work_bytes[0] == cm.fwd_work_bytes[0]  # measured 0: the analytic figure stays
    assert out.fwd_ms[3] == cm.fwd_ms[3]  # full attention not measured here


@pytest.mark.gpu
def test_cuda_measurement():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    m = measure_layer_costs(resolve_config("qwen2.5-3b"), 2, 512, "cuda")
    full = m["full_attention"]
    assert full.fwd_ms > 0 and full.bwd_ms > full.fwd_ms and full.saved_bytes > 2 * 512 * 2048 * 2


def test_apply_scales_times_to_the_row_passes_and_can_keep_analytic_memory():
    cm = analytic_cost_model(resolve_config("qwen3.5-tiny"), 8, 16, gpu_bytes=GIB, host_bytes=4 * GIB, rows_per_pass=2)
    meas = {"full_attention": LayerMeasurement("full_attention", 3, 1.5, 3.0, 12345, 66, 77, "cuda:0")}
    out = apply_layer_measurements(cm, meas, time_scale=4.0, memory=False)
    assert out.fwd_ms[3] == 6.0 and out.bwd_ms[3] == 12.0
    assert (out.saved_bytes, out.fwd_work_bytes, out.bwd_work_bytes) == \
        (cm.saved_bytes, cm.fwd_work_bytes, cm.bwd_work_bytes)


def _measured(device: str, **cfg):
    """plan.measured_layer_costs as the LazyTrainer calls it, for the tiny Qwen3.5 at 8 x 16."""
    from lazytrain_hf.config import LazyTrainConfig
    from lazytrain_hf.hf import plan

    cm = analytic_cost_model(resolve_config("qwen3.5-tiny"), 8, 16, gpu_bytes=GIB, host_bytes=4 * GIB, rows_per_pass=2)
    return cm, plan.measured_layer_costs(cm, resolve_config("qwen3.5-tiny"), LazyTrainConfig(**cfg),
                                         torch.device(device), 8, 16)


def test_planning_uses_layers_measured_at_one_row_pass(monkeypatch):
    """On CUDA the planner measures each layer kind at (rows per pass, T) and scales to the micro-batch; the
    measurement itself is replaced here (CPU CI), the wiring and the scaling are what is checked."""
    from lazytrain_hf.hf import plan

    calls, compiled = [], []

    def fake(config, rows, T, dev, **kw):
        calls.append((rows, T, dev.type))
        compiled.append(kw["compile_linear_attention"])
        return {"full_attention": LayerMeasurement("full_attention", 3, 2.0, 5.0, None, None, None, str(dev))}

    monkeypatch.setattr(plan, "measure_layer_costs", fake)
    cm, (out, used) = _measured("cuda", max_rows_per_pass=2)
    assert used == "measured" and calls == [(2, 16, "cuda")]
    assert out.fwd_ms[3] == 8.0 and out.bwd_ms[3] == 20.0  # 4 passes of 2 rows
    assert out.fwd_ms[0] == cm.fwd_ms[0] and out.saved_bytes == cm.saved_bytes

    # a cache (the trainer's, kept across re-plans) measures once per (rows, T, device)
    from lazytrain_hf.config import LazyTrainConfig

    cache: dict = {}
    for _ in range(2):
        again, used = plan.measured_layer_costs(cm, resolve_config("qwen3.5-tiny"),
                                                LazyTrainConfig(max_rows_per_pass=2), torch.device("cuda"), 8, 16, cache)
        assert used == "measured" and again.fwd_ms == out.fwd_ms
    assert len(calls) == 2 and list(cache) == [(2, 16, "cuda")]
    calls.pop()
    _measured("cuda", max_rows_per_pass=2, compile_linear_attention=True)  # the profiler measures what runs
    assert calls.pop() == (2, 16, "cuda") and compiled == [False, False, True]

    for device, cfg in (("cpu", {"max_rows_per_pass": 2}), ("cuda", {"profile_layers": False})):
        cm, got = _measured(device, **cfg)
        assert got == (cm, "analytic")
    assert len(calls) == 1

    def oom(*a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(plan, "measure_layer_costs", oom)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    cm, got = _measured("cuda")
    assert got == (cm, "analytic")


@pytest.mark.gpu
def test_planning_measures_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")

    cm, (out, used) = _measured("cuda", max_rows_per_pass=2)
    assert used == "measured" and out.meta["estimate"] == "measured layers"
    assert all(f > 0 for f in out.fwd_ms) and out.fwd_ms != cm.fwd_ms


def _lora_layers(arch: str = "qwen3-tiny"):
    """The decoder layers of a tiny `arch` model in fp32 wrapped with LoRA on every linear layer."""
    peft = pytest.importorskip("peft")
    from lazytrain_hf.models import load_model

    model = peft.get_peft_model(load_model(arch, "float32", seed=0),
                                peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
    return model.base_model.model.model.layers


def test_frozen_layers_are_measured_as_they_run(monkeypatch):
    """With `layers` the profiler measures a copy of the model's own layer (its LoRA adapters, frozen base weights,
    dtype) under the executor's autocast, not a fresh dense bf16 layer whose weight gradients a frozen layer never
    computes; the model's layer is left untouched (no gradients, same weights)."""
    from lazytrain_hf.profiling import layer_costs

    layers = _lora_layers()
    before = {n: p.detach().clone() for n, p in layers[0].named_parameters()}
    seen = []
    real = layer_costs._measure_one

    def spy(layer, *a, **kw):
        seen.append((layer, kw.get("autocast_dtype")))
        out = real(layer, *a, **kw)
        seen.append(kw.get("hidden_dtype"))
        return out

    monkeypatch.setattr(layer_costs, "_measure_one", spy)
    m = measure_layer_costs(resolve_config("qwen3-tiny"), 2, 16, "cpu", allow_cpu=True, warmup=1, iters=1,
                            layers=layers, autocast_dtype=torch.bfloat16, hidden_dtype=torch.float32)
    assert m["full_attention"].fwd_ms > 0 and m["full_attention"].bwd_ms >= 0
    (layer, autocast), hidden = seen
    assert hidden == torch.float32
    assert autocast == torch.bfloat16 and layer is not layers[0]
    names = {n for n, _ in layer.named_parameters()}
    assert any("lora_A" in n for n in names) and names == set(before)
    assert not any(p.requires_grad for n, p in layer.named_parameters() if "lora_" not in n)
    for n, p in layers[0].named_parameters():
        assert p.grad is None and torch.equal(p, before[n]), n

    seen.clear()  # without `layers`: the fresh dense layer of the config, no autocast
    measure_layer_costs(resolve_config("qwen3-tiny"), 2, 16, "cpu", allow_cpu=True, warmup=0, iters=1)
    (layer, autocast), _ = seen
    assert autocast is None and not any("lora_" in n for n, _ in layer.named_parameters())
    assert all(p.requires_grad for p in layer.parameters())


def test_four_bit_layers_are_measured_with_their_packed_weights(tmp_path):
    """A QLoRA layer (nf4 base, fp32 norms and adapters) is measured with its 4-bit weights: the hidden states
    take the layer's floating dtype, not the packed weights' uint8."""
    pytest.importorskip("bitsandbytes")
    from lazytrain_hf.streaming.quant import is_4bit
    from tests.hf.test_qlora import _base, _qlora

    model = _qlora(_base(tmp_path, "qwen3-tiny"))
    layers = model.base_model.model.model.layers
    assert any(is_4bit(p) for p in layers[0].parameters())
    m = measure_layer_costs(model.config, 2, 16, "cpu", allow_cpu=True, warmup=0, iters=1, layers=layers)
    assert m["full_attention"].fwd_ms > 0

