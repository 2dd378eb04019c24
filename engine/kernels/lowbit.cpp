// Low-bit weights x int8 activations for steps of 1..n tokens on AVX2 CPUs.
//
// Each row of activations is quantized to int8 in blocks of 32 with a float scale per
// block (llama.cpp's Q8_0 form), then multiplied with integer dot products (vpmaddubsw) by
// int8 weights with a float scale per output row (q8_linear), or by 4-bit weights with a
// half-precision scale and low per block of 32 (q4_linear: w = code * scale + low, Q4_1's
// form and size: 0.625 bytes per weight). A
// weight row is read from memory once for up to kTile activation rows. PyTorch's own
// low-bit kernels convert every weight to fp32 and multiply in fp32: at one token their
// arithmetic, not the memory, is what limits them on CPUs without AVX-512.
//
// Built where the CPU has VNNI (AVX-VNNI, or AVX-512 VNNI with VL), a block's integer dot
// product is one vpdpbusd instead of vpmaddubsw + vpmaddwd: the same integers (no
// intermediate here can saturate), so the same bits, in about half the multiply work
// that bounds steps of several tokens.
#include <immintrin.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 8;  // activation rows sharing one pass over a weight row

// Activations quantized per block of 32: q (M, K) int8, d (M, K/32) scales.
struct Quantized {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<float> dsum;  // d times the block's sum of q (4-bit weights' low term)
};

// 8 activations as floats: float32 as they are, bfloat16 widened (its bits are a float's top half).
inline __m256 load8(const float* v) { return _mm256_loadu_ps(v); }
inline __m256 load8(const c10::BFloat16* v) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

template <typename T>
Quantized quantize(const T* x, int64_t m, int64_t k) {
  const int64_t nb = k / kBlock;
  Quantized out{std::vector<int8_t>(m * k), std::vector<float>(m * nb),
                std::vector<float>(m * nb)};
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
    const __m256i sums = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]),
                                          _mm256_add_epi32(c[2], c[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    out.dsum[i] = d * static_cast<float>(_mm_cvtsi128_si32(s4));
  }
  return out;
}

// Sums of 4 adjacent products u * s per 32-bit lane (u unsigned, s signed bytes; each
// sum's pairs fit int16 here: |u| <= 128, |s| <= 127).
#if defined(__AVXVNNI__)
inline __m256i dot4(__m256i u, __m256i s) {
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
}
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
inline __m256i dot4(__m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}
#else
inline __m256i dot4(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#endif

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// R activation rows (a, stride k; scales d, stride nb) times one weight row w:
// result[r] = sum over blocks of d[r, b] * (a[r, block b] . w[block b]).
template <int R>
inline void tile(const int8_t* w, const int8_t* a, const float* d, int64_t k, int64_t nb,
                 float* result) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    _mm_prefetch(reinterpret_cast<const char*>(w + b * kBlock) + 1024, _MM_HINT_T0);
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * kBlock));
    const __m256i magnitude = _mm256_sign_epi8(wv, wv);  // |w|: maddubs wants unsigned
    for (int r = 0; r < R; ++r) {
      const __m256i av = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(a + r * k + b * kBlock));
      // |w| * (a * sign(w)) = a * w (pairs within int16: |.| <= 2 * 127 * 127, exact)
      const __m256 dot = _mm256_cvtepi32_ps(dot4(magnitude, _mm256_sign_epi8(av, wv)));
      acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(d + r * nb + b), dot, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) result[r] = hsum(acc[r]);
}

// The same for a 4-bit weight row: codes (k / 2 bytes; byte i of a block holds element i
// in its low nibble and i + 16 in its high one), scales (nb) and lows (nb) of its blocks as
// IEEE half-precision bits.
template <int R>
inline void tile4(const uint8_t* codes, const uint16_t* scales, const uint16_t* lows,
                  const int8_t* a, const float* d, const float* dsum, int64_t k, int64_t nb,
                  float* result) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    // Weights stream from memory once per step: asking for them ~3 rows ahead keeps the
    // arithmetic from waiting on each row (~12% per call, measured; a few hundred bytes
    // more or less ahead made no measurable difference)
    _mm_prefetch(reinterpret_cast<const char*>(codes + b * 16) + 1024, _MM_HINT_T0);
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + b * 16));
    const __m256i wv = _mm256_and_si256(
        _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), nibble);  // 0..15: unsigned
    const float scale = _cvtsh_ss(scales[b]);
    for (int r = 0; r < R; ++r) {
      const __m256i av = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(a + r * k + b * kBlock));
      const __m256 dot = _mm256_cvtepi32_ps(dot4(wv, av));  // pairs: |.| <= 2 * 15 * 127
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(scale * d[r * nb + b]), dot, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    // the lows: sum over blocks of low * d * (sum of the block's activations)
    __m256 low = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
      const __m256 halves = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(lows + b)));
      low = _mm256_fmadd_ps(halves, _mm256_loadu_ps(dsum + r * nb + b), low);
    }
    float tail = 0.f;
    for (; b < nb; ++b) tail += _cvtsh_ss(lows[b]) * dsum[r * nb + b];
    result[r] = hsum(acc[r]) + hsum(low) + tail;
  }
}

