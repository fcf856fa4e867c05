"""Fused one-pass CPU AdamW kernel (C++ / OpenMP), built on first use with `torch.utils.cpp_extension.load_inline`.

One pass per quantization block: dequantize m and v -> AdamW (clip coefficient folded into the gradient) ->
write the parameter (fp32, or bf16 from an fp32 master / Kahan-compensated) -> new per-block absmax ->
requantize m and v. OpenMP threads take whole blocks.

The source is plain C++ with ``extern "C"`` entry points called through ctypes (which releases the GIL while the
kernel runs, so an executor thread can overlap it with other work). It includes no torch headers: the build takes
well under a second instead of about a minute for a ``torch/extension.h`` extension.

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
import platform
import threading
from dataclasses import dataclass

import torch
from torch import Tensor

from .quant import LUT_EXP_RANGE, LUT_MANT_BITS

__all__ = ["load_cpu_kernel", "cpu_kernel_status", "CpuTables", "cpu_adamw_step", "cpu_quantize_blockwise",
           "DTYPE_CODES"]

logger = logging.getLogger(__name__)

# dtype codes shared with the C++ source
DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1}
# master modes shared with the C++ source
MASTER_NONE, MASTER_FP32, MASTER_KAHAN = 0, 1, 2

_SOURCE = r"""
// lazytrain_hf Hybrid 8-bit AdamW: fused CPU kernel. No torch headers: called from Python through ctypes.
// Per block of B elements (all in L1): dequantize m and v (AVX2 gathers), AdamW and the parameter write with
// the new absmax of |m| and v (auto-vectorized; the max is taken over the float bits, so NaN propagates),
// requantize (AVX2 gathers into the lookup table when available, else scalar).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

enum DType { kF32 = 0, kBF16 = 1 };
enum Master { kMasterNone = 0, kMasterFp32 = 1, kMasterKahan = 2 };

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, NaN -> canonical quiet NaN: the same rounding as c10::BFloat16.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return f != f ? static_cast<uint16_t>(0x7FC0u) : static_cast<uint16_t>(r);
}

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T> inline float load(const T* p, int64_t i);
template <> inline float load<float>(const float* p, int64_t i) { return p[i]; }
template <> inline float load<uint16_t>(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }
template <typename T> inline void store(T* p, int64_t i, float v);
template <> inline void store<float>(float* p, int64_t i, float v) { p[i] = v; }
template <> inline void store<uint16_t>(uint16_t* p, int64_t i, float v) { p[i] = f32_to_bf16(v); }

inline float fmadd(float a, float b, float c) {
#ifdef __FMA__
  return __builtin_fmaf(a, b, c);  // as torch's vectorized lerp
#else
  return a * b + c;
#endif
}

// Nearest code of x (already divided by the block absmax), ties to the lower code: one read of the packed
// lookup table (lazytrain_hf/optim/quant.py: code_lookup_table): entry = base | t << 16, and the code is
// base + (low > t) for x >= 0, base + (low < t) for x < 0, low = the mantissa bits below the bucket's.
struct Codebook {
  const int32_t* lut;   // [2 * half]
  const float* qmap;    // [256]
  int64_t half;
  int lut_k;
  int lut_m;
};

inline uint32_t nearest_code(float x, const Codebook& cb) {
  const uint32_t u = f32_bits(x);
  const uint32_t sign = u >> 31;
  const int32_t e = static_cast<int32_t>((u >> 23) & 0xFFu);
  int32_t rel = e - (127 - cb.lut_k);
  rel = rel > cb.lut_k ? cb.lut_k : rel;
  const uint32_t mant = (u >> (23 - cb.lut_m)) & ((1u << cb.lut_m) - 1u);
  const uint32_t key = rel < 0 ? 0u : 1u + ((static_cast<uint32_t>(rel) << cb.lut_m) | mant);
  const uint32_t entry = static_cast<uint32_t>(cb.lut[sign * cb.half + key]);
  const uint32_t low = u & ((1u << (23 - cb.lut_m)) - 1u), t = entry >> 16;
  return (entry & 0xFFu) + (sign ? (low < t ? 1u : 0u) : (low > t ? 1u : 0u));
}

