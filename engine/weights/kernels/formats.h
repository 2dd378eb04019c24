// The GGUF block formats the block kernels read (blocks.cpp), one struct each, and the table
// of them (`Formats`). A format is its GGML type id, its block geometry, the fields of a
// block (how the repack lays them out) and one kernel function, `Unit`: what a unit (one
// stored block: 32 values, or a K-quant's 256) of a group of kRows rows holds, per lane
// (one lane per row):
//   word(j, g)   the codes of values 4g..4g+3 of its block j of 32 (a byte each; unsigned,
//                stored + kBias; Q8_0's signed, kSigned),
//   scale(j)     that block's float scale, low(j) its float low (kLow) and, for Q6_K
//                (kSixteens), sixteens(j) the integer scales of its two halves of 16,
// so that value i of block j is (scale(j) * its half's integer scale) * (code - kBias)
// [+ low(j)]: the values gguf's own dequantizer gives, bit for bit (tested). The matrix
// kernel and the row reader (blocks.cpp) are written once over this; adding a format is one
// struct here and one name in `Formats`.
//
// The repack puts each field's words (2 bytes for halves, 4 for the rest) of a group's kRows
// rows side by side, unit by unit: the bytes a row stores at offset o of a unit lie, for all
// kRows rows, at kRows * o of the repacked unit (a row's kTail bytes after its units, a
// float, likewise after the group's units); a format's kSpread word (Q5_0's and Q5_1's
// fifth bits) is stored with its bits reordered for a cheaper unpacking. A repacked group
// has the rows' own size.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace quickdraft {

struct Field {
  int offset;  // bytes into the stored block
  int bytes;  // its size
  int unit;  // bytes a lane holds: 2 (a half) or 4
};

// What most formats share: unsigned codes, one scale per block of 32, no low, nothing
// stored per row after the units, every word repacked as stored (kSpread: none).
struct Plain {
  static constexpr int kBias = 0, kTail = 0, kSpread = -1;
  static constexpr bool kLow = false, kSigned = false, kSixteens = false;
  static constexpr bool kArranged = false;  // true: arrange() reorders a block's bits first
};

// Lane helpers: byte b of each lane as an int32 (unsigned, or sign-extended).
template <class V>
typename V::I lane_byte(typename V::I x, int b) {
  return V::and_(V::shr(x, 8 * b), V::words(0xFF));
}
template <class V>
typename V::I lane_int8(typename V::I x, int b) {
  return V::sar(V::shl(x, 24 - 8 * b), 24);
}

// 4-bit codes of a block of 32 at `p` (16 bytes a row): byte i holds value i in its low
// nibble and value i + 16 in its high one; word g < 4 is values 4g.., g >= 4 values 16 + ...
template <class V>
typename V::I split_nibbles(const uint8_t* p, int g) {
  const typename V::I w = V::load(p + V::kRows * 4 * (g & 3));
  return g < 4 ? V::and_(w, V::bytes(0x0F)) : V::nibbles_high(w);
}

// Q5_0's and Q5_1's 32 fifth bits as the repack stores them (the word at kSpread): the
// file's bit 4g + i (value 4g + i of the block, byte i of word g) moved to bit 8i + g, so
// word g's four bits are bit g of each byte (as Q5_K stores them). A transpose of 8 x 4
// bits: for each i, the bits i, 4 + i, .., 28 + i gathered into byte i by three folds.
inline uint32_t spread_fifth_bits(uint32_t qh) {
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i) {
    uint32_t x = (qh >> i) & 0x11111111u;  // bit 4g
    x = (x | (x >> 3)) & 0x03030303u;  // bits g = 2k, 2k + 1 at 8k, 8k + 1
    x = (x | (x >> 6)) & 0x000F000Fu;  // g = 0..3 at 0..3, g = 4..7 at 16..19
    x = (x | (x >> 12)) & 0xFFu;  // g at bit g
    out |= x << (8 * i);
  }
  return out;
}

// The fifth bits of word g's 4 values from a spread `qh`, as 0x10 in each byte: bit g of
// each byte moved to bit 4.
template <class V>
typename V::I fifth_bits(typename V::I qh, int g) {
  const typename V::I bit = g <= 4 ? V::shl(qh, 4 - g) : V::shr(qh, g - 4);
  return V::and_(bit, V::bytes(0x10));
}

