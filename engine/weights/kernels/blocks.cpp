// Quickdraft's CPU kernels: low-bit weights in blocks (formats.h: GGUF files' own formats,
// and Quickdraft's int4 (Q4_1) and int8w) x int8 activations, for steps of 1..n tokens, read
// from a repack of the blocks that is exactly their size: no weight is ever expanded.
//
// Each activation row is quantized per block of 32 (llama.cpp's Q8_0 form: a float
// scale and int8 values), then for each block of 32 weights an exact integer dot product of
// codes and activations, corrected for the codes' offset with the activations' block sum
// (for Q6_K, each half of 16 first multiplied by its integer scale), and
//   acc = fma(float(dot), scale * d_act, acc);   acc = fma(low, d_act * sum_act, acc)
// in that order, block after block. Every row of activations takes exactly these operations
// whatever the step's size and whatever the vector width, so a row's result has the same
// bits in a step of 1 token or 16, with or without VNNI, in 256 or 512 bits.
//
// Outputs are computed kRows at a time, one per 32-bit lane (the repack lays a group of
// kRows rows' blocks side by side: formats.h); each activation row's 4-byte group is
// broadcast against a register of kRows rows' codes, so a block costs each activation row one
// dot product per 4 values for all kRows outputs, and one conversion and scaling.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <type_traits>

#include "activations.h"
#include "formats.h"
#include "lanes.h"

