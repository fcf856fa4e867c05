"""Analytic costs (lazytrain_hf/profiling/analytic.py) for the registry shapes, checked against closed forms."""

from __future__ import annotations

import pytest

from lazytrain_hf.models import resolve_config
from lazytrain_hf.profiling import H200_DEFAULTS, analytic_cost_model, layer_flops, model_shape
from lazytrain_hf.profiling.analytic import HOST_EMBED_ROWS_GBPS

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
    # host: 10 B/param for layers (+fp32 absmax); resident parameters on the GPU: weight, gradient, fp32 moments
    # (Hybrid8 keeps the embedding and LM head in fp32 states) and fp32 master weights, nothing on the host
    resident = qwen7b.embed_params + qwen7b.lm_head_params + qwen7b.norm_params
    opt_b = 2 + 8 / 256 + 4
    expect = (2 + 2 + opt_b) * sum(qwen7b.layer_params)
    assert cm.host_fixed_bytes == pytest.approx(expect, rel=1e-9)
    assert cm.resident_bytes == pytest.approx((2 + 2 + 8 + 4) * resident, rel=1e-9) and cm.resident_optim_on_gpu
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
                               resident="host")
    # a tied weight in host memory: its GPU working copy is what the head multiplies by, its gradient comes back
    assert tied.head_h2d_bytes == tied.head_grad_bytes == 2 * tied.embed_optim_params
    assert tied.resident_cpu_params == tied.embed_optim_params
    with pytest.raises(ValueError, match="untied"):
        analytic_cost_model(resolve_config("qwen3-tiny"), 2, 64, gpu_bytes=GIB, host_bytes=4 * GIB,
                            resident="host_embedding")


@pytest.mark.parametrize("name", ["qwen2.5-7b", "qwen3.6-27b"])
def test_resident_placements_trade_gpu_bytes_for_host_bytes_and_cpu_time(name):
    """Each step of placement moves the embedding / LM head bytes (weights, gradients, fp32 states, master) from
    the GPU budget to the host's, and their update from the GPU to the CPU; the host head adds its per-step copy,
    the host embedding its [B, T, H] staging buffer and the row work on the step's critical path."""
    config = resolve_config(name)
    cms = {r: analytic_cost_model(config, 8, 1024, gpu_bytes=24 * GIB, host_bytes=400 * GIB, resident=r)
           for r in ("gpu", "host_embedding", "host")}
    gpu, emb, host = cms["gpu"], cms["host_embedding"], cms["host"]
    per_param = 2 + 2 + 8 + 4
    E, V = gpu.embed_optim_params, gpu.head_optim_params - config.hidden_size  # lm_head (norm: hidden_size)
    assert gpu.resident_bytes - emb.resident_bytes == per_param * E
    assert emb.resident_bytes - host.resident_bytes == per_param * V - 2 * V  # the head's bf16 copy stays
    rows_b = 2 * 8 * 1024 * config.hidden_size
    assert emb.host_fixed_bytes - gpu.host_fixed_bytes == per_param * E + rows_b
    assert host.host_fixed_bytes - emb.host_fixed_bytes == per_param * V
    assert (gpu.resident_cpu_params, emb.resident_cpu_params, host.resident_cpu_params) == (0, E, E + V)
    assert gpu.resident_optim_ms < emb.resident_optim_ms < host.resident_optim_ms
    assert host.head_h2d_bytes == host.head_grad_bytes == 2 * V and emb.head_h2d_bytes == 0
    assert emb.embed_grad_bytes == host.embed_grad_bytes == gpu.act_bytes[0] and gpu.embed_grad_bytes == 0
    hw = H200_DEFAULTS
    row_ms = rows_b / 1e6 * (1 / hw.h2d_gbps + 1 / hw.d2h_gbps + 2 / HOST_EMBED_ROWS_GBPS)
    assert emb.head_ms - gpu.head_ms == pytest.approx(row_ms) and host.head_ms == pytest.approx(emb.head_ms)


