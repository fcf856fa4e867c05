"""Fused GPU AdamW kernel for 8-bit states (Triton): the CPU kernel's arithmetic, one pass, no temporaries.

The bitsandbytes route (`functional.adamw_step_bnb_cuda`) needs fp32 copies around bitsandbytes' own kernel for the
Kahan compensation (param + kahan, the fp32 gradient, the write-back residual): about 97 bytes of traffic per parameter
over ten launches, measured at 17.7 G params/s on an H200 (benchmarks/results/hybrid8-gpu-triton-20261130.json) against
~14 bytes per parameter for the update itself. This kernel does it all in one pass: per quantization block it
dequantizes m and v through the 256-entry maps, applies AdamW (clip coefficient folded into the gradient), writes the
parameter (fp32 master, Kahan-compensated bf16, or plain), takes the new per-block absmax and requantizes.

Every fp32 operation mirrors `_cpu_kernel`'s ``update_one`` / ``nearest_code`` in the same order: the m update
is one fused multiply-add (`tl.fma`, as the C++ ``fmadd``), nothing else is contracted (``enable_fp_fusion=False``,
the C++ is built with ``-ffp-contract=off``), division and square root are IEEE-rounded (`tl.div_rn`,
`tl.sqrt_rn`), bf16 rounding is the same integer round-to-nearest-even with canonical NaN. So the GPU update gives
the CPU kernel's bits, and a layer updated on the CPU or on the GPU ends up identical (tests/optim: the Triton
interpreter on CPU in CI, compiled on the GPU machine).

CPU tensors run through Triton's interpreter (numpy; for tests only: thousands of times slower than the C++
kernel). Needs the ``triton`` package (shipped with CUDA builds of torch); `triton_status` says why not otherwise.
"""

from __future__ import annotations

import functools
import struct
from typing import Any

import torch
from torch import Tensor

from ._cpu_kernel import CpuTables
from .quant import LUT_EXP_RANGE, LUT_MANT_BITS

__all__ = ["triton_status", "triton_adamw_step", "triton_supports", "LAUNCH"]

# Launch shape: quantization blocks per Triton program (a [rows, block] tile) and warps per program. Speed only,
# never a result bit (blocks are independent); `benchmarks/bench_optim.py --triton-launch` sweeps it.
LAUNCH = {"rows": 4, "num_warps": 4}
_MAX_BLOCK = 4096


