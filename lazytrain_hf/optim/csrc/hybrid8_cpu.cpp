// lazytrain_hf Hybrid 8-bit AdamW: fused CPU kernel. No torch headers: called from Python through ctypes.
// Per block of B elements (kept in L1), two passes: (1) dequantize m and v, AdamW, write the parameter, keep the
// new m and v in a per-thread buffer and take their absmax; (2) requantize m and v. Paths (`Isa`, picked per call):
// generic (the compiler vectorizes it where it can), AVX2 + FMA (8 lanes) and AVX-512 (16 lanes; both one template
// over SIMD traits V8 / V16), each compiled where the flags allow. All do the same fp32 operations in the same order
// on every element: results are bit-identical (except which NaN survives where two NaNs meet, the compiler's operand
// order for a commutative operation).
// Table reads (4 per element: 2 dequantizations, 2 code searches) dominate. AVX-512 keeps the dequantization
// tables in registers (Table256); the code searches, and all four on AVX2, use gathers or scalar loads
// (`Lookup`); which one is faster depends on the CPU (scalar loads on the AMD Zen 3 cores measured; gathers should
// win where they are cheap), so the library measures both once (`lt_calibrate_lookup`) and uses the faster one.
// Both give the same values. lt_dequantize_q8 runs the dequantization alone (prepared moments); the update then
// reads its output (Args::pre1 / pre2) instead of the tables.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
// GCC 12's AVX-512 headers trip -Wall's (maybe-)uninitialized checks on their own `_mm512_undefined_*` once
// inlined (a false positive): silenced for the header's lines only
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#define LT_AVX2 1
// F for the 16-lane arithmetic, permutes, gathers and down-converts; BW / VL / DQ: not used by the code, but
// required so that only Skylake-SP and later cores (not Xeon Phi) take the path
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define LT_AVX512 1
#endif
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

enum DType { kF32 = 0, kBF16 = 1 };
// code-search table reads of the AVX2 / AVX-512 paths (the generic path ignores it); the AVX2 path's
// dequantizations too (the AVX-512 path keeps those tables in registers)
enum Lookup { kGather = 0, kScalar = 1 };
// vectorized paths; a build has the generic path and those its compiler flags allow (lt_isa_best and below)
enum Isa { kIsaGeneric = 0, kIsaAvx2 = 1, kIsaAvx512 = 2 };
#if defined(LT_AVX512)
constexpr int kIsaBest = kIsaAvx512;
#elif defined(LT_AVX2)
constexpr int kIsaBest = kIsaAvx2;
#else
constexpr int kIsaBest = kIsaGeneric;
#endif
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

// Nearest code of x (already divided by the block absmax), ties to the lower code: one read of the kernel's
// lookup table (`_cpu_kernel.kernel_lookup_table`): key = clamp((|x| bits >> (23 - M)) - key_off, 0, half - 1)
// (below 2**-K: bucket 0; at or above 2: the last bucket, whose row holds no midpoint), entry = base | t << 16 with t
// the low 23 - M mantissa bits of the bucket's midpoint, stored as is for x >= 0 and mirrored (2**(23-M) - 1 - t)
// for x < 0, so that one comparison serves both signs: code = base + (low' > t), low' = the low bits of x,
// mirrored for x < 0.
struct Codebook {
  const int32_t* lut;   // [2 * half]
  const float* qmap;    // [256]
  int64_t half;
  int lut_k;
  int lut_m;
};

struct KeyGeom {
  uint32_t shift, kmask, low_mask;
  int32_t key_off, key_max;
  explicit KeyGeom(const Codebook& cb)
      : shift(static_cast<uint32_t>(23 - cb.lut_m)),
        kmask((1u << (8 + cb.lut_m)) - 1u),
        low_mask((1u << (23 - cb.lut_m)) - 1u),
        key_off(((127 - cb.lut_k) << cb.lut_m) - 1),
        key_max(static_cast<int32_t>(cb.half) - 1) {}
};

inline uint32_t nearest_code(float x, const Codebook& cb, const KeyGeom& kg) {
  const uint32_t u = f32_bits(x);
  const uint32_t sign = u >> 31;
  int32_t key = static_cast<int32_t>((u >> kg.shift) & kg.kmask) - kg.key_off;
  key = key < 0 ? 0 : key > kg.key_max ? kg.key_max : key;
  const uint32_t entry = static_cast<uint32_t>(cb.lut[sign * cb.half + key]);
  const uint32_t low = (u ^ (0u - sign)) & kg.low_mask;
  return (entry & 0xFFu) + (low > (entry >> 16) ? 1u : 0u);
}

