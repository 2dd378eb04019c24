// Low-bit weights x int8 activations for steps of 1..n tokens on AVX2 CPUs.
//
// Each row of activations is quantized to int8 in blocks of 32 with a float scale per
// block (llama.cpp's Q8_0 form), then multiplied with integer dot products by int8 weights
// with a float scale per output row (q8_linear), or by 4-bit weights with a half-precision
// scale and low per block of 32 (q4_linear: w = code * scale + low, Q4_1's form and size:
// 0.625 bytes per weight). PyTorch's own low-bit kernels convert every weight to fp32 and
// multiply in fp32: at one token their arithmetic, not the memory, is what limits them on
// CPUs without AVX-512.
//
// Outputs are computed kCols at a time, one per 32-bit lane: a block's 4-byte groups of
// kCols weight rows sit side by side in one register each (4-bit weights are stored in
// that order; int8 ones, whose rows the token table also reads, are transposed once per
// block for every activation row), and each activation row's group is broadcast against it. A block then
// costs an activation row one dot product per 4-byte group and one scaling for all kCols
// outputs, with no horizontal sums: per output, that per-row work is a quarter of a
// kernel that takes weight rows one at a time, and it is what bounds steps of several
// tokens. Every row gets the same arithmetic whatever the step's size, so a row's result
// has the same bits in a step of 1 token or of 16 (exact integer block sums, then the same
// float operations in the same order).
//
// Built where the CPU has VNNI (AVX-VNNI, or AVX-512 VNNI with VL), a dot product of 4-byte
// groups is one vpdpbusd instead of vpmaddubsw + vpmaddwd: the same integers.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "activations.h"

namespace {

using namespace quickdraft;

constexpr int64_t kCols = 8;  // outputs computed together, one per 32-bit lane

// Weights stream from memory once per step. A group's kCols rows lie one after the other
// (`first`, `bytes` per block each), so while block b of this group is multiplied the same
// share of the next group's bytes is asked for: it is in cache when that group starts.
inline void prefetch_next(const void* first, int64_t row_bytes, int64_t b, int64_t block_bytes) {
  const char* next = static_cast<const char*>(first) + kCols * row_bytes + b * kCols * block_bytes;
  for (int64_t at = 0; at < kCols * block_bytes; at += 64) _mm_prefetch(next + at, _MM_HINT_T0);
}

// out[g] lane c = 32-bit word g of row c (rows[c] + offset: 4 words each).
inline void words8x4(const uint8_t* const* rows, int64_t offset, __m256i out[4]) {
  __m256i t[4];
  for (int c = 0; c < 4; ++c)
    t[c] = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(rows[c + 4] + offset),
                               reinterpret_cast<const __m128i*>(rows[c] + offset));
  const __m256i u0 = _mm256_unpacklo_epi32(t[0], t[1]), u1 = _mm256_unpackhi_epi32(t[0], t[1]);
  const __m256i u2 = _mm256_unpacklo_epi32(t[2], t[3]), u3 = _mm256_unpackhi_epi32(t[2], t[3]);
  out[0] = _mm256_unpacklo_epi64(u0, u2);
  out[1] = _mm256_unpackhi_epi64(u0, u2);
  out[2] = _mm256_unpacklo_epi64(u1, u3);
  out[3] = _mm256_unpackhi_epi64(u1, u3);
}

// Under this many rows a block's dot products are split into two dependency chains (a
// chain of 8 waits on each product's latency; more rows interleave their own chains).
constexpr int kChains = 3;

// Signed int8 weights times signed int8 activations with an unsigned x signed dot product.
// With VNNI: (w + 128) . a = w . a + 128 * (the block's sum of a), one instruction and one
// correction per block and row (128 times the activations' block sum). Without it
// the dot product's pairs would overflow int16 that way: |w| . (a * sign(w)) instead.
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
constexpr bool kOffset = true;
inline __m256i unsigned_weights(__m256i w) { return _mm256_xor_si256(w, _mm256_set1_epi8(-128)); }
inline __m256i times(__m256i acc, __m256i u, __m256i, __m256i a) { return dpbusd(acc, u, a); }
#else
constexpr bool kOffset = false;
inline __m256i unsigned_weights(__m256i w) { return _mm256_sign_epi8(w, w); }
inline __m256i times(__m256i acc, __m256i u, __m256i w, __m256i a) {
  return dpbusd(acc, u, _mm256_sign_epi8(a, w));
}
#endif

// The block's dot products of a row with the kCols weight rows, finished: offset removed,
// scaled by the row's block scale d into acc.
inline __m256 add_block(__m256i sum, const Quantized& a, int64_t i, __m256 acc) {
  if (kOffset) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(128 * a.sum[i]));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(a.d[i]), acc);
}

