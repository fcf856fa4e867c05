"""Fused CPU AdamW kernel (C++ / OpenMP, ``csrc/hybrid8_cpu.cpp``), built on first use with
`torch.utils.cpp_extension.load_inline`.

Per quantization block (kept in L1), two passes: (1) dequantize m and v -> AdamW (clip coefficient folded into the
gradient) -> write the parameter (fp32, or bf16 from an fp32 master / Kahan-compensated) -> new m and v into a
per-thread buffer and their absmax; (2) requantize m and v. OpenMP threads take dynamic chunks of whole blocks.

Three paths (ISAs), each doing the same fp32 operations in the same order, so the same bits (except which NaN
survives where two NaNs meet: the compiler's operand order): a generic one (compiled always, vectorized by the
compiler), AVX2 + FMA (8 lanes) and AVX-512 (16 lanes; compiled where the flags define AVX-512 F/BW/VL/DQ): one
hand-vectorized implementation (C++ templates) over a traits struct per vector width. The native build
(``-march=native``) has every path its CPU allows, the portable build the generic one (without FMA there, its m
update rounds twice: not the native paths' bits). The path is an argument of
each call: ``LAZYTRAIN_CPU_ISA=avx512|avx2|generic`` forces one (read at each update; a path the build lacks
raises), else AVX2 where the build has it: AVX-512 ran 9% slower than AVX2 at 16 threads on the one AVX-512 host
measured (`_configure_isa`), so it is opt-in. It must give the AVX2 path's bits on this CPU at load
(`isa_bit_check`), else forcing it raises and the status says why. `cpu_kernel_status` names the path in use.

Cost per element is dominated by four table reads (two dequantizations through the 256-entry maps, two searches
for the nearest code through `kernel_lookup_table`). The AVX-512 path keeps each 256-entry map in 16 registers
(vpermi2ps + blends, no memory access); the code-search table (2 x 6,401 entries) does not fit. The AVX2 path's
four reads and the AVX-512 path's two code searches use gathers or scalar loads; which is faster depends on the CPU
(scalar loads were 10-20% faster on the AMD Zen 3 cores measured; gathers are cheap on some other cores), so at
load the library times both on one thread on the "auto" path and keeps the faster
(``LAZYTRAIN_CPU_LOOKUP=gather|scalar`` forces one; `cpu_kernel_status` says which was picked and why). The
choice changes speed only, never a result bit.

Prepared moments: `cpu_dequantize_q8` runs the dequantization alone, ahead of time, into fp32 buffers that a later
update reads instead (``prepared=``; the same values, so the same bits): half of the table reads move out of the
update (`Hybrid8bitOptimizer.prepare_states`; measured on the H200 host: 1.09x alone, no faster in training steps,
so the executor does it only when asked, `LazyTrainConfig.prepared_states_budget`).

The source is plain C++ with ``extern "C"`` entry points called through ctypes (which releases the GIL while the
kernel runs, so an executor thread can overlap it with other work). It includes no torch headers: the build takes
seconds instead of about a minute for a ``torch/extension.h`` extension.

The library is cached in torch's extension directory (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions/<python>_<variant>``) under a name that includes a hash of the CPU's feature flags,
because it is built with ``-march=native`` (a cache shared by different CPUs gets one build per CPU kind). If the
native build fails, a portable build is tried; if that fails too, `load_cpu_kernel` returns None and
`cpu_kernel_status` gives the reason (the optimizer then logs it and uses the pure-torch path).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import pathlib
import platform
import threading
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import envvars
from .quant import LUT_EXP_RANGE, LUT_MANT_BITS

__all__ = ["load_cpu_kernel", "cpu_kernel_status", "CpuTables", "kernel_lookup_table", "cpu_adamw_step",
           "cpu_quantize_blockwise", "cpu_dequantize_q8", "cpu_isa_choice", "resolve_isa", "isa_paths",
           "isa_bit_check", "DTYPE_CODES", "ISA_ENV", "ISA_CODES"]

logger = logging.getLogger(__name__)

# dtype codes shared with the C++ source
DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1}
# master modes shared with the C++ source
MASTER_NONE, MASTER_FP32, MASTER_KAHAN = 0, 1, 2
# lt_abi_version() of csrc/hybrid8_cpu.cpp (4: the kernel's lookup table layout of `CpuTables`; 5: the ISA argument;
# 6: prepared m / v (lt_dequantize_q8, pre1 / pre2))
_ABI_VERSION = 6

# The C++ source, shipped as package data (setup.cfg); load_inline's build cache hashes its text, so an edited
# source rebuilds.
_SOURCE_PATH = pathlib.Path(__file__).with_name("csrc") / "hybrid8_cpu.cpp"
try:
    _SOURCE: str | None = _SOURCE_PATH.read_text(encoding="utf-8")
    _SOURCE_ERROR = ""
except OSError as e:  # a broken install: the optimizer falls back to the pure-torch path (`cpu_kernel_status`)
    _SOURCE = None
    _SOURCE_ERROR = f"kernel source {_SOURCE_PATH} not readable ({e}); reinstall lazytrain-hf"

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I = ctypes.c_int
_F = ctypes.c_float
_ADAMW_ARGTYPES = [_P, _I, _P, _I, _I64,            # param, param_dtype, grad, grad_dtype, n
                   _P, _P, _I, _P, _P,              # state1, state2, state_8bit, absmax1, absmax2
                   _P, _P, _I, _I64,                # master, kahan, master_mode, block
                   _P, _P, _P, _P,                  # lut1, qmap1, lut2, qmap2
                   _I64, _I, _I,                    # lut_half, lut_k, lut_m
                   _F, _F, _F, _F, _F, _F, _F, _F,  # clip, beta2, 1-beta1, 1-beta2, eps, decay, -step_size, bc2_sqrt
                   _I, _I, _P, _P]                  # threads, isa, pre1, pre2
_DEQUANT_ARGTYPES = [_P, _P, _P, _P, _P, _P, _I64, _I64, _P, _P, _I, _I]
_QUANT_ARGTYPES = [_P, _I64, _I64, _P, _P, _P, _P, _I64, _I, _I, _I, _I, _I, _I]
_CALIBRATE_ARGTYPES = [_I64, _I, _P, _P, _P, _P, _I64, _I, _I, ctypes.POINTER(ctypes.c_double), _I]

LOOKUP_ENV = "LAZYTRAIN_CPU_LOOKUP"
# table-read modes of the kernel's AVX2 / AVX-512 paths (lt_set_lookup); "auto" measures both once at load
LOOKUP_MODES = {"gather": 0, "scalar": 1}
ISA_ENV = "LAZYTRAIN_CPU_ISA"
# the kernel's paths (`Isa` in the source), best first; a build has those up to lt_isa_best()
ISA_CODES = {"avx512": 2, "avx2": 1, "generic": 0}
_ISA_NAMES = {v: k for k, v in ISA_CODES.items()}
_CALIBRATION_ELEMENTS = 1 << 14
_CALIBRATION_REPS = 15

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_status: tuple[bool, str] | None = None


def _cpu_tag() -> str:
    """Short hash of the CPU's feature flags and architecture (the build uses -march=native)."""
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name")):
                    flags += line
                    if line.startswith(("flags", "Features")):
                        break
    except OSError:
        pass
    return hashlib.sha1((platform.machine() + flags).encode()).hexdigest()[:10]