namespace {

using namespace quickdraft;

#if defined(QUICKDRAFT_LANES16) && defined(QUICKDRAFT_WIDE)
constexpr int64_t kWidest = 16;  // rows a group may hold: 16 with AVX-512, else 8
#else
constexpr int64_t kWidest = 8;
#endif

// fn(lanes) for the lanes a matrix was repacked for (groups of `rows` rows): 16-row groups
// where the library is built for them and a layer fills them, 8-row ones everywhere.
template <class Fn>
auto with_lanes(int64_t rows, Fn&& fn) {
#if defined(QUICKDRAFT_LANES16) && defined(QUICKDRAFT_WIDE)
  if (rows == 16) return fn(Lanes16{});
#endif
  TORCH_CHECK(rows == 8, "blocks were repacked for groups of ", rows,
              " rows; this CPU's kernels take 8 or ", kWidest);
  return fn(Lanes8{});
}

constexpr int kTile = 4;  // activation rows per pass over a group's weights

// The format whose GGML type id is `type`: fn(F{}) for it (an error for any other id).
template <class Fn, std::size_t I = 0>
auto with_format(int64_t type, Fn&& fn) {
  using F = std::tuple_element_t<I, Formats>;
  if (type == F::kType) return fn(F{});
  if constexpr (I + 1 < std::tuple_size_v<Formats>) {
    return with_format<Fn, I + 1>(type, std::forward<Fn>(fn));
  } else {
    TORCH_CHECK(false, "no kernel for GGML block type ", type);
    return fn(F{});
  }
}

// Independent chains of dot products per activation row: a few rows keep the multiplier
// busy with their own chains, one row splits its block's 8 words over several.
template <class F, int R>
constexpr int chains() {
  return R == 1 ? 4 : 2;
}

// acc[r] (lane c: output c of the group) += activation row r0 + r times block b of the
// group's rows, for R rows: see the file's comment for the arithmetic.
template <class V, class F, int R>
inline void multiply_block(const typename F::template Unit<V>& unit, int j, const Quantized& a,
                           int64_t r0, int64_t k, int64_t b, typename V::F acc[R]) {
  using I = typename V::I;
  constexpr int C = chains<F, R>();
  const int64_t nb = k / kBlock;
  I sum[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sum[r][c] = V::zero();
  #pragma GCC unroll 8  // g known at compile time: a format's word(j, g) decodes without branches
  for (int g = 0; g < 8; ++g) {
    I w = unit.word(j, g);
    I u = w;  // signed codes: offset by 128 under VNNI, else |w| against sign-flipped rows
    if constexpr (F::kSigned && V::kVnni) u = V::xor_(w, V::bytes(0x80));
    if constexpr (F::kSigned && !V::kVnni) u = V::abs8(w);
    // halves of 16 stay apart where they have their own scales
    const int c = F::kSixteens ? (g >> 2) * (C / 2) + (g & (C / 2 - 1)) : (g & (C - 1));
    for (int r = 0; r < R; ++r) {
      I s = V::words(word_at(a.q.data() + (r0 + r) * k + b * kBlock + 4 * g));
      if constexpr (F::kSigned && !V::kVnni) s = V::sign8(s, w);
      sum[r][c] = V::dot(sum[r][c], u, s);
    }
  }
  // signed codes under VNNI were offset by 128 to be unsigned
  constexpr int bias = F::kSigned ? (V::kVnni ? 128 : 0) : F::kBias;
  const typename V::F scale = unit.scale(j), low = F::kLow ? unit.low(j) : V::fzero();
  I first, second;
  if constexpr (F::kSixteens) unit.sixteens(j, first, second);
  for (int r = 0; r < R; ++r) {
    const int64_t at = (r0 + r) * nb + b;
    I dot;
    if constexpr (F::kSixteens) {
      I lo = sum[r][0], hi = sum[r][C / 2];
      for (int c = 1; c < C / 2; ++c) {
        lo = V::add(lo, sum[r][c]);
        hi = V::add(hi, sum[r][C / 2 + c]);
      }
      lo = V::sub(lo, V::words(bias * a.sum16[2 * at]));
      hi = V::sub(hi, V::words(bias * a.sum16[2 * at + 1]));
      dot = V::add(V::mul(lo, first), V::mul(hi, second));
    } else {
      dot = sum[r][0];
      for (int c = 1; c < C; ++c) dot = V::add(dot, sum[r][c]);
      if constexpr (bias != 0) dot = V::sub(dot, V::words(bias * a.sum[at]));
    }
    acc[r] = V::fma(V::cvt(dot), V::fmul(scale, V::fset(a.d[at])), acc[r]);
    if constexpr (F::kLow) acc[r] = V::fma(low, V::fset(a.dsum[at]), acc[r]);
  }
}

// R activation rows from r0 times a group of kRows rows (`group`: its repacked units, read
// in order). Where `next` is given (the next group), its unit u is asked for while unit u
// is multiplied: with 256-bit lanes (8-row groups: AVX2 CPUs, where that was measured
// faster, and layers too small to fill 16-row groups), and where
// a step's rows take several passes over each group (the later passes read it from cache
// while the next one arrives). Otherwise the hardware prefetcher alone streams the weights:
// with 512-bit lanes and one pass that was measured faster (AVX-512 VNNI AMD EPYC: the
// prefetches took the arithmetic's issue slots, and a K-quant's next group, 64 KB away,
// left L1 before its use).
template <class V, class F, int R>
void tile(const uint8_t* group, const uint8_t* next, const Quantized& a, int64_t r0,
          int64_t k, typename V::F acc[R]) {
  constexpr int64_t unit_bytes = V::kRows * F::kBytes;
  constexpr int blocks = F::kElems / kBlock;
  const int64_t units = k / F::kElems;
  for (int r = 0; r < R; ++r) acc[r] = V::fzero();
  for (int64_t u = 0; u < units; ++u) {
    for (int64_t at = 0; next != nullptr && at < unit_bytes; at += 64)
      _mm_prefetch(reinterpret_cast<const char*>(next + u * unit_bytes + at), _MM_HINT_T0);
    const typename F::template Unit<V> unit(group + u * unit_bytes);
    for (int j = 0; j < blocks; ++j)
      multiply_block<V, F, R>(unit, j, a, r0, k, u * blocks + j, acc);
  }
  if constexpr (F::kTail > 0) {  // each row's float scale, after the group's units
    const typename V::F scale = V::fload(group + units * unit_bytes);
    for (int r = 0; r < R; ++r) acc[r] = V::fmul(acc[r], scale);
  }
}

template <class V, class F>
at::Tensor linear(const at::Tensor& x, const at::Tensor& blocks) {
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0);
  TORCH_CHECK(k % F::kElems == 0 && blocks.size(1) == k / F::kElems * F::kBytes + F::kTail,
              "block_linear: x (M, K) and blocks (N, K / ", F::kElems, " * ", F::kBytes,
              (F::kTail ? " + a row scale" : ""), ")");
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  const at::Tensor xc = x.contiguous();
  const Quantized a = x.scalar_type() == at::kFloat
                          ? quantize(xc.data_ptr<float>(), m, k)
                          : quantize(xc.data_ptr<c10::BFloat16>(), m, k);
  float* f32 = x.scalar_type() == at::kFloat ? out.data_ptr<float>() : nullptr;
  c10::BFloat16* b16 = f32 ? nullptr : out.data_ptr<c10::BFloat16>();
  const uint8_t* base = blocks.data_ptr<uint8_t>();
  const int64_t group_bytes = V::kRows * blocks.size(1), groups = n / V::kRows;
  const bool prefetch = V::kRows == 8 || m > kTile;  // see tile()
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    typename V::F acc[kTile];
    alignas(64) float result[V::kRows];
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* group = base + i * group_bytes;
      const uint8_t* next = !prefetch ? nullptr : i + 1 < groups ? group + group_bytes : group;
      for (int64_t r0 = 0; r0 < m; r0 += kTile) {
        const int64_t rows = std::min<int64_t>(kTile, m - r0);
        switch (rows) {
          case 1: tile<V, F, 1>(group, next, a, r0, k, acc); break;
          case 2: tile<V, F, 2>(group, next, a, r0, k, acc); break;
          case 3: tile<V, F, 3>(group, next, a, r0, k, acc); break;
          default: tile<V, F, 4>(group, next, a, r0, k, acc); break;
        }
        for (int64_t r = 0; r < rows; ++r) {
          V::store(result, acc[r]);
          const int64_t at = (r0 + r) * n + i * V::kRows;
          for (int c = 0; c < V::kRows; ++c) {
            if (f32) f32[at + c] = result[c];
            else b16[at + c] = static_cast<c10::BFloat16>(result[c]);
          }
        }
      }
    }
  });
  return out;
}

