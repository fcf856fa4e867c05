"""Thin functional layer under `Hybrid8bitOptimizer`: one AdamW update of one tensor, per-device kernels.

``adamw_step`` routes one parameter's update to a kernel (``select_kernel``) and every kernel implements the same
contract:

- decoupled AdamW exactly as ``torch.optim.AdamW``: ``p *= 1 - lr * wd``; ``m = lerp(m, g, 1 - beta1)``
  (= ``beta1 m + (1 - beta1) g``); ``v = beta2 v + (1 - beta2) g^2``;
  ``p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)`` with ``g = grad * clip_coef`` (the clip coefficient enters
  the update; the gradient tensor itself is never modified);
- the step uses the fp32 m and v of this step; 8-bit states are requantized afterwards (per-block absmax of the
  new values), as bitsandbytes does;
- the parameter is written from the fp32 result: into the fp32 master and then rounded into the parameter, or
  with a bf16 Kahan compensation buffer (``p + kahan`` is the represented value), or rounded directly.

Kernels (`KERNELS`):

- ``"torch"``: pure torch, any device, any float dtype; the reference the others are tested against.
- ``"cpp"``: the fused one-pass CPU kernel (`_cpu_kernel`), fp32/bf16 params and grads, contiguous tensors.
  ``LAZYTRAIN_CPU_KERNEL=torch|cpp`` forces the CPU choice (``cpp`` raises if the kernel cannot be built);
  ``LAZYTRAIN_CPU_ISA=avx512|avx2|generic`` forces its vectorized path (same bits on each; raises where the build
  lacks it).
- ``"triton"``: the fused one-pass GPU kernel for 8-bit states (`_triton_kernel`): the ``"cpp"`` kernel's
  arithmetic, so its bits equal the CPU update's (a layer updated on either side ends up identical); the CUDA
  default for 8-bit states where ``triton`` imports. On CPU tensors it runs in Triton's interpreter (tests only).
  ``LAZYTRAIN_GPU_KERNEL=triton|bnb|torch`` forces the CUDA choice (``triton`` raises where it cannot run).
- ``"bnb"``: bitsandbytes' CUDA kernels (8-bit blockwise for uint8 states, 32-bit for fp32 states) with the clip
  coefficient as ``gnorm_scale``. bitsandbytes applies weight decay *after* the Adam step
  (``p = (p - u)(1 - lr wd)``), so decay is applied here first and bitsandbytes gets ``weight_decay=0``; its
  8-bit kernel works on blocks of 256 only, rounds v to the nearest code and so may store the zero code
  (Note [v floor] in `quant`): codes of state2 are floored at 1 right after the kernel.

State keys (bitsandbytes' vocabulary): ``state1``/``state2`` (uint8 codes or fp32 moments, param-shaped),
``absmax1``/``absmax2`` (fp32 [ceil(N / block_size)], 8-bit only), ``master`` (fp32, param-shaped) or ``kahan``
(param dtype, param-shaped), ``step`` (int, updates applied so far: the kernels read the step from
`AdamWHyper` and the caller counts it after the update).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .. import envvars
from ..config import cpu_threads
from ._cpu_kernel import (
    DTYPE_CODES,
    CpuTables,
    cpu_adamw_step,
    cpu_dequantize_q8,
    cpu_isa_choice,
    cpu_kernel_status,
    load_cpu_kernel,
    resolve_isa,
)
from ._triton_kernel import triton_adamw_step, triton_status, triton_supports
from .quant import code_midpoints, dequantize_blockwise, dynamic_map, num_blocks, quantize_blockwise, zero_code

__all__ = [
    "KERNELS",
    "CPU_KERNEL_ENV",
    "GPU_KERNEL_ENV",
    "AdamWHyper",
    "Codebooks",
    "adamw_step",
    "adamw_step_torch",
    "adamw_step_cpp",
    "adamw_step_bnb_cuda",
    "can_prepare_cpp",
    "dequantize_states_cpp",
    "select_kernel",
    "triton_self_check",
    "cpu_kernel_choice",
    "cpu_isa_choice",
    "forced_isa_problem",
    "gpu_kernel_choice",
    "bitsandbytes_cuda_status",
]

logger = logging.getLogger(__name__)

KERNELS = ("torch", "cpp", "bnb", "triton")
CPU_KERNEL_ENV = "LAZYTRAIN_CPU_KERNEL"
GPU_KERNEL_ENV = "LAZYTRAIN_GPU_KERNEL"
BNB_BLOCK_SIZE = 256  # bitsandbytes' 2-state blockwise CUDA kernel is compiled for 256-element blocks
# "torch" / "bnb" kernels update large tensors in slices of this many elements (a multiple of every block size):
# their fp32 temporaries (param + Kahan sum, fp32 gradient, write-back residual) then stay ~0.1 GiB each instead of
# several GiB for a 0.55 B-element embedding (the 7B run's optimizer phase peaked 11 GiB above its resident
# memory). Blocks are independent, so sliced and whole updates are bitwise equal.
CHUNK_ELEMENTS = 1 << 25
_BNB_MAX_NUMEL = 2**31 - 1  # its element index is a 32-bit int

_logged: set[str] = set()


def _log_once(key: str, msg: str, *args: Any) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.warning(msg, *args)


@dataclass(frozen=True)
class AdamWHyper:
    """Hyperparameters of one update (Python floats; ``step`` counts this update, so it is >= 1).

    Derived values use double precision as ``torch.optim.AdamW`` does and are rounded to fp32 by the kernels.
    """

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int
    clip_coef: float = 1.0

    @property
    def decay(self) -> float:
        """Multiplier of the decoupled weight decay: ``1 - lr * weight_decay``."""
        return 1.0 - self.lr * self.weight_decay

    @property
    def step_size(self) -> float:
        """``lr / (1 - beta1**step)``."""
        return self.lr / (1.0 - self.beta1**self.step)

    @property
    def bc2_sqrt(self) -> float:
        """``sqrt(1 - beta2**step)``."""
        return (1.0 - self.beta2**self.step) ** 0.5


@dataclass(frozen=True)
class Codebooks:
    """The two quantization maps on one device, plus the CPU kernel's lookup tables on CPU.

    Fields:
        qmap1: fp32 [256] signed map (first moment); qmap2: fp32 [256] unsigned map (second moment).
        mids1, mids2: fp32 [255] midpoints (torch path).
        cpu: lookup tables for the fused CPU kernel (CPU codebooks only, built on first use).
    """

    qmap1: Tensor
    qmap2: Tensor
    mids1: Tensor
    mids2: Tensor
    cpu: CpuTables | None = None

    @classmethod
    def for_device(cls, device: torch.device | str) -> Codebooks:
        """Codebooks on ``device`` (CPU ones are built once per process and shared: they are read-only)."""
        device = torch.device(device)
        if device.type == "cpu":
            return _cpu_codebooks()
        q1, q2 = dynamic_map(True, device), dynamic_map(False, device)
        return cls(q1, q2, code_midpoints(q1), code_midpoints(q2), None)


@functools.cache
def _cpu_codebooks() -> Codebooks:
    q1, q2 = dynamic_map(True), dynamic_map(False)
    return Codebooks(q1, q2, code_midpoints(q1), code_midpoints(q2), CpuTables.build(q1, q2))


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
    device = torch.device(device)
    ok, reason = triton_status()
    if not ok:
        return False, reason
    # `_adamw_step_now` and `triton_adamw_step` directly: the check runs now even inside `deferred_launches`
    gen = torch.Generator().manual_seed(0)
    n, block = (70_000 if device.type == "cuda" else 2_600), 256  # CPU: Triton's interpreter, ~1000x slower
    p0 = (torch.randn(n, generator=gen) * 0.05).to(torch.bfloat16)
    g = (torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16)
    books = Codebooks.for_device("cpu")
    st: dict[str, Any] = {"step": 1, "kahan": (torch.randn(n, generator=gen) * 1e-5).to(torch.bfloat16)}
    st["state1"], st["absmax1"] = quantize_blockwise(torch.randn(n, generator=gen) * 1e-4, books.qmap1, block,
                                                     mids=books.mids1)
    st["state2"], st["absmax2"] = quantize_blockwise(torch.rand(n, generator=gen) * 1e-7, books.qmap2, block,
                                                     mids=books.mids2, nonzero_floor=True)
    hyper = AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.1, 2, clip_coef=0.37)
    ref_kernel = "cpp" if load_cpu_kernel() is not None else "torch"
    q_ref, s_ref = p0.clone(), {k: v.clone() if isinstance(v, Tensor) else v for k, v in st.items()}
    _adamw_step_now(q_ref, g, s_ref, hyper, books, block, ref_kernel, 1)
    q, s = p0.to(device), {k: v.to(device) if isinstance(v, Tensor) else v for k, v in st.items()}
    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        triton_adamw_step(q, g.to(device), s, hyper, Codebooks.for_device(device), block_size=block)
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


_deferral = threading.local()


@contextlib.contextmanager
def deferred_launches():
    """Inside the block `adamw_step` queues each update as a callable instead of running it; yields the queue
    (a list). The caller runs the callables later, in order, where their inputs are ready: the executor stages a
    layer's states on the H2D stream at load time and runs the update on the compute stream right before the layer's
    forward (streaming/device_updates.py, Note [GPU-side update ordering]). Per thread; not reentrant."""
    queue: list[Callable[[], None]] = []
    _deferral.queue = queue
    try:
        yield queue
    finally:
        _deferral.queue = None


def adamw_step(param: Tensor, grad: Tensor, state: dict[str, Any], hyper: AdamWHyper, books: Codebooks, *,
               block_size: int, kernel: str | None = None, threads: int | None = None,
               prepared: tuple[Tensor, Tensor] | None = None) -> str:
    """Update ``param`` and its ``state`` in place with one AdamW step; returns the kernel used.

    Args:
        param: parameter, any shape, N elements, fp32 / bf16 / fp16, on the device that holds its states.
        grad: gradient with N elements on ``param``'s device (any float dtype; never modified).
        state: the parameter's state dict (keys in this module's docstring), updated in place.
        hyper: hyperparameters of this step (``hyper.step`` counts this update, so it is >= 1).
        books: codebooks on ``param``'s device.
        block_size: quantization block size (elements) of 8-bit states.
        kernel: force one of `KERNELS` (tests, benchmarks); None: `select_kernel`.
        threads: CPU threads for the fused kernel (default `lazytrain_hf.config.cpu_threads()`).
        prepared: (m, v) fp32 [N], `dequantize_states_cpp` of these 8-bit states since their last update: the
            fused CPU kernel reads them instead of dequantizing (same values, same bits); other kernels ignore them.

    Raises:
        ValueError: unknown kernel, or sizes that do not match.
    """
    if grad.numel() != param.numel():
        raise ValueError(f"grad has {grad.numel()} elements but its parameter has {param.numel()}")
    kernel = kernel or select_kernel(param, grad, state, block_size)
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {list(KERNELS)}, but got {kernel!r}")
    queue = getattr(_deferral, "queue", None)
    if queue is not None:  # `deferred_launches`: run later, with the kernel picked now
        queue.append(functools.partial(_adamw_step_now, param, grad, state, hyper, books, block_size, kernel, threads))
        return kernel
    _adamw_step_now(param, grad, state, hyper, books, block_size, kernel, threads, prepared)
    return kernel


def _adamw_step_now(param: Tensor, grad: Tensor, state: dict[str, Any], hyper: AdamWHyper, books: Codebooks,
                    block_size: int, kernel: str, threads: int | None,
                    prepared: tuple[Tensor, Tensor] | None = None) -> None:
    if kernel == "cpp":  # fused one pass: no temporaries to bound
        adamw_step_cpp(param, grad, state, hyper, books, block_size=block_size, threads=threads, prepared=prepared)
        return
    if kernel == "triton":  # fused one pass too
        triton_adamw_step(param, grad, state, hyper, books, block_size=block_size)
        return
    step = adamw_step_torch if kernel == "torch" else adamw_step_bnb_cuda
    for p, g, st in _slices(param, grad, state, block_size):
        step(p, g, st, hyper, books, block_size=block_size)


def _slices(param: Tensor, grad: Tensor, state: dict[str, Any], block_size: int):
    """(param, grad, state) over slices of `CHUNK_ELEMENTS` (rounded down to whole blocks) of flat views; the
    whole tensors when small or not contiguous. Per-block absmax slices follow their elements."""
    n = param.numel()
    chunk = CHUNK_ELEMENTS - CHUNK_ELEMENTS % block_size
    tensors = [param, grad] + [v for v in state.values() if isinstance(v, Tensor)]
    if n <= chunk or chunk <= 0 or not all(t.is_contiguous() for t in tensors):
        yield param, grad, state
        return
    flat_p, flat_g = param.view(-1), grad.reshape(-1)
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        sub = {}
        for k, v in state.items():
            if not isinstance(v, Tensor) or v.dim() == 0:
                sub[k] = v
            elif k in ("absmax1", "absmax2"):
                sub[k] = v[a // block_size:-(-b // block_size)]
            else:
                sub[k] = v.view(-1)[a:b]
        yield flat_p[a:b], flat_g[a:b], sub


def _write_back(param: Tensor, work: Tensor, state: dict[str, Any]) -> None:
    """Store the fp32 result ``work`` (param-shaped) into the parameter (and the Kahan buffer)."""
    kahan = state.get("kahan")
    if kahan is not None:
        new = work.to(param.dtype)
        kahan.copy_(work - new.float())   # rounding residual, rounded to the buffer's dtype
        param.copy_(new)
    elif work is not param:
        param.copy_(work)                 # from the master (or a temporary): round to nearest


def _work_tensor(param: Tensor, state: dict[str, Any]) -> Tensor:
    """The fp32 value the update applies to: the master, ``param + kahan``, the fp32 param itself, or a copy."""
    master, kahan = state.get("master"), state.get("kahan")
    if master is not None:
        return master
    if kahan is not None:
        return param.float() + kahan.float()
    if param.dtype == torch.float32:
        return param
    return param.float()


@torch.no_grad()
def adamw_step_torch(param: Tensor, grad: Tensor, state: dict[str, Any], hyper: AdamWHyper, books: Codebooks,
                     *, block_size: int) -> None:
    """Pure-torch reference update (any device). Several passes and fp32 temporaries of N elements."""
    g = grad.reshape(param.shape).float()
    if hyper.clip_coef != 1.0:
        g = g * hyper.clip_coef                        # a temporary: the caller's gradient stays as it was
    s1, s2 = state["state1"], state["state2"]
    eight_bit = s1.dtype == torch.uint8
    if eight_bit:
        m = dequantize_blockwise(s1, state["absmax1"], books.qmap1, block_size).view(param.shape)
        v = dequantize_blockwise(s2, state["absmax2"], books.qmap2, block_size).view(param.shape)
    else:
        m, v = s1, s2
    work = _work_tensor(param, state)
    # the operations and their order of torch.optim.AdamW (single-tensor path)
    if hyper.weight_decay != 0:
        work.mul_(hyper.decay)
    m.lerp_(g, 1 - hyper.beta1)
    v.mul_(hyper.beta2).addcmul_(g, g, value=1 - hyper.beta2)
    denom = (v.sqrt() / hyper.bc2_sqrt).add_(hyper.eps)
    work.addcdiv_(m, denom, value=-hyper.step_size)
    _write_back(param, work, state)
    if eight_bit:
        quantize_blockwise(m, books.qmap1, block_size, mids=books.mids1, out=s1, absmax_out=state["absmax1"])
        quantize_blockwise(v, books.qmap2, block_size, mids=books.mids2, nonzero_floor=True, out=s2,
                           absmax_out=state["absmax2"])


@torch.no_grad()
def adamw_step_cpp(param: Tensor, grad: Tensor, state: dict[str, Any], hyper: AdamWHyper, books: Codebooks,
                   *, block_size: int, threads: int | None = None,
                   prepared: tuple[Tensor, Tensor] | None = None) -> None:
    """Fused one-pass CPU update (`_cpu_kernel`). Same result as `adamw_step_torch` up to fp32 rounding
    order, i.e. at most one code step per 8-bit state element. `prepared`: as `adamw_step` (8-bit states only;
    ignored for fp32 ones).

    Raises:
        RuntimeError: the kernel could not be built.
        ValueError: a tensor the kernel does not handle (see `select_kernel`).
    """
    lib = load_cpu_kernel()
    if lib is None:
        raise RuntimeError(f"fused CPU kernel unavailable: {cpu_kernel_status()[1]}")
    why_not = _cpp_supports(param, grad, state)
    if why_not is not None:
        raise ValueError(f"fused CPU kernel does not handle {why_not}")
    if books.cpu is None:
        raise ValueError("adamw_step_cpp needs CPU codebooks (Codebooks.for_device('cpu'))")
    g = grad.contiguous()
    eight_bit = state["state1"].dtype == torch.uint8
    cpu_adamw_step(
        lib, books.cpu, param, g, state["state1"], state["state2"],
        state["absmax1"] if eight_bit else None, state["absmax2"] if eight_bit else None,
        state.get("master"), state.get("kahan"),
        block_size=block_size, clip_coef=hyper.clip_coef, beta1=hyper.beta1, beta2=hyper.beta2, eps=hyper.eps,
        decay=hyper.decay, step_size=hyper.step_size, bc2_sqrt=hyper.bc2_sqrt,
        threads=threads if threads is not None else cpu_threads(), prepared=prepared if eight_bit else None,
    )


def can_prepare_cpp(param: Tensor, state: dict[str, Any]) -> bool:
    """Whether `dequantize_states_cpp` applies: 8-bit states of a contiguous CPU parameter, the fused kernel
    built and not switched off (``LAZYTRAIN_CPU_KERNEL=torch``)."""
    s1 = state.get("state1")
    return (s1 is not None and s1.dtype == torch.uint8 and param.device.type == "cpu" and param.is_contiguous()
            and s1.is_contiguous() and state["state2"].is_contiguous() and cpu_kernel_choice() != "torch"
            and load_cpu_kernel() is not None)


@torch.no_grad()
def dequantize_states_cpp(state: dict[str, Any], books: Codebooks, out: tuple[Tensor, Tensor], *, block_size: int,
                          threads: int | None = None) -> None:
    """m and v of 8-bit CPU `state` -> fp32 `out` ([N] each), the values the fused kernel's update dequantizes, so
    that a later `adamw_step(..., prepared=out)` skips that half of its table reads (Hybrid8bitOptimizer
    `prepare_states`). Check `can_prepare_cpp` first.

    Raises:
        RuntimeError: the fused kernel is unavailable. ValueError: tensors of the wrong dtype, size or layout.
    """
    lib = load_cpu_kernel()
    if lib is None:
        raise RuntimeError(f"fused CPU kernel unavailable: {cpu_kernel_status()[1]}")
    cpu_dequantize_q8(lib, books.cpu, state["state1"].reshape(-1), state["state2"].reshape(-1), state["absmax1"],
                      state["absmax2"], out[0], out[1], block_size=block_size,
                      threads=threads if threads is not None else cpu_threads())


@torch.no_grad()
def adamw_step_bnb_cuda(param: Tensor, grad: Tensor, state: dict[str, Any], hyper: AdamWHyper, books: Codebooks,
                        *, block_size: int) -> None:
    """bitsandbytes' CUDA update (8-bit blockwise or 32-bit states), AdamW decay order, v floor.

    Raises:
        ValueError: 8-bit states with ``block_size != 256`` (bitsandbytes' kernel is compiled for 256).
    """
    import bitsandbytes.functional as bnbf

    s1, s2 = state["state1"], state["state2"]
    eight_bit = s1.dtype == torch.uint8
    if eight_bit and block_size != BNB_BLOCK_SIZE:
        raise ValueError(f"bitsandbytes' 8-bit blockwise kernel needs block_size={BNB_BLOCK_SIZE}, "
                         f"but got {block_size}")
    work = _work_tensor(param, state)                  # fp32, contiguous (bitsandbytes reads raw pointers)
    g = grad.float().contiguous()                      # bitsandbytes needs g.dtype == p.dtype
    if hyper.weight_decay != 0:
        work.mul_(hyper.decay)                         # decoupled decay first, as torch.optim.AdamW
    with _on_default_stream(param.device, (work, g)):
        _bnb_update(bnbf, eight_bit, work, g, s1, s2, state, hyper, books)
    if eight_bit:
        # Note [v floor] (quant.py): bitsandbytes rounds v to the nearest code, possibly 0. A v that was exactly
        # 0 also gets code 1 here; harmless, since then m == 0 as well.
        s2.clamp_(min=1)
    _write_back(param, work, state)


@contextlib.contextmanager
def _on_default_stream(device: torch.device, temporaries: tuple[Tensor, ...]):
    """Order a bitsandbytes optimizer kernel with the current stream. bitsandbytes launches its optimizer kernels
    without a stream argument, i.e. on the legacy default stream (bitsandbytes/backends/cuda/ops.py,
    `_optimizer_update_8bit_blockwise_impl`), which does not synchronize with PyTorch's non-blocking side streams:
    under a side stream the kernel read half-copied inputs and raced its own write-back (non-finite norms on an
    H200, 2026-11-29). Under a side stream: the default stream waits for the current one, and
    the current one for the kernel; the temporaries are marked in use by the default stream."""
    cur, s0 = torch.cuda.current_stream(device), torch.cuda.default_stream(device)
    if cur == s0:
        yield
        return
    s0.wait_stream(cur)
    yield
    cur.wait_stream(s0)
    for t in temporaries:
        t.record_stream(s0)


def _bnb_update(bnbf: Any, eight_bit: bool, work: Tensor, g: Tensor, s1: Tensor, s2: Tensor, state: dict[str, Any],
                hyper: AdamWHyper, books: Codebooks) -> None:
    """The bitsandbytes kernel launch alone (it runs on the legacy default stream: `_on_default_stream`)."""
    if eight_bit:
        bnbf.optimizer_update_8bit_blockwise(
            "adam", g, work, s1, s2, hyper.beta1, hyper.beta2, 0.0, 0.0, hyper.eps, hyper.step, hyper.lr,
            books.qmap1, books.qmap2, state["absmax1"], state["absmax2"],
            weight_decay=0.0, gnorm_scale=hyper.clip_coef, skip_zeros=False,
        )
    else:
        bnbf.optimizer_update_32bit(
            "adam", g, work, s1, hyper.beta1, hyper.eps, hyper.step, hyper.lr, state2=s2, beta2=hyper.beta2,
            weight_decay=0.0, gnorm_scale=hyper.clip_coef,
        )