// floor: a non-zero x never takes the zero code z (it takes z +- 1, by its sign; Note [v floor] in quant.py).
inline uint32_t floor_code(uint32_t c, float raw, int z) {
  if (static_cast<int>(c) == z) {
    if (raw > 0.0f) return static_cast<uint32_t>(z + 1);
    if (raw < 0.0f && z > 0) return static_cast<uint32_t>(z - 1);
  }
  return c;
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

struct Args {
  void* param; const void* grad;
  void* state1; void* state2; float* absmax1; float* absmax2;
  float* master; uint16_t* kahan;
  int64_t n; int64_t block;
  float clip, beta2, w1, w2, eps, decay, neg_step_size, bc2_sqrt;
  Codebook cb1, cb2;
  int threads;
  const float* pre1; const float* pre2;  // m, v already dequantized (fp32 [n]) or nullptr
};

// Hyperparameters of one update, as fp32 (1 - beta1 and 1 - beta2 come from the caller in double precision:
// 1.0f - 0.999f is off by 1.3e-5).
struct Hyper {
  float clip, beta2, w1c, w2, eps, decay, nss, bc2;
  // m = lerp(m, g, w1) as torch: w1 < 0.5: m + w1 (g - m); else g + (w1 - 1)(g - m). The base (m or g) is picked
  // with a bit mask (all ones: m), which vectorizes where a bool select does not.
  uint32_t lerp_mask;
};

// One element of AdamW: m, v (fp32, in place) and the parameter (p, with master or Kahan buffer).
template <typename PT, typename GT, int MM>
inline void update_one(PT* __restrict__ p, const GT* __restrict__ g, float& m, float& v,
                       float* __restrict__ master, uint16_t* __restrict__ kahan, int64_t j, const Hyper& h) {
  const float gv = load<GT>(g, j) * h.clip;
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
}

#ifdef LT_AVX2

// Table reads of 8 lanes (`Lookup`): kGather: one AVX2 gather; kScalar: eight scalar loads (indices moved to
// general registers), which some CPUs run faster than a gather. Same values either way.

template <int LK>
inline __m256 dequant8(const uint8_t* codes, const float* qmap, __m256 scale) {
  if (LK == kScalar) {
    uint64_t c;
    std::memcpy(&c, codes, 8);
    const __m256 x = _mm256_setr_ps(qmap[c & 255], qmap[(c >> 8) & 255], qmap[(c >> 16) & 255],
                                    qmap[(c >> 24) & 255], qmap[(c >> 32) & 255], qmap[(c >> 40) & 255],
                                    qmap[(c >> 48) & 255], qmap[c >> 56]);
    return _mm256_mul_ps(x, scale);
  }
  const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
  return _mm256_mul_ps(_mm256_i32gather_ps(qmap, idx, 4), scale);
}

template <int LK>
inline __m256i lookup8(const int* lut, __m256i key) {
  if (LK == kScalar) {
    const __m128i lo = _mm256_castsi256_si128(key), hi = _mm256_extracti128_si256(key, 1);
    const uint64_t k01 = static_cast<uint64_t>(_mm_cvtsi128_si64(lo));
    const uint64_t k23 = static_cast<uint64_t>(_mm_extract_epi64(lo, 1));
    const uint64_t k45 = static_cast<uint64_t>(_mm_cvtsi128_si64(hi));
    const uint64_t k67 = static_cast<uint64_t>(_mm_extract_epi64(hi, 1));
    return _mm256_setr_epi32(lut[static_cast<uint32_t>(k01)], lut[k01 >> 32], lut[static_cast<uint32_t>(k23)],
                             lut[k23 >> 32], lut[static_cast<uint32_t>(k45)], lut[k45 >> 32],
                             lut[static_cast<uint32_t>(k67)], lut[k67 >> 32]);
  }
  return _mm256_i32gather_epi32(lut, key, 4);
}

// SIMD traits: the vector operations of the shared templates (update_block_simd, quantize_block_simd), one struct
// per width: V8 (AVX2 + FMA, 8 lanes) here, V16 (AVX-512, 16 lanes) below. The templates run the same fp32
// operations in the same order (and operand order) on either, so the same bits; the widths differ in data
// movement only (dequantization, compare results as vectors or mask registers, narrowing).
struct V8 {
  using F = __m256;
  using I = __m256i;
  using Sel = __m256;  // the lerp base select: blendv reads the sign bit
  static constexpr int kLanes = 8;
  static F set1(float x) { return _mm256_set1_ps(x); }
  static I set1i(int x) { return _mm256_set1_epi32(x); }
  static I zeroi() { return _mm256_setzero_si256(); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const uint16_t* p) {  // bf16 -> fp32
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static F loada(const float* p) { return _mm256_load_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static void storea(float* p, F v) { _mm256_store_ps(p, v); }
  static Sel sel(uint32_t bits) { return _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(bits))); }
  static F blend(Sel k, F a, F b) { return _mm256_blendv_ps(a, b, k); }  // b where k
  static I cast(F a) { return _mm256_castps_si256(a); }
  static F casti(I a) { return _mm256_castsi256_ps(a); }
  static I band(I a, I b) { return _mm256_and_si256(a, b); }
  static I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  static I umax(I a, I b) { return _mm256_max_epu32(a, b); }
  static I srli16(I a) { return _mm256_srli_epi32(a, 16); }
  static I slli16(I a) { return _mm256_slli_epi32(a, 16); }
  static uint32_t reduce_umax(I b) {
    alignas(32) uint32_t l[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(l), b);
    uint32_t r = 0;
    for (int q = 0; q < 8; ++q) r = l[q] > r ? l[q] : r;
    return r;
  }
  // NaN lanes of f -> canonical 0x7FC0 in bits
  static I fix_nan(I bits, F f) {
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7FC0), nan);
  }
  static bool any_nan(F f) {
    const __m256 bad = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
    return !_mm256_testz_ps(bad, bad);
  }
  // bf16 bits in the low 16 bits of each lane -> 8 bf16
  static void store_bf16(uint16_t* p, I bits) {
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  // as two store_bf16 with one pack: [r0-3 c0-3 | r4-7 c4-7] -> [r0-7 | c0-7]
  static void store_bf16_pair(uint16_t* p, uint16_t* q, I r, I c) {
    const __m256i rc = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, c), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(rc));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm256_extracti128_si256(rc, 1));
  }
  // m and v of the first lenv (a multiple of 8) elements: both tables in one loop, reads as LK
  static constexpr bool kDequantFirst = false;
  template <int LK>
  static void dequant(const uint8_t* c1, const uint8_t* c2, float s1, float s2, const float* qmap1,
                      const float* qmap2, float* __restrict__ mbuf, float* __restrict__ vbuf, int64_t lenv) {
    const __m256 vs1 = _mm256_set1_ps(s1), vs2 = _mm256_set1_ps(s2);
    for (int64_t j = 0; j < lenv; j += 8) {
      _mm256_store_ps(mbuf + j, dequant8<LK>(c1 + j, qmap1, vs1));
      _mm256_store_ps(vbuf + j, dequant8<LK>(c2 + j, qmap2, vs2));
    }
  }
  // code search (quant): compare results are all-ones lanes
  using Mask = __m256i;
  static constexpr bool kPack4 = true;  // codes narrowed 4 vectors at a time (store_codes4)
  static F zero() { return _mm256_setzero_ps(); }
  static I bxor(I a, I b) { return _mm256_xor_si256(a, b); }
  static I isub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I imax(I a, I b) { return _mm256_max_epi32(a, b); }
  static I imin(I a, I b) { return _mm256_min_epi32(a, b); }
  static I srai31(I a) { return _mm256_srai_epi32(a, 31); }
  static I srl(I a, __m128i n) { return _mm256_srl_epi32(a, n); }
  static Mask gt_i(I a, I b) { return _mm256_cmpgt_epi32(a, b); }
  static Mask eq_i(I a, I b) { return _mm256_cmpeq_epi32(a, b); }
  static Mask gt_f(F a, F b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_GT_OQ)); }
  static Mask lt_f(F a, F b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
  static Mask mand(Mask a, Mask b) { return _mm256_and_si256(a, b); }
  static I inc_where(I c, Mask k, I) { return _mm256_sub_epi32(c, k); }  // c - (-1) where k
  static I add_where(I c, Mask k, I x) { return _mm256_add_epi32(c, _mm256_and_si256(k, x)); }
  static I sub_where(I c, Mask k, I x) { return _mm256_sub_epi32(c, _mm256_and_si256(k, x)); }
  template <int LK> static I lookup(const int* lut, I key) { return lookup8<LK>(lut, key); }
  // 8 codes (each in 0..255) -> 8 bytes
  static void store_codes(uint8_t* out, I c) {
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(w, w));
  }
  // 32 codes (4 x 8 lanes) -> 32 bytes in order
  static void store_codes4(uint8_t* out, I c0, I c1, I c2, I c3) {
    const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                        _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
};

// bf16 bits (in the low 16 bits of each lane), rounded as f32_to_bf16 without the NaN case: right for every
// non-NaN lane
template <typename V>
inline typename V::I bf16_bits_nonnan(typename V::F f) {
  const typename V::I u = V::cast(f);
  const typename V::I lsb = V::band(V::srli16(u), V::set1i(1));
  return V::srli16(V::iadd(V::iadd(u, V::set1i(0x7FFF)), lsb));
}

template <typename V> inline void store_v(float* p, typename V::F v) { V::store(p, v); }
template <typename V> inline void store_v(uint16_t* p, typename V::F v) {
  V::store_bf16(p, V::fix_nan(bf16_bits_nonnan<V>(v), v));
}

