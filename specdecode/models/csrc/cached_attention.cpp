// cached_attention: the attention of a pass's few queries per row over that row's KV-cache slot.
//
// Why: in a batched decode step every row attends over its own slot of the cache. Stock SDPA needs the
// rows' keys and values gathered into one tensor first (a copy of the whole cache, every layer: 132 ms a
// layer for 64 rows of 1024 entries on a 2-core EPYC) and then ran at ~2.5 GB/s. Here each (row, kv head)
// reads its slot in place, once, for all the queries that share that kv head (grouped-query attention
// without expanding the keys), so the step streams the cache at memory speed.
// Row r's query m sees cache entries 0 .. limits[r][m] - 1: a causal chain or a batch of chains. Trees,
// whose masks are arbitrary, stay on SDPA.
// Every query is computed on its own, in the same order whatever the other queries and rows are, so a
// row's result never depends on its batch: a verify pass over k + 1 positions attends bit for bit like
// k + 1 one-token steps.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kBlock = 64;  // keys scored at once per query before their softmax weights are applied

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, v8 v) { __builtin_memcpy(p, &v, sizeof(v)); }

#if defined(__FMA__)
#include <immintrin.h>
inline v8 fma8(v8 a, v8 b, v8 c) { return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#else
inline v8 fma8(v8 a, v8 b, v8 c) { return a * b + c; }
#endif

inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

// exp(x) of eight x <= 0 (scores minus their running maximum): Cody-Waite range reduction and a degree-6
// polynomial in vector arithmetic (std::exp does not vectorize); relative error ~2e-7.
inline v8 exp8(v8 x) {
  x = x < splat(-87.f) ? splat(-87.f) : x;
  const v8 magic = splat(12582912.f);  // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer
  const v8 n = (x * splat(1.44269504088896341f) + magic) - magic;
  const v8 r = (x - n * splat(0.693145751953125f)) - n * splat(1.428606765330187045e-06f);
  v8 p = splat(1.f / 720.f);
  p = p * r + splat(1.f / 120.f);
  p = p * r + splat(1.f / 24.f);
  p = p * r + splat(1.f / 6.f);
  p = p * r + splat(0.5f);
  p = p * r + splat(1.f);
  p = p * r + splat(1.f);
  const i8 bits = (__builtin_convertvector(n, i8) + 127) << 23;
  v8 scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float exp1(float x) { return exp8(splat(x))[0]; }

inline float dot(const float* a, const float* b, int64_t D) {
  v8 acc = splat(0.f);
  for (int64_t d = 0; d < D; d += 8) acc = fma8(load8(a + d), load8(b + d), acc);
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += acc[i];
  return s;
}

// One (row, kv head): M queries (M, D) over that slot's keys and values (D floats per entry).
void attend(const float* q, const float* k, const float* v, const int64_t* limits, float* out, int64_t M, int64_t D,
            float scale) {
  int64_t longest = 0;
  for (int64_t m = 0; m < M; ++m) longest = std::max(longest, limits[m]);
  std::vector<float> best(M, -INFINITY), total(M, 0.f), acc(M * D, 0.f);
  alignas(32) float weights[kBlock];
  for (int64_t j0 = 0; j0 < longest; j0 += kBlock) {
    for (int64_t m = 0; m < M; ++m) {
      const int64_t visible = std::min(limits[m] - j0, kBlock);
      if (visible <= 0) continue;
      const float* qm = q + m * D;
      float block_max = -INFINITY;
      for (int64_t b = 0; b < visible; ++b) {
        weights[b] = dot(qm, k + (j0 + b) * D, D) * scale;
        block_max = std::max(block_max, weights[b]);
      }
      float* am = acc.data() + m * D;
      if (block_max > best[m]) {  // a new maximum: rescale what was summed so far
        const float shrink = exp1(best[m] - block_max);
        total[m] *= shrink;
        for (int64_t d = 0; d < D; d += 8) store8(am + d, load8(am + d) * splat(shrink));
        best[m] = block_max;
      }
      for (int64_t b = visible; b < (visible + 7) / 8 * 8; ++b) weights[b] = -INFINITY;  // exp gives 0 there
      v8 block_total = splat(0.f);
      for (int64_t b = 0; b < visible; b += 8) {
        const v8 w = exp8(load8(weights + b) - splat(best[m]));
        store8(weights + b, w);
        block_total += w;
      }
      for (int i = 0; i < 8; ++i) total[m] += block_total[i];
      for (int64_t b = 0; b < visible; ++b) {
        const v8 w = splat(weights[b]);
        const float* vb = v + (j0 + b) * D;
        for (int64_t d = 0; d < D; d += 8) store8(am + d, fma8(w, load8(vb + d), load8(am + d)));
      }
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    const float inv = total[m] > 0.f ? 1.f / total[m] : 0.f;
    for (int64_t d = 0; d < D; ++d) out[m * D + d] = acc[m * D + d] * inv;
  }
}

}  // namespace

// q (R, KV, M, D) float32: the M queries of row r that share kv head h (grouped heads times positions);
// keys, values (S, KV, C, D) float32, a layer's cache, entries contiguous per (slot, head);
// slots (R) int64: row r's slot; limits (R, M) int64: how many entries query m sees. Returns (R, KV, M, D).
torch::Tensor cached_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor slots,
                               torch::Tensor limits, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && keys.scalar_type() == torch::kFloat &&
                  values.scalar_type() == torch::kFloat,
              "cached_attention computes in float32");
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes(), "bad shapes");
  TORCH_CHECK(keys.stride(3) == 1 && keys.stride(2) == keys.size(3) && values.strides() == keys.strides(),
              "cache entries must be contiguous per (slot, head)");
  q = q.contiguous();
  auto slot_index = slots.contiguous();
  auto limit = limits.contiguous();
  const int64_t R = q.size(0), KV = q.size(1), M = q.size(2), D = q.size(3), C = keys.size(2);
  TORCH_CHECK(keys.size(1) == KV && keys.size(3) == D, "queries and cache disagree on heads or head size");
  TORCH_CHECK(D % 8 == 0, "cached_attention needs a head size that is a multiple of 8");
  TORCH_CHECK(limit.size(0) == R && limit.size(1) == M, "limits must be (rows, queries)");
  TORCH_CHECK(limit.max().item<int64_t>() <= C, "a query would read past the cache's capacity");
  auto out = torch::empty_like(q);
  const float *qp = q.data_ptr<float>(), *kp = keys.data_ptr<float>(), *vp = values.data_ptr<float>();
  const int64_t *sp = slot_index.data_ptr<int64_t>(), *lp = limit.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t slot_stride = keys.stride(0), head_stride = keys.stride(1);
  at::parallel_for(0, R * KV, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / KV, h = item % KV;
      const int64_t base = sp[r] * slot_stride + h * head_stride;
      attend(qp + item * M * D, kp + base, vp + base, lp + r * M, op + item * M * D, M, D,
             static_cast<float>(scale));
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(specdecode, m) {
  m.def("cached_attention(Tensor q, Tensor keys, Tensor values, Tensor slots, Tensor limits, float scale) -> Tensor",
        &cached_attention);
}