def test_the_sliced_head_trades_its_gpu_copy_and_logits_for_two_slices_and_link_time():
    """"host_sliced" at Qwen3.6-27B width, 8 x 1024: no [V, H] copy or gradient on the GPU and a [chunk, 16384]
    instead of a [chunk, 248320] logits workspace (9.3 -> 1.7 GiB of head workspace, 2.4 -> 0 GiB resident), the
    same host bytes and CPU update as "host"; its head time is 8 N V H FLOPs or the slices' 3 V H bf16 bytes over
    PCIe, whichever is longer, plus one slice's copy; nothing on the link outside the head."""
    config = resolve_config("qwen3.6-27b")
    host, sl = (analytic_cost_model(config, 8, 1024, gpu_bytes=24 * GIB, host_bytes=400 * GIB, resident=r)
                for r in ("host", "host_sliced"))
    H, V = config.hidden_size, config.vocab_size
    assert host.resident_bytes - sl.resident_bytes == 2 * V * H
    assert host.head_work_bytes > 9 * GIB and sl.head_work_bytes < 2 * GIB
    assert sl.head_h2d_bytes == sl.head_grad_bytes == 0
    assert (sl.host_fixed_bytes, sl.resident_cpu_params) == (host.host_fixed_bytes, host.resident_cpu_params)
    hw, n = H200_DEFAULTS, 8 * 1024
    compute = host.head_ms * 8 / 6  # the "host" head: 6 N V H
    link = 2 * 2 * V * H / (hw.h2d_gbps * 1e6) + 2 * V * H / (hw.d2h_gbps * 1e6)
    first = 2 * 16384 * H / (hw.h2d_gbps * 1e6)
    assert host.head_ms == pytest.approx(6 * n * V * H / 0.7 / (hw.gpu_tflops * 1e9) + _host_rows_ms(config, hw))
    assert sl.head_ms == pytest.approx(max(compute - 8 / 6 * _host_rows_ms(config, hw), link) + first
                                       + _host_rows_ms(config, hw))


def _host_rows_ms(config, hw, n: int = 8 * 1024) -> float:
    """The host-placed embedding's lookup, upload, gradient download and index-add (ms)."""
    return 2 * n * config.hidden_size / 1e6 * (1 / hw.h2d_gbps + 1 / hw.d2h_gbps + 2 / HOST_EMBED_ROWS_GBPS)


def test_fixed_rule_puts_resident_parts_on_the_host_when_they_take_over_half_the_gpu():
    from lazytrain_hf.planning.fixed import fixed_resident

    assert fixed_resident(10 * GIB, 24 * GIB, ("gpu", "host_embedding", "host")) == "gpu"
    assert fixed_resident(13 * GIB, 24 * GIB, ("gpu", "host_embedding", "host")) == "host"
    assert fixed_resident(13 * GIB, 24 * GIB, ("gpu", "host_embedding")) == "host_embedding"
    assert fixed_resident(13 * GIB, 24 * GIB, ("gpu",)) == "gpu"


def test_row_chunks_shrink_transients_not_boundaries_or_retained_layers(qwen7b):
    full = analytic_cost_model(qwen7b, 16, 1024, gpu_bytes=24 * GIB, host_bytes=100 * GIB)
    chunked = analytic_cost_model(qwen7b, 16, 1024, gpu_bytes=24 * GIB, host_bytes=100 * GIB, rows_per_pass=8)
    assert chunked.saved_bytes[0] * 2 == pytest.approx(full.saved_bytes[0], rel=1e-6)
    assert chunked.fwd_work_bytes[0] * 2 == pytest.approx(full.fwd_work_bytes[0], rel=1e-6)
    assert chunked.act_bytes == full.act_bytes and chunked.retained_bytes == full.retained_bytes
    assert full.retained(0) == full.saved_bytes[0] + full.act_bytes[0]
    assert chunked.fwd_ms == full.fwd_ms