// New parameter of one vector at j from its step (nss m) / denom: (old * decay) + step, written as the mode keeps
// it (fp32 master and the parameter; the bf16 parameter and its bf16 compensation; the parameter alone).
template <typename V, typename PT, int MM>
inline void write_param(PT* __restrict__ p, float* __restrict__ master, uint16_t* __restrict__ kahan, int64_t j,
                        typename V::F decay, typename V::F step) {
  using F = typename V::F;
  using I = typename V::I;
  F pf;
  if (MM == kMasterFp32) pf = V::load(master + j);
  else if (MM == kMasterKahan) pf = V::add(V::load(p + j), V::load(kahan + j));
  else pf = V::load(p + j);
  pf = V::add(V::mul(pf, decay), step);
  if (MM == kMasterFp32) {
    V::store(master + j, pf);
    store_v<V>(p + j, pf);
  } else if (MM == kMasterKahan) {
    // rounded as store_v, the NaN fix-up only where needed: the residual is NaN where pf is NaN or infinite
    // (pf NaN: the residual is NaN whatever r holds), so one test covers both roundings
    I r = bf16_bits_nonnan<V>(pf);
    const F res = V::sub(pf, V::casti(V::slli16(r)));
    I c = bf16_bits_nonnan<V>(res);
    if (__builtin_expect(V::any_nan(res), 0)) {
      r = V::fix_nan(r, pf);
      c = V::fix_nan(c, res);
    }
    V::store_bf16_pair(reinterpret_cast<uint16_t*>(p) + j, kahan + j, r, c);
  } else {
    store_v<V>(p + j, pf);
  }
}

// Pass 1 on one block: dequantize, AdamW, parameter write; new m and v into mbuf / vbuf; returns their absmax
// (integer max over the float bits with the sign cleared, as abs_max). Two loops over the block: the table reads
// first, into the buffers (V::dequant), then the arithmetic: in one loop the dependency chain per vector (table
// reads -> moments -> sqrt, two divisions -> parameter -> bf16 rounding) was too long for the out-of-order window to
// overlap enough iterations (AVX2: the split measured 4-14% faster with the block in cache; streaming from memory
// it needs the prefetch in adamw_q8 to gain, 2-12%).
template <typename V, int LK, typename PT, typename GT, int MM>
inline void update_block_simd(PT* __restrict__ p, const GT* __restrict__ g, const uint8_t* c1, const uint8_t* c2,
                              float s1, float s2, const float* qmap1, const float* qmap2,
                              float* __restrict__ mbuf, float* __restrict__ vbuf, float* __restrict__ master,
                              uint16_t* __restrict__ kahan, int64_t len, const Hyper& h, float* am1, float* am2,
                              const float* pm, const float* pv) {
  using F = typename V::F;
  using I = typename V::I;
  constexpr int W = V::kLanes;
  const int64_t lenv = len & ~int64_t{W - 1};
  // pm / pv: m and v already dequantized (lt_dequantize_q8, the same values): read from there, no table reads
  const float* msrc = pm != nullptr ? pm : mbuf;
  const float* vsrc = pv != nullptr ? pv : vbuf;
  const bool deq = pm == nullptr;
  // where the constants are set up shapes the compiler's register allocation: V::kDequantFirst gives each width
  // the code of its former hand-written version (V16: fewer spills beside the 16 table registers)
  if constexpr (V::kDequantFirst) {
    if (deq) V::template dequant<LK>(c1, c2, s1, s2, qmap1, qmap2, mbuf, vbuf, lenv);
  }
  const F clip = V::set1(h.clip), w1c = V::set1(h.w1c), beta2 = V::set1(h.beta2);
  const F w2 = V::set1(h.w2), eps = V::set1(h.eps), decay = V::set1(h.decay);
  const F nss = V::set1(h.nss), bc2 = V::set1(h.bc2);
  const typename V::Sel lerp = V::sel(h.lerp_mask);
  const I abs_mask = V::set1i(0x7FFFFFFF);
  if constexpr (!V::kDequantFirst) {
    if (deq) V::template dequant<LK>(c1, c2, s1, s2, qmap1, qmap2, mbuf, vbuf, lenv);
  }
  I b1 = V::zeroi(), b2 = V::zeroi();
  // Software-pipelined: iteration j computes the moments and step of elements j.. and writes the parameter of the
  // previous vector (whose step is ready), so the write's work (Kahan: two roundings, the compensation) overlaps
  // the next divisions instead of lengthening one dependency chain past the out-of-order window (measured on Zen
  // 3, AVX2, 1 thread, block in cache: Kahan 7% faster than the single chain). Kahan only: pipelined, the
  // fp32-master path was ~4% faster too, but the compiler then swapped a commutative add's operands, which changes
  // which NaN survives where the master and the step are both NaN (the master stores it as is; Kahan canonicalizes
  // NaN).
  auto moments = [&](int64_t j) {  // moments, their absmax; returns the step (nss m) / denom
    const F gv = V::mul(V::load(g + j), clip);
    F m = V::load(msrc + j);
    F v = V::load(vsrc + j);
    m = V::fmadd(w1c, V::sub(gv, m), V::blend(lerp, gv, m));
    v = V::add(V::mul(v, beta2), V::mul(V::mul(w2, gv), gv));
    const F denom = V::add(V::div(V::sqrt(v), bc2), eps);
    const F step = V::div(V::mul(nss, m), denom);
    V::storea(mbuf + j, m);
    V::storea(vbuf + j, v);
    b1 = V::umax(b1, V::band(V::cast(m), abs_mask));
    b2 = V::umax(b2, V::band(V::cast(v), abs_mask));
    return step;
  };
  if (MM != kMasterKahan) {
    for (int64_t j = 0; j < lenv; j += W) write_param<V, PT, MM>(p, master, kahan, j, decay, moments(j));
  } else if (lenv > 0) {
    F prev = moments(0);
    for (int64_t j = W; j < lenv; j += W) {
      const F step = moments(j);
      write_param<V, PT, MM>(p, master, kahan, j - W, decay, prev);
      prev = step;
    }
    write_param<V, PT, MM>(p, master, kahan, lenv - W, decay, prev);
  }
  uint32_t r1 = V::reduce_umax(b1), r2 = V::reduce_umax(b2);
  for (int64_t j = lenv; j < len; ++j) {  // the last len % W elements, one at a time
    float m = deq ? qmap1[c1[j]] * s1 : pm[j], v = deq ? qmap2[c2[j]] * s2 : pv[j];
    update_one<PT, GT, MM>(p, g, m, v, master, kahan, j, h);
    mbuf[j] = m;
    vbuf[j] = v;
    const uint32_t u1 = f32_bits(m) & 0x7FFFFFFFu, u2 = f32_bits(v) & 0x7FFFFFFFu;
    r1 = u1 > r1 ? u1 : r1;
    r2 = u2 > r2 ? u2 : r2;
  }
  *am1 = bits_f32(r1);
  *am2 = bits_f32(r2);
}

enum Floor { kFloorNone = 0, kFloorZero0 = 1, kFloorAny = 2 };

