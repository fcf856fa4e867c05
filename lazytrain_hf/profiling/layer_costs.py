"""Measure one decoder layer of each kind at the planned (batch, seq) on the GPU, and put the numbers in a CostModel.

`measure_layer_costs` builds the model on the meta device, materializes one layer per kind (and the rotary table)
on the device with random bf16 weights, and times, with CUDA events (median of `iters`):
    fwd_ms       a no-grad forward,
    bwd_ms       forward with grad + backward, minus fwd_ms,
and reads from the caching allocator:
    saved_bytes      memory held after a forward with grad (autograd-saved activations, the input included),
    fwd_work_bytes   peak during a no-grad forward, minus its input and output,
    bwd_work_bytes   peak during backward, minus the saved activations and the weight gradients.
On a machine without CUDA it returns None (a no-op), unless `allow_cpu=True` (tests): then wall-clock timing and
no memory figures. With `compile_linear_attention` (LazyTrainConfig.compile_linear_attention) a linear-attention
layer on the reference kernels is measured compiled, as the executor runs it; the compile happens in the first,
untimed warm-up.

Layers that do not train in full (LoRA adapters over frozen weights, a 4-bit QLoRA base) are measured as they run:
with `layers` given, a device copy of the model's own first layer of each kind (its dtypes, 4-bit weights and
adapters; the weight gradients only of what trains) under the executor's autocast. A fresh bf16 layer would time
weight-gradient GEMMs a frozen layer never runs and miss the adapters' work and the 4-bit weights' dequantization
(the run's own layers of a Llama-3-70B nf4 base ran at 1.04-1.05 of their profile, those of a Qwen2.5-32B LoRA at
1.03-1.04: benchmarks/results/lora-20261203.json).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any

from ..planning.cost_model import CostModel

__all__ = ["LayerMeasurement", "measure_layer_costs", "apply_layer_measurements", "time_ms"]


@dataclass
class LayerMeasurement:
    """One layer kind measured at one (batch, seq).

    Attributes:
        kind: "full_attention" or "linear_attention".
        layer_index: the decoder layer that was measured.
        fwd_ms, bwd_ms: no-grad forward; backward including its forward with grad minus `fwd_ms` (ms).
        saved_bytes, fwd_work_bytes, bwd_work_bytes: see the module docstring (bytes; None when not measured).
        device: where it ran.
    """

    kind: str
    layer_index: int
    fwd_ms: float
    bwd_ms: float
    saved_bytes: int | None
    fwd_work_bytes: int | None
    bwd_work_bytes: int | None
    device: str


def measure_layer_costs(config: Any, batch_size: int, seq_len: int, device: Any = "cuda", *, warmup: int = 2,
                        iters: int = 5, allow_cpu: bool = False, seed: int = 0, memory: bool = True,
                        compile_linear_attention: bool = False, layers: Any = None,
                        autocast_dtype: Any = None, hidden_dtype: Any = None) -> dict[str, LayerMeasurement] | None:
    """Measure the first decoder layer of each kind; {kind: LayerMeasurement}, or None without CUDA.

    Args:
        config: a transformers config (its `_attn_implementation` is used, sdpa by default).
        batch_size, seq_len: the planned micro-batch [B, T].
        device: the CUDA device.
        warmup, iters: untimed and timed repetitions.
        allow_cpu: measure on the CPU anyway (wall clock, no memory figures): for tests of this code path.
        seed: random seed of weights and inputs (the caller's random state is restored afterwards).
        memory: also measure the memory figures (resets the device's peak-memory statistics); False: times only.
        compile_linear_attention: measure the linear-attention layer with its GatedDeltaNet module compiled where
            the reference kernels run (`kernels.compile_linear_attention`; at least one warm-up then, the compile).
        layers: the model's decoder layers (host copies): measure a device copy of the first of each kind as it is
            (frozen and 4-bit weights, adapters) instead of a fresh bf16 layer; None: the fresh layer.
        autocast_dtype: run the measured layer under torch.autocast to this dtype (the executor's
            `autocast_dtype`); None: off.
        hidden_dtype: the dtype of the layer's input hidden states (the model's input embedding's); None: the
            measured layer's first floating parameter's.
    """
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        return None
    if dev.type != "cuda" and not allow_cpu:
        return None
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):  # mid-training: keep the run's RNG
        torch.manual_seed(seed)
        return _measure_kinds(config, batch_size, seq_len, dev, warmup, iters, memory, compile_linear_attention,
                              layers, autocast_dtype, hidden_dtype)


def _measure_kinds(config: Any, batch_size: int, seq_len: int, dev: Any, warmup: int, iters: int,
                   memory: bool, compile_la: bool = False, layers: Any = None,
                   autocast_dtype: Any = None, hidden_dtype: Any = None) -> dict[str, LayerMeasurement]:
    import torch
    from transformers import AutoModelForCausalLM

    from ..kernels import TORCH_COMPILE, compile_linear_attention, select_linear_attention

    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(config)
    # the kernels training will run: fla where it is bound and works on `dev`, else the reference functions
    # (compiled with `compile_la`)
    path = select_linear_attention(meta_model, dev, log=False, compile=compile_la)
    body = meta_model.model
    kinds = list(getattr(config, "layer_types", None) or ["full_attention"] * len(body.layers))
    first: dict[str, int] = {}
    for i, k in enumerate(kinds[: len(body.layers)]):
        first.setdefault("linear_attention" if k == "linear_attention" else "full_attention", i)
    with torch.device(dev):
        rotary = type(body.rotary_emb)(config=config)
    out: dict[str, LayerMeasurement] = {}
    for kind, idx in first.items():
        if layers is not None:
            layer = _device_copy(layers[idx], dev)
        else:
            layer = _fresh_layer(body.layers[idx], config, dev)
        compiled = path == TORCH_COMPILE and compile_linear_attention(layer) > 0
        out[kind] = _measure_one(layer, rotary, kind, idx, batch_size, seq_len, config.hidden_size, dev,
                                 max(warmup, 1) if compiled else warmup, iters, memory,
                                 mrope="qwen3_5" in config.model_type, autocast_dtype=autocast_dtype,
                                 hidden_dtype=hidden_dtype)
        del layer
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _device_copy(layer: Any, dev: Any) -> Any:
    """A copy of the model's layer `layer` on `dev` with its own dtypes, 4-bit weights and requires_grad flags."""
    from ..streaming.quant import keep_packing, template_copy

    out = template_copy(layer).to(dev)
    keep_packing(out)
    return out


def _fresh_layer(meta_layer: Any, config: Any, dev: Any) -> Any:
    """The meta layer `meta_layer` materialized on `dev` with random weights, in bf16 (fp32 on a CPU)."""
    import torch

    layer = meta_layer.to_empty(device=dev)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            elif "norm" in name and "qwen3_5" in config.model_type and "linear_attn.norm" not in name:
                p.zero_()  # Qwen3.5's RMSNorms scale by (1 + weight); the gated norm inside linear_attn by weight
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return layer.to(torch.bfloat16 if dev.type == "cuda" else torch.float32)


def _measure_one(layer: Any, rotary: Any, kind: str, idx: int, B: int, T: int, H: int, dev: Any, warmup: int,
                 iters: int, memory: bool = True, mrope: bool = False, autocast_dtype: Any = None,
                 hidden_dtype: Any = None) -> LayerMeasurement:
    import torch

    cuda = dev.type == "cuda"
    # the hidden states' dtype: the layer's floating parameters' (a 4-bit weight's packed data is uint8)
    dtype = hidden_dtype or next(p.dtype for p in layer.parameters() if p.is_floating_point())
    x = torch.randn(B, T, H, device=dev, dtype=dtype)
    pos = torch.arange(T, device=dev).unsqueeze(0).expand(B, -1)
    # Qwen3.5's multimodal rotary takes (3, B, T) position ids (transformers <= 5.17 indexes them as 3-D)
    cos, sin = rotary(x, pos[None].expand(3, -1, -1) if mrope else pos)

    def fwd(inp: Any) -> Any:
        with torch.autocast(dev.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            out = layer(inp, position_embeddings=(cos, sin), attention_mask=None, position_ids=pos)
        return out[0] if isinstance(out, tuple) else out

    def timed(fn: Any) -> float:
        return time_ms(fn, cuda)

    def no_grad_fwd() -> None:
        with torch.no_grad():
            fwd(x)

    def fwd_bwd() -> None:
        xi = x.detach().requires_grad_(True)
        y = fwd(xi)
        y.backward(torch.ones_like(y))
        layer.zero_grad(set_to_none=True)

    for _ in range(warmup):  # the first one compiles a compiled module (its no-grad and its autograd graphs)
        no_grad_fwd()
        fwd_bwd()
    f = statistics.median(timed(no_grad_fwd) for _ in range(iters))
    fb = statistics.median(timed(fwd_bwd) for _ in range(iters))
    saved = fwd_work = bwd_work = None
    if cuda and memory:
        act = x.numel() * x.element_size()
        grads = sum(p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        with torch.no_grad():
            y = fwd(x)
        fwd_work = max(0, torch.cuda.max_memory_allocated(dev) - base - act)  # y (= act) stays allocated
        del y
        xi = x.detach().requires_grad_(True)
        before = torch.cuda.memory_allocated(dev)
        y = fwd(xi)
        # growth = graph-held tensors + the output y; the output's bytes stand in for the input's (saved_bytes
        # counts the input, which here was allocated before)
        saved = max(0, torch.cuda.memory_allocated(dev) - before)
        torch.cuda.reset_peak_memory_stats(dev)
        held = torch.cuda.memory_allocated(dev)
        y.backward(torch.ones_like(y))
        bwd_work = max(0, torch.cuda.max_memory_allocated(dev) - held - grads)
        del y, xi
        layer.zero_grad(set_to_none=True)
    return LayerMeasurement(kind, idx, f, max(0.0, fb - f), saved, fwd_work, bwd_work, str(dev))


def time_ms(fn: Any, cuda: bool) -> float:
    """Milliseconds `fn()` takes: CUDA events on the current stream when `cuda`, else the wall clock."""
    import torch

    if cuda:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def apply_layer_measurements(cm: CostModel, measured: dict[str, LayerMeasurement], *, time_scale: float = 1.0,
                             memory: bool = True, memory_scale: float = 1.0) -> CostModel:
    """A copy of `cm` whose per-layer fwd_ms, bwd_ms (and memory figures, when measured and `memory`) come from
    `measured`, by layer kind. Kinds not measured keep their analytic values.

    Args:
        time_scale: multiplies the measured times: a layer measured over r rows and run over a micro-batch of B
            rows in passes takes B / r times as long (its GEMMs are linear in rows).
        memory: take the measured memory figures too: saved / forward / backward workspaces per pass (x
            `memory_scale`, the planned rows per pass over the measured rows: activations are linear in rows), and
            a retained layer's bytes (`retained_bytes`: the whole micro-batch's saved activations, x `time_scale`,
            plus its output)."""
    fields: dict[str, list[Any]] = {k: list(getattr(cm, k)) for k in
                                    ("fwd_ms", "bwd_ms", "saved_bytes", "fwd_work_bytes", "bwd_work_bytes")}
    retained = [cm.retained(i) for i in range(cm.num_layers)]
    for i, kind in enumerate(cm.layer_kind):
        m = measured.get(kind)
        if m is None:
            continue
        fields["fwd_ms"][i] = m.fwd_ms * time_scale
        fields["bwd_ms"][i] = m.bwd_ms * time_scale
        if not memory:
            continue
        for name in ("saved_bytes", "fwd_work_bytes", "bwd_work_bytes"):
            if getattr(m, name) is not None:
                fields[name][i] = int(getattr(m, name) * memory_scale)
        if m.saved_bytes is not None:
            retained[i] = int(m.saved_bytes * time_scale) + int(cm.act_bytes[i])
    meta = dict(cm.meta, estimate="measured layers" if measured else cm.meta.get("estimate", ""))
    return dataclasses.replace(cm, **fields, retained_bytes=retained if memory else cm.retained_bytes, meta=meta)
