"""Analytic per-layer costs from a transformers config and a batch shape, for planning without a GPU.

`model_shape(config)` instantiates the model on the meta device (no memory allocated) to count each decoder
layer's parameters exactly and to read its kind (Qwen3.5 mixes "linear_attention" and "full_attention" layers,
`config.layer_types`). `analytic_cost_model(...)` turns that into a `CostModel` for a (batch, seq) on a
`HardwareProfile`. Numbers are estimates; `layer_costs.measure_layer_costs` replaces the per-layer ones with
measurements on a CUDA device.

Sources of the formulas:
    - matmul FLOPs: 2 * tokens * parameters forward and twice that backward (Kaplan et al. 2020, the 6ND rule;
      PaLM, Chowdhery et al. 2022, appendix B);
    - causal attention FLOPs: QK^T and AV are 2 * B * T^2 * heads * head_dim each, halved by causality (flash
      attention skips the masked half), backward about 2.5x forward (FlashAttention-2, Dao 2023);
    - gated delta rule (Qwen3.5 linear attention, chunk C = 64): per token and value head about
      2 * (3 * dk * dv + C * (2 * dk + dv)) FLOPs (state read/update and the intra-chunk WY form; Yang et al.
      2024, "Gated Delta Networks"); without flash-linear-attention kernels transformers runs a reference PyTorch
      path (fp32 elementwise work, batched 64 x 64 triangular solves, a Python loop over chunks) that reaches
      about 0.6% of the GEMM rate on these FLOPs, with a backward 3.1x its forward (`LINEAR_ATTENTION_EFFICIENCY`,
      `LINEAR_ATTENTION_BWD_RATIO`);
    - saved activations: per-tensor accounting of what autograd keeps in a Qwen decoder layer in bf16 with
      fp32 RMSNorm internals and SDPA (q, k, v, output and log-sum-exp), in the manner of Korthikanti et al.
      2022, "Reducing Activation Recomputation in Large Transformer Models" §4;
    - saved activations of Qwen3.5 layers: counted tensor by tensor (`_per_token_bytes`);
    - efficiencies: a dense layer reaches about 0.7 of the 8192^3 GEMM rate (on an H200, 2026-11-29, the stock
      Trainer's 416 TFLOPS (6ND) at batch 8 x 1024 with one recompute executes 8ND, about 555 TFLOPS of 787);
    - host bytes per parameter: bf16 weight 2 + bf16 gradient 2 + 8-bit moments 2 (+ fp32 absmax per block) +
      fp32 master 4 (Kahan: 2); resident parameters (embedding, lm_head, norm) keep gradients and optimizer
      states on the GPU by default, as the executor does (measured: 4.39 GB of states for Qwen2.5-7B).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..optim.functional import CHUNK_ELEMENTS
from ..planning.cost_model import CostModel
from ..planning.schedule import HEAD_VOCAB_SLICE_ROWS, RESIDENT_PLACEMENTS
from .hardware import H200_DEFAULTS, HardwareProfile

__all__ = ["ModelShape", "model_shape", "analytic_cost_model", "layer_flops", "resident_placements"]

#: Achieved fraction of the GPU's bf16 rate on the gated-delta-rule FLOPs (`layer_flops`) by transformers' reference
#: path, and its backward / forward time ratio. Measured on the H200 for a Qwen3.6-27B linear-attention layer at
#: 8 x 1024 (bf16, torch 2.11, transformers 5.17): forward 23.2 ms, backward 59.9 ms, of which the projections and
#: MLP at the dense rate take 11.4 / 22.8 ms. These constants give 23.3 / 59.6 ms (before: 11.7 / 23.4 ms with
#: 0.25 and 2x); the full-attention layer beside it: 11.3 / 22.8 ms here, 11.7 / 25.5 ms measured. With
#: flash-linear-attention kernels the rate is far higher: measure (`layer_costs`) or pass
#: linear_attention_efficiency.
LINEAR_ATTENTION_EFFICIENCY = 0.0062
LINEAR_ATTENTION_BWD_RATIO = 3.1

BF16 = 2  # bytes per bf16 element
FP32 = 4
MIB = 1024**2
#: Host-side rate of a host-placed embedding's row work, in bytes of [tokens, H] rows per second, for each of the
#: lookup into the staging buffer and the index-add of its gradient (streaming/resident.py): 5.2 ms / 11.3 ms for
#: 8192 x 3584 bf16 rows (58.7 MB) on 2 Zen cores; the slower one, rounded down.
HOST_EMBED_ROWS_GBPS = 5.0


@dataclass
class ModelShape:
    """What the cost formulas need from a config (dimensions) and from the meta model (parameter counts).

    Attributes:
        model_type: transformers model_type ("qwen2", "qwen3", "qwen3_5_text", "llama").
        hidden_size, intermediate_size, vocab_size: H, I, V.
        num_heads, num_kv_heads, head_dim: full-attention geometry.
        attn_output_gate: q_proj also produces a sigmoid output gate (Qwen3.5 full attention).
        qk_norm: per-head RMSNorm on q and k (Qwen3, Qwen3.5).
        linear_k_heads, linear_v_heads, linear_k_dim, linear_v_dim, linear_conv_kernel: Qwen3.5 gated delta net.
        layer_kinds: per decoder layer, "full_attention" or "linear_attention".
        layer_params: per decoder layer, trainable parameters (count).
        embed_params: embedding parameters; lm_head_params: untied lm_head parameters (0 when tied);
        norm_params: final norm parameters.
        zero_centered_norm: RMSNorm scales by (1 + weight) in fp32 (Qwen3.5), so autograd also keeps the fp32
            normalized input; the Llama form (Qwen2, Qwen3) keeps a bf16 one.
        name: registry name or hub id (for printing).
    """

    model_type: str
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attn_output_gate: bool
    qk_norm: bool
    linear_k_heads: int
    linear_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    linear_conv_kernel: int
    layer_kinds: list[str]
    layer_params: list[int]
    embed_params: int
    lm_head_params: int
    norm_params: int
    zero_centered_norm: bool = False
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def num_params(self) -> int:
        return sum(self.layer_params) + self.embed_params + self.lm_head_params + self.norm_params


def model_shape(config: Any, name: str = "") -> ModelShape:
    """Read dimensions from `config` and count parameters on a meta-device instance (nothing allocated).

    Raises:
        ValueError: the config has no decoder layers under `model.layers`.
    """
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    body = getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if layers is None:
        raise ValueError(f"model_type={config.model_type!r}: expected decoder layers at model.model.layers")
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * len(layers))
    kinds = ["linear_attention" if t == "linear_attention" else "full_attention" for t in types[: len(layers)]]
    layer_params = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    embed = body.embed_tokens.weight.numel()
    lm_head = model.lm_head.weight
    lm_head_params = 0 if lm_head is body.embed_tokens.weight else lm_head.numel()
    norm_params = sum(p.numel() for p in body.norm.parameters())
    nh = config.num_attention_heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // nh
    mt = config.model_type
    return ModelShape(
        model_type=mt, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size, num_heads=nh, num_kv_heads=getattr(config, "num_key_value_heads", nh) or nh,
        head_dim=hd, attn_output_gate=mt.startswith("qwen3_5"), qk_norm=mt.startswith("qwen3"),
        linear_k_heads=getattr(config, "linear_num_key_heads", 0) or 0,
        linear_v_heads=getattr(config, "linear_num_value_heads", 0) or 0,
        linear_k_dim=getattr(config, "linear_key_head_dim", 0) or 0,
        linear_v_dim=getattr(config, "linear_value_head_dim", 0) or 0,
        linear_conv_kernel=getattr(config, "linear_conv_kernel_dim", 4) or 4,
        layer_kinds=kinds, layer_params=layer_params, embed_params=embed, lm_head_params=lm_head_params,
        norm_params=norm_params, zero_centered_norm=mt.startswith("qwen3_5"),
        name=name or getattr(config, "_name_or_path", "") or mt)


def resident_placements(shape: ModelShape) -> tuple[str, ...]:
    """The embedding / LM head placements the executor can run for this shape (a tied head: all but
    "host_embedding")."""
    return tuple(p for p in RESIDENT_PLACEMENTS if p != "host_embedding") if shape.lm_head_params == 0 \
        else RESIDENT_PLACEMENTS


def layer_flops(shape: ModelShape, i: int, batch_size: int, seq_len: int) -> dict[str, float]:
    """Forward FLOPs of decoder layer i for [B, T] tokens, split by kind of work.

    Returns:
        {"matmul": 2 * N * params, "attention": causal SDPA, "linear_attention": gated delta rule} (FLOPs).
    """
    n = batch_size * seq_len
    out = {"matmul": 2.0 * n * shape.layer_params[i], "attention": 0.0, "linear_attention": 0.0}
    if shape.layer_kinds[i] == "full_attention":
        # QK^T and AV: 2 * B * T^2 * nh * hd each; causal flash attention computes half
        out["attention"] = 2.0 * batch_size * seq_len**2 * shape.num_heads * shape.head_dim
    else:
        c, dk, dv = 64, shape.linear_k_dim, shape.linear_v_dim
        out["linear_attention"] = 2.0 * n * shape.linear_v_heads * (3 * dk * dv + c * (2 * dk + dv))
    return out


#: chunk length of transformers' torch_chunk_gated_delta_rule (and of flash-linear-attention's kernels)
GDN_CHUNK = 64


def _per_token_bytes(shape: ModelShape, i: int) -> tuple[float, float, float]:
    """(saved, forward workspace, backward workspace) bytes per token of decoder layer i (bf16 activations).

    Saved: the tensors autograd keeps (unique storages, parameters and the shared rotary table excluded) plus the
    layer input. Llama-form layers (Qwen2, Qwen3): input 2H; two RMSNorms 2 x (fp32 copy 4H + bf16 output 2H);
    q/k/v outputs (with qk norm also their fp32 copies); SDPA q, k, v, output and fp32 log-sum-exp; MLP gate, up,
    silu(gate) and product, 4 x 2I (within 3% of a counted pass for Qwen2.5-7B and Qwen3-8B).
    Qwen3.5 (`zero_centered_norm`), counted tensor by tensor in transformers' modeling_qwen3_5:
        both layer kinds: input 2H; each RMSNorm its fp32 input, fp32 normalized input and bf16 output, 2 x 10H;
        MLP 4 x 2I;
        full attention: per-head q/k RMSNorms, fp32 input and normalized input, 8 (q + kv); SDPA q, k, v, output
        and log-sum-exp (the rotary product keeps only cos / sin); the output gate's sigmoid, the attention output
        and their product, 3 x 2q;
        linear attention (torch_chunk_gated_delta_rule, every value head nv, chunk C): in_proj_qkv output (the conv
        input) and conv output, 2 x 2 conv_dim; beta (bf16) and the softplus input / output of g (fp32);
        fp32 [token, nv, dk] tensors: q and k before l2norm, chunked q and k, k_beta, k_cumdecay, decayed q and
        k (8 dk); fp32 [token, nv, dv]: v, the solved values and each chunk's v_new (3 dv); five fp32 [token, nv,
        C] chunk matrices (pairwise decay, k_beta k^T, q k^T, the triangular system, the intra-chunk attention);
        one fp32 state nv dk dv per chunk; the gated RMSNorm's fp32 input, gate and silu(gate), its bf16
        normalized and weighted values and output (3 x 4 vd + 3 x 2 vd).
    Qwen3.6-27B at 8 x 1024 (H 5120): linear attention 786,208 B/token = 6.00 GiB, full attention 375,000 B/token =
    2.86 GiB; measured on the H200 (bf16, transformers' reference kernels, allocator growth after a forward with
    grad): 5.999 and 2.861 GiB.
    """
    H, I = shape.hidden_size, shape.intermediate_size  # noqa: E741 - the paper's symbols
    mlp = 4 * BF16 * I
    q = shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    if shape.zero_centered_norm:
        norms = 2 * (2 * FP32 * H + BF16 * H + FP32)  # + the per-row rsqrt
    else:
        norms = 2 * (FP32 * H + BF16 * H)
    if shape.layer_kinds[i] == "full_attention":
        if shape.zero_centered_norm:
            qk_norm = 2 * FP32 * (q + kv) + FP32 * (shape.num_heads + shape.num_kv_heads)
            proj = qk_norm + BF16 * (q + 2 * kv)  # SDPA's q (after rotary), k and v
        else:
            proj = BF16 * (q + 2 * kv) + (FP32 * (q + kv) + BF16 * (q + kv) if shape.qk_norm else 0)
            proj += BF16 * (q + 2 * kv)  # SDPA inputs
        sdpa = BF16 * q + FP32 * shape.num_heads  # output and log-sum-exp
        gate = (3 if shape.zero_centered_norm else 2) * BF16 * q if shape.attn_output_gate else 0
        saved = BF16 * H + norms + proj + sdpa + gate + mlp
        mix_work = BF16 * 2 * (q + kv) + BF16 * q + (BF16 * q if shape.attn_output_gate else 0)
    else:
        nv, dk, dv, c = shape.linear_v_heads, shape.linear_k_dim, shape.linear_v_dim, GDN_CHUNK
        kd, vd = shape.linear_k_heads * dk, nv * dv
        conv = 2 * kd + vd
        gates = BF16 * nv + 2 * FP32 * nv
        chunk = (FP32 * nv * (8 * dk + 3 * dv) + 5 * FP32 * nv * c + FP32 * nv * dk * dv / c
                 + 6 * FP32 * nv)  # + beta, the l2norm rsqrt of q and k, and the cumulative decays
        gated_norm = 3 * FP32 * vd + 3 * BF16 * vd + FP32 * nv
        saved = BF16 * H + norms + 2 * BF16 * conv + gates + chunk + gated_norm + mlp
        # no-grad forward, live at once inside the chunk rule: the normalized layer input, the conv output and z
        # (bf16), fp32 q, k, v, k_beta, v_beta, decayed k_beta, the two triangular solves, the output and a decayed
        # q / k (6 dk + 4 dv per value head) and three [token, nv, C] matrices. Qwen3.6-27B at 8 x 1024: 2.64 GiB
        # with the fp32 norm copy below; measured on the H200: 2.63 GiB.
        mix_work = BF16 * (H + conv + vd) + FP32 * nv * (6 * dk + 4 * dv) + 3 * FP32 * nv * c
    # no-grad forward: the larger of the token mixer's and the MLP's live intermediates, plus an fp32 norm copy
    fwd_work = max(mix_work, 3 * BF16 * I) + FP32 * H
    # backward (beyond saved activations and weight grads): two MLP-intermediate gradients, the hidden-state
    # gradients in and out, an fp32 norm gradient; saved tensors are freed as backward proceeds. Measured on the
    # H200 for a Qwen2.5-7B layer at 16 x 1024: 1.03 GB; this gives 1.70 GB (forward workspace: 1.98 measured,
    # 2.10 GB here; saved activations 3.81 measured, 3.73 GB here; fwd / bwd time 13.9 / 27.4 ms measured,
    # 14.1 / 28.3 ms here). Qwen3.6-27B at 8 x 1024 measured 0.06 (linear) and 0.08 GiB (full attention), this
    # gives 0.84 GiB: an upper bound kept for both kinds.
    bwd_work = 2 * BF16 * I + 2 * BF16 * H + FP32 * H
    return saved, fwd_work, bwd_work


def analytic_cost_model(config_or_shape: Any, batch_size: int, seq_len: int,
                        hardware: HardwareProfile = H200_DEFAULTS, *, gpu_bytes: int, host_bytes: int,
                        nvme_bytes: int = 0, matmul_efficiency: float = 0.7, attention_efficiency: float = 0.5,
                        linear_attention_efficiency: float = LINEAR_ATTENTION_EFFICIENCY, loss_chunk_tokens: int = 2048,
                        state_dtype: str = "8bit", master_weights: str = "fp32", block_size: int = 256,
                        gpu_reserve_bytes: int = 512 * MIB, rows_per_pass: int | None = None,
                        kept_grads: bool = True, name: str = "",
                        resident: str = "gpu", resident_states: str = "fp32", frozen: Sequence[bool] | None = None,
                        adapter_params: int = 0, frozen_embed: bool = False, frozen_head: bool = False,
                        quantized: Sequence[tuple[int, int]] | None = None, host_weight_ranks: int = 1,
                        hidden_itemsize: int = BF16, embed_itemsize: int = BF16,
                        head_itemsize: int = BF16) -> CostModel:
    """A `CostModel` for `config_or_shape` (a transformers config or a `ModelShape`) at [batch_size, seq_len].

    Args:
        config_or_shape: the model (a config is turned into a `ModelShape` on the meta device).
        batch_size, seq_len: B and T of one micro-batch (padding counts: tokens = B * T).
        hardware: machine rates (GB/s, TFLOP/s, params/s).
        gpu_bytes, host_bytes, nvme_bytes: budgets (bytes).
        matmul_efficiency, attention_efficiency, linear_attention_efficiency: achieved fraction of
            `hardware.gpu_tflops` for each kind of work.
        loss_chunk_tokens: tokens per chunk of the chunked cross-entropy (sets the head's logits workspace).
        state_dtype: optimizer moments, "8bit" (2 bytes/param + fp32 absmax per block) or "fp32" (8 bytes/param).
        master_weights: "fp32" (4 bytes/param), "kahan" (2 bytes/param compensation), "stochastic" or "none" (0).
        block_size: quantization block (elements per fp32 absmax).
        gpu_reserve_bytes: GPU bytes held back for allocator fragmentation.
        rows_per_pass: the executor runs each layer over the micro-batch in chunks of this many sequences
            (`max_rows_per_pass`): a layer's transient activations (saved, forward and backward workspaces) are
            one chunk's, while boundaries and retained layers keep the whole micro-batch. None: no chunking.
        resident: where the embedding and LM head live (`planning.schedule.RESIDENT_PLACEMENTS`, the executor's
            `streaming/resident.py`): "gpu" (weights, gradients and optimizer states on the GPU), "host_embedding"
            (the embedding's in host memory, looked up and updated on the CPU: its output goes up and its gradient
            [B, T, H] comes back), "host" (the LM head's too: updated on the CPU, its bf16 weights copied up once
            per step, its gradient sent back after the head), "host_sliced" (as "host", the head's weights streamed
            in slices of `HEAD_VOCAB_SLICE_ROWS` rows during the head, twice, and its gradient sent back slice by
            slice: no whole copy on the GPU). Their optimizer states are `resident_states` plus the master weights;
            the final norm stays on the GPU.
        resident_states: the embedding / LM head optimizer states: "fp32" (Hybrid8's default: 8 bytes/param) or
            "8bit" (an optimizer that quantizes them too, as `state_dtype` "8bit" does the layers').
        kept_grads: GPU-updated layers keep their bf16 gradients on the GPU from backward to the update
            (`CostModel.kept_grad_bytes`, `Schedule.keep_grads`); the executor does so with one micro-batch per
            optimizer step only, so pass False with gradient accumulation.
        frozen: per layer, streamed read-only (the executor's `StreamingExecutor.frozen`: LoRA base weights, plain
            freezing): no gradient buffers or D2H, no optimizer update or states, only the weights in host memory.
            None: every layer trains.
        frozen_embed, frozen_head: the input embedding / LM head has requires_grad=False (LoRA's base): its weights
            only, wherever placed (no gradient, no optimizer state), and a frozen head's backward computes the
            hidden-state gradient alone. A tied head follows the embedding.
        adapter_params: trainable parameters of the frozen layers (LoRA A / B), resident on the GPU with their
            gradients and fp32 states, updated with the resident parameters at `optimizer.step()`.
        quantized: per layer, (parameters held as bitsandbytes 4-bit weights, their streamed bytes: packed data
            plus quantization state) for a frozen layer of a 4-bit base (QLoRA); its host copy and H2D load are
            those bytes plus 2 per remaining parameter instead of 2 per parameter. None: no 4-bit weights.
        host_weight_ranks: data-parallel ranks on this host that map one host copy of the streamed layers' weights
            (streaming/shared_host.py): `host_fixed_bytes` (bytes per rank) counts 1 / host_weight_ranks of those
            weights, so the host counts them once. 1: each rank its own copy.
        hidden_itemsize: bytes per element of the hidden states between layers (boundaries, a retained layer's
            output, the embedding's output): the input embedding's dtype. 4 for a float32 embedding, as
            peft's `prepare_model_for_kbit_training` leaves a QLoRA base, or an fp32 model under bf16 autocast.
        embed_itemsize, head_itemsize: bytes per parameter of a frozen embedding / LM head's weight (its dtype);
            a trained one is priced as bf16 weights plus its states.

    Raises:
        ValueError: non-positive batch or sequence length, unknown state_dtype / master_weights.
    """
    problems = []
    if batch_size < 1 or seq_len < 1:
        problems.append(f"batch_size and seq_len must be >= 1, but got {batch_size} and {seq_len}")
    if state_dtype not in ("8bit", "fp32"):
        problems.append(f"state_dtype must be '8bit' or 'fp32', but got {state_dtype!r}")
    if master_weights not in ("fp32", "kahan", "stochastic", "none"):
        problems.append(f"master_weights must be 'fp32', 'kahan', 'stochastic' or 'none', but got {master_weights!r}")
    if resident_states not in ("8bit", "fp32"):
        problems.append(f"resident_states must be '8bit' or 'fp32', but got {resident_states!r}")
    if resident not in RESIDENT_PLACEMENTS:
        problems.append(f"resident must be one of {RESIDENT_PLACEMENTS}, but got {resident!r}")
    bad_sizes = {k: v for k, v in (("hidden_itemsize", hidden_itemsize), ("embed_itemsize", embed_itemsize),
                                   ("head_itemsize", head_itemsize)) if v not in (1, 2, 4, 8)}
    if bad_sizes:
        problems.append(f"element sizes must be 1, 2, 4 or 8 bytes, but got {bad_sizes}")
    if rows_per_pass is not None and rows_per_pass < 1:
        problems.append(f"rows_per_pass must be >= 1 or None, but got {rows_per_pass}")
    shape = config_or_shape if isinstance(config_or_shape, ModelShape) else model_shape(config_or_shape, name)
    frozen = [False] * shape.num_layers if frozen is None else [bool(f) for f in frozen]
    if len(frozen) != shape.num_layers:
        problems.append(f"frozen must have one entry per layer ({shape.num_layers}), but got {len(frozen)}")
    if adapter_params < 0:
        problems.append(f"adapter_params must be >= 0, but got {adapter_params}")
    if isinstance(host_weight_ranks, bool) or not isinstance(host_weight_ranks, int) or host_weight_ranks < 1:
        problems.append(f"host_weight_ranks must be an integer >= 1, but got {host_weight_ranks!r}")
    quantized = [(0, 0)] * shape.num_layers if quantized is None else [(int(q), int(b)) for q, b in quantized]
    if len(quantized) != shape.num_layers:
        problems.append(f"quantized must have one entry per layer ({shape.num_layers}), but got {len(quantized)}")
    else:
        bad = [i for i, (q, b) in enumerate(quantized) if q and (not frozen[i] or not 0 < q <= shape.layer_params[i]
                                                                  or b < 0)]
        if bad:
            problems.append(f"quantized layers must be frozen, with 0 < parameters <= the layer's and bytes >= 0: "
                            f"layer {bad[0]} has {quantized[bad[0]]}")
    if problems:
        raise ValueError("analytic_cost_model: " + "; ".join(problems))
    L, H, V = shape.num_layers, shape.hidden_size, shape.vocab_size
    n = batch_size * seq_len
    peak = hardware.gpu_tflops * 1e12 / 1e3  # FLOPs per ms
    state_b = 2 + 2 * FP32 / block_size if state_dtype == "8bit" else 2 * FP32  # moments, bytes/param
    master_b = {"fp32": FP32, "kahan": BF16, "stochastic": 0, "none": 0}[master_weights]
    n_pass = min(batch_size, rows_per_pass or batch_size) * seq_len  # tokens of one pass through a layer
    fwd_ms, bwd_ms, saved, fwd_work, bwd_work, retained = [], [], [], [], [], []
    for i in range(L):
        fl = layer_flops(shape, i, batch_size, seq_len)
        fwd_ms.append((fl["matmul"] / matmul_efficiency + fl["attention"] / attention_efficiency
                       + fl["linear_attention"] / linear_attention_efficiency) / peak)
        bwd_ms.append((2 * fl["matmul"] / matmul_efficiency + 2.5 * fl["attention"] / attention_efficiency
                       + LINEAR_ATTENTION_BWD_RATIO * fl["linear_attention"] / linear_attention_efficiency) / peak)
        s, fw, bw = _per_token_bytes(shape, i)
        saved.append(int(s * n_pass))
        fwd_work.append(int(fw * n_pass))
        bwd_work.append(int(bw * n_pass))
        retained.append(int(s * n) + hidden_itemsize * n * H)  # whole micro-batch: activations and the output
    params = shape.layer_params
    trained = [0 if f else p for p, f in zip(params, frozen)]  # parameters with gradients and optimizer work
    weight_b = [BF16 * (p - q) + b for p, (q, b) in zip(params, quantized)]  # streamed weights (4-bit: packed)
    act = hidden_itemsize * n * H
    tied = shape.lm_head_params == 0
    frozen_head = frozen_embed if tied else frozen_head
    sliced = resident == "host_sliced"
    # backward (input [+ weight]) + forward; sliced, the forward's logits again in the backward sweep
    head_flops = (2.0 if frozen_head else 4.0) * n * H * V + (4.0 if sliced else 2.0) * n * H * V
    # a host-placed embedding's lookup and upload before the first layer, and the blocking download and index-add
    # of its gradient after the last backward: on the step's critical path (the head's, as the GPU embedding's is)
    host_embed_ms = 0.0
    if resident != "gpu":
        rows_b = hidden_itemsize * n * H
        host_embed_ms = rows_b * (1 / (hardware.h2d_gbps * 1e6)
                                  + (0 if frozen_embed else 1 / (hardware.d2h_gbps * 1e6))
                                  + (1 if frozen_embed else 2) / (HOST_EMBED_ROWS_GBPS * 1e6))
    chunk = min(loss_chunk_tokens, n)
    layer_host_b = BF16 + BF16 + state_b + master_b  # weight, gradient, moments, master
    # the CPU update is memory bound: a host-placed part whose states take more bytes per parameter than a layer's
    # (fp32 moments: 16 against 10 bytes with fp32 masters) updates that much slower. Priced at the layers' rate, the
    # 24 GiB hybrid rows' embedding / head update ran at 0.66-0.82 of it (optimizer_ms in
    # benchmarks/results/hybrid-20261202.json; this ratio: 0.63)
    # resident parts: moments as `resident_states` (Hybrid8 keeps them fp32 unless told otherwise) + master; a frozen
    # part keeps its weights only
    small_b = BF16 + BF16 + 2 * FP32 + master_b  # the final norm (below min_8bit_size) and LoRA adapters: fp32 states
    resident_b = BF16 + BF16 + (state_b if resident_states == "8bit" else 2 * FP32) + master_b
    embed_b, head_b = (embed_itemsize if frozen_embed else resident_b), (head_itemsize if frozen_head else resident_b)
    embed_p, norm_p = shape.embed_params, shape.norm_params
    head_p = shape.lm_head_params or shape.embed_params  # the weight the head multiplies by (tied: the embedding)
    host_embed = resident != "gpu"
    host_head = resident in ("host", "host_sliced")
    # parameters whose weights, gradients and states live on the GPU; the rest live in host memory
    if tied and resident == "host_embedding":
        raise ValueError("analytic_cost_model: resident='host_embedding' needs an untied LM head (a tied weight is "
                         "the embedding and the head at once): use 'gpu' or 'host'")
    gpu_resident_b = (small_b * (norm_p + adapter_params) + (0 if host_embed else embed_b * embed_p)
                      + (0 if host_head else head_b * shape.lm_head_params))
    host_resident_b = ((embed_b * embed_p + act) if host_embed else 0) \
        + (head_b * shape.lm_head_params if host_head else 0)  # + the embedding's [B, T, H] staging buffer
    host_params = ((0 if frozen_embed else embed_p) if host_embed else 0) + \
        ((0 if frozen_head else shape.lm_head_params) if host_head else 0)  # updated on the CPU
    head_w = head_itemsize if frozen_head else BF16  # bytes per element of the head's GPU working copy
    head_copy = head_w * head_p if host_head and not sliced else 0  # the GPU working copy of a host-placed head
    head_grad = 0 if frozen_head else head_copy  # its weight gradient, sent back right after the head
    # head workspace (streaming/head.py): final norm internals (fp32 copy + bf16); per logit of a chunk the bf16
    # logits and, in its backward, three fp32 [chunk, V] tensors at once (log-softmax output, the loss gradient,
    # the logits' gradient); the hidden-state gradient; and a host-placed head's GPU weight gradient (sent back
    # right after the head). A GPU-placed head's gradient is in the resident bytes; it grows in place per chunk.
    # With 2 fp32 tensors per logit and a [V, H] product per chunk (autograd's accumulation) the Qwen3.6-27B-width
    # head planned 16.9 GiB at 24 GiB, batch 8, and needed 22.4 GiB on an H200 (benchmarks/results/hybrid-20261201.json)
    # + an fp32 frozen head's bf16 copy for its products under autocast (streaming/head.py `_compute_copies`)
    head_cast = BF16 * head_p if head_w > BF16 else 0
    head_work = (FP32 + BF16) * n * H + (BF16 + 3 * FP32) * chunk * V + hidden_itemsize * n * H + head_grad \
        + head_cast
    head_ms = head_flops / matmul_efficiency / peak
    if sliced:
        # streaming/resident.py `sliced_loss` and vocab_head.py: the target rows, their normed copy, the loss's fp32
        # dL/dh and its bf16 result (10 bytes per token and hidden unit; the returned [B, T, H] gradient comes after
        # the normed copy is freed); the norm's fp32 internals per chunk; a chunk's [chunk, Vc] logits as above; two weight slices in
        # flight, one slice's gradient (fp32-summed over token chunks when there are several); per token fp32 running
        # max, sum, target logit and log-sum-exp
        vc = min(HEAD_VOCAB_SLICE_ROWS, V)
        slice_grad = 0 if frozen_head else (BF16 + (FP32 if n > chunk else 0)) * vc * H
        head_work = (10 * n * H + (FP32 + BF16) * chunk * H + (BF16 + 3 * FP32) * chunk * vc
                     + 2 * head_w * vc * H + slice_grad + 4 * FP32 * n)
        # the slices go up twice (one sweep each) and their gradients come back, on one side stream, while the head
        # computes: the head takes the longer of the two, plus the first slice's copy that nothing hides
        link_ms = (2 * head_w * head_p / (hardware.h2d_gbps * 1e6)
                   + (0 if frozen_head else BF16 * head_p / (hardware.d2h_gbps * 1e6)))
        head_ms = max(head_ms, link_ms) + head_w * vc * H / (hardware.h2d_gbps * 1e6)
    gpu_opt_b = state_b + master_b + BF16  # per param: states + master + gradient (up) / weight (down)
    # the update's fp32 temporaries over one slice of CHUNK_ELEMENTS (optim/functional.py: param + Kahan sum, fp32
    # gradient, bf16 result, its fp32 copy and the residual: 18 bytes per element at the write-back). Missing, the
    # 24 GiB plan with GPU-side updates peaked ~1 GiB above its prediction (21.7 vs 20.7 GiB at B=64) and ran out of
    # memory at B=8 on the H200.
    gpu_opt_tmp = [18 * min(p, CHUNK_ELEMENTS) for p in trained]
    # the streamed weights' host copy: each rank's own, or one per host whose other ranks' shares are not this rank's
    shared_off = sum(weight_b) * (1 - 1 / host_weight_ranks) if host_weight_ranks > 1 else 0
    meta = {"model": shape.name, "model_type": shape.model_type, "batch_size": batch_size, "seq_len": seq_len,
            "rows_per_pass": rows_per_pass, "resident": resident,
            "num_params": shape.num_params, "frozen_layers": sum(frozen), "adapter_params": int(adapter_params),
            "frozen_embed": bool(frozen_embed), "frozen_head": bool(frozen_head), "hidden_itemsize": hidden_itemsize,
            "embed_itemsize": embed_itemsize, "head_itemsize": head_itemsize,
            "quantized_params": sum(q for q, _ in quantized),
            "hardware": hardware.source, "hardware_measured": hardware.measured,
            "estimate": "analytic"}
    return CostModel(
        layer_kind=list(shape.layer_kinds), num_params=list(trained), fwd_ms=fwd_ms, bwd_ms=bwd_ms,
        param_bytes=weight_b, grad_bytes=[BF16 * p for p in trained], act_bytes=[act] * L,
        saved_bytes=saved, fwd_work_bytes=fwd_work, bwd_work_bytes=bwd_work,
        gpu_optim_h2d_bytes=[int(gpu_opt_b * p) for p in trained],
        gpu_optim_d2h_bytes=[int(gpu_opt_b * p) for p in trained],
        gpu_optim_work_bytes=[int(gpu_opt_b * p) + t for p, t in zip(trained, gpu_opt_tmp)], retained_bytes=retained,
        kept_grad_bytes=[BF16 * p for p in trained] if kept_grads else [],
        resident_bytes=int(gpu_resident_b + head_copy),
        head_ms=head_ms + host_embed_ms,
        head_work_bytes=int(head_work), head_grad_bytes=head_grad, head_h2d_bytes=head_copy,
        embed_grad_bytes=act if host_embed and not frozen_embed else 0,
        embed_optim_params=0 if frozen_embed else shape.embed_params,
        resident_optim_on_gpu=True, resident_cpu_params=host_params,
        resident_cpu_rate_factor=min(1.0, layer_host_b / resident_b),
        head_optim_params=(0 if frozen_head else shape.lm_head_params) + shape.norm_params + adapter_params,
        gpu_reserve_bytes=int(gpu_reserve_bytes),
        host_fixed_bytes=int(layer_host_b * sum(trained) + sum(w for w, f in zip(weight_b, frozen) if f)
                             + host_resident_b - shared_off),
        **hardware.planner_rates(), gpu_bytes=int(gpu_bytes), pinned_host_bytes=int(host_bytes),
        nvme_bytes=int(nvme_bytes), tokens_per_step=n, meta=meta)
