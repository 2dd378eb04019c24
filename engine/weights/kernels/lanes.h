// The vector widths the block kernels are written for: one output row per 32-bit lane.
// `Lanes8` (AVX2, 256 bits) everywhere, `Lanes16` (AVX-512 with VNNI, 512 bits) where the
// library is built for it. A kernel written once over these types computes every lane with
// the same operations in either width, so both give the same bits.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "activations.h"

namespace quickdraft {

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
  static I bytes(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
  static I words(int32_t v) { return _mm256_set1_epi32(v); }
  static I zero() { return _mm256_setzero_si256(); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I xor_(I a, I b) { return _mm256_xor_si256(a, b); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I mul(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I shl(I a, int n) { return _mm256_slli_epi32(a, n); }
  static I shr(I a, int n) { return _mm256_srli_epi32(a, n); }
  static I sar(I a, int n) { return _mm256_srai_epi32(a, n); }
  static I nibbles_high(I a) {  // each byte's high nibble, as a byte
    return _mm256_and_si256(_mm256_srli_epi16(a, 4), _mm256_set1_epi8(0x0F));
  }
  // without VNNI: signed codes as |w| against the activations' signs flipped where w < 0
  static I abs8(I a) { return _mm256_sign_epi8(a, a); }
  static I sign8(I a, I b) { return _mm256_sign_epi8(a, b); }
  static I dot(I acc, I u, I s) { return dpbusd(acc, u, s); }
  static F fload(const uint8_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F fset(float v) { return _mm256_set1_ps(v); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F fmul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fneg(F a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.f)); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, F a) { _mm256_storeu_ps(p, a); }
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
  static I bytes(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
  static I words(int32_t v) { return _mm512_set1_epi32(v); }
  static I zero() { return _mm512_setzero_si512(); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I mul(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I shl(I a, int n) { return _mm512_slli_epi32(a, n); }
  static I shr(I a, int n) { return _mm512_srli_epi32(a, n); }
  static I sar(I a, int n) { return _mm512_srai_epi32(a, n); }
  static I nibbles_high(I a) {
    return _mm512_and_si512(_mm512_srli_epi16(a, 4), _mm512_set1_epi8(0x0F));
  }
  static I dot(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static F fload(const uint8_t* p) { return _mm512_loadu_ps(p); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F fset(float v) { return _mm512_set1_ps(v); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F fmul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fneg(F a) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a),
                                                 _mm512_set1_epi32(INT32_MIN)));
  }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, F a) { _mm512_storeu_ps(p, a); }
  static void store(int32_t* p, I a) { _mm512_storeu_si512(p, a); }
};
#endif

}  // namespace quickdraft