def _build() -> tuple[ctypes.CDLL, str]:
    from torch.utils.cpp_extension import load_inline

    if _SOURCE is None:
        raise RuntimeError(_SOURCE_ERROR)
    errors = []
    for variant, arch in (("native", ["-march=native"]), ("portable", [])):
        name = f"lazytrain_hybrid8_cpu_{variant}_{_cpu_tag() if arch else platform.machine()}"
        try:
            path = load_inline(
                name=name,
                cpp_sources=[_SOURCE],
                extra_cflags=["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", *arch],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                no_implicit_headers=True,
                verbose=False,
            )
            return bind_library(path), variant
        except Exception as e:  # noqa: BLE001 - any build/load failure means: fall back
            errors.append(f"{variant} build failed: {type(e).__name__}: {str(e).strip()[-400:]}")
    raise RuntimeError("; ".join(errors))


def bind_library(path: str) -> ctypes.CDLL:
    """Load a library built from `_SOURCE` (csrc/hybrid8_cpu.cpp) and declare its entry points (also for tests' own builds)."""
    lib = ctypes.CDLL(path)
    if lib.lt_abi_version() != _ABI_VERSION:
        raise RuntimeError(f"unexpected ABI version {lib.lt_abi_version()} in {path}")
    lib.lt_adamw_step.argtypes = _ADAMW_ARGTYPES
    lib.lt_adamw_step.restype = _I
    lib.lt_quantize_blockwise.argtypes = _QUANT_ARGTYPES
    lib.lt_dequantize_q8.argtypes = _DEQUANT_ARGTYPES
    lib.lt_dequantize_q8.restype = _I
    lib.lt_quantize_blockwise.restype = _I
    lib.lt_set_lookup.argtypes = [_I]
    lib.lt_set_lookup.restype = _I
    lib.lt_get_lookup.argtypes = []
    lib.lt_get_lookup.restype = _I
    lib.lt_calibrate_lookup.argtypes = _CALIBRATE_ARGTYPES
    lib.lt_calibrate_lookup.restype = _I
    lib.lt_isa_best.argtypes = []
    lib.lt_isa_best.restype = _I
    return lib