// R activation rows from r0 times kCols int8 weight rows:
// acc[r] lane c = sum over blocks of d[r, b] * (a[r, block b] . w_c[block b]).
template <int R>
void int8_tile(const int8_t* const* w, const Quantized& a, int64_t r0, int64_t k, __m256 acc[R]) {
  const int64_t nb = k / kBlock;
  const int8_t* q = a.q.data() + r0 * k;
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_next(w[0], k, b, kBlock);
    __m256i sum[R];  // 3 or 4 rows (fewer take int8_tile_few): their chains interleave
    for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_si256();
    for (int half = 0; half < 2; ++half) {  // 4-byte groups 0..3, then 4..7
      __m256i words[4];
      words8x4(reinterpret_cast<const uint8_t* const*>(w), b * kBlock + 16 * half, words);
      for (int g = 0; g < 4; ++g) {
        const __m256i u = unsigned_weights(words[g]);
        for (int r = 0; r < R; ++r) {
          const __m256i av = broadcast4(q + r * k + b * kBlock + 16 * half + 4 * g);
          sum[r] = times(sum[r], u, words[g], av);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      acc[r] = add_block(sum[r], a, (r0 + r) * nb + b, acc[r]);
  }
}

// int8_tile for one or two rows, the same integers and so the same bits: weight rows c and c + 4
// share a register (each 16 bytes of a block), the activations' 16 bytes repeated in both
// halves, and the lanes are summed after; fewer shuffles than transposing the block when few
// rows share it.
template <int R>
void int8_tile_few(const int8_t* const* w, const Quantized& a, int64_t r0, int64_t k,
               __m256 acc[R]) {
  const int64_t nb = k / kBlock;
  const int8_t* q = a.q.data() + r0 * k;
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_next(w[0], k, b, kBlock);
    __m256i act[R][2], pairs[R][4];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h)
        act[r][h] = _mm256_broadcastsi128_si256(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + r * k + b * kBlock + 16 * h)));
    for (int c = 0; c < 4; ++c) {
      for (int r = 0; r < R; ++r) pairs[r][c] = _mm256_setzero_si256();
      for (int h = 0; h < 2; ++h) {
        const int64_t at = b * kBlock + 16 * h;
        const __m256i wv = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(w[c + 4] + at),
                                               reinterpret_cast<const __m128i*>(w[c] + at));
        const __m256i u = unsigned_weights(wv);
        for (int r = 0; r < R; ++r) pairs[r][c] = times(pairs[r][c], u, wv, act[r][h]);
      }
    }
    for (int r = 0; r < R; ++r) {
      // lanes 0..3: row c's four partial sums, 4..7: row c + 4's; after the two hadds
      // lane c holds row c's (c < 4) and lane c + 4 row c + 4's
      const __m256i sum = _mm256_hadd_epi32(_mm256_hadd_epi32(pairs[r][0], pairs[r][1]),
                                            _mm256_hadd_epi32(pairs[r][2], pairs[r][3]));
      acc[r] = add_block(sum, a, (r0 + r) * nb + b, acc[r]);
    }
  }
}

// The same for a group of kCols 4-bit weight rows in the kernel's order (engine/quant.py
// `_own_int4`): per block, its 4-byte words of the kCols rows side by side (word g of row
// c at codes[b * 128 + 32 * g + 4 * c]; byte i of a row's block holds element i in its low
// nibble and i + 16 in its high one), and the block's kCols scales then kCols lows as
// halves (scales[b * 16 + c], scales[b * 16 + 8 + c]); the lows' term is
// low * d * (the block's sum of a). Nothing to transpose: the rows were laid out so.
template <int R>
void int4_tile(const uint8_t* codes, const uint16_t* scales, const Quantized& a, int64_t r0,
               int64_t k, __m256 acc[R]) {
  const int64_t nb = k / kBlock;
  const int8_t* q = a.q.data() + r0 * k;
  const float* d = a.d.data() + r0 * nb;
  const float* dsum = a.dsum.data() + r0 * nb;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_next(codes, k / 2, b, 16);
    if ((b & 1) == 0) prefetch_next(scales, 2 * nb * 2, b, 2 * 2);  // 32 bytes a block
    const uint8_t* block = codes + b * kCols * 16;
    __m256i sum[R], second[R];
    for (int r = 0; r < R; ++r) sum[r] = second[r] = _mm256_setzero_si256();
    for (int g = 0; g < 4; ++g) {
      const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * g));
      const __m256i low = _mm256_and_si256(words, nibble);  // elements 4g..4g+3
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(words, 4), nibble);  // +16
      for (int r = 0; r < R; ++r) {
        const int8_t* row = q + r * k + b * kBlock;
        sum[r] = dpbusd(sum[r], low, broadcast4(row + 4 * g));
        if (R < kChains) second[r] = dpbusd(second[r], high, broadcast4(row + 16 + 4 * g));
        else sum[r] = dpbusd(sum[r], high, broadcast4(row + 16 + 4 * g));
      }
    }
    if (R < kChains)
      for (int r = 0; r < R; ++r) sum[r] = _mm256_add_epi32(sum[r], second[r]);
    const __m256 scale = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b * 2 * kCols)));
    const __m256 low = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b * 2 * kCols + kCols)));
    for (int r = 0; r < R; ++r) {
      const __m256 sd = _mm256_mul_ps(scale, _mm256_set1_ps(d[r * nb + b]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), sd, acc[r]);
      acc[r] = _mm256_fmadd_ps(low, _mm256_set1_ps(dsum[r * nb + b]), acc[r]);
    }
  }
}

