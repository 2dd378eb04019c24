// Decode attention for many independent sequences at once (engine/lean/batch.py): one
// query token per sequence, each attending to its own cache row over its own length.
//
// A batched matmul over the rows' caches reads every row up to the longest row's length
// and runs 3 x 64 by 64 x W products that the BLAS handles poorly; here each (row, key
// head) pair streams exactly its own positions once: every key vector serves the group's
// query heads while it is in registers, then every value vector does. Softmax in float32,
// as the lean step computes it (scores scaled, soft-capped where the family caps them,
// the row's maximum subtracted).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// q: (B, H, D) float32; keys, values: (B, KV, C, D) float32; lengths: (B,) int64 (positions
// 0..length-1 are attended, the last one being the query's own); window: 0, or attend only
// the last `window` positions. Returns (B, H, D) float32.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys,
                            const at::Tensor& values, const at::Tensor& lengths,
                            double scaling, double softcap, int64_t window) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
                  values.scalar_type() == at::kFloat, "decode_attention takes float32");
  TORCH_CHECK(q.is_contiguous() && keys.is_contiguous() && values.is_contiguous(),
              "decode_attention takes contiguous tensors");
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && values.sizes() == keys.sizes(),
              "decode_attention: q (B, H, D), keys and values (B, KV, C, D)");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KV = keys.size(1), C = keys.size(2);
  TORCH_CHECK(keys.size(0) == B && keys.size(3) == D && H % KV == 0,
              "decode_attention: shapes do not match");
  const int64_t G = H / KV;
  at::Tensor lens = lengths.to(at::kLong).contiguous();
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(len[b] >= 1 && len[b] <= C, "decode_attention: a length is outside the cache");
  at::Tensor out = at::empty({B, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float scale = static_cast<float>(scaling), cap = static_cast<float>(softcap);

  at::parallel_for(0, B * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / KV, h = pair % KV;
      const int64_t stop = len[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, stop - window) : 0;
      const int64_t n = stop - start;
      const float* qg = qp + (b * H + h * G) * D;  // the group's G query heads
      const float* k = kp + ((b * KV + h) * C + start) * D;
      const float* v = vp + ((b * KV + h) * C + start) * D;
      scores.assign(G * n, 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        const float* kj = k + j * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qh = qg + g * D;
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qh[d] * kj[d];
          s *= scale;
          if (cap > 0.0f) s = std::tanh(s / cap) * cap;
          scores[g * n + j] = s;
        }
      }
      float* og = op + (b * H + h * G) * D;
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * n;
        float top = sg[0];
        for (int64_t j = 1; j < n; ++j) top = std::max(top, sg[j]);
        float sum = 0.0f;
        for (int64_t j = 0; j < n; ++j) {
          sg[j] = std::exp(sg[j] - top);
          sum += sg[j];
        }
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < n; ++j) sg[j] *= inv;
        std::fill(og + g * D, og + (g + 1) * D, 0.0f);
      }
      for (int64_t j = 0; j < n; ++j) {
        const float* vj = v + j * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * n + j];
          float* o = og + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += p * vj[d];
        }
      }
    }
  });
  return out;
}

at::Tensor decode_attention_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, double, double, int64_t) {
  return at::empty(q.sizes(), q.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(quickdraft, m) {
  m.def("decode_attention(Tensor q, Tensor keys, Tensor values, Tensor lengths, "
        "float scaling, float softcap, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(quickdraft, CPU, m) { m.impl("decode_attention", decode_attention); }

TORCH_LIBRARY_IMPL(quickdraft, Meta, m) { m.impl("decode_attention", decode_attention_meta); }
