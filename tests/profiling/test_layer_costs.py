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


@pytest.mark.gpu
def test_cuda_measurement():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    m = measure_layer_costs(resolve_config("qwen2.5-3b"), 2, 512, "cuda")
    full = m["full_attention"]
    assert full.fwd_ms > 0 and full.bwd_ms > full.fwd_ms and full.saved_bytes > 2 * 512 * 2048 * 2