// max |x| over x[0, len) through the float bits (non-negative floats order as unsigned ints; NaN is largest)
inline float abs_max(const float* __restrict__ x, int64_t len) {
  uint32_t m = 0;
  for (int64_t j = 0; j < len; ++j) {
    const uint32_t u = f32_bits(x[j]) & 0x7FFFFFFFu;
    m = u > m ? u : m;
  }
  return bits_f32(m);
}

// codes of x[0, len) * inv; floor: a non-zero x never takes the zero code z (it takes z +- 1, by its sign).
void quantize_block(const float* __restrict__ x, uint8_t* __restrict__ out, int64_t len, float inv,
                    const Codebook& cb, int z, bool floor) {
  int64_t j = 0;
#ifdef __AVX2__
  if (cb.lut_m == 8) {
    const __m256 vinv = _mm256_set1_ps(inv);
    const __m256i kbias = _mm256_set1_epi32(127 - cb.lut_k), kk = _mm256_set1_epi32(cb.lut_k);
    const __m256i m255 = _mm256_set1_epi32(255), one = _mm256_set1_epi32(1), zero = _mm256_setzero_si256();
    const __m256i half = _mm256_set1_epi32(static_cast<int>(cb.half)), vz = _mm256_set1_epi32(z);
    const __m256i down = _mm256_set1_epi32(z > 0 ? 1 : 0), low_mask = _mm256_set1_epi32(0x7FFF);
    const int* lut = reinterpret_cast<const int*>(cb.lut);
    for (; j + 8 <= len; j += 8) {
      const __m256 raw = _mm256_loadu_ps(x + j);
      const __m256 xv = _mm256_mul_ps(raw, vinv);
      const __m256i u = _mm256_castps_si256(xv);
      const __m256i e = _mm256_and_si256(_mm256_srli_epi32(u, 23), m255);
      const __m256i rel = _mm256_min_epi32(_mm256_sub_epi32(e, kbias), kk);
      const __m256i mant = _mm256_and_si256(_mm256_srli_epi32(u, 15), m255);
      __m256i key = _mm256_add_epi32(one, _mm256_or_si256(_mm256_slli_epi32(rel, 8), mant));
      key = _mm256_andnot_si256(_mm256_cmpgt_epi32(zero, rel), key);                  // rel < 0 -> bucket 0
      key = _mm256_add_epi32(key, _mm256_and_si256(_mm256_srai_epi32(u, 31), half));   // negative half
      const __m256i entry = _mm256_i32gather_epi32(lut, key, 4);
      const __m256i t = _mm256_srli_epi32(entry, 16), low = _mm256_and_si256(u, low_mask);
      const __m256i up = _mm256_blendv_epi8(_mm256_cmpgt_epi32(low, t), _mm256_cmpgt_epi32(t, low),
                                            _mm256_srai_epi32(u, 31));                 // -1 where x passes t
      __m256i c = _mm256_sub_epi32(_mm256_and_si256(entry, m255), up);
      if (floor) {
        const __m256i atz = _mm256_cmpeq_epi32(c, vz);
        const __m256i pos = _mm256_castps_si256(_mm256_cmp_ps(raw, _mm256_setzero_ps(), _CMP_GT_OQ));
        const __m256i neg = _mm256_castps_si256(_mm256_cmp_ps(raw, _mm256_setzero_ps(), _CMP_LT_OQ));
        c = _mm256_add_epi32(c, _mm256_and_si256(_mm256_and_si256(atz, pos), one));
        c = _mm256_sub_epi32(c, _mm256_and_si256(_mm256_and_si256(atz, neg), down));
      }
      const __m256i p16 = _mm256_packus_epi32(c, c);
      const __m256i p8 = _mm256_packus_epi16(p16, p16);
      const uint32_t lo = static_cast<uint32_t>(_mm256_extract_epi32(p8, 0));
      const uint32_t hi = static_cast<uint32_t>(_mm256_extract_epi32(p8, 4));
      std::memcpy(out + j, &lo, 4);
      std::memcpy(out + j + 4, &hi, 4);
    }
  }
#endif
  for (; j < len; ++j) {
    const float xv = x[j];
    int c = static_cast<int>(nearest_code(xv * inv, cb));
    if (floor && c == z) {
      if (xv > 0.0f) c = z + 1;
      else if (xv < 0.0f && z > 0) c = z - 1;
    }
    out[j] = static_cast<uint8_t>(c);
  }
}