template <typename V>
struct QuantConsts {
  typename V::F inv;
  typename V::I kmask, key_off, key_max, zero, half, low_mask, m255, vz, one, down;
  __m128i shift;
  const int* lut;
  QuantConsts(const Codebook& cb, float inv_, int z) {
    const KeyGeom kg(cb);
    inv = V::set1(inv_);
    kmask = V::set1i(static_cast<int>(kg.kmask));
    key_off = V::set1i(kg.key_off);
    key_max = V::set1i(kg.key_max);
    zero = V::zeroi();
    half = V::set1i(static_cast<int>(cb.half));
    low_mask = V::set1i(static_cast<int>(kg.low_mask));
    m255 = V::set1i(255);
    vz = V::set1i(z);
    one = V::set1i(1);
    down = V::set1i(z > 0 ? 1 : 0);
    shift = _mm_cvtsi32_si128(static_cast<int>(kg.shift));
    lut = reinterpret_cast<const int*>(cb.lut);
  }
};

// codes (one per 32-bit lane) of one vector of x, as nearest_code (and floor_code: FL)
template <typename V, int LK, int FL>
inline typename V::I quant(const float* x, const QuantConsts<V>& k) {
  using F = typename V::F;
  using I = typename V::I;
  using Mask = typename V::Mask;
  const F raw = V::load(x);
  const I u = V::cast(V::mul(raw, k.inv));
  const I s = V::srai31(u);
  I key = V::isub(V::band(V::srl(u, k.shift), k.kmask), k.key_off);
  key = V::imin(V::imax(key, k.zero), k.key_max);
  key = V::iadd(key, V::band(s, k.half));
  const I entry = V::template lookup<LK>(k.lut, key);
  const I low = V::slli16(V::band(V::bxor(u, s), k.low_mask));
  I c = V::inc_where(V::band(entry, k.m255), V::gt_i(low, entry), k.one);
  if (FL == kFloorZero0) {
    // z = 0: c == 0 and raw > 0 -> 1; min(raw bits, 1) is 1 for raw > 0 or NaN (whose code is 255 anyway), and
    // 0 or negative for +0 and negatives
    c = V::imax(c, V::imin(V::cast(raw), k.one));
  } else if (FL == kFloorAny) {
    const Mask atz = V::eq_i(c, k.vz);
    const Mask pos = V::gt_f(raw, V::zero());
    const Mask neg = V::lt_f(raw, V::zero());
    c = V::add_where(c, V::mand(atz, pos), k.one);
    c = V::sub_where(c, V::mand(atz, neg), k.down);
  }
  return c;
}

template <typename V, int LK, int FL>
void quantize_block_simd(const float* __restrict__ x, uint8_t* __restrict__ out, int64_t len, float inv,
                         const Codebook& cb, int z) {
  constexpr int W = V::kLanes;
  const QuantConsts<V> k(cb, inv, z);
  int64_t j = 0;
  if constexpr (V::kPack4) {
    for (; j + 4 * W <= len; j += 4 * W)
      V::store_codes4(out + j, quant<V, LK, FL>(x + j, k), quant<V, LK, FL>(x + j + W, k),
                      quant<V, LK, FL>(x + j + 2 * W, k), quant<V, LK, FL>(x + j + 3 * W, k));
  }
  for (; j + W <= len; j += W) V::store_codes(out + j, quant<V, LK, FL>(x + j, k));
  const KeyGeom kg(cb);
  for (; j < len; ++j) {
    uint32_t c = nearest_code(x[j] * inv, cb, kg);
    if (FL != kFloorNone) c = floor_code(c, x[j], z);
    out[j] = static_cast<uint8_t>(c);
  }
}

// quantize_block_simd with the floor's case picked
template <typename V, int LK>
inline void quantize_block_simd(const float* __restrict__ x, uint8_t* __restrict__ out, int64_t len, float inv,
                                const Codebook& cb, int z, bool floor) {
  if (!floor) quantize_block_simd<V, LK, kFloorNone>(x, out, len, inv, cb, z);
  else if (z == 0) quantize_block_simd<V, LK, kFloorZero0>(x, out, len, inv, cb, z);
  else quantize_block_simd<V, LK, kFloorAny>(x, out, len, inv, cb, z);
}
#endif  // LT_AVX2

#ifdef LT_AVX512

// A 256-entry float table in 16 registers, read without memory accesses: vpermi2ps picks from a pair of
// registers (32 entries) by index bits 0-4 (it ignores the higher bits), then three levels of blends pick one of
// the 8 pairs' results by index bits 5, 6 and 7 (mask_blend(k, a, b): b where k is set). 8 permutes and 7 blends
// per 16 lanes instead of a 16-element gather.
struct Table256 {
  __m512 t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, t12, t13, t14, t15;
  explicit Table256(const float* q)
      : t0(_mm512_loadu_ps(q)), t1(_mm512_loadu_ps(q + 16)), t2(_mm512_loadu_ps(q + 32)),
        t3(_mm512_loadu_ps(q + 48)), t4(_mm512_loadu_ps(q + 64)), t5(_mm512_loadu_ps(q + 80)),
        t6(_mm512_loadu_ps(q + 96)), t7(_mm512_loadu_ps(q + 112)), t8(_mm512_loadu_ps(q + 128)),
        t9(_mm512_loadu_ps(q + 144)), t10(_mm512_loadu_ps(q + 160)), t11(_mm512_loadu_ps(q + 176)),
        t12(_mm512_loadu_ps(q + 192)), t13(_mm512_loadu_ps(q + 208)), t14(_mm512_loadu_ps(q + 224)),
        t15(_mm512_loadu_ps(q + 240)) {}
  // idx: 16 indices in 0..255, one per 32-bit lane -> table[idx]
  inline __m512 operator()(__m512i idx) const {
    const __mmask16 b5 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
    const __mmask16 b6 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(64));
    const __mmask16 b7 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(128));
    // entries 0-63, 64-127, 128-191, 192-255 (bit 5 picks the upper 32 of each 64)
    const __m512 s0 = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(t0, idx, t1),
                                           _mm512_permutex2var_ps(t2, idx, t3));
    const __m512 s1 = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(t4, idx, t5),
                                           _mm512_permutex2var_ps(t6, idx, t7));
    const __m512 s2 = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(t8, idx, t9),
                                           _mm512_permutex2var_ps(t10, idx, t11));
    const __m512 s3 = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(t12, idx, t13),
                                           _mm512_permutex2var_ps(t14, idx, t15));
    return _mm512_mask_blend_ps(b7, _mm512_mask_blend_ps(b6, s0, s1), _mm512_mask_blend_ps(b6, s2, s3));
  }
};

inline __m512i codes16(const uint8_t* c) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
}

// The code-search table (2 x 6,401 entries) is far too large for registers: gathers or scalar loads, as lookup8.
// Note the AVX-512 gather's argument order: (indices, base, scale).
template <int LK>
inline __m512i lookup16(const int* lut, __m512i key) {
  if (LK == kScalar) {
    alignas(64) int32_t k[16];
    _mm512_store_si512(reinterpret_cast<__m512i*>(k), key);
    return _mm512_setr_epi32(lut[k[0]], lut[k[1]], lut[k[2]], lut[k[3]], lut[k[4]], lut[k[5]], lut[k[6]],
                             lut[k[7]], lut[k[8]], lut[k[9]], lut[k[10]], lut[k[11]], lut[k[12]], lut[k[13]],
                             lut[k[14]], lut[k[15]]);
  }
  return _mm512_i32gather_epi32(key, lut, 4);
}