def cpu_isa_choice() -> str:
    """``LAZYTRAIN_CPU_ISA`` normalized: ``"auto"`` (unset) or one of `ISA_CODES`.

    Raises:
        ValueError: any other value.
    """
    return envvars.read(ISA_ENV)


def isa_paths(lib: ctypes.CDLL) -> list[str]:
    """The ISA paths `lib` has, best first."""
    return [name for name, code in ISA_CODES.items() if code <= lib.lt_isa_best()]


def _auto_isa(lib: ctypes.CDLL) -> int:
    """The path "auto" runs: AVX2 where the build has it, else generic (`_configure_isa` says why not AVX-512)."""
    return getattr(lib, "_lt_auto_isa", min(lib.lt_isa_best(), ISA_CODES["avx2"]))


def resolve_isa(lib: ctypes.CDLL, isa: str | None = None) -> str:
    """The ISA path an update runs: `isa` if given, else ``LAZYTRAIN_CPU_ISA`` (read at each call), "auto" being
    AVX2 where the build has it (`_configure_isa`).

    Raises:
        ValueError: not "auto" or a name of `ISA_CODES`.
        RuntimeError: a path this build lacks (the CPU or compiler has no AVX2 / AVX-512), or AVX-512 where its
            load-time bit check against AVX2 failed.
    """
    name = cpu_isa_choice() if isa is None else isa
    if name == "auto":
        return _ISA_NAMES[_auto_isa(lib)]
    if name not in ISA_CODES:
        raise ValueError(f"ISA path must be 'auto' or one of {list(ISA_CODES)}, but got {name!r}")
    if ISA_CODES[name] > lib.lt_isa_best():
        raise RuntimeError(f"{ISA_ENV}={name} but the fused CPU kernel was built without that path on this CPU "
                           f"(it has: {', '.join(isa_paths(lib))}); unset {ISA_ENV} (auto runs "
                           f"{_ISA_NAMES[_auto_isa(lib)]}) or set it to one of those")
    refused = getattr(lib, "_lt_refused", {}).get(name)
    if refused is not None:
        raise RuntimeError(f"{ISA_ENV}={name} but that path's bits differ from AVX2's on this CPU ({refused}); "
                           f"unset {ISA_ENV} to run AVX2")
    return name