// A unit that starts with its scale d (f16): Q4_0's, Q5_0's and Q8_0's (no offset), and
// with d and an offset m (f16), Q4_1's and Q5_1's. Each format adds how it reads its codes.
template <class V>
struct DUnit {
  const uint8_t* p;
  explicit DUnit(const uint8_t* unit) : p(unit) {}
  typename V::F scale(int) const { return V::halves(p); }
  typename V::F low(int) const { return V::fzero(); }
};

template <class V>
struct DMUnit : DUnit<V> {
  using DUnit<V>::DUnit;
  typename V::F low(int) const { return V::halves(this->p + V::kRows * 2); }
};

// Q5_0's and Q5_1's units: their base's scale (and offset), the 32 fifth bits (spread by
// the repack) at byte kHigh of the unit and the 16 bytes of low nibbles at kLow.
template <class V, class Base, int kHigh, int kLow>
struct FifthBitUnit : Base {
  typename V::I qh;
  explicit FifthBitUnit(const uint8_t* unit) : Base(unit), qh(V::load(unit + V::kRows * kHigh)) {}
  typename V::I word(int, int g) const {
    return V::or_(split_nibbles<V>(this->p + V::kRows * kLow, g), fifth_bits<V>(qh, g));
  }
};

// Q4_0: d (f16), 16 bytes of 4-bit codes; w = (code - 8) * d.
struct Q4_0 : Plain {
  static constexpr int kType = 2, kElems = 32, kBytes = 18, kBias = 8;
  static constexpr std::array<Field, 2> kFields{{{0, 2, 2}, {2, 16, 4}}};
  template <class V>
  struct Unit : DUnit<V> {
    using DUnit<V>::DUnit;
    typename V::I word(int, int g) const { return split_nibbles<V>(this->p + V::kRows * 2, g); }
  };
};

// Q4_1: d, m (f16), 16 bytes of 4-bit codes; w = code * d + m.
struct Q4_1 : Plain {
  static constexpr int kType = 3, kElems = 32, kBytes = 20;
  static constexpr bool kLow = true;
  static constexpr std::array<Field, 3> kFields{{{0, 2, 2}, {2, 2, 2}, {4, 16, 4}}};
  template <class V>
  struct Unit : DMUnit<V> {
    using DMUnit<V>::DMUnit;
    typename V::I word(int, int g) const { return split_nibbles<V>(this->p + V::kRows * 4, g); }
  };
};

// Q5_0: d, 32 fifth bits (spread by the repack), 16 bytes of low nibbles; w = (code - 16) * d.
struct Q5_0 : Plain {
  static constexpr int kType = 6, kElems = 32, kBytes = 22, kBias = 16, kSpread = 2;
  static constexpr std::array<Field, 3> kFields{{{0, 2, 2}, {2, 4, 4}, {6, 16, 4}}};
  template <class V>
  using Unit = FifthBitUnit<V, DUnit<V>, 2, 6>;
};

// Q5_1: d, m, 32 fifth bits (spread by the repack), 16 bytes of low nibbles; w = code * d + m.
struct Q5_1 : Plain {
  static constexpr int kType = 7, kElems = 32, kBytes = 24, kSpread = 4;
  static constexpr bool kLow = true;
  static constexpr std::array<Field, 4> kFields{{{0, 2, 2}, {2, 2, 2}, {4, 4, 4}, {8, 16, 4}}};
  template <class V>
  using Unit = FifthBitUnit<V, DMUnit<V>, 4, 8>;
};

// Q8_0: d, 32 signed bytes; w = code * d.
struct Q8_0 : Plain {
  static constexpr int kType = 8, kElems = 32, kBytes = 34;
  static constexpr bool kSigned = true;
  static constexpr std::array<Field, 2> kFields{{{0, 2, 2}, {2, 32, 4}}};
  template <class V>
  struct Unit : DUnit<V> {
    using DUnit<V>::DUnit;
    typename V::I word(int, int g) const { return V::load(this->p + V::kRows * (2 + 4 * g)); }
  };
};