// Activation rows per pass over a group's weights: their sums and accumulators stay in
// AVX2's 16 vector registers (8 rows with AVX-512's 32 measured slower: 122 against 88 us
// a 3072x576 layer at 8 rows); the group's weights are in L1 for the next pass.
constexpr int kTile = 4;

// out (M, N) in x's dtype, x's rows quantized once. `prepare()` gives each thread a group
// object: `start(j0, cols)` takes outputs j0..j0+kCols (those past N read as zeros),
// `run(a, r0, rows, acc)` computes them for activation rows r0.., `finish` scales a result.
template <typename Prepare>
at::Tensor each_group(const char* name, const at::Tensor& x, int64_t n, Prepare prepare) {
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
  const int64_t groups = (n + kCols - 1) / kCols;
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    auto group = prepare();
    alignas(32) float result[kCols];
    __m256 acc[kTile];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t j0 = i * kCols, cols = std::min(kCols, n - j0);
      group.start(j0, cols);
      for (int64_t r0 = 0; r0 < m; r0 += kTile) {
        const int64_t rows = std::min<int64_t>(kTile, m - r0);
        group.run(a, r0, rows, acc);
        for (int64_t r = 0; r < rows; ++r) {
          _mm256_store_ps(result, group.finish(acc[r]));
          for (int64_t c = 0; c < cols; ++c) {
            if (f32) f32[(r0 + r) * n + j0 + c] = result[c];
            else b16[(r0 + r) * n + j0 + c] = static_cast<c10::BFloat16>(result[c]);
          }
        }
      }
    }
  });
  return out;
}

// kCols int8 weight rows at a time (rows past N: zeros), times their row scales.
struct Int8Group {
  const int8_t* w;
  const float* s;
  int64_t k, nb;
  std::vector<int8_t> zeros;
  const int8_t* rows[kCols];
  alignas(32) float scale[kCols];

  void start(int64_t j0, int64_t cols) {
    for (int64_t c = 0; c < kCols; ++c) {
      rows[c] = c < cols ? w + (j0 + c) * k : zeros.data();
      scale[c] = c < cols ? s[j0 + c] : 0.f;
    }
  }
  void run(const Quantized& a, int64_t r0, int64_t count, __m256* acc) {
    switch (count) {
      case 1: int8_tile_few<1>(rows, a, r0, k, acc); break;
      case 2: int8_tile_few<2>(rows, a, r0, k, acc); break;
      case 3: int8_tile<3>(rows, a, r0, k, acc); break;
      case 4: int8_tile<4>(rows, a, r0, k, acc); break;
    }
  }
  __m256 finish(__m256 acc) const { return _mm256_mul_ps(acc, _mm256_load_ps(scale)); }
};

// A group of kCols 4-bit weight rows (N is a multiple of kCols: engine/quant.py keeps
// other shapes on PyTorch's kernel).
struct Int4Group {
  const uint8_t* w;
  const uint16_t* s;
  int64_t k, nb;
  const uint8_t* codes = nullptr;
  const uint16_t* scales = nullptr;

  void start(int64_t j0, int64_t) {
    codes = w + j0 * (k / 2);
    scales = s + j0 * 2 * nb;
  }
  void run(const Quantized& a, int64_t r0, int64_t count, __m256* acc) {
    switch (count) {
      case 1: int4_tile<1>(codes, scales, a, r0, k, acc); break;
      case 2: int4_tile<2>(codes, scales, a, r0, k, acc); break;
      case 3: int4_tile<3>(codes, scales, a, r0, k, acc); break;
      case 4: int4_tile<4>(codes, scales, a, r0, k, acc); break;
    }
  }
  __m256 finish(__m256 acc) const { return acc; }
};

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
  return each_group("q8_linear", x, codes.size(0), [&] {
    return Int8Group{w, s, k, nb, std::vector<int8_t>(k)};
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
  TORCH_CHECK(n % kCols == 0, "q4_linear: N must be a multiple of 8");
  const at::Tensor wc = codes.contiguous(), sc = scales.contiguous();
  const uint8_t* w = wc.data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(sc.data_ptr<at::Half>());
  return each_group("q4_linear", x, n, [&] { return Int4Group{w, s, k, nb}; });
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