struct Args {
  void* param; const void* grad;
  void* state1; void* state2; float* absmax1; float* absmax2;
  float* master; uint16_t* kahan;
  int64_t n; int64_t block;
  float clip, beta2, w1, w2, eps, decay, neg_step_size, bc2_sqrt;
  Codebook cb1, cb2;
  int threads;
};

// out[j] = qmap[codes[j]] * scale
inline void dequantize_block(const uint8_t* __restrict__ codes, const float* __restrict__ qmap, float scale,
                             float* __restrict__ out, int64_t len) {
  int64_t j = 0;
#ifdef __AVX2__
  const __m256 vs = _mm256_set1_ps(scale);
  for (; j + 8 <= len; j += 8) {
    uint64_t raw;
    std::memcpy(&raw, codes + j, 8);
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(raw)));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_i32gather_ps(qmap, idx, 4), vs));
  }
#endif
  for (; j < len; ++j) out[j] = qmap[codes[j]] * scale;
}

// Hyperparameters of one update, as fp32 (1 - beta1 and 1 - beta2 come from the caller in double precision:
// 1.0f - 0.999f is off by 1.3e-5).
struct Hyper {
  float clip, beta2, w1c, w2, eps, decay, nss, bc2;
  // m = lerp(m, g, w1) as torch: w1 < 0.5: m + w1 (g - m); else g + (w1 - 1)(g - m). The base (m or g) is
  // picked with a bit mask (all ones: m), which vectorizes where a bool select does not.
  uint32_t lerp_mask;
};

// AdamW on len elements: m, v (fp32, in place) and the parameter (p, with master or Kahan buffer). With
// ABSMAX, also returns max |m| and max v (as in abs_max: integer max over the float bits, NaN propagates).
template <typename PT, typename GT, int MM, bool ABSMAX>
inline void update_block(PT* __restrict__ p, const GT* __restrict__ g, float* __restrict__ m_,
                         float* __restrict__ v_, float* __restrict__ master, uint16_t* __restrict__ kahan,
                         int64_t len, const Hyper h, float* am1, float* am2) {
  uint32_t b1 = 0, b2 = 0;
  for (int64_t j = 0; j < len; ++j) {
    const float gv = load<GT>(g, j) * h.clip;
    float m = m_[j];
    float v = v_[j];
    const float base = bits_f32((f32_bits(m) & h.lerp_mask) | (f32_bits(gv) & ~h.lerp_mask));
    m = fmadd(h.w1c, gv - m, base);
    v = v * h.beta2 + (h.w2 * gv) * gv;
    float pf;
    if (MM == kMasterFp32) pf = master[j];
    else if (MM == kMasterKahan) pf = load<PT>(p, j) + bf16_to_f32(kahan[j]);
    else pf = load<PT>(p, j);
    pf = pf * h.decay;
    const float denom = std::sqrt(v) / h.bc2 + h.eps;
    pf = pf + (h.nss * m) / denom;
    if (MM == kMasterFp32) {
      master[j] = pf;
      store<PT>(p, j, pf);
    } else if (MM == kMasterKahan) {
      const uint16_t r = f32_to_bf16(pf);
      reinterpret_cast<uint16_t*>(p)[j] = r;
      kahan[j] = f32_to_bf16(pf - bf16_to_f32(r));
    } else {
      store<PT>(p, j, pf);
    }
    m_[j] = m;
    v_[j] = v;
    if (ABSMAX) {
      const uint32_t u1 = f32_bits(m) & 0x7FFFFFFFu, u2 = f32_bits(v) & 0x7FFFFFFFu;
      b1 = u1 > b1 ? u1 : b1;
      b2 = u2 > b2 ? u2 : b2;
    }
  }
  if (ABSMAX) {
    *am1 = bits_f32(b1);
    *am2 = bits_f32(b2);
  }
}

