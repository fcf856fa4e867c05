"""The analytic memory of each layer kind is checked against a measured CPU pass of a small shape.

One decoder layer runs forward with grad in bf16 on the CPU; the bytes autograd saves are counted through
`saved_tensors_hooks` (unique storages by data pointer, plus the layer input) and compared with
`_per_token_bytes(...)[0] * tokens`. Excluded from the count: parameters (they are weights, not activations) and
the rotary cos / sin table (computed once per model and shared by every layer).

CPU and CUDA keep the same tensors here: with no attention mask transformers calls SDPA with is_causal=True, which
on the CPU runs the flash kernel (it keeps the output and log-sum-exp, as on CUDA, not the attention matrix of the
math backend); the pass is pinned to that kernel so a fallback fails instead of inflating the count. On the H200
the same counting gave the same bytes as the allocator's growth (Qwen3.6-27B layers at 8 x 1024: 5.999 and 2.861
GiB).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from lazytrain_hf.models import resolve_config
from lazytrain_hf.profiling.analytic import _per_token_bytes, analytic_cost_model, model_shape

GIB = 1024**3
B, T = 2, 256
TOLERANCE = 0.05  # the counts are per-tensor: the formulas land within 3% on these shapes

# A small Qwen3.5 shape whose terms differ: key and value head dims, key and value head counts (grouped values).
QWEN35_SMALL = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=32, linear_value_head_dim=64, vocab_size=512)
DENSE_SMALL = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512)

CASES = [
    ("qwen3.6-27b", QWEN35_SMALL, "linear_attention"),
    ("qwen3.6-27b", QWEN35_SMALL, "full_attention"),
    ("qwen2.5-7b", DENSE_SMALL, "full_attention"),
    ("qwen3-8b", dict(DENSE_SMALL, head_dim=64), "full_attention"),
]


def _saved_bytes(config, index: int) -> int:
    """Bytes autograd keeps for one forward with grad of decoder layer `index` (bf16, CPU), the input included."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    body = model.model
    x = torch.randn(B, T, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(T).unsqueeze(0).expand(B, -1)
    cos, sin = body.rotary_emb(x, pos[None].expand(3, -1, -1) if config.model_type == "qwen3_5_text" else pos)
    excluded = {p.untyped_storage().data_ptr() for p in model.parameters()}
    excluded |= {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
    kept: dict[int, int] = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in excluded:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = body.layers[index](x, position_embeddings=(cos, sin), attention_mask=None, position_ids=pos)
    assert (out[0] if isinstance(out, tuple) else out).requires_grad
    return sum(kept.values())


@pytest.mark.parametrize("name,overrides,kind", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_analytic_saved_bytes_match_a_counted_cpu_pass(name, overrides, kind):
    config = resolve_config(name, **overrides)
    config._attn_implementation = "sdpa"
    shape = model_shape(config, name)
    index = shape.layer_kinds.index(kind)
    measured = _saved_bytes(config, index)
    analytic = _per_token_bytes(shape, index)[0] * B * T
    assert analytic == pytest.approx(measured, rel=TOLERANCE), f"{name} {kind}: {analytic} vs {measured} counted"


def test_qwen36_27b_layers_near_the_h200_measurement():
    """Qwen3.6-27B at 8 x 1024 on the H200 (bf16, transformers' reference kernels): linear attention 5.999 GiB
    saved, forward 23.2 ms, backward 59.9 ms; full attention 2.861 GiB, 11.7 / 25.5 ms."""
    cm = analytic_cost_model(resolve_config("qwen3.6-27b"), 8, 1024, gpu_bytes=80 * GIB, host_bytes=400 * GIB)
    lin, full = cm.layer_kind.index("linear_attention"), cm.layer_kind.index("full_attention")
    assert cm.saved_bytes[lin] / GIB == pytest.approx(5.999, rel=0.05)
    assert cm.saved_bytes[full] / GIB == pytest.approx(2.861, rel=0.05)
    assert cm.fwd_ms[lin] + cm.bwd_ms[lin] == pytest.approx(23.2 + 59.9, rel=0.1)
    assert cm.fwd_ms[full] + cm.bwd_ms[full] == pytest.approx(11.7 + 25.5, rel=0.15)
    assert cm.bwd_ms[lin] / cm.fwd_ms[lin] == pytest.approx(59.9 / 23.2, rel=0.1)
    assert cm.fwd_work_bytes[lin] / GIB == pytest.approx(2.63, rel=0.1)
