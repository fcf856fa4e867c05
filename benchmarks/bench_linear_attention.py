"""Gated DeltaNet kernel paths, one decoder layer at a time, on the GPU machine.

    python -m benchmarks.bench_linear_attention --batch-size 8 --out benchmarks/results/linear_attention-YYYYMMDD.json

One decoder layer of each kind at the registry shape `--model` (default qwen3.6-27b: hidden 5120, 16 key / 48 value
heads of 128), bf16, input [B, T, hidden] (`--batch-size` B, `--seq-len` T = 1024), for each path (`--systems`):
    fla            flash-linear-attention's kernels, where transformers bound them (it does when `fla` imports).
                   Attempted also where `fla_usable` says no, so the row shows fla's own error (status "error");
                   a row without fla installed says "unsupported".
    torch          transformers' reference PyTorch functions (`lazytrain_hf.kernels.use_reference_kernels`).
    torch_compile  the reference with the layer's GatedDeltaNet module compiled (`module.compile()`, default
                   inductor, by `lazytrain_hf.kernels.compile_linear_attention`, as lazytrain_config
                   compile_linear_attention runs it). Chosen over compiling `torch_chunk_gated_delta_rule` alone:
                   the layer calls that by its module-level name, so compiling it means rebinding a transformers
                   global, while the module compiles in place; transformers' kernel wrapper is dynamo-aware (it
                   skips its logging while compiling), the chunk loop unrolls at a fixed T (T / 64 chunks), and the
                   conv, gates and gated norm around the rule fuse too. `compile_s` is the first forward + backward (the compile).
The full-attention layer does not use these kernels: it is measured once, under "torch".

Per row, CUDA events around each call, `--warmup` untimed calls, median of `--iters` (>= 5):
    fwd_ms       no-grad forward;
    fwd_bwd_ms   forward with grad + backward of a random output gradient (weight gradients included);
    saved_gib    memory held after the forward with grad (autograd's saved activations and the output);
    peak_gib     peak during forward + backward above what was allocated before, less the weight gradients;
    max_rel_err_out / max_rel_err_dx   (fla, torch_compile) ||y - y_torch|| / ||y_torch||, same for the input grad.
Each path runs in its own try/except (out of memory: status "oom"; anything else: "error" with the reason);
`--budget-s` stops starting new measurements once spent (rows say "not run"). Rows follow shared/RESULTS_FORMAT.md
(suite "linear_attention"; `step_s_*` are the forward + backward times) and are appended to `--out`; a table is
printed. `--device cpu` runs the same code on a tiny shape (tests; wall clock, no memory figures).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

SYSTEMS = ("fla", "torch", "torch_compile")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3.6-27b", help="lazytrain_hf registry name (a qwen3_5_text shape)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {SYSTEMS}")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--budget-s", type=float, default=900.0, help="start no new measurement after this many seconds")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None, help="results JSON (appended); omitted: print only")
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in args.systems if s not in SYSTEMS]
    if bad:
        p.error(f"--systems: unknown {bad}; choose from {list(SYSTEMS)}")
    if args.iters < 5 and args.device == "cuda":
        p.error(f"--iters must be at least 5 on CUDA (medians over 5+ calls), but got {args.iters}")
    return args


class _Holder(torch.nn.Module):
    """Lets the kernel helpers, which take a model, see one decoder layer."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer


