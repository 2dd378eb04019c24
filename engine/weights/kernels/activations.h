// Activations as the block kernels (blocks.cpp) read them: each row quantized to int8 in
// blocks of 32 with a float scale per block (llama.cpp's Q8_0 form), and the integer dot
// product of 4-byte groups those kernels are built on (256 bits; lanes.h has both widths).
#pragma once

#include <immintrin.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace quickdraft {

constexpr int64_t kBlock = 32;

// Activations quantized per block of 32: q (M, K) int8, d (M, K/32) scales.
struct Quantized {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<float> dsum;  // d times the block's sum of q (a weight low's term)
  std::vector<int32_t> sum;  // the block's sum of q (a weight code offset's term)
  std::vector<int32_t> sum16;  // the sums of its two halves of 16 (M, K/16)
};

// 8 activations as floats: float32 as they are, bfloat16 widened (its bits are a float's top half).
inline __m256 load8(const float* v) { return _mm256_loadu_ps(v); }
inline __m256 load8(const c10::BFloat16* v) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

inline int32_t sum8(__m256i v) {
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  return _mm_cvtsi128_si32(s4);
}

template <typename T>
Quantized quantize(const T* x, int64_t m, int64_t k) {
  const int64_t nb = k / kBlock;
  Quantized out{std::vector<int8_t>(m * k), std::vector<float>(m * nb),
                std::vector<float>(m * nb), std::vector<int32_t>(m * nb),
                std::vector<int32_t>(2 * m * nb)};
  const __m256 sign_bit = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < m * nb; ++i) {
    const T* v = x + i * kBlock;
    __m256 part[4];
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      part[j] = load8(v + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, part[j]));
    }
    __m128 top = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    top = _mm_max_ps(top, _mm_movehl_ps(top, top));
    top = _mm_max_ss(top, _mm_movehdup_ps(top));
    const float d = _mm_cvtss_f32(top) / 127.f;
    const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
    __m256i c[4];  // rounded to nearest (even), as nearbyint
    for (int j = 0; j < 4; ++j) c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(part[j], inv));
    // packs interleave 128-bit lanes: the permute puts the 32 values back in order
    const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]),
                                             _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + i * kBlock),
                        _mm256_permutevar8x32_epi32(words, order));
    out.d[i] = d;
    const int32_t low = sum8(_mm256_add_epi32(c[0], c[1]));
    const int32_t high = sum8(_mm256_add_epi32(c[2], c[3]));
    out.sum16[2 * i] = low;
    out.sum16[2 * i + 1] = high;
    out.sum[i] = low + high;
    out.dsum[i] = d * static_cast<float>(low + high);
  }
  return out;
}

// acc + sums of 4 adjacent products u * s per 32-bit lane (u unsigned, s signed bytes).
// Without VNNI the pairs pass through int16, which callers keep from saturating
// (|u * s| <= 128 * 127 there).
#if defined(__AVXVNNI__)
constexpr bool kVnni = true;
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
  return _mm256_dpbusd_avx_epi32(acc, u, s);
}
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kVnni = true;
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(acc, u, s);
}
#else
constexpr bool kVnni = false;
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                 _mm256_set1_epi16(1)));
}
#endif

inline int32_t word_at(const int8_t* v) {
  int32_t word;
  std::memcpy(&word, v, 4);
  return word;
}

inline __m256i broadcast4(const int8_t* v) { return _mm256_set1_epi32(word_at(v)); }

}  // namespace quickdraft