using Tile4 = void (*)(const uint8_t*, const uint16_t*, const uint16_t*, const int8_t*,
                       const float*, const float*, int64_t, int64_t, float*);
constexpr Tile4 kTiles4[kTile + 1] = {nullptr, tile4<1>, tile4<2>, tile4<3>, tile4<4>,
                                      tile4<5>, tile4<6>, tile4<7>, tile4<8>};

using Tile = void (*)(const int8_t*, const int8_t*, const float*, int64_t, int64_t, float*);
constexpr Tile kTiles[kTile + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>,
                                   tile<5>, tile<6>, tile<7>, tile<8>};

// out (M, N) in x's dtype, x's rows quantized once: `tile(a, j, r0, rows, result)` fills
// result[0..rows) with output j of rows r0.. (the weights' part, the caller's).
template <typename TileFn>
at::Tensor each_output(const char* name, const at::Tensor& x, int64_t n, TileFn tile) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
              ": float32 or bfloat16 activations");
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  const at::Tensor xc = x.contiguous();
  const Quantized a = x.scalar_type() == at::kFloat
                          ? quantize(xc.data_ptr<float>(), m, k)
                          : quantize(xc.data_ptr<c10::BFloat16>(), m, k);
  // Pointers taken once: data_ptr's checks cost about what a 1-row output does.
  float* f32 = x.scalar_type() == at::kFloat ? out.data_ptr<float>() : nullptr;
  c10::BFloat16* b16 = f32 ? nullptr : out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, n, 32, [&](int64_t begin, int64_t end) {
    float result[kTile];
    for (int64_t j = begin; j < end; ++j) {
      for (int64_t r0 = 0; r0 < m; r0 += kTile) {
        const int64_t rows = std::min(kTile, m - r0);
        tile(a, j, r0, rows, result);
        for (int64_t r = 0; r < rows; ++r) {
          if (f32) f32[(r0 + r) * n + j] = result[r];
          else b16[(r0 + r) * n + j] = static_cast<c10::BFloat16>(result[r]);
        }
      }
    }
  });
  return out;
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && x.size(1) == codes.size(1),
              "q8_linear: x (M, K) and codes (N, K)");
  TORCH_CHECK(x.size(1) % kBlock == 0, "q8_linear: K must be a multiple of 32");
  TORCH_CHECK(codes.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat &&
                  scale.numel() == codes.size(0),
              "q8_linear: int8 codes (N, K) and float32 scales (N,)");
  const int64_t k = x.size(1), nb = k / kBlock;
  const at::Tensor wc = codes.contiguous(), sc = scale.contiguous();
  const int8_t* w = wc.data_ptr<int8_t>();
  const float* s = sc.data_ptr<float>();
  return each_output("q8_linear", x, codes.size(0),
                     [&](const Quantized& a, int64_t j, int64_t r0, int64_t rows, float* result) {
    kTiles[rows](w + j * k, a.q.data() + r0 * k, a.d.data() + r0 * nb, k, nb, result);
    for (int64_t r = 0; r < rows; ++r) result[r] *= s[j];
  });
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && x.size(1) == 2 * codes.size(1),
              "q4_linear: x (M, K) and codes (N, K/2)");
  TORCH_CHECK(x.size(1) % kBlock == 0, "q4_linear: K must be a multiple of 32");
  const int64_t k = x.size(1), n = codes.size(0), nb = k / kBlock;
  TORCH_CHECK(codes.scalar_type() == at::kByte && scales.scalar_type() == at::kHalf &&
                  scales.dim() == 3 && scales.size(0) == n && scales.size(1) == 2 &&
                  scales.size(2) == nb,
              "q4_linear: uint8 codes (N, K/2) and float16 scales (N, 2, K/32)");
  const at::Tensor wc = codes.contiguous(), sc = scales.contiguous();
  const uint8_t* w = wc.data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(sc.data_ptr<at::Half>());
  return each_output("q4_linear", x, n,
                     [&](const Quantized& a, int64_t j, int64_t r0, int64_t rows, float* result) {
    const uint16_t* row_scales = s + j * 2 * nb;
    kTiles4[rows](w + j * (k / 2), row_scales, row_scales + nb, a.q.data() + r0 * k,
                  a.d.data() + r0 * nb, a.dsum.data() + r0 * nb, k, nb, result);
  });
}

at::Tensor linear_meta(const at::Tensor& x, const at::Tensor& codes, const at::Tensor&) {
  return at::empty({x.size(0), codes.size(0)}, x.options());
}

}  // namespace

TORCH_LIBRARY(quickdraft, m) {
  m.def("q8_linear(Tensor x, Tensor codes, Tensor scale) -> Tensor");
  m.def("q4_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(quickdraft, CPU, m) {
  m.impl("q8_linear", q8_linear);
  m.impl("q4_linear", q4_linear);
}

TORCH_LIBRARY_IMPL(quickdraft, Meta, m) {
  m.impl("q8_linear", linear_meta);
  m.impl("q4_linear", linear_meta);
}