// The 6-bit scales and mins of a K-quant's 8 blocks (12 bytes: three words per lane), as
// bytes: sc[0] bytes 0..3 = blocks 0..3, sc[1] = blocks 4..7; the same for mins.
template <class V>
struct KScales {
  typename V::I sc[2], mn[2];
  explicit KScales(const uint8_t* p) {
    const auto w0 = V::load(p), w1 = V::load(p + V::kRows * 4), w2 = V::load(p + V::kRows * 8);
    const auto six = V::bytes(0x3F), top = V::bytes(0x30), nibble = V::bytes(0x0F);
    sc[0] = V::and_(w0, six);
    mn[0] = V::and_(w1, six);
    sc[1] = V::or_(V::and_(w2, nibble), V::and_(V::shr(w0, 2), top));
    mn[1] = V::or_(V::and_(V::shr(w2, 4), nibble), V::and_(V::shr(w1, 2), top));
  }
};

// What the units of Q4_K and Q5_K share: d and dmin (f16), then the 8 blocks' 6-bit scales
// and mins; w = code * (d * sc) - dmin * m. Each format adds only how it reads its codes.
template <class V>
struct KUnit {
  const uint8_t* p;
  typename V::F d, dmin;
  KScales<V> k;
  explicit KUnit(const uint8_t* unit)
      : p(unit), d(V::halves(unit)), dmin(V::halves(unit + V::kRows * 2)),
        k(unit + V::kRows * 4) {}
  typename V::F scale(int j) const { return V::fmul(d, V::cvt(lane_byte<V>(k.sc[j >> 2], j & 3))); }
  typename V::F low(int j) const {
    return V::fneg(V::fmul(dmin, V::cvt(lane_byte<V>(k.mn[j >> 2], j & 3))));
  }
};

// Q4_K: 256 values; d, dmin (f16), 6-bit scale and min per block of 32, 128 bytes of
// 4-bit codes (per 64 values, 32 bytes: block 2c in low nibbles, 2c + 1 in high ones);
// w = code * (d * sc) - dmin * m.
struct Q4_K : Plain {
  static constexpr int kType = 12, kElems = 256, kBytes = 144;
  static constexpr bool kLow = true;
  static constexpr std::array<Field, 4> kFields{{{0, 2, 2}, {2, 2, 2}, {4, 12, 4}, {16, 128, 4}}};
  template <class V>
  struct Unit : KUnit<V> {
    using KUnit<V>::KUnit;
    typename V::I word(int j, int g) const {
      const auto w = V::load(this->p + V::kRows * (16 + 32 * (j >> 1) + 4 * g));
      return j & 1 ? V::nibbles_high(w) : V::and_(w, V::bytes(0x0F));
    }
  };
};

// Q5_K: Q4_K with a fifth bit per value (32 bytes: bit j of byte i is value i of block j).
struct Q5_K : Plain {
  static constexpr int kType = 13, kElems = 256, kBytes = 176;
  static constexpr bool kLow = true;
  static constexpr std::array<Field, 5> kFields{
      {{0, 2, 2}, {2, 2, 2}, {4, 12, 4}, {16, 32, 4}, {48, 128, 4}}};
  template <class V>
  struct Unit : KUnit<V> {
    using KUnit<V>::KUnit;
    typename V::I word(int j, int g) const {
      const auto w = V::load(this->p + V::kRows * (48 + 32 * (j >> 1) + 4 * g));
      const auto low4 = j & 1 ? V::nibbles_high(w) : V::and_(w, V::bytes(0x0F));
      return V::or_(low4, fifth_bits<V>(V::load(this->p + V::kRows * (16 + 4 * g)), j));
    }
  };
};

// Q6_K: 256 values; per 128, 64 bytes of low nibbles and 32 of 2-bit tops, then 16 int8
// scales (one per 16 values) and d (f16); w = (code - 32) * sc * d. The repack rearranges
// the 192 bytes of codes (arrange) so that a block of 32 reads one 6-bit code per byte for
// its first 16 values: see `arrange`.
struct Q6_K : Plain {
  static constexpr int kType = 14, kElems = 256, kBytes = 210, kBias = 32;
  static constexpr bool kSixteens = true, kArranged = true;
  static constexpr std::array<Field, 3> kFields{{{0, 192, 4}, {192, 16, 4}, {208, 2, 2}}};

