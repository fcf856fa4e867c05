"""Analytic costs (lazytrain_hf/profiling/analytic.py) for the registry shapes, checked against closed forms."""

from __future__ import annotations

import pytest

from lazytrain_hf.models import resolve_config
from lazytrain_hf.profiling import H200_DEFAULTS, analytic_cost_model, layer_flops, model_shape

GIB = 1024**3


@pytest.fixture(scope="module")
def qwen7b():
    return model_shape(resolve_config("qwen2.5-7b"), "qwen2.5-7b")


def test_qwen25_7b_parameter_counts(qwen7b):
    assert qwen7b.num_layers == 28 and set(qwen7b.layer_kinds) == {"full_attention"}
    assert qwen7b.num_params == 7_615_616_512  # the published Qwen2.5-7B count
    H, I, q, kv = 3584, 18944, 28 * 128, 4 * 128  # noqa: E741
    per_layer = H * q + q + 2 * (H * kv + kv) + q * H + 3 * H * I + 2 * H  # q/k/v with bias, o, MLP, 2 norms
    assert qwen7b.layer_params == [per_layer] * 28
    assert qwen7b.lm_head_params == qwen7b.embed_params == 152064 * 3584


def test_qwen36_27b_mixes_linear_and_full_attention_layers():
    shape = model_shape(resolve_config("qwen3.6-27b"), "qwen3.6-27b")
    assert shape.layer_kinds.count("linear_attention") == 48 and shape.layer_kinds.count("full_attention") == 16
    assert shape.layer_kinds[3] == "full_attention" and shape.attn_output_gate and shape.qk_norm
    cm = analytic_cost_model(shape, 4, 1024, gpu_bytes=80 * GIB, host_bytes=400 * GIB)
    full, lin = cm.layer_kind.index("full_attention"), cm.layer_kind.index("linear_attention")
    assert cm.saved_bytes[full] != cm.saved_bytes[lin] and cm.param_bytes[full] != cm.param_bytes[lin]


def test_cost_model_closed_forms(qwen7b):
    B, T = 16, 1024
    cm = analytic_cost_model(qwen7b, B, T, gpu_bytes=24 * GIB, host_bytes=100 * GIB, matmul_efficiency=0.5,
                             attention_efficiency=0.5)
    n = B * T
    assert cm.act_bytes == [2 * n * 3584] * 28  # B*T*H bf16
    assert cm.param_bytes[0] == 2 * qwen7b.layer_params[0] and cm.tokens_per_step == n
    flops = 2 * n * qwen7b.layer_params[0] + 2 * B * T * T * 28 * 128
    assert cm.fwd_ms[0] == pytest.approx(flops / (0.5 * 787e12) * 1e3)
    assert 2.0 < cm.bwd_ms[0] / cm.fwd_ms[0] < 2.5  # 2x matmul, 2.5x attention
    # 6ND check: the per-layer matmul FLOPs over the step are 6 * N_layers * tokens
    total = sum(3 * layer_flops(qwen7b, i, B, T)["matmul"] for i in range(28))
    assert total == pytest.approx(6 * sum(qwen7b.layer_params) * n)
    assert 20 < cm.saved_bytes[0] / cm.act_bytes[0] < 45  # Korthikanti-style accounting, ~32 A per layer
    assert 0 < cm.bwd_work_bytes[0] < cm.saved_bytes[0]
    # host: 10 B/param for layers (+fp32 absmax); resident parameters: a bf16 copy (states and grads on the GPU)
    resident = qwen7b.embed_params + qwen7b.lm_head_params + qwen7b.norm_params
    opt_b = 2 + 8 / 256 + 4
    expect = (2 + 2 + opt_b) * sum(qwen7b.layer_params) + 2 * resident
    assert cm.host_fixed_bytes == pytest.approx(expect, rel=1e-9)
    assert cm.resident_bytes == pytest.approx((2 + 2 + opt_b) * resident, rel=1e-9) and cm.resident_optim_on_gpu
    assert cm.resident_optim_ms == pytest.approx(resident / H200_DEFAULTS.gpu_optim_params_per_s * 1e3)
    assert cm.h2d_gbps == H200_DEFAULTS.h2d_gbps and cm.gpu_bytes == 24 * GIB
    assert cm.meta["model"] == "qwen2.5-7b"


def test_invalid_arguments_are_reported_together(qwen7b):
    with pytest.raises(ValueError) as info:
        analytic_cost_model(qwen7b, 0, 1024, gpu_bytes=GIB, host_bytes=GIB, state_dtype="4bit", master_weights="x")
    msg = str(info.value)
    assert "batch_size" in msg and "state_dtype" in msg and "master_weights" in msg


def test_config_input_and_tiny_models():
    cm = analytic_cost_model(resolve_config("qwen3.5-tiny"), 2, 64, gpu_bytes=GIB, host_bytes=4 * GIB)
    assert cm.num_layers == 4 and cm.layer_kind[:4] == ["linear_attention"] * 3 + ["full_attention"]
    tied = analytic_cost_model(resolve_config("qwen3-tiny"), 2, 64, gpu_bytes=GIB, host_bytes=4 * GIB,
                               resident_optimizer="cpu")
    assert tied.head_grad_bytes < tied.embed_grad_bytes  # tied lm_head: its gradient is the embedding's
    assert not tied.resident_optim_on_gpu and tied.resident_bytes == 2 * (tied.embed_optim_params
                                                                          + tied.head_optim_params)


def test_row_chunks_shrink_transients_not_boundaries_or_retained_layers(qwen7b):
    full = analytic_cost_model(qwen7b, 16, 1024, gpu_bytes=24 * GIB, host_bytes=100 * GIB)
    chunked = analytic_cost_model(qwen7b, 16, 1024, gpu_bytes=24 * GIB, host_bytes=100 * GIB, rows_per_pass=8)
    assert chunked.saved_bytes[0] * 2 == pytest.approx(full.saved_bytes[0], rel=1e-6)
    assert chunked.fwd_work_bytes[0] * 2 == pytest.approx(full.fwd_work_bytes[0], rel=1e-6)
    assert chunked.act_bytes == full.act_bytes and chunked.retained_bytes == full.retained_bytes
    assert full.retained(0) == full.saved_bytes[0] + full.act_bytes[0]
    assert chunked.fwd_ms == full.fwd_ms
