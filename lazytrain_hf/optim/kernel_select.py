"""Which Hybrid8 update kernel runs where: the environment choices (``LAZYTRAIN_CPU_KERNEL``,
``LAZYTRAIN_CPU_ISA``, ``LAZYTRAIN_GPU_KERNEL``), the kernels' self-checks against the pure-torch reference (once
per process, before the first update depends on them) and `select_kernel`, which picks one per update and logs each
fallback reason once. The kernels themselves are in `functional` (and `_cpu_kernel`, `_triton_kernel`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import Tensor

from .. import envvars
from ..config import cpu_threads
from ._cpu_kernel import DTYPE_CODES, cpu_isa_choice, cpu_kernel_status, load_cpu_kernel, resolve_isa
from ._triton_kernel import triton_status, triton_supports
from .quant import dynamic_map, num_blocks, quantize_blockwise, zero_code

__all__ = ["CPU_KERNEL_ENV", "GPU_KERNEL_ENV", "BNB_BLOCK_SIZE", "select_kernel", "cpu_kernel_choice",
           "forced_isa_problem", "gpu_kernel_choice", "bitsandbytes_cuda_status", "cpp_kernel_self_check",
           "triton_self_check"]

logger = logging.getLogger("lazytrain_hf.optim.functional")  # the name users filter on for these warnings

CPU_KERNEL_ENV = "LAZYTRAIN_CPU_KERNEL"
GPU_KERNEL_ENV = "LAZYTRAIN_GPU_KERNEL"
BNB_BLOCK_SIZE = 256  # bitsandbytes' 2-state blockwise CUDA kernel is compiled for 256-element blocks
_BNB_MAX_NUMEL = 2**31 - 1  # its element index is a 32-bit int

_logged: set[str] = set()


def _log_once(key: str, msg: str, *args: Any) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.warning(msg, *args)


def cpu_kernel_choice() -> str:
    """``LAZYTRAIN_CPU_KERNEL`` normalized: ``"auto"`` (unset), ``"torch"`` or ``"cpp"``.

    Raises:
        ValueError: any other value.
    """
    return envvars.read(CPU_KERNEL_ENV)


def forced_isa_problem() -> str | None:
    """Why the ISA path ``LAZYTRAIN_CPU_ISA`` forces cannot run here (the build lacks it, or it failed the load-time
    bit check), else None; None too when unset / "auto", with ``LAZYTRAIN_CPU_KERNEL=torch``, or when the fused
    kernel cannot be built (`select_kernel` reports that). Builds the kernel (cached) only when a path is forced, so
    that the optimizer refuses it when built instead of at its first update, after a step's work.

    Raises:
        ValueError: a bad ``LAZYTRAIN_CPU_ISA`` / ``LAZYTRAIN_CPU_KERNEL`` value.
    """
    if cpu_isa_choice() == "auto" or cpu_kernel_choice() == "torch":
        return None
    lib = load_cpu_kernel()
    if lib is None:
        return None
    try:
        resolve_isa(lib)
    except RuntimeError as e:
        return str(e)
    return None


def gpu_kernel_choice() -> str:
    """``LAZYTRAIN_GPU_KERNEL`` normalized: ``"auto"`` (unset), ``"triton"``, ``"bnb"`` or ``"torch"``.

    Raises:
        ValueError: any other value.
    """
    return envvars.read(GPU_KERNEL_ENV)


@functools.cache
def bitsandbytes_cuda_status(device_index: int = 0) -> tuple[bool, str]:
    """``(available, reason)``: can bitsandbytes' CUDA optimizer kernels run on ``cuda:device_index``?

    Runs both kernels once on 512-element dummy tensors (so a missing CUDA library shows up here, not halfway
    through an update). Cached per device.
    """
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    try:
        import bitsandbytes.functional as bnbf
    except Exception as e:  # noqa: BLE001 - any import failure means: not available
        return False, f"bitsandbytes is not importable ({type(e).__name__}: {e})"
    try:
        dev = torch.device("cuda", device_index)
        n = 2 * BNB_BLOCK_SIZE
        p = torch.zeros(n, device=dev)
        g = torch.full((n,), 0.5, device=dev)
        s1 = torch.full((n,), 127, dtype=torch.uint8, device=dev)
        s2 = torch.zeros(n, dtype=torch.uint8, device=dev)
        a1 = torch.zeros(2, device=dev)
        a2 = torch.zeros(2, device=dev)
        bnbf.optimizer_update_8bit_blockwise("adam", g, p, s1, s2, 0.9, 0.999, 0.0, 0.0, 1e-8, 1, 1e-3,
                                             dynamic_map(True, dev), dynamic_map(False, dev), a1, a2,
                                             weight_decay=0.0, gnorm_scale=1.0, skip_zeros=False)
        f1, f2 = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
        bnbf.optimizer_update_32bit("adam", g, p, f1, 0.9, 1e-8, 1, 1e-3, state2=f2, beta2=0.999,
                                    weight_decay=0.0, gnorm_scale=1.0)
        torch.cuda.synchronize(dev)
        if not torch.allclose(p, torch.full_like(p, -2e-3), rtol=1e-3):
            return False, f"bitsandbytes self-test gave {p[:2].tolist()} instead of -2e-3 after two Adam steps"
    except Exception as e:  # noqa: BLE001
        return False, f"bitsandbytes CUDA kernels failed a self-test ({type(e).__name__}: {e})"
    return True, "ok"


@functools.cache
def cpp_kernel_self_check(threads: int) -> tuple[bool, str]:
    """``(ok, reason)``: does the fused CPU kernel, as built for this CPU (``-march=native``) and run on ``threads``
    threads, agree with the pure-torch reference? Once per process and thread count, on 262,221 elements (several
    threads' ranges, a partial last block) in the executor's configuration (bf16 weights, Kahan compensation,
    8-bit states, bf16 gradients) and with fp32 master weights: finite results, parameters within one bf16 ulp,
    masters within fp32 rounding (the tolerances of tests/optim/test_functional.py). ~50 ms.

    Why: the native build runs on CPUs CI never sees; a wrong update there would poison training silently.
    """
    from .functional import AdamWHyper, Codebooks, adamw_step

    if load_cpu_kernel() is None:
        return False, cpu_kernel_status()[1]
    books = Codebooks.for_device("cpu")
    n, block = (1 << 18) + 77, 256
    gen = torch.Generator().manual_seed(0)
    for gdtype, master in ((torch.bfloat16, "kahan"), (torch.float32, "master")):
        p0 = (torch.randn(n, generator=gen) * 0.05).to(torch.bfloat16)
        grads = [torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 2) for _ in range(3)]
        st: dict[str, Any] = {
            "step": 0, "state1": torch.full((n,), zero_code(books.qmap1), dtype=torch.uint8),
            "state2": torch.full((n,), zero_code(books.qmap2), dtype=torch.uint8),
            "absmax1": torch.zeros(num_blocks(n, block)), "absmax2": torch.zeros(num_blocks(n, block))}
        st[master] = torch.zeros(n, dtype=torch.bfloat16) if master == "kahan" else p0.float()
        for g in grads[:2]:
            st["step"] += 1
            adamw_step(p0, g, st, AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.1, st["step"]), books, block_size=block,
                       kernel="torch")
        out = {}
        for kernel in ("torch", "cpp"):
            q = p0.clone()
            s = {k: v.clone() if isinstance(v, Tensor) else v for k, v in st.items()}
            s["step"] += 1
            hyper = AdamWHyper(2e-3, 0.9, 0.999, 1e-8, 0.1, s["step"], clip_coef=0.37)
            adamw_step(q, grads[2].to(gdtype), s, hyper, books, block_size=block, kernel=kernel, threads=threads)
            out[kernel] = (q.float(), s[master].float() + (q.float() if master == "kahan" else 0))
        (q_t, v_t), (q_c, v_c) = out["torch"], out["cpp"]
        where = f"{master} master, {gdtype} gradients, {threads} threads"
        if not (bool(torch.isfinite(q_c).all()) and bool(torch.isfinite(v_c).all())):
            return False, f"non-finite results ({where})"
        bad = _beyond_one_bf16_ulp(q_c, q_t)
        if bad:
            return False, f"{bad} of {n} parameters differ from the torch reference by more than one bf16 ulp ({where})"
        rtol = 2.0**-15 if master == "kahan" else 1e-6
        if not torch.allclose(v_c, v_t, rtol=rtol, atol=1e-7):
            return False, f"the updated master values differ from the torch reference ({where})"
    return True, "ok"


@functools.cache
def triton_self_check(device: torch.device | str) -> tuple[bool, str]:
    """``(ok, reason)``: does the Triton update kernel compile and run on ``device``, and give the C++ kernel's bits?
    Once per process and device, before the first GPU-side update uses it: 70,000 elements on a GPU (many programs, a
    partial last block; 2,600 on the CPU, where the interpreter runs it) in the executor's configuration (bf16
    weights, Kahan compensation, 8-bit states, bf16 gradients, a clip coefficient), against the C++ kernel on the CPU (bit-equal), or against the torch reference
    within one bf16 ulp where the C++ kernel is unavailable. ~1-2 s the first time (Triton's compile).

    Why: ``import triton`` can succeed where compiling or running the kernel fails (an unsupported GPU, a broken
    toolchain); a failure here falls back to bitsandbytes' kernel before any training step depends on it.
    """
    from . import functional as F

    device = torch.device(device)
    ok, reason = triton_status()
    if not ok:
        return False, reason
    # `_adamw_step_now` and `triton_adamw_step` directly: the check runs now even inside `deferred_launches`
    gen = torch.Generator().manual_seed(0)
    n, block = (70_000 if device.type == "cuda" else 2_600), 256  # CPU: Triton's interpreter, ~1000x slower
    p0 = (torch.randn(n, generator=gen) * 0.05).to(torch.bfloat16)
    g = (torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16)
    books = F.Codebooks.for_device("cpu")
    st: dict[str, Any] = {"step": 1, "kahan": (torch.randn(n, generator=gen) * 1e-5).to(torch.bfloat16)}
    st["state1"], st["absmax1"] = quantize_blockwise(torch.randn(n, generator=gen) * 1e-4, books.qmap1, block,
                                                     mids=books.mids1)
    st["state2"], st["absmax2"] = quantize_blockwise(torch.rand(n, generator=gen) * 1e-7, books.qmap2, block,
                                                     mids=books.mids2, nonzero_floor=True)
    hyper = F.AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.1, 2, clip_coef=0.37)
    ref_kernel = "cpp" if load_cpu_kernel() is not None else "torch"
    q_ref, s_ref = p0.clone(), {k: v.clone() if isinstance(v, Tensor) else v for k, v in st.items()}
    F._adamw_step_now(q_ref, g, s_ref, hyper, books, block, ref_kernel, 1)
    q, s = p0.to(device), {k: v.to(device) if isinstance(v, Tensor) else v for k, v in st.items()}
    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        F.triton_adamw_step(q, g.to(device), s, hyper, F.Codebooks.for_device(device), block_size=block)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - any compile or launch failure means: fall back
        return False, f"the Triton kernel failed to run on {device}: {type(e).__name__}: {str(e).strip()[-300:]}"
    q, s = q.cpu(), {k: v.cpu() if isinstance(v, Tensor) else v for k, v in s.items()}
    if ref_kernel == "cpp":
        differ = [k for k in ("state1", "state2", "absmax1", "absmax2", "kahan")
                  if not torch.equal(s[k].view(torch.uint8), s_ref[k].view(torch.uint8))]
        if not torch.equal(q.view(torch.int16), q_ref.view(torch.int16)):
            differ.insert(0, "param")
        if differ:
            return False, f"the Triton kernel's {', '.join(differ)} differ from the C++ kernel's bits on {device}"
    else:
        bad = _beyond_one_bf16_ulp(q.float(), q_ref.float())
        if bad:
            return False, f"{bad} of {n} parameters differ from the torch reference by more than one bf16 ulp"
    return True, "ok"


def _beyond_one_bf16_ulp(x: Tensor, ref: Tensor) -> int:
    """How many elements of fp32 `x` differ from `ref` by more than one bf16 ulp of `ref` (the self-checks' rule)."""
    return int(((x - ref).abs() > (ref.abs() * 2.0**-7).clamp(min=1e-30)).sum())


def _cpp_supports(param: Tensor, grad: Tensor, state: dict[str, Any]) -> str | None:
    """None when the fused CPU kernel can run this update, else the reason it cannot."""
    if param.dtype not in DTYPE_CODES:
        return f"param dtype {param.dtype} (the kernel takes float32 and bfloat16)"
    if grad.dtype not in DTYPE_CODES:
        return f"grad dtype {grad.dtype} (the kernel takes float32 and bfloat16)"
    if state.get("kahan") is not None and param.dtype != torch.bfloat16:
        return f"Kahan compensation for {param.dtype} params (the kernel does it for bfloat16)"
    if not param.is_contiguous():
        return "a non-contiguous parameter"
    return None


def select_kernel(param: Tensor, grad: Tensor, state: dict[str, Any], block_size: int) -> str:
    """Pick the kernel for one update (one of `KERNELS`); logs each fallback reason once.

    Raises:
        RuntimeError: ``LAZYTRAIN_CPU_KERNEL=cpp`` but the fused kernel cannot be built, ``LAZYTRAIN_CPU_ISA``
            names a path the built kernel lacks, or
            ``LAZYTRAIN_GPU_KERNEL=triton`` but ``triton`` does not import or the kernel fails its self-check.
        ValueError: bad ``LAZYTRAIN_CPU_KERNEL`` / ``LAZYTRAIN_CPU_ISA`` / ``LAZYTRAIN_GPU_KERNEL`` value.
    """
    dev = param.device.type
    if dev == "cpu":
        choice = cpu_kernel_choice()
        if choice == "torch":
            return "torch"
        if load_cpu_kernel() is None:
            ok, reason = cpu_kernel_status()
            if choice == "cpp":
                raise RuntimeError(f"{CPU_KERNEL_ENV}=cpp but the fused CPU kernel could not be built: {reason}")
            _log_once("cpp-build", "Hybrid8bitOptimizer: fused CPU kernel unavailable (%s); using the pure-torch "
                      "update, several times slower. Install a C++ compiler with OpenMP (g++) to enable it.",
                      reason)
            return "torch"
        resolve_isa(load_cpu_kernel())  # a forced path the build lacks fails here, before any update
        ok, reason = cpp_kernel_self_check(cpu_threads())
        if not ok:
            if choice == "cpp":
                raise RuntimeError(f"{CPU_KERNEL_ENV}=cpp but the fused CPU kernel failed its self-check on this CPU: "
                                   f"{reason}")
            _log_once("cpp-check", "Hybrid8bitOptimizer: the fused CPU kernel failed its self-check on this CPU (%s); "
                      "using the pure-torch update, several times slower. Please report it with your CPU model.",
                      reason)
            return "torch"
        why_not = _cpp_supports(param, grad, state)
        if why_not is not None:
            _log_once(f"cpp-{why_not}", "Hybrid8bitOptimizer: fused CPU kernel does not handle %s; using the "
                      "pure-torch update for such tensors.", why_not)
            return "torch"
        return "cpp"
    if dev == "cuda":
        choice = gpu_kernel_choice()
        if choice == "torch":
            return "torch"
        if choice in ("auto", "triton"):
            ok, reason = triton_status()
            if not ok and choice == "triton":
                raise RuntimeError(f"{GPU_KERNEL_ENV}=triton but the Triton update kernel is unavailable: {reason}")
            if not ok:
                _log_once("triton-missing", "Hybrid8bitOptimizer: the fused Triton update kernel is unavailable "
                          "(%s); using bitsandbytes' kernel (several times slower with Kahan compensation).",
                          reason)
            elif triton_supports(param, grad, state, block_size) is None:
                checked, why = triton_self_check(param.device)
                if checked:
                    return "triton"
                if choice == "triton":
                    raise RuntimeError(f"{GPU_KERNEL_ENV}=triton but the Triton update kernel failed its self-check: "
                                       f"{why}")
                _log_once("triton-check", "Hybrid8bitOptimizer: the fused Triton update kernel failed its self-check "
                          "(%s); using bitsandbytes' kernel. Please report it with your GPU model.", why)
            # else (fp32 states, odd block sizes, a failed check): bitsandbytes or torch, below
        eight_bit = state["state1"].dtype == torch.uint8
        if eight_bit and block_size != BNB_BLOCK_SIZE:
            _log_once("bnb-block", "Hybrid8bitOptimizer: bitsandbytes' CUDA kernel uses %d-element blocks, but "
                      "block_size=%d; using the pure-torch update on the GPU (slower).", BNB_BLOCK_SIZE, block_size)
            return "torch"
        if param.numel() > _BNB_MAX_NUMEL or not param.is_contiguous():
            return "torch"
        ok, reason = bitsandbytes_cuda_status(param.device.index or 0)
        if not ok:
            _log_once("bnb-missing", "Hybrid8bitOptimizer: bitsandbytes CUDA kernels unavailable (%s); using the "
                      "pure-torch update on the GPU (slower).", reason)
            return "torch"
        return "bnb"
    return "torch"