def isa_bit_check(lib: ctypes.CDLL, isa: str, ref: str, *, n: int = 3 * 256 + 77, seed: int = 0,
                  steps: int = 1) -> str | None:
    """Do the `isa` and `ref` paths of `lib` give the same bits? None if so, else what differs.

    Each master mode with fp32 / bf16 parameters and gradients, both table-read modes, `n` elements in blocks of
    256 (the last one partial, one all-zero), gradients with huge, infinite and NaN elements (the last step only:
    before it, which NaN survives where two NaNs meet is the compiler's operand order, not the path's), `steps`
    updates; then the quantizer with and without the floor. fp32 outputs compare NaN-for-NaN (the same reason);
    everything else bit for bit. The `isa` path also runs with its moments prepared (`cpu_dequantize_q8` before
    each update, `prepared=`; output buffers 64-byte aligned on alternate steps, else not: the scalar fallback)
    and must give `ref`'s bits too.
    """
    from .quant import dynamic_map, zero_code

    tables = CpuTables.build(dynamic_map(True), dynamic_map(False))
    gen = torch.Generator().manual_seed(seed)
    block = 256
    nb = -(-n // block)
    lookups = list(LOOKUP_MODES.values()) if lib.lt_get_lookup() >= 0 else [None]
    saved = lib.lt_get_lookup()

    def same(a: Tensor, b: Tensor) -> bool:
        if a.dtype == torch.float32:
            both_nan = torch.isnan(a) & torch.isnan(b)
            return bool(((a.view(torch.int32) == b.view(torch.int32)) | both_nan).all())
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    configs = [(pd, gd, mm) for pd in (torch.float32, torch.bfloat16) for gd in (torch.float32, torch.bfloat16)
               for mm in ("none", "fp32", "kahan") if not (mm == "kahan" and pd == torch.float32)]
    try:
        for pd, gd, mm in configs:
            p0 = (torch.randn(n, generator=gen) * 0.05).to(pd)
            grads = [torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 3) * 1e-3
                     for _ in range(steps)]
            for g in grads:
                g[block:2 * block] = 0.0                       # an all-zero block (its moments too, below)
            last = grads[-1]
            last[3::97], last[5::211], last[7::401], last[11::503] = float("inf"), float("nan"), 1e30, -float("inf")
            s1 = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
            s2 = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
            s1[block:2 * block], s2[block:2 * block] = zero_code(tables.qmap1), zero_code(tables.qmap2)
            a1, a2 = torch.rand(nb, generator=gen) * 1e-2, torch.rand(nb, generator=gen) * 1e-5
            a1[1:2] = a2[1:2] = 0.0
            mst = p0.float() + torch.randn(n, generator=gen) * 1e-4 if mm == "fp32" else None
            kah = (torch.randn(n, generator=gen) * 1e-5).to(torch.bfloat16) if mm == "kahan" else None
            for lk in lookups:
                out = {}
                for name, prep in ((isa, False), (ref, False), (isa, True)):
                    if lk is not None:
                        lib.lt_set_lookup(lk)
                    ts = [t.clone() if t is not None else None for t in (p0, s1, s2, a1, a2, mst, kah)]
                    for k, g in enumerate(grads):
                        pre = None
                        if prep:
                            off = (k + seed) % 2  # 1: 4 bytes past an aligned start
                            pre = (torch.empty(n + off)[off:], torch.empty(n + off)[off:])
                            cpu_dequantize_q8(lib, tables, *ts[1:5], *pre, block_size=block, threads=1, isa=name)
                        cpu_adamw_step(lib, tables, ts[0], g.to(gd), *ts[1:], block_size=block, clip_coef=0.37,
                                       beta1=0.9, beta2=0.999, eps=1e-8, decay=1 - 2e-4, step_size=2e-3 / (k + 1),
                                       bc2_sqrt=0.05 * (k + 1), threads=1, isa=name, prepared=pre)
                    out[(name, prep)] = [t for t in ts if t is not None]
                names = ["param", "state1", "state2", "absmax1", "absmax2", "master/kahan"]
                for which in ((isa, False), (isa, True)):
                    bad = [nm for nm, x, y in zip(names, out[which], out[(ref, False)]) if not same(x, y)]
                    if bad:
                        return (f"{', '.join(bad)} differ ({pd} params, {gd} grads, master {mm}, table reads "
                                f"{lk}, {steps} step(s){', moments prepared' if which[1] else ''})")
        x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 4)
        x[::17], x[block:2 * block] = 0.0, 0.0
        for lk in lookups:
            if lk is not None:
                lib.lt_set_lookup(lk)
            for signed in (True, False):
                for floor in (False, True):
                    xs = x if signed else x.abs()
                    got = [cpu_quantize_blockwise(lib, tables, xs, signed=signed, block_size=block,
                                                  nonzero_floor=floor, isa=name) for name in (isa, ref)]
                    if not all(same(u, w) for u, w in zip(got[0], got[1])):
                        return f"quantizer codes differ (signed {signed}, floor {floor}, table reads {lk})"
    finally:
        if saved >= 0:
            lib.lt_set_lookup(saved)
    return None


