// AVX-512 intrinsics SIMDe 0.7.4 lacks, emulated per Intel's pseudo-code, for test_cpu_isa.py's emulated build of the
// kernel (included after simde/x86/avx512.h, which provides the rest)
static inline simde__m512i lt_emu_cvtepu8_epi32(simde__m128i a) {
  uint8_t b[16]; int32_t r[16]; simde__m512i o;
  std::memcpy(b, &a, 16);
  for (int i = 0; i < 16; ++i) r[i] = b[i];
  std::memcpy(&o, r, 64); return o;
}
static inline simde__m512i lt_emu_cvtepu16_epi32(simde__m256i a) {
  uint16_t b[16]; int32_t r[16]; simde__m512i o;
  std::memcpy(b, &a, 32);
  for (int i = 0; i < 16; ++i) r[i] = b[i];
  std::memcpy(&o, r, 64); return o;
}
static inline simde__m256i lt_emu_cvtepi32_epi16(simde__m512i a) {
  int32_t r[16]; uint16_t b[16]; simde__m256i o;
  std::memcpy(r, &a, 64);
  for (int i = 0; i < 16; ++i) b[i] = static_cast<uint16_t>(r[i]);
  std::memcpy(&o, b, 32); return o;
}
static inline simde__m128i lt_emu_cvtepi32_epi8(simde__m512i a) {
  int32_t r[16]; uint8_t b[16]; simde__m128i o;
  std::memcpy(r, &a, 64);
  for (int i = 0; i < 16; ++i) b[i] = static_cast<uint8_t>(r[i]);
  std::memcpy(&o, b, 16); return o;
}
static inline simde__m512i lt_emu_i32gather_epi32(simde__m512i idx, const void* base, int scale) {
  int32_t k[16], r[16]; simde__m512i o;
  std::memcpy(k, &idx, 64);
  for (int i = 0; i < 16; ++i)
    std::memcpy(&r[i], static_cast<const char*>(base) + static_cast<int64_t>(k[i]) * scale, 4);
  std::memcpy(&o, r, 64); return o;
}
static inline uint32_t lt_emu_reduce_max_epu32(simde__m512i a) {
  uint32_t r[16], m = 0;
  std::memcpy(r, &a, 64);
  for (int i = 0; i < 16; ++i) m = r[i] > m ? r[i] : m;
  return m;
}
static inline simde__m512i lt_emu_srai_epi32(simde__m512i a, unsigned imm) {
  int32_t r[16]; simde__m512i o;
  std::memcpy(r, &a, 64);
  for (int i = 0; i < 16; ++i) r[i] = imm > 31 ? (r[i] < 0 ? -1 : 0) : (r[i] >> imm);
  std::memcpy(&o, r, 64); return o;
}
#define _mm512_cvtepu8_epi32 lt_emu_cvtepu8_epi32
#define _mm512_cvtepu16_epi32 lt_emu_cvtepu16_epi32
#define _mm512_cvtepi32_epi16 lt_emu_cvtepi32_epi16
#define _mm512_cvtepi32_epi8 lt_emu_cvtepi32_epi8
#define _mm512_i32gather_epi32 lt_emu_i32gather_epi32
#define _mm512_reduce_max_epu32 lt_emu_reduce_max_epu32
#define _mm512_srai_epi32 lt_emu_srai_epi32