@functools.cache
def triton_status() -> tuple[bool, str]:
    """(usable, reason): whether ``import triton`` works here (the kernel is compiled on first launch)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return False, f"triton not importable ({type(e).__name__}: {e})"
    return True, "ok"


def triton_supports(param: Tensor, grad: Tensor, state: dict[str, Any], block_size: int) -> str | None:
    """None when the kernel handles this update, else what it does not handle (for the caller's fallback)."""
    s1 = state.get("state1")
    if s1 is None or s1.dtype != torch.uint8:
        return "fp32 optimizer states"
    if block_size & (block_size - 1) or not 32 <= block_size <= _MAX_BLOCK:
        return f"block_size={block_size} (needs a power of two in [32, {_MAX_BLOCK}])"
    if param.dtype not in (torch.float32, torch.bfloat16) or grad.dtype not in (torch.float32, torch.bfloat16):
        return f"param {param.dtype} / grad {grad.dtype}"
    tensors = [param, grad] + [v for v in state.values() if isinstance(v, Tensor) and v.dim() > 0]
    if not all(t.is_contiguous() for t in tensors):
        return "non-contiguous tensors"
    if "kahan" in state and param.dtype != torch.bfloat16:
        return "a Kahan buffer on a non-bf16 parameter"
    return None


@functools.cache
def _kernel(interpret: bool):
    """The kernel: compiled for CUDA, or Triton's interpreter for CPU tensors. The interpreter replaces every
    ``@triton.jit`` function when ``TRITON_INTERPRET=1`` is set at decoration, so the CPU variant is a second copy
    of the source module, imported under that setting."""
    if not interpret:
        from ._triton_source import hybrid8_adamw

        return hybrid8_adamw
    import importlib.util
    import os
    from pathlib import Path
    from unittest import mock

    spec = importlib.util.spec_from_file_location("lazytrain_hf.optim._triton_source_interpreted",
                                                  Path(__file__).with_name("_triton_source.py"))
    module = importlib.util.module_from_spec(spec)
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
        spec.loader.exec_module(module)
    return module.hybrid8_adamw


_tables_on: dict[tuple[str, int | None], CpuTables] = {}


def _tables(books: Any, device: torch.device) -> CpuTables:
    """The C++ kernel's tables (`CpuTables`: maps and lookup tables) of `books`' maps, on `device`, cached."""
    key = (device.type, device.index)
    hit = _tables_on.get(key)
    if hit is None:
        t = books.cpu if getattr(books, "cpu", None) is not None else CpuTables.build(books.qmap1, books.qmap2)
        hit = _tables_on[key] = CpuTables(t.qmap1.to(device), t.qmap2.to(device), t.lut1.to(device),
                                          t.lut2.to(device), t.half)
    return hit


def _f32(x: float) -> float:
    """x rounded to fp32 (as the C++ entry point's float arguments), back as a Python float."""
    return struct.unpack("f", struct.pack("f", x))[0]


@torch.no_grad()
def triton_adamw_step(param: Tensor, grad: Tensor, state: dict[str, Any], hyper: Any, books: Any, *,
                      block_size: int) -> None:
    """One AdamW update of ``param`` (8-bit states) in place; same contract and bits as `adamw_step_cpp`.

    Args:
        param: fp32 or bf16 [N] (any shape, contiguous) on a CUDA device, or on the CPU (Triton interpreter).
        grad: fp32 or bf16, N elements, same device (never modified).
        state: uint8 ``state1`` / ``state2`` [N], fp32 ``absmax1`` / ``absmax2`` [ceil(N / block_size)], and
            ``master`` (fp32 [N]) or ``kahan`` (bf16 [N]) or neither; updated in place.
        hyper: `functional.AdamWHyper`; books: `functional.Codebooks` (its maps; moved to the device once).
        block_size: elements per quantization block (a power of two in [32, 4096]).

    Raises:
        RuntimeError: triton is not importable (`triton_status`).
        ValueError: an update the kernel does not handle (`triton_supports`), or tensors on different devices.
    """
    ok, why = triton_status()
    if not ok:
        raise RuntimeError(f"the Triton update kernel is unavailable: {why}")
    why_not = triton_supports(param, grad, state, block_size)
    if why_not is not None:
        raise ValueError(f"the Triton update kernel does not handle {why_not}")
    dev = param.device
    master, kahan = state.get("master"), state.get("kahan")
    tensors = [grad, state["state1"], state["state2"], state["absmax1"], state["absmax2"], master, kahan]
    if any(t is not None and t.device != dev for t in tensors):
        raise ValueError("triton_adamw_step: every tensor must be on the parameter's device")
    n = param.numel()
    if n == 0:
        return
    tab = _tables(books, dev)
    shift = 23 - LUT_MANT_BITS
    kmask = (1 << (8 + LUT_MANT_BITS)) - 1
    low_mask = (1 << shift) - 1
    key_off = ((127 - LUT_EXP_RANGE) << LUT_MANT_BITS) - 1
    w1 = _f32(1.0 - hyper.beta1)
    lerp_low = abs(w1) < 0.5
    w1c = w1 if lerp_low else _f32(w1 - 1.0)  # exact: w1 and 1 are fp32, so the fp32 difference is w1 - 1
    mode = 1 if master is not None else 2 if kahan is not None else 0
    p_bf16 = param.dtype == torch.bfloat16

    def bits(t: Tensor | None) -> Tensor | None:  # bf16 tensors go in as their int16 bits
        return t.view(torch.int16) if t is not None and t.dtype == torch.bfloat16 else t

    p_arg, g_arg = bits(param.view(-1)), bits(grad.reshape(-1))
    nblocks = -(-n // block_size)
    rows, warps = LAUNCH["rows"], LAUNCH["num_warps"]
    grid = (-(-nblocks // rows),)
    dummy = state["absmax1"]  # pointer arguments a mode does not read
    kernel = _kernel(dev.type != "cuda")
    kernel[grid](
        p_arg, g_arg, state["state1"].view(-1), state["state2"].view(-1), state["absmax1"], state["absmax2"],
        master.view(-1) if master is not None else dummy, bits(kahan.view(-1)) if kahan is not None else dummy,
        tab.qmap1, tab.qmap2, tab.lut1, tab.lut2, n, nblocks,
        _f32(hyper.clip_coef), _f32(hyper.beta2), w1c, _f32(1.0 - hyper.beta2), _f32(hyper.eps), _f32(hyper.decay),
        _f32(-hyper.step_size), _f32(hyper.bc2_sqrt),
        tab.half, shift, kmask, low_mask, key_off, tab.half - 1,
        BLOCK=block_size, ROWS=rows, MODE=mode, P_BF16=p_bf16, G_BF16=grad.dtype == torch.bfloat16,
        LERP_LOW=lerp_low, num_warps=warps, enable_fp_fusion=False,
    )