def _configure_isa(lib: ctypes.CDLL) -> str:
    """Sets the path "auto" runs and says which paths the build has. "auto" runs AVX2 where AVX-512 exists too:
    on the one AVX-512 host measured (the H200 machine's Xeon, 16 threads, Kahan, bf16 gradients) the AVX-512 path
    ran 4.19 G params/s against AVX2's 4.58 (benchmarks/results/hybrid8-cpu-isa-20261130.json; in training steps
    the two were within the ~4% run-to-run spread): the two code-search gathers stay and 512-bit work lowers the clock.
    LAZYTRAIN_CPU_ISA=avx512 runs it; it must give the AVX2 path's bits on this CPU (`isa_bit_check`, ~10 ms at load), or it is refused."""
    best = lib.lt_isa_best()
    lib._lt_auto_isa = min(best, ISA_CODES["avx2"])
    lib._lt_refused = {}
    note = ""
    if best == ISA_CODES["avx512"]:
        try:
            why = isa_bit_check(lib, "avx512", "avx2")
        except Exception as e:  # noqa: BLE001 - a crash in the check must not take the kernel down with it
            why = f"{type(e).__name__}: {e}"
        if why is not None:
            lib._lt_refused["avx512"] = why
            note = f"; avx512 refused: its bits differ from avx2's ({why}), please report it"
            logger.warning("fused CPU kernel: the AVX-512 path's bits differ from the AVX2 path's (%s); it is not "
                           "used", why)
        else:
            note = f" (avx512 opt-in: {ISA_ENV}=avx512)"
    return f"paths {', '.join(isa_paths(lib))}; auto: {_ISA_NAMES[lib._lt_auto_isa]}{note}"


