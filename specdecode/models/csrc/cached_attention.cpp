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

typedef float v4 __attribute__((vector_size(16)));

// The eight lanes of a partial dot product added as a fixed tree: (0+4, 1+5, 2+6, 3+7), then pairs two apart,
// then the last two. dots8 computes the same tree for eight keys at once.
inline float lane_sum(v8 v) {
  const v4 a = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  return (a[0] + a[2]) + (a[1] + a[3]);
}

#if defined(__AVX512F__)
// With AVX-512 a dot product runs 16 lanes wide where the head size allows (half the multiply-adds of 8
// lanes), and the two halves of its partial sums are added first: every query still gets one fixed order.
typedef float v16 __attribute__((vector_size(64)));
inline v16 load16(const float* p) {
  v16 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
inline v16 fma16(v16 a, v16 b, v16 c) { return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
inline v8 halves(v16 v) {
  return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
}
#endif

// The partial sums (eight lanes) of the dot product of a and b.
inline v8 partial_dot(const float* a, const float* b, int64_t D) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    v16 acc = {};
    for (int64_t d = 0; d < D; d += 16) acc = fma16(load16(a + d), load16(b + d), acc);
    return halves(acc);
  }
#endif
  v8 acc = splat(0.f);
  for (int64_t d = 0; d < D; d += 8) acc = fma8(load8(a + d), load8(b + d), acc);
  return acc;
}

inline float dot(const float* a, const float* b, int64_t D) { return lane_sum(partial_dot(a, b, D)); }

// dot(q, k_i) for eight consecutive keys, bit for bit what `dot` gives each, with the eight lane trees done
// as one transposition (a sequential lane sum per key cost more than the products).
inline v8 dots8(const float* q, const float* k, int64_t D) {
  v8 acc[8];
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    v16 wide[8] = {};
    for (int64_t d = 0; d < D; d += 16) {
      const v16 qd = load16(q + d);
      for (int i = 0; i < 8; ++i) wide[i] = fma16(qd, load16(k + i * D + d), wide[i]);
    }
    for (int i = 0; i < 8; ++i) acc[i] = halves(wide[i]);
  } else
#endif
  {
    for (int i = 0; i < 8; ++i) acc[i] = splat(0.f);
    for (int64_t d = 0; d < D; d += 8) {
      const v8 qd = load8(q + d);
      for (int i = 0; i < 8; ++i) acc[i] = fma8(qd, load8(k + i * D + d), acc[i]);
    }
  }
  v8 h[4], e[2];
  for (int p = 0; p < 4; ++p)
    h[p] = __builtin_shufflevector(acc[2 * p], acc[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(acc[2 * p], acc[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int p = 0; p < 2; ++p)
    e[p] = __builtin_shufflevector(h[2 * p], h[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(h[2 * p], h[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15);
}

// The widest slice of a value row the CPU multiplies in one instruction: 16 floats with AVX-512, else 8.
#if defined(__AVX512F__)
typedef v16 Slice;
inline v16 fma_slice(v16 a, v16 b, v16 c) { return fma16(a, b, c); }
#else
typedef v8 Slice;
inline v8 fma_slice(v8 a, v8 b, v8 c) { return fma8(a, b, c); }
#endif
constexpr int64_t kSliceLanes = sizeof(Slice) / sizeof(float);

// acc (D floats) += sum over b of weights[b] * v[b]: the accumulator stays in registers over the block's keys
// (the same products added in the same order as one slice at a time in memory, whatever the slice width).
template <int64_t D>
inline void add_weighted(float* acc, const float* v, const float* weights, int64_t visible) {
  constexpr int64_t S = D / kSliceLanes;
  Slice slices[S];
  for (int64_t i = 0; i < S; ++i) __builtin_memcpy(&slices[i], acc + kSliceLanes * i, sizeof(Slice));
  for (int64_t b = 0; b < visible; ++b) {
    const Slice w = Slice{} + weights[b];  // weights are exp() values >= 0: adding to zero copies them
    for (int64_t i = 0; i < S; ++i) {
      Slice vb;
      __builtin_memcpy(&vb, v + b * D + kSliceLanes * i, sizeof(Slice));
      slices[i] = fma_slice(w, vb, slices[i]);
    }
  }
  for (int64_t i = 0; i < S; ++i) __builtin_memcpy(acc + kSliceLanes * i, &slices[i], sizeof(Slice));
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
      int64_t b = 0;
      for (; b + 8 <= visible; b += 8) store8(weights + b, dots8(qm, k + (j0 + b) * D, D) * splat(scale));
      for (; b < visible; ++b) weights[b] = dot(qm, k + (j0 + b) * D, D) * scale;
      for (b = 0; b < visible; ++b) block_max = std::max(block_max, weights[b]);
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
      if (D == 64) {
        add_weighted<64>(am, v + j0 * D, weights, visible);
      } else if (D == 128) {
        add_weighted<128>(am, v + j0 * D, weights, visible);
      } else {
        for (int64_t b = 0; b < visible; ++b) {
          const v8 w = splat(weights[b]);
          const float* vb = v + (j0 + b) * D;
          for (int64_t d = 0; d < D; d += 8) store8(am + d, fma8(w, load8(vb + d), load8(am + d)));
        }
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
  // Work items are (row, kv head, a share of its queries): one request has only `KV` (row, head) pairs, too
  // few to keep every thread busy, and each query is computed on its own anyway.
  const int64_t pairs = R * KV, threads = at::get_num_threads();
  const int64_t shares = std::min(M, pairs >= 2 * threads ? int64_t{1} : (2 * threads + pairs - 1) / pairs);
  const int64_t per_share = (M + shares - 1) / shares;
  at::parallel_for(0, pairs * shares, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t pair = item / shares, m0 = item % shares * per_share;
      const int64_t count = std::min(per_share, M - m0);
      if (count <= 0) continue;
      const int64_t r = pair / KV, h = pair % KV;
      const int64_t base = sp[r] * slot_stride + h * head_stride;
      const int64_t first = pair * M + m0;
      attend(qp + first * D, kp + base, vp + base, lp + r * M + m0, op + first * D, count, D,
             static_cast<float>(scale));
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(specdecode, m) {
  m.def("cached_attention(Tensor q, Tensor keys, Tensor values, Tensor slots, Tensor limits, float scale) -> Tensor",
        &cached_attention);
}