// V16: the AVX-512 traits. The dequantization tables live in registers (Table256), compares give mask registers,
// and 32-bit lanes are narrowed with vpmovdw / vpmovdb (lanes hold 0..0xFFFF / 0..255, so the truncation keeps
// every value, as V8's saturating packs do).
struct V16 {
  using F = __m512;
  using I = __m512i;
  using Sel = __mmask16;
  static constexpr int kLanes = 16;
  static F set1(float x) { return _mm512_set1_ps(x); }
  static I set1i(int x) { return _mm512_set1_epi32(x); }
  static I zeroi() { return _mm512_setzero_si512(); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static F loada(const float* p) { return _mm512_load_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static void storea(float* p, F v) { _mm512_store_ps(p, v); }
  static Sel sel(uint32_t bits) { return bits ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>(0); }
  static F blend(Sel k, F a, F b) { return _mm512_mask_blend_ps(k, a, b); }  // b where k
  static I cast(F a) { return _mm512_castps_si512(a); }
  static F casti(I a) { return _mm512_castsi512_ps(a); }
  static I band(I a, I b) { return _mm512_and_si512(a, b); }
  static I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  static I umax(I a, I b) { return _mm512_max_epu32(a, b); }
  static I srli16(I a) { return _mm512_srli_epi32(a, 16); }
  static I slli16(I a) { return _mm512_slli_epi32(a, 16); }
  static uint32_t reduce_umax(I b) { return _mm512_reduce_max_epu32(b); }
  static I fix_nan(I bits, F f) {
    return _mm512_mask_mov_epi32(bits, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  }
  static bool any_nan(F f) { return _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q) != 0; }
  static void store_bf16(uint16_t* p, I bits) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bits));
  }
  static void store_bf16_pair(uint16_t* p, uint16_t* q, I r, I c) {
    store_bf16(p, r);
    store_bf16(q, c);
  }
  // one loop per table, so that only one table (16 of the 32 vector registers) is live at a time; LK: only the
  // code search of pass 2 reads memory
  static constexpr bool kDequantFirst = true;
  template <int LK>
  static void dequant(const uint8_t* c1, const uint8_t* c2, float s1, float s2, const float* qmap1,
                      const float* qmap2, float* __restrict__ mbuf, float* __restrict__ vbuf, int64_t lenv) {
    {
      const Table256 t(qmap1);
      const __m512 vs = _mm512_set1_ps(s1);
      for (int64_t j = 0; j < lenv; j += 16) _mm512_store_ps(mbuf + j, _mm512_mul_ps(t(codes16(c1 + j)), vs));
    }
    {
      const Table256 t(qmap2);
      const __m512 vs = _mm512_set1_ps(s2);
      for (int64_t j = 0; j < lenv; j += 16) _mm512_store_ps(vbuf + j, _mm512_mul_ps(t(codes16(c2 + j)), vs));
    }
  }
  // code search (quant): compare results are mask registers, V8's all-ones arithmetic becomes masked adds
  using Mask = __mmask16;
  static constexpr bool kPack4 = false;
  static F zero() { return _mm512_setzero_ps(); }
  static I bxor(I a, I b) { return _mm512_xor_si512(a, b); }
  static I isub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I imax(I a, I b) { return _mm512_max_epi32(a, b); }
  static I imin(I a, I b) { return _mm512_min_epi32(a, b); }
  static I srai31(I a) { return _mm512_srai_epi32(a, 31); }
  static I srl(I a, __m128i n) { return _mm512_srl_epi32(a, n); }
  static Mask gt_i(I a, I b) { return _mm512_cmpgt_epi32_mask(a, b); }
  static Mask eq_i(I a, I b) { return _mm512_cmpeq_epi32_mask(a, b); }
  static Mask gt_f(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static Mask lt_f(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static Mask mand(Mask a, Mask b) { return static_cast<__mmask16>(a & b); }
  static I inc_where(I c, Mask k, I one) { return _mm512_mask_add_epi32(c, k, c, one); }
  static I add_where(I c, Mask k, I x) { return _mm512_mask_add_epi32(c, k, c, x); }
  static I sub_where(I c, Mask k, I x) { return _mm512_mask_sub_epi32(c, k, c, x); }
  template <int LK> static I lookup(const int* lut, I key) { return lookup16<LK>(lut, key); }
  static void store_codes(uint8_t* out, I c) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(c));
  }
};
#endif  // LT_AVX512

// Lookup mode of the AVX2 / AVX-512 paths (`Lookup`), set by lt_set_lookup / lt_calibrate_lookup.
std::atomic<int> g_lookup{kScalar};

// codes of x[0, len) * inv with the ISA path's code search; floor: a non-zero x never takes the zero code z (it
// takes z +- 1, by its sign).
template <int ISA, int LK>
void quantize_block(const float* __restrict__ x, uint8_t* __restrict__ out, int64_t len, float inv,
                    const Codebook& cb, int z, bool floor) {
#ifdef LT_AVX512
  if (ISA == kIsaAvx512) {
    quantize_block_simd<V16, LK>(x, out, len, inv, cb, z, floor);
    return;
  }
#endif
#ifdef LT_AVX2
  if (ISA == kIsaAvx2) {
    quantize_block_simd<V8, LK>(x, out, len, inv, cb, z, floor);
    return;
  }
#endif
  const KeyGeom kg(cb);
  for (int64_t j = 0; j < len; ++j) {
    uint32_t c = nearest_code(x[j] * inv, cb, kg);
    if (floor) c = floor_code(c, x[j], z);
    out[j] = static_cast<uint8_t>(c);
  }
}