def _configure_lookup(lib: ctypes.CDLL) -> str:
    """Pick the table reads of the kernel's AVX2 / AVX-512 path (`LOOKUP_ENV`, else the faster one measured now,
    on the path "auto" runs); says which.

    Both modes give bit-identical results; only their speed differs by CPU (gathers are slow on some cores, scalar
    loads cost more instructions). A bad `LOOKUP_ENV` value is logged and treated as unset.
    """
    if lib.lt_get_lookup() < 0:
        return "generic path only"
    try:
        choice = envvars.read(LOOKUP_ENV)
    except ValueError as e:  # loading never raises; Hybrid8bitOptimizer refuses the value when built
        logger.warning("%s; measuring both", e)
        choice = "auto"
    if choice in LOOKUP_MODES:
        lib.lt_set_lookup(LOOKUP_MODES[choice])
        return f"table reads: {choice} ({LOOKUP_ENV})"
    from .quant import dynamic_map

    tables = CpuTables.build(dynamic_map(True), dynamic_map(False))
    seconds = (ctypes.c_double * 2)()
    mode = lib.lt_calibrate_lookup(_CALIBRATION_ELEMENTS, _CALIBRATION_REPS, _ptr(tables.lut1), _ptr(tables.qmap1),
                                   _ptr(tables.lut2), _ptr(tables.qmap2), tables.half, LUT_EXP_RANGE, LUT_MANT_BITS,
                                   seconds, _auto_isa(lib))
    name = next(k for k, v in LOOKUP_MODES.items() if v == mode)
    per = 1e9 / _CALIBRATION_ELEMENTS
    return (f"table reads: {name} (measured on one thread, {_ISA_NAMES[_auto_isa(lib)]}: gather "
            f"{seconds[0] * per:.2f} ns/param, scalar {seconds[1] * per:.2f} ns/param)")


def load_cpu_kernel() -> ctypes.CDLL | None:
    """Build (first call; cached on disk) and load the fused CPU kernel. Thread-safe; never raises.

    Returns:
        The loaded library, or None when no build succeeded (`cpu_kernel_status` says why).
    """
    global _lib, _status
    if _status is not None:
        return _lib
    with _lock:
        if _status is None:
            try:
                lib, variant = _build()
                isa = _configure_isa(lib)
                _status = (True, f"built ({variant}; {isa}; {_configure_lookup(lib)})")
                _lib = lib
            except Exception as e:  # noqa: BLE001
                _lib = None
                _status = (False, str(e))
    return _lib


def cpu_kernel_status() -> tuple[bool, str]:
    """``(available, reason)`` of the fused CPU kernel, building it if not tried yet. When available, the reason
    starts with the ISA path updates run now (``LAZYTRAIN_CPU_ISA`` as set at this call)."""
    lib = load_cpu_kernel()
    assert _status is not None
    if lib is None:
        return _status
    try:
        now = f"ISA path {resolve_isa(lib)}"
    except (ValueError, RuntimeError) as e:
        now = f"ISA path unusable: {e}"
    return True, f"{now}; {_status[1]}"


