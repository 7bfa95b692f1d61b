// Decode attention straight from the paged KV pool, on a CPU: one query token per sequence, keys and
// values read in place from each sequence's blocks (no gathered copy, no padding, no mask).
//
// q       [N, H, D]             float32, one row per decoding sequence (its new token)
// k, v    [blocks, B, KVH, D]   float32, one layer of the pool (B tokens per block)
// tables  [N, W]                int64, each sequence's block ids (padded past its length; never read)
// lengths [N]                   int64, tokens to attend to, the new one included (its K/V already written)
// returns [N, H, D]
//
// Query head i reads KV head i / (H / KVH) (grouped-query attention, as repeat_interleave does). Work is
// split over (sequence, KV head) pairs; each reads its keys once for all the query heads of its group, so
// the pool is read once per step and layer. Softmax in two passes (scores, then max, exp, sum), float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

static inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor tables,
                           torch::Tensor lengths, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.sizes() == k.sizes(), "paged_decode: shapes");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32,
              "paged_decode: float32 only");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && tables.is_contiguous() && lengths.is_contiguous(),
              "paged_decode: contiguous tensors only");
  TORCH_CHECK(tables.scalar_type() == torch::kInt64 && lengths.scalar_type() == torch::kInt64, "paged_decode: int64 tables");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t blocks = k.size(0), B = k.size(1), KVH = k.size(2), W = tables.size(1);
  TORCH_CHECK(k.size(3) == D && H % KVH == 0 && tables.size(0) == N && lengths.size(0) == N, "paged_decode: sizes");
  const int64_t G = H / KVH;
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(len[n] >= 1 && len[n] <= W * B, "paged_decode: length out of range");
    for (int64_t w = 0; w < (len[n] + B - 1) / B; ++w)
      TORCH_CHECK(tab[n * W + w] >= 0 && tab[n * W + w] < blocks, "paged_decode: block id out of range");
  }
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(H * D);
    for (int64_t n = begin; n < end; ++n) {
      const int64_t L = len[n];
      const float* qn = qp + n * H * D;
      scores.resize(H * L);
      for (int64_t t = 0; t < L; ++t) {  // a token's K row holds every KV head: read it whole, once
        const float* key = kp + (tab[n * W + t / B] * B + t % B) * KVH * D;
        for (int64_t i = 0; i < H; ++i) scores[i * L + t] = dot(qn + i * D, key + (i / G) * D, D) * s;
      }
      for (int64_t i = 0; i < H; ++i) {
        float* row = scores.data() + i * L;
        float top = -std::numeric_limits<float>::infinity(), sum = 0.f;
#pragma omp simd reduction(max : top)
        for (int64_t t = 0; t < L; ++t) top = std::max(top, row[t]);
#pragma omp simd
        for (int64_t t = 0; t < L; ++t) row[t] = std::exp(row[t] - top);
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < L; ++t) sum += row[t];
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t t = 0; t < L; ++t) row[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const float* value = vp + (tab[n * W + t / B] * B + t % B) * KVH * D;
        for (int64_t i = 0; i < H; ++i) {
          const float p = scores[i * L + t];
          const float* vh = value + (i / G) * D;
          float* a = acc.data() + i * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * vh[d];
        }
      }
      std::copy(acc.begin(), acc.end(), op + n * H * D);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode, "decode attention over a paged KV pool (CPU)"); }