template <typename PT, typename GT, bool Q8, int MM>
void adamw_impl(const Args& a) {
  PT* const p = static_cast<PT*>(a.param);
  const GT* const g = static_cast<const GT*>(a.grad);
  const int64_t n = a.n, B = a.block;
  const int64_t nblocks = (n + B - 1) / B;
  const bool lerp_low = std::fabs(a.w1) < 0.5f;
  const Hyper h{a.clip, a.beta2, lerp_low ? a.w1 : a.w1 - 1.0f, a.w2, a.eps, a.decay, a.neg_step_size,
                a.bc2_sqrt, lerp_low ? 0xFFFFFFFFu : 0u};
  const int nthreads = std::max(1, a.threads);
  const bool par = nthreads > 1 && n >= 32768;
#pragma omp parallel num_threads(nthreads) if (par)
  {
    float* mbuf = nullptr;
    float* vbuf = nullptr;
    if (Q8) {
      mbuf = static_cast<float*>(std::aligned_alloc(64, ((B * 4 + 63) / 64) * 64));
      vbuf = static_cast<float*>(std::aligned_alloc(64, ((B * 4 + 63) / 64) * 64));
    }
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t s = b * B;
      const int64_t len = std::min(B, n - s);
      float* master = MM == kMasterFp32 ? a.master + s : nullptr;
      uint16_t* kahan = MM == kMasterKahan ? a.kahan + s : nullptr;
      if (Q8) {
        uint8_t* c1 = static_cast<uint8_t*>(a.state1) + s;
        uint8_t* c2 = static_cast<uint8_t*>(a.state2) + s;
        // dequantize -> AdamW -> new scales -> requantize (Note [v floor] in lazytrain_hf/optim/quant.py)
        dequantize_block(c1, a.cb1.qmap, a.absmax1[b], mbuf, len);
        dequantize_block(c2, a.cb2.qmap, a.absmax2[b], vbuf, len);
        float am1 = 0.0f, am2 = 0.0f;
        update_block<PT, GT, MM, true>(p + s, g + s, mbuf, vbuf, master, kahan, len, h, &am1, &am2);
        a.absmax1[b] = am1;
        a.absmax2[b] = am2;
        quantize_block(mbuf, c1, len, am1 > 0.0f ? 1.0f / am1 : 0.0f, a.cb1, 127, false);
        quantize_block(vbuf, c2, len, am2 > 0.0f ? 1.0f / am2 : 0.0f, a.cb2, 0, true);
      } else {
        update_block<PT, GT, MM, false>(p + s, g + s, static_cast<float*>(a.state1) + s,
                                        static_cast<float*>(a.state2) + s, master, kahan, len, h, nullptr,
                                        nullptr);
      }
    }
    std::free(mbuf);
    std::free(vbuf);
  }
}