  // A stored block's codes (`in`, gguf's layout: value 128h + 32i + l has its low nibble in
  // byte 64h + l + 32(i & 1) of ql, low (i < 2) or high, and its top 2 bits at 2i of byte
  // 32h + l of qh) rewritten in `out` as 24 bytes per block j of 32 values v = 32j + ..:
  //   bytes 0..15 (words A0..A3): byte n = code(v = n) | top 2 bits of code(16 + n) << 6,
  //   bytes 16..23 (words B0, B1): byte n = low nibble of code(16 + n) | that of
  //   code(20 + n) << 4 (B0; B1 the same for 24 + n, 28 + n);
  // the scales and d stay where they are: out has in's size, and the same bits.
  static void arrange(const uint8_t* in, uint8_t* out) {
    uint8_t code[256];
    for (int v = 0; v < 256; ++v) {
      const int h = v >> 7, i = (v >> 5) & 3, l = v & 31;
      const uint8_t ql = in[64 * h + l + 32 * (i & 1)], qh = in[128 + 32 * h + l];
      code[v] = static_cast<uint8_t>(((i < 2 ? ql : ql >> 4) & 0x0F) | ((qh >> 2 * i) & 3) << 4);
    }
    for (int j = 0; j < 8; ++j) {
      const uint8_t* c = code + 32 * j;
      uint8_t* o = out + 24 * j;
      for (int n = 0; n < 16; ++n) o[n] = static_cast<uint8_t>(c[n] | (c[16 + n] >> 4) << 6);
      for (int n = 0; n < 4; ++n) {
        o[16 + n] = static_cast<uint8_t>((c[16 + n] & 0x0F) | (c[20 + n] & 0x0F) << 4);
        o[20 + n] = static_cast<uint8_t>((c[24 + n] & 0x0F) | (c[28 + n] & 0x0F) << 4);
      }
    }
    std::memcpy(out + 192, in + 192, kBytes - 192);
  }

  template <class V>
  struct Unit {
    const uint8_t* p;
    explicit Unit(const uint8_t* unit) : p(unit) {}
    typename V::F scale(int) const { return V::halves(p + V::kRows * 208); }
    typename V::F low(int) const { return V::fzero(); }
    // word g < 4 of block j: its bytes' low 6 bits; g >= 4: a nibble of B0 or B1 and, as
    // bits 4 and 5, the top 2 bits of the bytes of word g - 4
    typename V::I word(int j, int g) const {
      const uint8_t* b = p + V::kRows * 24 * j;
      if (g < 4) return V::and_(V::load(b + V::kRows * 4 * g), V::bytes(0x3F));
      const auto nibbles = V::load(b + V::kRows * (16 + 4 * ((g - 4) >> 1)));
      const auto low4 = g & 1 ? V::nibbles_high(nibbles) : V::and_(nibbles, V::bytes(0x0F));
      const auto top = V::shr(V::load(b + V::kRows * 4 * (g - 4)), 2);  // bits 6, 7 -> 4, 5
      return V::or_(low4, V::and_(top, V::bytes(0x30)));
    }
    void sixteens(int j, typename V::I& first, typename V::I& second) const {
      const auto w = V::load(p + V::kRows * (192 + 4 * (j >> 1)));
      first = lane_int8<V>(w, 2 * (j & 1));
      second = lane_int8<V>(w, 2 * (j & 1) + 1);
    }
  };
};

// Quickdraft's own int8w (engine/weights/quant.py): int8 codes in blocks of 32 and one float32
// scale per row, stored after the row's units (kTail bytes, side by side for a group's
// rows); w = code * row scale. The row scale multiplies the finished sums, each block's
// scale being 1. (Quickdraft's int4 is Q4_1.)
struct I8 : Plain {
  static constexpr int kType = 256, kElems = 32, kBytes = 32, kTail = 4;
  static constexpr bool kSigned = true;
  static constexpr std::array<Field, 1> kFields{{{0, 32, 4}}};
  template <class V>
  struct Unit {
    const uint8_t* p;
    explicit Unit(const uint8_t* unit) : p(unit) {}
    typename V::F scale(int) const { return V::fset(1.f); }
    typename V::F low(int) const { return V::fzero(); }
    typename V::I word(int, int g) const { return V::load(p + V::kRows * 4 * g); }
  };
};

// Every format the kernels read. Adding one: its struct above and its name here.
using Formats = std::tuple<Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, I8>;

}  // namespace quickdraft