// AdamW on len elements, m and v (fp32) in place; with ABSMAX also their absmax (as abs_max). The generic path
// (auto-vectorized: every pointer restrict-qualified, h a local copy that no store can alias).
template <typename PT, typename GT, int MM, bool ABSMAX>
void update_block(PT* __restrict__ p, const GT* __restrict__ g, float* __restrict__ m_, float* __restrict__ v_,
                  float* __restrict__ master, uint16_t* __restrict__ kahan, int64_t len, const Hyper h, float* am1,
                  float* am2) {
  uint32_t b1 = 0, b2 = 0;
  for (int64_t j = 0; j < len; ++j) {
    float m = m_[j], v = v_[j];
    update_one<PT, GT, MM>(p, g, m, v, master, kahan, j, h);
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

// Generic pass 1: dequantize into the buffers, then AdamW in place.
template <typename PT, typename GT, int MM>
inline void update_block_generic(PT* __restrict__ p, const GT* __restrict__ g, const uint8_t* c1,
                                 const uint8_t* c2, float s1, float s2, const float* qmap1, const float* qmap2,
                                 float* __restrict__ mbuf, float* __restrict__ vbuf, float* __restrict__ master,
                                 uint16_t* __restrict__ kahan, int64_t len, const Hyper& h, float* am1,
                                 float* am2, const float* pm, const float* pv) {
  if (pm != nullptr) {
    std::memcpy(mbuf, pm, static_cast<size_t>(len) * 4);
    std::memcpy(vbuf, pv, static_cast<size_t>(len) * 4);
  } else {
    for (int64_t j = 0; j < len; ++j) mbuf[j] = qmap1[c1[j]] * s1;
    for (int64_t j = 0; j < len; ++j) vbuf[j] = qmap2[c2[j]] * s2;
  }
  update_block<PT, GT, MM, true>(p, g, mbuf, vbuf, master, kahan, len, h, am1, am2);
}

// Software prefetch of the block of len elements at element s (every stream the update reads or writes): with
// the table reads in a loop of their own, the streams are touched in bursts and DRAM latency was exposed.
template <typename PT, typename GT, int MM>
inline void prefetch_block(const Args& a, int64_t s, int64_t len) {
  const char* gp = reinterpret_cast<const char*>(static_cast<const GT*>(a.grad) + s);
  for (int64_t o = 0; o < len * static_cast<int64_t>(sizeof(GT)); o += 64) __builtin_prefetch(gp + o, 0);
  const char* pp = reinterpret_cast<const char*>(static_cast<PT*>(a.param) + s);
  for (int64_t o = 0; o < len * static_cast<int64_t>(sizeof(PT)); o += 64) __builtin_prefetch(pp + o, 1);
  if (MM == kMasterFp32) {
    const char* mp = reinterpret_cast<const char*>(a.master + s);
    for (int64_t o = 0; o < len * 4; o += 64) __builtin_prefetch(mp + o, 1);
  }
  if (MM == kMasterKahan) {
    const char* kp = reinterpret_cast<const char*>(a.kahan + s);
    for (int64_t o = 0; o < len * 2; o += 64) __builtin_prefetch(kp + o, 1);
  }
  if (a.pre1 != nullptr) {
    const char* m = reinterpret_cast<const char*>(a.pre1 + s);
    const char* v = reinterpret_cast<const char*>(a.pre2 + s);
    for (int64_t o = 0; o < len * 4; o += 64) {
      __builtin_prefetch(m + o, 0);
      __builtin_prefetch(v + o, 0);
    }
  }
  const char* c1 = static_cast<const char*>(a.state1) + s;
  const char* c2 = static_cast<const char*>(a.state2) + s;
  for (int64_t o = 0; o < len; o += 64) {
    __builtin_prefetch(c1 + o, 1);
    __builtin_prefetch(c2 + o, 1);
  }
}

constexpr int kDynamicChunk = 64;  // quantization blocks a thread takes at a time (16K elements at B = 256)

// 8-bit states: threads take chunks of whole blocks; per block: prefetch of a block about 512
// elements ahead, pass 1, new scales, pass 2 (requantize; Note [v floor] in lazytrain_hf/optim/quant.py for the
// second moment).
template <int ISA, int LK, typename PT, typename GT, int MM>
void adamw_q8(const Args& a, const Hyper& h) {
  PT* const p = static_cast<PT*>(a.param);
  const GT* const g = static_cast<const GT*>(a.grad);
  const int64_t n = a.n, B = a.block;
  const int64_t nblocks = (n + B - 1) / B;
  const int64_t ahead = std::max<int64_t>(1, 512 / B);
  const int nthreads = std::max(1, a.threads);
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && n >= 32768)
  {
    const size_t bytes = static_cast<size_t>((B * 4 + 63) / 64) * 64;
    float* mbuf = static_cast<float*>(std::aligned_alloc(64, bytes));
    float* vbuf = static_cast<float*>(std::aligned_alloc(64, bytes));
    // Dynamic chunks of ~16K elements, not one static range per thread: inside a training step a core is shared
    // with the launching thread and the copy engines' traffic, and a static split waits for its slowest thread
    // (H200 host, 2026-11-30: static, the worker ran 2.25-2.5 G params/s in steps against 3.0-3.75 alone; dynamic,
    // 3.56-3.80 in steps: benchmarks/results/7b-cpu-dynamic-chunks-20261130.json).
    // Blocks are independent: the same bits whichever thread runs a block.
#pragma omp for schedule(dynamic, kDynamicChunk)
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t s = b * B;
      const int64_t len = std::min(B, n - s);
      float* master = MM == kMasterFp32 ? a.master + s : nullptr;
      uint16_t* kahan = MM == kMasterKahan ? a.kahan + s : nullptr;
      uint8_t* c1 = static_cast<uint8_t*>(a.state1) + s;
      uint8_t* c2 = static_cast<uint8_t*>(a.state2) + s;
      if (b + ahead < nblocks) prefetch_block<PT, GT, MM>(a, s + ahead * B, B);
      const float* pm = a.pre1 != nullptr ? a.pre1 + s : nullptr;
      const float* pv = a.pre2 != nullptr ? a.pre2 + s : nullptr;
      float am1 = 0.0f, am2 = 0.0f;
      bool done = false;
#ifdef LT_AVX512
      if (ISA == kIsaAvx512) {
        // V16 reads its dequantization tables from registers whatever LK: one instantiation for both
        update_block_simd<V16, kScalar, PT, GT, MM>(p + s, g + s, c1, c2, a.absmax1[b], a.absmax2[b],
                                                    a.cb1.qmap, a.cb2.qmap, mbuf, vbuf, master, kahan, len, h,
                                                    &am1, &am2, pm, pv);
        done = true;
      }
#endif
#ifdef LT_AVX2
      if (ISA == kIsaAvx2) {
        update_block_simd<V8, LK, PT, GT, MM>(p + s, g + s, c1, c2, a.absmax1[b], a.absmax2[b], a.cb1.qmap,
                                              a.cb2.qmap, mbuf, vbuf, master, kahan, len, h, &am1, &am2, pm, pv);
        done = true;
      }
#endif
      if (!done)
        update_block_generic<PT, GT, MM>(p + s, g + s, c1, c2, a.absmax1[b], a.absmax2[b], a.cb1.qmap,
                                         a.cb2.qmap, mbuf, vbuf, master, kahan, len, h, &am1, &am2, pm, pv);
      a.absmax1[b] = am1;
      a.absmax2[b] = am2;
      quantize_block<ISA, LK>(mbuf, c1, len, am1 > 0.0f ? 1.0f / am1 : 0.0f, a.cb1, 127, false);
      quantize_block<ISA, LK>(vbuf, c2, len, am2 > 0.0f ? 1.0f / am2 : 0.0f, a.cb2, 0, true);
    }
    std::free(mbuf);
    std::free(vbuf);
  }
}

// fp32 states: threads take contiguous ranges of chunks of `block` elements.
template <typename PT, typename GT, int MM>
void adamw_f32(const Args& a, const Hyper& h) {
  PT* const p = static_cast<PT*>(a.param);
  const GT* const g = static_cast<const GT*>(a.grad);
  float* const m = static_cast<float*>(a.state1);
  float* const v = static_cast<float*>(a.state2);
  const int64_t n = a.n, B = a.block;
  const int64_t nblocks = (n + B - 1) / B;
  const int nthreads = std::max(1, a.threads);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && n >= 32768)
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t s = b * B;
    update_block<PT, GT, MM, false>(p + s, g + s, m + s, v + s, MM == kMasterFp32 ? a.master + s : nullptr,
                                    MM == kMasterKahan ? a.kahan + s : nullptr, std::min(B, n - s), h, nullptr,
                                    nullptr);
  }
}