// meta: (type, rows per group) of a repacked matrix.
const int64_t* checked_meta(const at::Tensor& meta) {
  TORCH_CHECK(meta.scalar_type() == at::kLong && meta.numel() == 2 && meta.is_contiguous(),
              "block kernels: meta must be int64 (type, rows per group)");
  return meta.data_ptr<int64_t>();
}

// out (M, N) = x (M, K) times the repacked blocks (N, bytes per row); meta: (type, rows).
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& meta) {
  TORCH_CHECK(x.dim() == 2 && blocks.dim() == 2 && blocks.scalar_type() == at::kByte,
              "block_linear: x (M, K) and uint8 blocks (N, bytes)");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "block_linear: float32 or bfloat16 activations");
  const int64_t* m = checked_meta(meta);
  TORCH_CHECK(m[1] > 0 && blocks.size(0) % m[1] == 0 && blocks.is_contiguous(),
              "block_linear: repacked blocks (rows a multiple of ", m[1], ")");
  return with_format(m[0], [&](auto f) {
    return with_lanes(m[1], [&](auto v) { return linear<decltype(v), decltype(f)>(x, blocks); });
  });
}

// Every word of a block of F, field by field: its offset in the block and its size (2 or 4).
struct Word {
  int at = 0, size = 0;
};
template <class F>
constexpr int word_count() {
  int n = 0;
  for (const Field& field : F::kFields) n += field.bytes / field.unit;
  return n;
}
template <class F>
constexpr std::array<Word, word_count<F>()> words_of() {
  std::array<Word, word_count<F>()> out{};
  int i = 0;
  for (const Field& field : F::kFields)
    for (int w = 0; w < field.bytes / field.unit; ++w)
      out[i++] = Word{field.offset + w * field.unit, field.unit};
  return out;
}