def test_4bit_layers_stream_and_keep_their_packed_bytes(qwen7b):
    """A frozen 4-bit layer (QLoRA base) costs its packed bytes plus 2 per remaining parameter, on the host and per
    load, instead of 2 per parameter; only frozen layers may be 4-bit."""
    L = qwen7b.num_layers
    frozen = [True] * L
    linear = [p - 2 * qwen7b.hidden_size for p in qwen7b.layer_params]  # all but the two norms
    quantized = [(q, q // 2 + q // 64 // 64 * 4) for q in linear]  # packed nibbles + a nested absmax
    kw = dict(gpu_bytes=24 * GIB, host_bytes=256 * GIB, frozen=frozen, frozen_embed=True, frozen_head=True)
    bf16 = analytic_cost_model(qwen7b, 1, 1024, **kw)
    four = analytic_cost_model(qwen7b, 1, 1024, **kw, quantized=quantized)
    for i, (q, b) in enumerate(quantized):
        assert four.param_bytes[i] == bf16.param_bytes[i] - 2 * q + b
        assert 0.25 < four.param_bytes[i] / bf16.param_bytes[i] < 0.3
    assert bf16.host_fixed_bytes - four.host_fixed_bytes == sum(bf16.param_bytes) - sum(four.param_bytes)
    assert four.meta["quantized_params"] == sum(linear)
    with pytest.raises(ValueError, match=r"quantized layers must be frozen.*layer 0"):
        analytic_cost_model(qwen7b, 1, 1024, gpu_bytes=GIB, host_bytes=GIB, quantized=quantized)
    with pytest.raises(ValueError, match="one entry per layer"):
        analytic_cost_model(qwen7b, 1, 1024, **kw, quantized=quantized[:1])


@pytest.mark.parametrize("frozen", [False, True])
def test_weights_shared_by_the_hosts_ranks_count_their_share_per_rank(qwen7b, frozen):
    """One host copy of the streamed weights for `host_weight_ranks` ranks (streaming/shared_host.py): each rank's
    fixed host bytes count 1/ranks of the layers' weights (trained or frozen, 4-bit packed as stored); gradients,
    states and everything else are unchanged."""
    L = qwen7b.num_layers
    linear = [p - 2 * qwen7b.hidden_size for p in qwen7b.layer_params]
    kw = dict(gpu_bytes=24 * GIB, host_bytes=256 * GIB)
    if frozen:
        kw.update(frozen=[True] * L, frozen_embed=True, frozen_head=True,
                  quantized=[(q, q // 2 + q // 64 // 64 * 4) for q in linear])
    own = analytic_cost_model(qwen7b, 1, 1024, **kw)
    weights = sum(own.param_bytes)
    for ranks in (2, 4):
        shared = analytic_cost_model(qwen7b, 1, 1024, **kw, host_weight_ranks=ranks)
        assert own.host_fixed_bytes - shared.host_fixed_bytes == pytest.approx(weights * (1 - 1 / ranks), abs=1)
        assert shared.param_bytes == own.param_bytes and shared.resident_bytes == own.resident_bytes
    with pytest.raises(ValueError, match="host_weight_ranks must be an integer >= 1"):
        analytic_cost_model(qwen7b, 1, 1024, **kw, host_weight_ranks=0)


@pytest.mark.parametrize(("states", "master", "factor"), [("fp32", "fp32", (2 + 2 + 2 + 8 / 256 + 4) / (2 + 2 + 8 + 4)),
                                                        ("fp32", "kahan", (2 + 2 + 2 + 8 / 256 + 2) / (2 + 2 + 8 + 2)),
                                                        ("8bit", "fp32", 1.0)])
def test_host_placed_parts_update_at_the_layers_rate_times_their_bytes_ratio(qwen7b, states, master, factor):
    """The CPU update is memory bound: host-placed parts with fp32 moments (16 bytes per parameter with fp32
    masters, against a layer's ~10) update that much slower than the layers (the 24 GiB hybrid rows ran it at
    0.66-0.82 of the layers' rate: benchmarks/results/hybrid-20261202.json)."""
    cm = analytic_cost_model(qwen7b, 8, 1024, gpu_bytes=24 * GIB, host_bytes=400 * GIB, resident="host",
                             resident_states=states, master_weights=master)
    assert cm.resident_cpu_rate_factor == pytest.approx(factor)
    params = cm.embed_optim_params + cm.head_optim_params
    # (the final norm, on the GPU, adds microseconds)
    assert cm.resident_optim_ms == pytest.approx(params / (cm.cpu_optim_params_per_s * factor) * 1e3, rel=1e-4)