// isa: an `Isa` this build has (the caller checks). fp32 states take the generic path whatever the ISA.
template <typename PT, typename GT, int MM>
void adamw_impl(const Args& a, bool q8, int isa) {
  const bool lerp_low = std::fabs(a.w1) < 0.5f;
  const Hyper h{a.clip, a.beta2, lerp_low ? a.w1 : a.w1 - 1.0f, a.w2, a.eps, a.decay, a.neg_step_size,
                a.bc2_sqrt, lerp_low ? 0xFFFFFFFFu : 0u};
  if (!q8) {
    adamw_f32<PT, GT, MM>(a, h);
    return;
  }
  const bool gather = g_lookup.load(std::memory_order_relaxed) == kGather;
  (void)gather;
  (void)isa;
#ifdef LT_AVX512
  if (isa == kIsaAvx512) {
    if (gather) adamw_q8<kIsaAvx512, kGather, PT, GT, MM>(a, h);
    else adamw_q8<kIsaAvx512, kScalar, PT, GT, MM>(a, h);
    return;
  }
#endif
#ifdef LT_AVX2
  if (isa == kIsaAvx2) {
    if (gather) adamw_q8<kIsaAvx2, kGather, PT, GT, MM>(a, h);
    else adamw_q8<kIsaAvx2, kScalar, PT, GT, MM>(a, h);
    return;
  }
#endif
  adamw_q8<kIsaGeneric, kScalar, PT, GT, MM>(a, h);
}

// m and v of n elements dequantized into out1 / out2 (fp32 [n]): the values pass 1 computes (one fp32
// multiply, code value * block absmax, on every path), for a later update that reads them instead
// (Args::pre1 / pre2). Vector stores are aligned: a block whose output is not 64-byte aligned takes the scalar loop.
template <int ISA, int LK>
void dequant_q8(const uint8_t* c1, const uint8_t* c2, const float* am1, const float* am2, const float* qmap1,
                const float* qmap2, int64_t n, int64_t B, float* out1, float* out2, int threads) {
  const int64_t nblocks = (n + B - 1) / B;
  const int nthreads = std::max(1, threads);
#pragma omp parallel for schedule(dynamic, kDynamicChunk) num_threads(nthreads) if (nthreads > 1 && n >= 32768)
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t s = b * B, len = std::min(B, n - s);
    const float s1 = am1[b], s2 = am2[b];
    int64_t done = 0;
    const bool aligned = (reinterpret_cast<uintptr_t>(out1 + s) % 64 == 0) &&
                         (reinterpret_cast<uintptr_t>(out2 + s) % 64 == 0);
    (void)aligned;
#ifdef LT_AVX512
    if (ISA == kIsaAvx512 && aligned) {
      done = len & ~int64_t{15};
      V16::dequant<LK>(c1 + s, c2 + s, s1, s2, qmap1, qmap2, out1 + s, out2 + s, done);
    }
#endif
#ifdef LT_AVX2
    if (ISA == kIsaAvx2 && aligned) {
      done = len & ~int64_t{7};
      V8::dequant<LK>(c1 + s, c2 + s, s1, s2, qmap1, qmap2, out1 + s, out2 + s, done);
    }
#endif
    for (int64_t j = done; j < len; ++j) {
      out1[s + j] = qmap1[c1[s + j]] * s1;
      out2[s + j] = qmap2[c2[s + j]] * s2;
    }
  }
}

template <typename PT, typename GT>
int dispatch_mode(const Args& a, int q8, int master_mode, int isa) {
  switch (master_mode) {
    case kMasterNone: adamw_impl<PT, GT, kMasterNone>(a, q8 != 0, isa); return 0;
    case kMasterFp32: adamw_impl<PT, GT, kMasterFp32>(a, q8 != 0, isa); return 0;
    case kMasterKahan: adamw_impl<PT, GT, kMasterKahan>(a, q8 != 0, isa); return 0;
  }
  return 2;
}

}  // namespace

extern "C" {

int lt_abi_version() { return 6; }

// The best `Isa` path this build has (every lower one is there too).
int lt_isa_best() { return kIsaBest; }

// Returns 0 on success, 1 on an unsupported dtype, 2 on an unsupported mode, 3 on an ISA path the build lacks.
int lt_adamw_step(void* param, int param_dtype, const void* grad, int grad_dtype, int64_t n,
                  void* state1, void* state2, int state_8bit, float* absmax1, float* absmax2,
                  float* master, uint16_t* kahan, int master_mode, int64_t block,
                  const int32_t* lut1, const float* qmap1, const int32_t* lut2, const float* qmap2,
                  int64_t lut_half, int lut_k, int lut_m,
                  float clip, float beta2, float one_minus_beta1, float one_minus_beta2, float eps,
                  float decay, float neg_step_size, float bc2_sqrt, int threads, int isa, const float* pre1,
                  const float* pre2) {
  Args a{param, grad, state1, state2, absmax1, absmax2, master, kahan, n, block,
         clip, beta2, one_minus_beta1, one_minus_beta2, eps, decay, neg_step_size, bc2_sqrt,
         Codebook{lut1, qmap1, lut_half, lut_k, lut_m}, Codebook{lut2, qmap2, lut_half, lut_k, lut_m}, threads,
         pre1, pre2};
  if ((pre1 == nullptr) != (pre2 == nullptr) || (pre1 != nullptr && !state_8bit)) return 2;
  if (isa < kIsaGeneric || isa > kIsaBest) return 3;
  if (master_mode == kMasterKahan && param_dtype != kBF16) return 2;
  const int q8 = state_8bit;
  if (param_dtype == kF32 && grad_dtype == kF32) return dispatch_mode<float, float>(a, q8, master_mode, isa);
  if (param_dtype == kF32 && grad_dtype == kBF16) return dispatch_mode<float, uint16_t>(a, q8, master_mode, isa);
  if (param_dtype == kBF16 && grad_dtype == kF32) return dispatch_mode<uint16_t, float>(a, q8, master_mode, isa);
  if (param_dtype == kBF16 && grad_dtype == kBF16) return dispatch_mode<uint16_t, uint16_t>(a, q8, master_mode, isa);
  return 1;
}

// 8-bit states' m and v (codes [n], absmax [ceil(n / block)]) -> fp32 out1 / out2 [n], as the update's pass 1
// dequantizes them (the update then takes them as pre1 / pre2). Returns 0, or 3 on an ISA path the build lacks.
int lt_dequantize_q8(const uint8_t* codes1, const uint8_t* codes2, const float* absmax1, const float* absmax2,
                     const float* qmap1, const float* qmap2, int64_t n, int64_t block, float* out1, float* out2,
                     int threads, int isa) {
  if (isa < kIsaGeneric || isa > kIsaBest) return 3;
  const bool gather = g_lookup.load(std::memory_order_relaxed) == kGather;
  (void)gather;
#ifdef LT_AVX512
  // V16 reads its tables from registers whatever LK
  if (isa == kIsaAvx512) {
    dequant_q8<kIsaAvx512, kScalar>(codes1, codes2, absmax1, absmax2, qmap1, qmap2, n, block, out1, out2, threads);
    return 0;
  }
#endif
#ifdef LT_AVX2
  if (isa == kIsaAvx2) {
    if (gather) dequant_q8<kIsaAvx2, kGather>(codes1, codes2, absmax1, absmax2, qmap1, qmap2, n, block, out1, out2,
                                               threads);
    else dequant_q8<kIsaAvx2, kScalar>(codes1, codes2, absmax1, absmax2, qmap1, qmap2, n, block, out1, out2,
                                       threads);
    return 0;
  }
#endif
  dequant_q8<kIsaGeneric, kScalar>(codes1, codes2, absmax1, absmax2, qmap1, qmap2, n, block, out1, out2, threads);
  return 0;
}

// Blockwise quantization of fp32 x [n] (tests and tools): codes [n], absmax [ceil(n / block)]. Returns 0, or 3
// on an ISA path the build lacks.
int lt_quantize_blockwise(const float* x, int64_t n, int64_t block, uint8_t* codes, float* absmax,
                          const int32_t* lut, const float* qmap, int64_t lut_half,
                          int lut_k, int lut_m, int zero, int nonzero_floor, int threads, int isa) {
  if (isa < kIsaGeneric || isa > kIsaBest) return 3;
  const Codebook cb{lut, qmap, lut_half, lut_k, lut_m};
  const int64_t nblocks = (n + block - 1) / block;
  const int nthreads = std::max(1, threads);
  const bool gather = g_lookup.load(std::memory_order_relaxed) == kGather;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && n >= 32768)
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t s = b * block, len = std::min(block, n - s);
    const float am = abs_max(x + s, len);
    absmax[b] = am;
    const float inv = am > 0.0f ? 1.0f / am : 0.0f;
    const float* xs = x + s;
    uint8_t* cs = codes + s;
    const bool fl = nonzero_floor != 0;
#ifdef LT_AVX512
    if (isa == kIsaAvx512) {
      if (gather) quantize_block<kIsaAvx512, kGather>(xs, cs, len, inv, cb, zero, fl);
      else quantize_block<kIsaAvx512, kScalar>(xs, cs, len, inv, cb, zero, fl);
      continue;
    }
#endif
#ifdef LT_AVX2
    if (isa == kIsaAvx2) {
      if (gather) quantize_block<kIsaAvx2, kGather>(xs, cs, len, inv, cb, zero, fl);
      else quantize_block<kIsaAvx2, kScalar>(xs, cs, len, inv, cb, zero, fl);
      continue;
    }
#endif
    (void)gather;
    quantize_block<kIsaGeneric, kScalar>(xs, cs, len, inv, cb, zero, fl);
  }
  return 0;
}