def _build_layers(config: Any, dev: torch.device, dtype: torch.dtype) -> tuple[dict[str, tuple[int, Any]], Any]:
    """{kind: (layer index, decoder layer on `dev`)} with random weights, and the rotary module."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        body = AutoModelForCausalLM.from_config(config).model
    kinds = list(config.layer_types)
    layers: dict[str, tuple[int, Any]] = {}
    for kind in ("linear_attention", "full_attention"):
        if kind not in kinds:
            continue
        idx = kinds.index(kind)
        layer = body.layers[idx].to_empty(device=dev)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02)
                elif name.endswith("linear_attn.norm.weight"):
                    p.fill_(1.0)  # the gated RMSNorm scales by its weight
                elif "norm" in name:
                    p.zero_()  # Qwen3.5's other RMSNorms scale by (1 + weight)
                elif name.endswith("A_log"):
                    p.copy_(torch.empty_like(p, dtype=torch.float32).uniform_(0.01, 16).log())
                elif name.endswith("dt_bias"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02)
        layers[kind] = (idx, layer.to(dtype))
    with torch.device(dev):
        rotary = type(body.rotary_emb)(config=config)
    return layers, rotary


def _timer(cuda: bool):
    from lazytrain_hf.profiling.layer_costs import time_ms

    return lambda fn: time_ms(fn, cuda)


def _measure(layer: Any, inputs: dict[str, Any], args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    """Times and memory of one layer (see the module docstring), plus its output and input gradient."""
    x, dy = inputs["x"], inputs["dy"]
    timed = _timer(cuda)

    def fwd(inp: Any) -> Any:
        out = layer(inp, position_embeddings=inputs["rope"], attention_mask=None, position_ids=inputs["pos"])
        return out[0] if isinstance(out, tuple) else out

    def no_grad_fwd() -> None:
        with torch.no_grad():
            fwd(x)

    def fwd_bwd() -> None:
        xi = x.detach().requires_grad_(True)
        fwd(xi).backward(dy)
        layer.zero_grad(set_to_none=True)

    first_s = timed(fwd_bwd) / 1e3  # includes compilation where there is one
    for _ in range(args.warmup):
        no_grad_fwd()
        fwd_bwd()
    f = [timed(no_grad_fwd) for _ in range(args.iters)]
    fb = [timed(fwd_bwd) for _ in range(args.iters)]
    out: dict[str, Any] = {"fwd_ms": statistics.median(f), "fwd_bwd": fb, "first_s": first_s,
                           "saved_gib": None, "peak_gib": None, "peak_gpu_gib": None}
    xi = x.detach().requires_grad_(True)
    if cuda:
        gib = 1024**3
        grads = sum(p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        y = fwd(xi)
        out["saved_gib"] = (torch.cuda.memory_allocated() - base) / gib
        y.backward(dy)
        torch.cuda.synchronize()
        out["peak_gib"] = max(0, torch.cuda.max_memory_allocated() - base - grads) / gib
        out["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / gib
    else:
        y = fwd(xi)
        y.backward(dy)
    out["y"], out["dx"] = y.detach(), xi.grad.detach()
    layer.zero_grad(set_to_none=True)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _failure(e: BaseException) -> tuple[str, str]:
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return "oom", str(e).splitlines()[0][:300]
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return "error", f"{type(e).__name__}: {first}"[:400]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = _parse(argv)
    from lazytrain_hf import kernels
    from lazytrain_hf.models import resolve_config

    from .common import append_results, percentiles, row

    t_start = time.monotonic()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    config = resolve_config(args.model)
    if getattr(config, "model_type", None) != "qwen3_5_text":
        raise ValueError(f"--model {args.model!r} is model_type {config.model_type!r}; a qwen3_5_text shape "
                         "(linear-attention layers) is needed, e.g. qwen3.6-27b or qwen3.5-tiny")
    torch.manual_seed(0)
    layers, rotary = _build_layers(config, dev, dtype)
    B, T, H = args.batch_size, args.seq_len, config.hidden_size
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(B, T, H, device=dev, dtype=dtype, generator=g)
    pos = torch.arange(T, device=dev).unsqueeze(0).expand(B, -1)
    inputs = {"x": x, "dy": torch.randn(B, T, H, device=dev, dtype=dtype, generator=g), "pos": pos,
              "rope": rotary(x, pos[None].expand(3, -1, -1))}  # Qwen3.5's rotary takes (3, B, T) positions

    lin_idx, lin = layers["linear_attention"]
    holder = _Holder(lin)
    bound = kernels.linear_attention_kernel(holder)
    usable, usable_reason = kernels.fla_usable(dev)
    common = {"fla_usable": usable, "fla_reason": usable_reason, "fla_version": kernels._fla_version(),
              "triton_version": kernels._triton_version(), "bound_by_transformers": bound}

    plan = [(s, "linear_attention") for s in SYSTEMS if s in args.systems]
    if "torch" in args.systems and "full_attention" in layers:
        plan.insert(plan.index(("torch", "linear_attention")) + 1, ("torch", "full_attention"))
    rows: list[dict[str, Any]] = []
    results: dict[tuple[str, str], dict[str, Any]] = {}
    for system, kind in plan:
        idx, layer = layers[kind]
        params = sum(p.numel() for p in layer.parameters())
        r = row(system=system, model=args.model, params=params, batch_size=B, seq_len=T, status="ok",
                extra={"kind": kind, "layer_index": idx, **common})
        rows.append(r)
        spent = time.monotonic() - t_start
        if spent > args.budget_s:
            r.update(status="error", reason=f"not run: --budget-s {args.budget_s:g} spent ({spent:.0f} s)")
            continue
        try:
            if kind == "linear_attention":
                if system == "fla" and bound != "fla":
                    r.update(status="unsupported", reason=f"transformers bound {bound!r}, not fla: {usable_reason}")
                    continue
                if system != "fla":
                    kernels.use_reference_kernels(holder)
                if system == "torch_compile":
                    kernels.compile_linear_attention(holder)  # what compile_linear_attention=True runs
                r["extra"]["kernel"] = kernels.linear_attention_kernel(holder)
            m = _measure(layer, inputs, args, cuda)
        except Exception as e:  # noqa: BLE001 - every failure becomes a row
            status, reason = _failure(e)
            r.update(status=status, reason=reason)
            if cuda:
                torch.cuda.empty_cache()
            continue
        med = statistics.median(m["fwd_bwd"])
        r.update(percentiles([t / 1e3 for t in m["fwd_bwd"]]), tokens_per_s=B * T / (med / 1e3),
                 peak_gpu_gib=m["peak_gpu_gib"])
        r["extra"].update(fwd_ms=m["fwd_ms"], fwd_bwd_ms=med, peak_gib=m["peak_gib"], saved_gib=m["saved_gib"])
        if system == "torch_compile":
            r["extra"]["compile_s"] = m["first_s"]
        results[(system, kind)] = {"row": r, "y": m["y"], "dx": m["dx"]}
    ref = results.get(("torch", "linear_attention"))
    for system in ("fla", "torch_compile"):
        got = results.get((system, "linear_attention"))
        if ref is not None and got is not None:
            got["row"]["extra"].update(max_rel_err_out=_rel(got["y"], ref["y"]), max_rel_err_dx=_rel(got["dx"], ref["dx"]))

    if args.out:
        append_results(args.out, "linear_attention", rows)
    _print_table(rows)
    return rows


def _print_table(rows: list[dict[str, Any]]) -> None:
    def f(v: Any, fmt: str) -> str:
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    print(f"{'system':<14} {'kind':<17} {'status':<11} {'fwd_ms':>8} {'fwd_bwd_ms':>10} {'peak_gib':>8} "
          f"{'rel_err_dx':>10}  reason")
    for r in rows:
        e = r["extra"]
        print(f"{r['system']:<14} {e['kind']:<17} {r['status']:<11} {f(e.get('fwd_ms'), '8.2f')} "
              f"{f(e.get('fwd_bwd_ms'), '10.2f')} {f(e.get('peak_gib'), '8.2f')} {f(e.get('max_rel_err_dx'), '10.2e')}"
              f"  {r['reason'] or ''}")


if __name__ == "__main__":
    main()
