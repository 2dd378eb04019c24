// The vector widths the block kernels are written for: one output row per 32-bit lane.
// `Lanes8` (AVX2, 256 bits) everywhere, `Lanes16` (AVX-512 with VNNI, 512 bits) where the
// library is built for it. A kernel written once over these types computes every lane with
// the same operations in either width, so both give the same bits.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "activations.h"

namespace quickdraft {

// The operations both widths spell alike but for the width in each intrinsic's name
// (mm: _mm256 or _mm512, si: si256 or si512).
#define QUICKDRAFT_LANE_OPS(mm, si)                                                   \
  static I bytes(int v) { return mm##_set1_epi8(static_cast<char>(v)); }              \
  static I words(int32_t v) { return mm##_set1_epi32(v); }                            \
  static I zero() { return mm##_setzero_##si(); }                                     \
  static I and_(I a, I b) { return mm##_and_##si(a, b); }                             \
  static I or_(I a, I b) { return mm##_or_##si(a, b); }                               \
  static I xor_(I a, I b) { return mm##_xor_##si(a, b); }                             \
  static I add(I a, I b) { return mm##_add_epi32(a, b); }                             \
  static I sub(I a, I b) { return mm##_sub_epi32(a, b); }                             \
  static I mul(I a, I b) { return mm##_mullo_epi32(a, b); }                           \
  static I shl(I a, int n) { return mm##_slli_epi32(a, n); }                          \
  static I shr(I a, int n) { return mm##_srli_epi32(a, n); }                          \
  static I sar(I a, int n) { return mm##_srai_epi32(a, n); }                          \
  /* each byte's high nibble, as a byte */                                            \
  static I nibbles_high(I a) {                                                        \
    return mm##_and_##si(mm##_srli_epi16(a, 4), mm##_set1_epi8(0x0F));                \
  }                                                                                   \
  static F fzero() { return mm##_setzero_ps(); }                                      \
  static F fset(float v) { return mm##_set1_ps(v); }                                  \
  static F cvt(I a) { return mm##_cvtepi32_ps(a); }                                   \
  static F fmul(F a, F b) { return mm##_mul_ps(a, b); }                               \
  static F fma(F a, F b, F c) { return mm##_fmadd_ps(a, b, c); }                      \
  static void store(float* p, F a) { mm##_storeu_ps(p, a); }

struct Lanes8 {
  static constexpr int kRows = 8;  // outputs a group computes at once
  static constexpr bool kVnni = quickdraft::kVnni;  // dot() is one vpdpbusd
  using I = __m256i;
  using F = __m256;

  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const I*>(p)); }
  // kRows halves (float16) widened to floats
  static F halves(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  QUICKDRAFT_LANE_OPS(_mm256, si256)
  // without VNNI: signed codes as |w| against the activations' signs flipped where w < 0
  static I abs8(I a) { return _mm256_sign_epi8(a, a); }
  static I sign8(I a, I b) { return _mm256_sign_epi8(a, b); }
  static I dot(I acc, I u, I s) { return dpbusd(acc, u, s); }
  static F fload(const uint8_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }
  static F fneg(F a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.f)); }
  static void store(int32_t* p, I a) { _mm256_storeu_si256(reinterpret_cast<I*>(p), a); }
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define QUICKDRAFT_LANES16 1
struct Lanes16 {
  static constexpr int kRows = 16;
  static constexpr bool kVnni = true;
  using I = __m512i;
  using F = __m512;

  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static F halves(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  QUICKDRAFT_LANE_OPS(_mm512, si512)
  static I dot(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static F fload(const uint8_t* p) { return _mm512_loadu_ps(p); }
  static F fneg(F a) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a),
                                                 _mm512_set1_epi32(INT32_MIN)));
  }
  static void store(int32_t* p, I a) { _mm512_storeu_si512(p, a); }
};
#endif

}  // namespace quickdraft