// Table reads of the AVX2 / AVX-512 paths: 0 gathers, 1 scalar loads; -1 when the library has neither.
int lt_get_lookup() { return kIsaBest > kIsaGeneric ? g_lookup.load() : -1; }

// Sets the table reads (0 or 1; ignored without an AVX2 path); returns lt_get_lookup().
int lt_set_lookup(int mode) {
  if (kIsaBest > kIsaGeneric && (mode == kGather || mode == kScalar)) g_lookup.store(mode);
  return lt_get_lookup();
}

// Times both table-read modes of the `isa` path on one thread (the 8-bit update of n synthetic elements: bf16
// parameters, fp32 master and gradients, quantized normal moments, blocks of 256; `reps` alternating runs each,
// best run kept), keeps the faster mode and returns lt_get_lookup(). seconds[0], seconds[1]: best time of gathers
// / scalar loads (0 for the generic path, which has one mode, or an ISA the build lacks).
int lt_calibrate_lookup(int64_t n, int reps, const int32_t* lut1, const float* qmap1, const int32_t* lut2,
                        const float* qmap2, int64_t lut_half, int lut_k, int lut_m, double* seconds, int isa) {
  seconds[0] = seconds[1] = 0.0;
  if (isa <= kIsaGeneric || isa > kIsaBest) return lt_get_lookup();
  const int64_t B = 256, nb = (n + B - 1) / B;
  std::vector<uint16_t> p(n), p0(n);
  std::vector<float> g(n), master(n), master0(n), m(n), v(n), a1(nb), a2(nb), a10(nb), a20(nb);
  std::vector<uint8_t> s1(n), s2(n), s10(n), s20(n);
  uint32_t r = 12345u;
  auto normal = [&r]() {  // deterministic, roughly normal (sum of 4 uniforms)
    float x = -2.0f;
    for (int k = 0; k < 4; ++k) {
      r = r * 1664525u + 1013904223u;
      x += static_cast<float>(r >> 8) * (1.0f / 16777216.0f);
    }
    return x;
  };
  for (int64_t i = 0; i < n; ++i) {
    g[i] = normal() * 1e-3f;
    master0[i] = normal() * 2e-2f;
    p0[i] = f32_to_bf16(master0[i]);
    m[i] = normal() * 1e-4f;
    const float w = normal() * 1e-3f;
    v[i] = w * w;
  }
  const Codebook cb1{lut1, qmap1, lut_half, lut_k, lut_m}, cb2{lut2, qmap2, lut_half, lut_k, lut_m};
  for (int64_t b = 0; b < nb; ++b) {  // states as a real run has them: quantized moments
    const int64_t s = b * B, len = std::min(B, n - s);
    a10[b] = abs_max(m.data() + s, len);
    a20[b] = abs_max(v.data() + s, len);
    quantize_block<kIsaGeneric, kScalar>(m.data() + s, s10.data() + s, len, 1.0f / a10[b], cb1, 127, false);
    quantize_block<kIsaGeneric, kScalar>(v.data() + s, s20.data() + s, len, 1.0f / a20[b], cb2, 0, true);
  }
  const int modes[2] = {kGather, kScalar};
  const int saved = g_lookup.load();
  double best[2] = {1e30, 1e30};
  for (int rep = 0; rep < reps; ++rep) {
    for (int k = 0; k < 2; ++k) {
      p = p0; master = master0; s1 = s10; s2 = s20; a1 = a10; a2 = a20;
      g_lookup.store(modes[k]);
      const auto t0 = std::chrono::steady_clock::now();
      lt_adamw_step(p.data(), kBF16, g.data(), kF32, n, s1.data(), s2.data(), 1, a1.data(), a2.data(),
                    master.data(), nullptr, kMasterFp32, B, lut1, qmap1, lut2, qmap2, lut_half, lut_k, lut_m,
                    1.0f, 0.999f, 0.1f, 0.001f, 1e-8f, 1.0f, -1e-4f, 0.5f, 1, isa, nullptr, nullptr);
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best[k] = std::min(best[k], dt);
    }
  }
  seconds[0] = best[0];
  seconds[1] = best[1];
  g_lookup.store(reps > 0 ? (best[0] < best[1] ? kGather : kScalar) : saved);
  return lt_get_lookup();
}

}  // extern "C"