// Copies `size` (2 or 4) bytes: typed moves, not a call per word; a word of F's kSpread
// field is stored with its bits spread (formats.h).
template <class F>
inline void move_word(uint8_t* to, const uint8_t* from, int size, int at) {
  if (size == 4) {
    uint32_t v;
    std::memcpy(&v, from, 4);
    if (at == F::kSpread) v = spread_fifth_bits(v);
    std::memcpy(to, &v, 4);
  } else {
    uint16_t v;
    std::memcpy(&v, from, 2);
    std::memcpy(to, &v, 2);
  }
}

// One group of `count` (<= kRows) rows, repacked into `group` (zeroed: missing rows stay
// zero blocks): for each unit, each word of the block (rearranged first where the format
// stores its bits in another order: kArranged) for every row side by side.
template <class F>
void repack_group(const uint8_t* const* rows, int count, int kRows, int64_t units,
                  uint8_t* group) {
  constexpr auto kWords = words_of<F>();
  uint8_t arranged[F::kArranged ? 16 : 1][F::kArranged ? F::kBytes : 1];
  for (int64_t u = 0; u < units; ++u) {
    uint8_t* unit = group + u * kRows * F::kBytes;
    const uint8_t* block[16];  // each row's block of this unit, in the order stored here
    for (int c = 0; c < count; ++c) {
      block[c] = rows[c] + u * F::kBytes;
      if constexpr (F::kArranged) {
        F::arrange(block[c], arranged[c]);
        block[c] = arranged[c];
      }
    }
    for (const Word& word : kWords) {
      uint8_t* to = unit + kRows * word.at;
      for (int c = 0; c < count; ++c)
        move_word<F>(to + c * word.size, block[c] + word.at, word.size, word.at);
    }
  }
  for (int c = 0; c < count && F::kTail > 0; ++c)
    std::memcpy(group + units * kRows * F::kBytes + c * F::kTail,
                rows[c] + units * F::kBytes, F::kTail);
}

// The file's rows (N, bytes per row) as the kernels read them: groups of `rows` rows (8 or
// 16), each field's words side by side (formats.h); rows past N (up to a multiple of
// `rows`) are zero blocks, whose values are all zero.
at::Tensor block_repack(const at::Tensor& raw, int64_t type, int64_t rows) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte, "block_repack: uint8 (N, bytes)");
  with_lanes(rows, [](auto) { return 0; });  // a width the kernels take
  return with_format(type, [&](auto f) {
    using F = decltype(f);
    const int kRows = static_cast<int>(rows);
    const int64_t n = raw.size(0), row_bytes = raw.size(1);
    const int64_t units = (row_bytes - F::kTail) / F::kBytes;
    TORCH_CHECK(row_bytes >= F::kTail && (row_bytes - F::kTail) % F::kBytes == 0,
                "block_repack: rows of whole blocks");
    const int64_t padded = (n + kRows - 1) / kRows * kRows;
    at::Tensor out = at::zeros({padded, row_bytes}, raw.options());
    const at::Tensor src = raw.contiguous();
    const uint8_t* from = src.data_ptr<uint8_t>();
    uint8_t* to = out.data_ptr<uint8_t>();
    at::parallel_for(0, padded / kRows, 16, [&](int64_t begin, int64_t end) {
      const uint8_t* group_rows[16];
      for (int64_t grp = begin; grp < end; ++grp) {
        const int count = static_cast<int>(std::min<int64_t>(kRows, n - grp * kRows));
        for (int c = 0; c < count; ++c) group_rows[c] = from + (grp * kRows + c) * row_bytes;
        repack_group<F>(group_rows, count, kRows, units, to + grp * kRows * row_bytes);
      }
    });
    return out;
  });
}

