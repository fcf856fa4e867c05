"""Thin functional layer under `Hybrid8bitOptimizer`: one AdamW update of one tensor, per-device kernels.

``adamw_step`` routes one parameter's update to a kernel (``select_kernel``, in `kernel_select` with the environment
choices and the kernels' self-checks) and every kernel implements the same contract:

- decoupled AdamW exactly as ``torch.optim.AdamW``: ``p *= 1 - lr * wd``; ``m = lerp(m, g, 1 - beta1)``
  (= ``beta1 m + (1 - beta1) g``); ``v = beta2 v + (1 - beta2) g^2``;
  ``p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)`` with ``g = grad * clip_coef`` (the clip coefficient enters
  the update; the gradient tensor itself is never modified);
- the step uses the fp32 m and v of this step; 8-bit states are requantized afterwards (per-block absmax of the
  new values), as bitsandbytes does;
- the parameter is written from the fp32 result: into the fp32 master and then rounded into the parameter, or
  with a bf16 Kahan compensation buffer (``p + kahan`` is the represented value), or rounded directly (to
  nearest, or stochastically where ``AdamWHyper.sr_seed`` is set: `stochastic_round_bf16`, torch kernel only).

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

from ..config import cpu_threads
from ._cpu_kernel import (
    CpuTables,
    cpu_adamw_step,
    cpu_dequantize_q8,
    cpu_isa_choice,
    cpu_kernel_status,
    load_cpu_kernel,
)
from ._triton_kernel import triton_adamw_step
from .kernel_select import (  # re-exported: the selection lives in kernel_select
    BNB_BLOCK_SIZE,
    CPU_KERNEL_ENV,
    GPU_KERNEL_ENV,
    _cpp_supports,
    bitsandbytes_cuda_status,
    cpu_kernel_choice,
    forced_isa_problem,
    gpu_kernel_choice,
    select_kernel,
    triton_self_check,
)
from .quant import code_midpoints, dequantize_blockwise, dynamic_map, quantize_blockwise

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
# "torch" / "bnb" kernels update large tensors in slices of this many elements (a multiple of every block size):
# their fp32 temporaries (param + Kahan sum, fp32 gradient, write-back residual) then stay ~0.1 GiB each instead of
# several GiB for a 0.55 B-element embedding (the 7B run's optimizer phase peaked 11 GiB above its resident
# memory). Blocks are independent, so sliced and whole updates are bitwise equal.
CHUNK_ELEMENTS = 1 << 25

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
    #: a bf16 parameter without master copy is written with stochastic rounding from random bits of this seed and
    #: each element's index (`stochastic_round_bf16`); None: round to nearest
    sr_seed: int | None = None

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
    if hyper.sr_seed is not None:  # the fused kernels round to nearest
        if kernel not in (None, "torch"):
            raise ValueError(f"stochastic rounding (AdamWHyper.sr_seed) runs on the torch kernel, not {kernel!r}")
        kernel = "torch"
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
    for offset, p, g, st in _slices(param, grad, state, block_size):
        if kernel == "torch":
            adamw_step_torch(p, g, st, hyper, books, block_size=block_size, offset=offset)
        else:
            adamw_step_bnb_cuda(p, g, st, hyper, books, block_size=block_size)


def _slices(param: Tensor, grad: Tensor, state: dict[str, Any], block_size: int):
    """(offset, param, grad, state) over slices of `CHUNK_ELEMENTS` (rounded down to whole blocks) of flat views,
    offset = the slice's first element; the whole tensors (offset 0) when small or not contiguous. Per-block absmax
    slices follow their elements."""
    n = param.numel()
    chunk = CHUNK_ELEMENTS - CHUNK_ELEMENTS % block_size
    tensors = [param, grad] + [v for v in state.values() if isinstance(v, Tensor)]
    if n <= chunk or chunk <= 0 or not all(t.is_contiguous() for t in tensors):
        yield 0, param, grad, state
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
        yield a, flat_p[a:b], flat_g[a:b], sub


_M32 = 0xFFFFFFFF


def random_bits16(seed: int, offset: int, n: int, device: torch.device | str = "cpu") -> Tensor:
    """16 random bits (int64 in [0, 65536)) for elements `offset` .. `offset + n - 1` of an update seeded `seed`:
    murmur3's 32-bit finalizer applied to the index, xor the seed, and applied again (mod 2^32): the seed enters
    non-linearly, so two updates draw unrelated bits rather than shifted windows of one sequence. A function of
    (seed, index) alone, so any split of a tensor into slices, and any device, gives each element the same bits."""
    h = _fmix32(torch.arange(offset, offset + n, dtype=torch.int64, device=device) & _M32)
    return _fmix32(h ^ (seed & _M32)) & 0xFFFF


def _fmix32(h: Tensor) -> Tensor:
    """murmur3's 32-bit finalizer on int64 tensors holding 32-bit values."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def stochastic_round_bf16(x: Tensor, seed: int, offset: int = 0) -> Tensor:
    """fp32 `x` rounded to bf16 stochastically: up (in magnitude) with probability equal to the dropped 16 bits'
    fraction of a bf16 ulp, so that the rounded value's expectation is `x` (unbiased, where round to nearest drops
    every update smaller than half an ulp). Non-finite values round to nearest; a finite value does not round to
    infinity (past the largest bf16 number it stays there, as round to nearest keeps it). The bits:
    `random_bits16`."""
    flat = x.reshape(-1)
    bits = flat.view(torch.int32).to(torch.int64) & _M32
    up = (bits + random_bits16(seed, offset, flat.numel(), x.device)) & 0xFFFF0000
    up = torch.where(up >= 1 << 31, up - (1 << 32), up).to(torch.int32).view(torch.float32)
    finite = torch.isfinite(flat)
    big = torch.finfo(torch.bfloat16).max
    up = torch.where(finite & torch.isinf(up), torch.copysign(torch.full_like(up, big), flat), up)
    return torch.where(finite, up, flat).to(torch.bfloat16).view(x.shape)