@dataclass(frozen=True)
class CpuTables:
    """Codebooks of the two maps in the layout the kernel reads (all CPU, contiguous).

    Fields:
        qmap1, qmap2: fp32 [256] signed / unsigned maps.
        lut1, lut2: int32 [2 * half] kernel lookup tables (`kernel_lookup_table`).
        half: entries per sign in a lookup table.
    """

    qmap1: Tensor
    qmap2: Tensor
    lut1: Tensor
    lut2: Tensor
    half: int

    @classmethod
    def build(cls, qmap1: Tensor, qmap2: Tensor) -> CpuTables:
        q1, q2 = qmap1.detach().cpu().float().contiguous(), qmap2.detach().cpu().float().contiguous()
        lut1, lut2 = kernel_lookup_table(q1), kernel_lookup_table(q2)
        return cls(q1, q2, lut1, lut2, lut1.numel() // 2)


def kernel_lookup_table(qmap: Tensor) -> Tensor:
    """`quant.code_lookup_table` rearranged for the kernel's branch-free lookup (see ``nearest_code`` in the source).

    Two changes, both exact: (1) in the negative half, ``t`` is mirrored to ``2**(23 - LUT_MANT_BITS) - 1 - t``,
    so that the kernel compares the mirrored low bits of a negative x with ``>`` as for a positive one
    (``low < t`` iff ``mirror(low) > mirror(t)``; a bucket without a midpoint gets the never-firing
    ``2**(23 - LUT_MANT_BITS) - 1`` in both halves); (2) the kernel clamps the key of |x| >= 2 (and NaN) to the last
    bucket instead of keeping its mantissa bits: the same code, since the last exponent row holds no midpoint and
    a single base (checked here).

    Returns:
        int32 [2 * half] on CPU, contiguous.

    Raises:
        ValueError: a table geometry the kernel cannot use (the low bits must fit in 15 bits).
    """
    from .quant import code_lookup_table

    low_bits = 23 - LUT_MANT_BITS
    if low_bits > 15:
        raise ValueError(f"the kernel needs LUT_MANT_BITS >= 8, but got {LUT_MANT_BITS}")
    lut = code_lookup_table(qmap).clone()
    half = lut.numel() // 2
    never = (1 << low_bits) - 1
    neg = lut[half:]
    neg.copy_((neg & 0xFF) | ((never - (neg >> 16)) << 16))
    row = 1 << LUT_MANT_BITS
    for part in (lut[half - row:half], lut[-row:]):
        if not bool((part == part[0]).all()) or int(part[0]) >> 16 != never:
            raise ValueError("kernel_lookup_table: the last exponent row must map to one code")
    return lut.contiguous()


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def cpu_adamw_step(
    lib: ctypes.CDLL,
    tables: CpuTables,
    param: Tensor,
    grad: Tensor,
    state1: Tensor,
    state2: Tensor,
    absmax1: Tensor | None,
    absmax2: Tensor | None,
    master: Tensor | None,
    kahan: Tensor | None,
    *,
    block_size: int,
    clip_coef: float,
    beta1: float,
    beta2: float,
    eps: float,
    decay: float,
    step_size: float,
    bc2_sqrt: float,
    threads: int,
    isa: str | None = None,
    prepared: tuple[Tensor, Tensor] | None = None,
) -> None:
    """Run one fused AdamW update in place. All tensors CPU and contiguous with the same numel N.

    Args:
        param: fp32 or bf16 [N], updated in place.
        grad: fp32 or bf16 [N] (never modified).
        state1, state2: uint8 codes [N] (8-bit) or fp32 [N] moments.
        absmax1, absmax2: fp32 [ceil(N / block_size)] when the states are uint8, else None.
        master: fp32 [N] master weights or None; kahan: bf16 [N] compensation or None (bf16 params only).
        decay: ``1 - lr * weight_decay``; step_size: ``lr / (1 - beta1**step)``;
        bc2_sqrt: ``sqrt(1 - beta2**step)``; clip_coef: multiplies the gradient; threads: OpenMP threads.
        isa: the ISA path (`resolve_isa`: default ``LAZYTRAIN_CPU_ISA``, else the best); the same bits on every path.
        prepared: (m, v) fp32 [N], `cpu_dequantize_q8` of the current 8-bit states: the update reads them instead of
            dequantizing (the same values, so the same bits; the caller must not pass stale ones). Not modified.

    Raises:
        ValueError: unsupported dtype or mode combination (the caller should have routed it to torch), prepared
            tensors that are not fp32 [N] contiguous or given with fp32 states, or a bad ISA name.
        RuntimeError: an ISA path the build lacks.
    """
    code = ISA_CODES[resolve_isa(lib, isa)]
    q8 = state1.dtype == torch.uint8
    mode = MASTER_FP32 if master is not None else MASTER_KAHAN if kahan is not None else MASTER_NONE
    pre1 = pre2 = None
    if prepared is not None:
        pre1, pre2 = prepared
        n = param.numel()
        for t in (pre1, pre2):
            if t.dtype != torch.float32 or t.numel() != n or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"prepared moments must be contiguous fp32 CPU tensors of {n} elements, but got "
                                 f"{t.dtype} {tuple(t.shape)} on {t.device}")
        if not q8:
            raise ValueError("prepared moments are for 8-bit states only")
    rc = lib.lt_adamw_step(
        _ptr(param), DTYPE_CODES[param.dtype], _ptr(grad), DTYPE_CODES[grad.dtype], param.numel(),
        _ptr(state1), _ptr(state2), int(q8), _ptr(absmax1), _ptr(absmax2),
        _ptr(master), _ptr(kahan), mode, block_size,
        _ptr(tables.lut1), _ptr(tables.qmap1), _ptr(tables.lut2), _ptr(tables.qmap2),
        tables.half, LUT_EXP_RANGE, LUT_MANT_BITS,
        clip_coef, beta2, 1.0 - beta1, 1.0 - beta2, eps, decay, -step_size, bc2_sqrt, threads, code,
        _ptr(pre1), _ptr(pre2),
    )
    if rc != 0:
        raise ValueError(f"fused CPU AdamW kernel refused param {param.dtype} / grad {grad.dtype} / "
                         f"master mode {mode} (code {rc})")