template <typename PT, typename GT>
int dispatch_mode(const Args& a, int q8, int master_mode) {
  if (q8) {
    switch (master_mode) {
      case kMasterNone: adamw_impl<PT, GT, true, kMasterNone>(a); return 0;
      case kMasterFp32: adamw_impl<PT, GT, true, kMasterFp32>(a); return 0;
      case kMasterKahan: adamw_impl<PT, GT, true, kMasterKahan>(a); return 0;
    }
  } else {
    switch (master_mode) {
      case kMasterNone: adamw_impl<PT, GT, false, kMasterNone>(a); return 0;
      case kMasterFp32: adamw_impl<PT, GT, false, kMasterFp32>(a); return 0;
      case kMasterKahan: adamw_impl<PT, GT, false, kMasterKahan>(a); return 0;
    }
  }
  return 2;
}

}  // namespace

extern "C" {

int lt_abi_version() { return 3; }

// Returns 0 on success, 1 on an unsupported dtype, 2 on an unsupported mode.
int lt_adamw_step(void* param, int param_dtype, const void* grad, int grad_dtype, int64_t n,
                  void* state1, void* state2, int state_8bit, float* absmax1, float* absmax2,
                  float* master, uint16_t* kahan, int master_mode, int64_t block,
                  const int32_t* lut1, const float* qmap1, const int32_t* lut2, const float* qmap2,
                  int64_t lut_half, int lut_k, int lut_m,
                  float clip, float beta2, float one_minus_beta1, float one_minus_beta2, float eps,
                  float decay, float neg_step_size, float bc2_sqrt, int threads) {
  Args a{param, grad, state1, state2, absmax1, absmax2, master, kahan, n, block,
         clip, beta2, one_minus_beta1, one_minus_beta2, eps, decay, neg_step_size, bc2_sqrt,
         Codebook{lut1, qmap1, lut_half, lut_k, lut_m}, Codebook{lut2, qmap2, lut_half, lut_k, lut_m}, threads};
  if (master_mode == kMasterKahan && param_dtype != kBF16) return 2;
  if (param_dtype == kF32 && grad_dtype == kF32) return dispatch_mode<float, float>(a, state_8bit, master_mode);
  if (param_dtype == kF32 && grad_dtype == kBF16) return dispatch_mode<float, uint16_t>(a, state_8bit, master_mode);
  if (param_dtype == kBF16 && grad_dtype == kF32) return dispatch_mode<uint16_t, float>(a, state_8bit, master_mode);
  if (param_dtype == kBF16 && grad_dtype == kBF16) return dispatch_mode<uint16_t, uint16_t>(a, state_8bit, master_mode);
  return 1;
}

// Blockwise quantization of fp32 x [n] (tests and tools): codes [n], absmax [ceil(n / block)].
void lt_quantize_blockwise(const float* x, int64_t n, int64_t block, uint8_t* codes, float* absmax,
                           const int32_t* lut, const float* qmap, int64_t lut_half,
                           int lut_k, int lut_m, int zero, int nonzero_floor, int threads) {
  const Codebook cb{lut, qmap, lut_half, lut_k, lut_m};
  const int64_t nblocks = (n + block - 1) / block;
  const int nthreads = std::max(1, threads);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && n >= 32768)
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t s = b * block, len = std::min(block, n - s);
    const float am = abs_max(x + s, len);
    absmax[b] = am;
    quantize_block(x + s, codes + s, len, am > 0.0f ? 1.0f / am : 0.0f, cb, zero, nonzero_floor != 0);
  }
}

}  // extern "C"
"""

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
                   _I]                              # threads
_QUANT_ARGTYPES = [_P, _I64, _I64, _P, _P, _P, _P, _I64, _I, _I, _I, _I, _I]

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


def _build() -> ctypes.CDLL:
    from torch.utils.cpp_extension import load_inline

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
            lib = ctypes.CDLL(path)
            if lib.lt_abi_version() != 3:
                raise RuntimeError(f"unexpected ABI version {lib.lt_abi_version()} in {path}")
            lib.lt_adamw_step.argtypes = _ADAMW_ARGTYPES
            lib.lt_adamw_step.restype = _I
            lib.lt_quantize_blockwise.argtypes = _QUANT_ARGTYPES
            lib.lt_quantize_blockwise.restype = None
            return lib
        except Exception as e:  # noqa: BLE001 - any build/load failure means: fall back
            errors.append(f"{variant} build failed: {type(e).__name__}: {str(e).strip()[-400:]}")
    raise RuntimeError("; ".join(errors))


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
                _lib = _build()
                _status = (True, "built")
            except Exception as e:  # noqa: BLE001
                _lib = None
                _status = (False, str(e))
    return _lib


def cpu_kernel_status() -> tuple[bool, str]:
    """``(available, reason)`` of the fused CPU kernel, building it if not tried yet."""
    load_cpu_kernel()
    assert _status is not None
    return _status


@dataclass(frozen=True)
class CpuTables:
    """Codebooks of the two maps in the layout the kernel reads (all CPU, contiguous).

    Fields:
        qmap1, qmap2: fp32 [256] signed / unsigned maps.
        lut1, lut2: int32 [2 * half] packed lookup tables (`quant.code_lookup_table`).
        half: entries per sign in a lookup table.
    """

    qmap1: Tensor
    qmap2: Tensor
    lut1: Tensor
    lut2: Tensor
    half: int

    @classmethod
    def build(cls, qmap1: Tensor, qmap2: Tensor) -> CpuTables:
        from .quant import code_lookup_table

        q1, q2 = qmap1.detach().cpu().float().contiguous(), qmap2.detach().cpu().float().contiguous()
        lut1, lut2 = code_lookup_table(q1).contiguous(), code_lookup_table(q2).contiguous()
        return cls(q1, q2, lut1, lut2, lut1.numel() // 2)


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

    Raises:
        ValueError: unsupported dtype or mode combination (the caller should have routed it to torch).
    """
    q8 = state1.dtype == torch.uint8
    mode = MASTER_FP32 if master is not None else MASTER_KAHAN if kahan is not None else MASTER_NONE
    rc = lib.lt_adamw_step(
        _ptr(param), DTYPE_CODES[param.dtype], _ptr(grad), DTYPE_CODES[grad.dtype], param.numel(),
        _ptr(state1), _ptr(state2), int(q8), _ptr(absmax1), _ptr(absmax2),
        _ptr(master), _ptr(kahan), mode, block_size,
        _ptr(tables.lut1), _ptr(tables.qmap1), _ptr(tables.lut2), _ptr(tables.qmap2),
        tables.half, LUT_EXP_RANGE, LUT_MANT_BITS,
        clip_coef, beta2, 1.0 - beta1, 1.0 - beta2, eps, decay, -step_size, bc2_sqrt, threads,
    )
    if rc != 0:
        raise ValueError(f"fused CPU AdamW kernel refused param {param.dtype} / grad {grad.dtype} / "
                         f"master mode {mode} (code {rc})")


def cpu_quantize_blockwise(lib: ctypes.CDLL, tables: CpuTables, x: Tensor, *, signed: bool, block_size: int,
                           nonzero_floor: bool = False, threads: int = 1) -> tuple[Tensor, Tensor]:
    """The kernel's quantizer on fp32 CPU ``x`` [N] -> (uint8 codes [N], fp32 absmax [ceil(N / block_size)]).

    Same contract as `quant.quantize_blockwise` (used by tests to prove both give identical codes).
    """
    x = x.detach().reshape(-1).float().contiguous()
    n = x.numel()
    codes = torch.empty(n, dtype=torch.uint8)
    absmax = torch.empty(-(-n // block_size), dtype=torch.float32)
    lut, qmap = (tables.lut1, tables.qmap1) if signed else (tables.lut2, tables.qmap2)
    zero = 127 if signed else 0
    lib.lt_quantize_blockwise(_ptr(x), n, block_size, _ptr(codes), _ptr(absmax), _ptr(lut), _ptr(qmap),
                              tables.half, LUT_EXP_RANGE, LUT_MANT_BITS, zero, int(nonzero_floor), threads)
    return codes, absmax