def update_seed(param_index: int, step: int) -> int:
    """The `AdamWHyper.sr_seed` of update `step` of the optimizer's parameter number `param_index`: every update of
    every parameter draws other bits, and a resumed run the same ones."""
    h = (param_index * 0x632BE5AB + step * 0x9E3779B1 + 0x2545F491) & _M32
    h ^= h >> 15
    h = (h * 0x2C1B3C6D) & _M32
    return h ^ (h >> 12)


def _write_back(param: Tensor, work: Tensor, state: dict[str, Any], hyper: AdamWHyper | None = None,
                offset: int = 0) -> None:
    """Store the fp32 result ``work`` (param-shaped) into the parameter (and the Kahan buffer); stochastically
    rounded where ``hyper.sr_seed`` is set and the parameter is bf16 without a master or Kahan buffer (`offset`:
    the index of ``param``'s first element in the whole tensor)."""
    kahan = state.get("kahan")
    if kahan is not None:
        new = work.to(param.dtype)
        kahan.copy_(work - new.float())   # rounding residual, rounded to the buffer's dtype
        param.copy_(new)
    elif (hyper is not None and hyper.sr_seed is not None and param.dtype == torch.bfloat16
          and state.get("master") is None):
        param.copy_(stochastic_round_bf16(work, hyper.sr_seed, offset))
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
                     *, block_size: int, offset: int = 0) -> None:
    """Pure-torch reference update (any device). Several passes and fp32 temporaries of N elements. `offset`: the
    index of ``param``'s first element in the whole tensor (a slice of it: the stochastic rounding's bits)."""
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
    _write_back(param, work, state, hyper, offset)
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
    assert hyper.sr_seed is None, "stochastic rounding runs the torch kernel (adamw_step)"
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