// Row `id`'s values (K floats) from its group's units: the same decoding the kernel reads.
template <class V, class F>
void row_values(const uint8_t* group, int lane, int64_t units, float* out) {
  alignas(64) int32_t words[V::kRows], first[V::kRows], second[V::kRows];
  alignas(64) float scale[V::kRows], low[V::kRows], tail[V::kRows];
  if constexpr (F::kTail > 0) V::store(tail, V::fload(group + units * V::kRows * F::kBytes));
  for (int64_t u = 0; u < units; ++u) {
    const typename F::template Unit<V> unit(group + u * V::kRows * F::kBytes);
    for (int j = 0; j < F::kElems / kBlock; ++j) {
      V::store(scale, unit.scale(j));
      V::store(low, unit.low(j));
      if constexpr (F::kSixteens) {
        typename V::I one, two;
        unit.sixteens(j, one, two);
        V::store(first, one);
        V::store(second, two);
      }
      float* values = out + u * F::kElems + j * kBlock;
      for (int g = 0; g < 8; ++g) {
        V::store(words, unit.word(j, g));
        // gguf's order: (scale * sub-scale) * code [+ low]; the products are exact, and
        // this order also gives a zero gguf's sign
        float step = scale[lane];
        if constexpr (F::kSixteens) step *= static_cast<float>(g < 4 ? first[lane] : second[lane]);
        for (int i = 0; i < 4; ++i) {
          const uint8_t byte = static_cast<uint8_t>(words[lane] >> (8 * i));
          const int32_t code = F::kSigned ? static_cast<int8_t>(byte) : byte - F::kBias;
          float value = step * static_cast<float>(code);
          if constexpr (F::kLow) value = value + low[lane];
          if constexpr (F::kTail > 0) value = value * tail[lane];
          values[4 * g + i] = value;
        }
      }
    }
  }
}

// (len(index), K) float32 values of rows `index` of blocks repacked for V's groups.
template <class V, class F>
at::Tensor rows_of(const at::Tensor& blocks, const at::Tensor& index) {
  const int64_t units = (blocks.size(1) - F::kTail) / F::kBytes, n = blocks.size(0);
  at::Tensor out = at::empty({index.numel(), units * F::kElems}, blocks.options().dtype(at::kFloat));
  const int64_t* id = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < index.numel(); ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < n, "block_rows: row ", id[i], " of ", n);
  at::parallel_for(0, index.numel(), 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* group = blocks.data_ptr<uint8_t>() + id[i] / V::kRows * V::kRows *
                             blocks.size(1);
      row_values<V, F>(group, id[i] % V::kRows, units,
                       out.data_ptr<float>() + i * units * F::kElems);
    }
  });
  return out;
}

// (len(ids), K) float32 values of rows `ids` of repacked blocks (embedding lookups).
at::Tensor block_rows(const at::Tensor& blocks, const at::Tensor& meta, const at::Tensor& ids) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "block_rows: repacked uint8 blocks (N, bytes)");
  const at::Tensor index = ids.to(at::kLong).contiguous().view({-1});
  const int64_t* m = checked_meta(meta);
  return with_format(m[0], [&](auto f) {
    return with_lanes(m[1], [&](auto v) {
      return rows_of<decltype(v), decltype(f)>(blocks, index);
    });
  });
}

int64_t block_group_rows() { return kWidest; }

std::vector<int64_t> block_types() {
  std::vector<int64_t> types;
  std::apply([&](auto... f) { (types.push_back(decltype(f)::kType), ...); }, Formats{});
  return types;
}

std::vector<int64_t> block_geometry(int64_t type) {
  return with_format(type, [](auto f) {
    return std::vector<int64_t>{decltype(f)::kElems, decltype(f)::kBytes};
  });
}

at::Tensor block_linear_meta(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor&) {
  return at::empty({x.size(0), blocks.size(0)}, x.options());
}

}  // namespace

TORCH_LIBRARY(quickdraft, m) {
  m.def("block_linear(Tensor x, Tensor blocks, Tensor meta) -> Tensor");
  m.def("block_repack(Tensor raw, int type, int rows) -> Tensor");
  m.def("block_rows(Tensor blocks, Tensor meta, Tensor ids) -> Tensor");
  m.def("block_group_rows() -> int", block_group_rows);
  m.def("block_types() -> int[]", block_types);
  m.def("block_geometry(int type) -> int[]", block_geometry);
}

TORCH_LIBRARY_IMPL(quickdraft, CPU, m) {
  m.impl("block_linear", block_linear);
  m.impl("block_repack", block_repack);
  m.impl("block_rows", block_rows);
}

TORCH_LIBRARY_IMPL(quickdraft, Meta, m) {
  m.impl("block_linear", block_linear_meta);
}