def cpu_dequantize_q8(lib: ctypes.CDLL, tables: CpuTables, state1: Tensor, state2: Tensor, absmax1: Tensor,
                      absmax2: Tensor, out1: Tensor, out2: Tensor, *, block_size: int, threads: int,
                      isa: str | None = None) -> None:
    """8-bit m and v -> fp32, exactly as the update dequantizes them (code value * block absmax), into out1 / out2.

    Args:
        state1, state2: uint8 codes [N] of m and v (contiguous CPU).
        absmax1, absmax2: fp32 [ceil(N / block_size)].
        out1, out2: fp32 [N] contiguous CPU, written (for `cpu_adamw_step(prepared=(out1, out2))`).
        threads: OpenMP threads; isa: as `cpu_adamw_step` (every path gives the same values).

    Raises:
        ValueError: tensors of the wrong dtype, size or layout, or a bad ISA name.
        RuntimeError: an ISA path the build lacks.
    """
    n = state1.numel()
    nb = -(-n // block_size)
    want = ((state1, torch.uint8, n), (state2, torch.uint8, n), (absmax1, torch.float32, nb),
            (absmax2, torch.float32, nb), (out1, torch.float32, n), (out2, torch.float32, n))
    for t, dtype, numel in want:
        if t.dtype != dtype or t.numel() != numel or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"cpu_dequantize_q8: expected a contiguous {dtype} CPU tensor of {numel} elements, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    code = ISA_CODES[resolve_isa(lib, isa)]
    lib.lt_dequantize_q8(_ptr(state1), _ptr(state2), _ptr(absmax1), _ptr(absmax2), _ptr(tables.qmap1),
                         _ptr(tables.qmap2), n, block_size, _ptr(out1), _ptr(out2), threads, code)


def cpu_quantize_blockwise(lib: ctypes.CDLL, tables: CpuTables, x: Tensor, *, signed: bool, block_size: int,
                           nonzero_floor: bool = False, threads: int = 1,
                           isa: str | None = None) -> tuple[Tensor, Tensor]:
    """The kernel's quantizer on fp32 CPU ``x`` [N] -> (uint8 codes [N], fp32 absmax [ceil(N / block_size)]).

    Same contract as `quant.quantize_blockwise` (used by tests to prove both give identical codes).
    """
    x = x.detach().reshape(-1).float().contiguous()
    n = x.numel()
    codes = torch.empty(n, dtype=torch.uint8)
    absmax = torch.empty(-(-n // block_size), dtype=torch.float32)
    lut, qmap = (tables.lut1, tables.qmap1) if signed else (tables.lut2, tables.qmap2)
    zero = 127 if signed else 0
    code = ISA_CODES[resolve_isa(lib, isa)]
    lib.lt_quantize_blockwise(_ptr(x), n, block_size, _ptr(codes), _ptr(absmax), _ptr(lut), _ptr(qmap),
                              tables.half, LUT_EXP_RANGE, LUT_MANT_BITS, zero, int(nonzero_floor), threads, code)
    return codes, absmax
