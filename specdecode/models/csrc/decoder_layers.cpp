// decoder_layers: every decoder layer of a causal pass in one call, for the few rows of a decode step, a
// verify pass or a small batch.
//
// Why: at a few rows a layer is ~0.3 ms of weight streaming, and the Python loop around it (views, slices,
// the cache writes, the query regrouping, ~25 dispatched ops a layer) cost 4-5 ms of a 15 ms step on a
// 2-core EPYC. Here the same kernels (few_rows_linear, add_rms_norm, rotate_, cached_attention, silu_mul)
// run in the same order on the same float32 rows, so a pass computes bit for bit what the Python
// loop computes (tested); only the glue between them moved out of the interpreter.
// Covers what the Python loop's fast path covers: causal rows and trees (`limits`, `paths`), a float32 or
// bfloat16 cache, no biases. Everything else stays on the Python loop (models/llama.py). With `head_norms`
// every query and key head is RMS-normed before its rotation (Qwen3's block, which the block drafters use:
// drafters/block_kernels.py runs their backbone here).
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "parts.h"
#include "vectors.h"

at::Tensor few_rows_linear(at::Tensor x, at::Tensor w);
at::Tensor add_rms_norm(at::Tensor residual, c10::optional<at::Tensor> delta, at::Tensor weight,
                           double eps);
void rotate_(at::Tensor x, int64_t heads, at::Tensor cos, at::Tensor sin);
at::Tensor cached_attention(at::Tensor q, at::Tensor keys, at::Tensor values, at::Tensor slots,
                               at::Tensor limits, double scale, c10::optional<at::Tensor> paths,
                               c10::optional<at::Tensor> starts);

namespace {

// silu(x) of a vector's lanes, x * sigmoid(x) with the sigmoid from exp(-|x|) <= 1 (exp_v's range; no overflow).
inline vf silu_v(vf x) {
  const vf zero = {}, e = exp_v(x < zero ? x : -x);
  return x * (x < zero ? e / (1.f + e) : 1.f / (1.f + e));
}

}  // namespace

// silu(gate) * up for every row of gate_up (M, 2 n) = [gate | up]: one pass over the rows where ATen took a silu,
// a product and their two allocations (~3 us a layer of a one-token pass, stop 50). Each element is computed the
// same way wherever it sits (the tail through lane 0 of the vector code), so a row's result never depends on M.
// The C++ loop and the Python loop both call it, so they still agree bit for bit; against ATen's silu it differs
// by rounding (~1e-7 relative). `silu_mul_row`: one row.
void silu_mul_row(const float* gate_up, float* out, int64_t n) {
  const float* up = gate_up + n;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const vf y = silu_v(load_v(gate_up + j)) * load_v(up + j);
    std::memcpy(out + j, &y, sizeof(y));
  }
  for (; j < n; ++j) out[j] = silu_v(vf{} + gate_up[j])[0] * up[j];
}

at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat && gate_up.size(1) % 2 == 0,
              "silu_mul: float32 rows [gate | up]");
  gate_up = gate_up.contiguous();
  const int64_t M = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = at::empty({M, n}, gate_up.options());
  const float* src = gate_up.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1));  // a few rows: no thread team
  at::parallel_for(0, M, grain, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) silu_mul_row(src + m * 2 * n, dst + m * n, n);
  });
  return out;
}

namespace {

constexpr int64_t kWeightsPerLayer = 6;  // input norm, qkv, o, post-attention norm, gate_up, down
constexpr int64_t kHeadNormWeights = 2;  // with head_norms, then: q norm, k norm

// RMS-normalises, in place, heads first .. first + count - 1 of every row of qkv (M, width) over their D
// values with `weight` (D); `norm_heads_row`: those heads of one row.
void norm_heads_row(float* row, int64_t first, int64_t count, int64_t D, const float* weight, float eps) {
  for (int64_t h = first; h < first + count; ++h) rms_norm_row(row + h * D, row + h * D, weight, D, eps);
}

void norm_heads_(at::Tensor& qkv, int64_t first, int64_t count, int64_t D, const at::Tensor& weight,
                 double eps) {
  float* base = qkv.data_ptr<float>();
  const int64_t M = qkv.size(0), width = qkv.size(1);
  for (int64_t m = 0; m < M; ++m)
    norm_heads_row(base + m * width, first, count, D, weight.data_ptr<float>(), static_cast<float>(eps));
}

// Copies, for every query (row r, position i < counts[r], packed at first[r] + i), its kv heads' keys and
// values from the qkv rows (heads of D values: keys at heads H .. H + KV - 1 of a row, its values right after)
// into cache entry starts[r] + i of slot slots[r]; a bfloat16 cache takes them rounded to nearest even, as a
// tensor copy rounds them in the Python loop. `write_cache_row`: one query's, its entry at `at` of every kv head.
template <typename Entry>
void write_cache_row(const float* row, Entry* kp, Entry* vp, int64_t at, int64_t head_stride, int64_t H, int64_t KV,
                     int64_t D) {
  for (int64_t h = 0; h < KV; ++h) {
    std::copy(row + (H + h) * D, row + (H + h + 1) * D, kp + at + h * head_stride);
    std::copy(row + (H + KV + h) * D, row + (H + KV + h + 1) * D, vp + at + h * head_stride);
  }
}

template <typename Entry>
void write_cache(const at::Tensor& qkv, at::Tensor keys, at::Tensor values, const int64_t* slots,
                 c10::IntArrayRef starts, c10::IntArrayRef counts, const std::vector<int64_t>& first, int64_t H,
                 int64_t KV, int64_t D) {
  const float* src = qkv.data_ptr<float>();
  const int64_t width = qkv.size(1);
  Entry *kp = keys.data_ptr<Entry>(), *vp = values.data_ptr<Entry>();
  const int64_t slot_stride = keys.stride(0), head_stride = keys.stride(1);
  for (int64_t r = 0; r < static_cast<int64_t>(counts.size()); ++r)
    for (int64_t i = 0; i < counts[r]; ++i)
      write_cache_row(src + (first[r] + i) * width, kp, vp, slots[r] * slot_stride + (starts[r] + i) * D,
                      head_stride, H, KV, D);
}

// Query head `head` of packed row m (row r, position i) goes to (r, kv, g * Q + i) of the grouped queries
// (R, KV, group * Q, D) that cached_attention takes (head = kv * group + g): the heads sharing a kv head together.
inline int64_t grouped_query(int64_t r, int64_t head, int64_t i, int64_t H, int64_t Q) {
  return (r * H + head) * Q + i;
}

// The H query heads of one packed row (row r, position i) into the grouped queries, and its heads' attention
// outputs back from the grouped outputs (same layout) into its row.
inline void group_queries_row(float* grouped, const float* row, int64_t r, int64_t i, int64_t H, int64_t Q, int64_t D) {
  for (int64_t head = 0; head < H; ++head)
    std::memcpy(grouped + grouped_query(r, head, i, H, Q) * D, row + head * D, D * sizeof(float));
}

inline void ungroup_outputs_row(float* row, const float* grouped, int64_t r, int64_t i, int64_t H, int64_t Q,
                                int64_t D) {
  for (int64_t head = 0; head < H; ++head)
    std::memcpy(row + head * D, grouped + grouped_query(r, head, i, H, Q) * D, D * sizeof(float));
}

// What a pass's layers need besides the weights, checked once by decoder_layers.
struct Pass {
  at::Tensor x, keys, values, cos, sin, slots, limits;
  const at::Tensor *paths, *path_starts;
  c10::IntArrayRef starts, counts;
  std::vector<int64_t> first;  // row r's tokens are packed rows first[r] .. first[r + 1] - 1
  int64_t R, M, H, KV, D, group, Q;
  double scale, eps;
};

// Every layer in one team of threads (one OpenMP region for the pass) where every linear takes 8-bit input rows
// (csrc/q8_rows.cpp): at a few rows a layer's five kernels (four products and attention) are ~10 us each, and
// each forked and joined the team at ~2 us (a one-token pass: 150 forks, ~0.3 ms of ~6). Here the threads meet
// at a spinning barrier between steps (~0.25 us), split each product's groups of outputs and attention's items
// as the kernels' own parallel loops split them (every output is computed the same way wherever it is, so the
// pass is bit for bit the forked loop's), and split the per-token steps (norms, rotation, cache writes, rounding
// the next product's inputs) by packed rows; the buffers are allocated once a pass, not once a kernel.
template <typename Entry>
at::Tensor team_layers(Pass& p, const std::vector<at::Tensor>& weights, int64_t per_layer, bool head_norms,
                          c10::IntArrayRef capture, std::vector<at::Tensor>& captured) {
  const int64_t layers = static_cast<int64_t>(weights.size()) / per_layer, M = p.M, H = p.H, KV = p.KV, D = p.D;
  const int64_t hidden = p.x.size(1), width = (H + 2 * KV) * D, inner = weights[5].size(1) * 32;
  const auto options = p.x.options();
  auto qkv = at::empty({M, width}, options), attended = at::empty({M, H * D}, options);
  auto h = at::empty({M, hidden}, options), projected = at::empty({M, hidden}, options);
  auto gate_up = at::empty({M, 2 * inner}, options), act = at::empty({M, inner}, options);
  auto delta = at::empty({M, hidden}, options);  // the first layer adds none (`layer > 0` below)
  auto q = at::zeros({p.R, KV, p.group * p.Q, D}, options);  // padded queries stay zero: finite, never read
  auto out = at::empty_like(q);
  Q8Inputs rounded_hidden, rounded_heads, rounded_inner;  // the next product's input rows, rounded
  rounded_hidden.size_for(M, hidden);
  rounded_heads.size_for(M, H * D);
  rounded_inner.size_for(M, inner);
  std::vector<int64_t> row_of(M), position_of(M);  // packed row m is token position_of[m] of row row_of[m]
  for (int64_t r = 0; r < p.R; ++r)
    for (int64_t i = 0; i < p.counts[r]; ++i) {
      row_of[p.first[r] + i] = r;
      position_of[p.first[r] + i] = i;
    }
  for (const int64_t c : capture) captured.push_back(at::empty({M, hidden}, options));
  // checked once: the layers' caches differ only by where they start
  auto partials = at::empty({0}, options);
  const AttentionWork layer0 = attention_work(q, p.keys.select(0, 0), p.values.select(0, 0), p.slots, p.limits,
                                              p.scale, p.paths, p.path_starts, out, partials);
  float *x = p.x.data_ptr<float>(), *hp = h.data_ptr<float>(), *qkvp = qkv.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *op = out.data_ptr<float>(), *ap = attended.data_ptr<float>();
  float *pp = projected.data_ptr<float>(), *gp = gate_up.data_ptr<float>(), *actp = act.data_ptr<float>();
  float* dp = delta.data_ptr<float>();
  const float *cos = p.cos.data_ptr<float>(), *sin = p.sin.data_ptr<float>();
  Entry *keys = p.keys.data_ptr<Entry>(), *values = p.values.data_ptr<Entry>();
  const int64_t* slots = p.slots.data_ptr<int64_t>();
  const int64_t layer_stride = p.keys.stride(0), slot_stride = p.keys.stride(1), head_stride = p.keys.stride(2);
  const auto eps = static_cast<float>(p.eps);
  SpinBarrier barrier;
  std::vector<int64_t> attention_bounds;  // each thread's attention items, the same in every layer
#pragma omp parallel
  {
#pragma omp single
    {
      barrier.reset(omp_get_num_threads());  // the team as OpenMP formed it (an implicit barrier follows)
      attention_bounds = layer0.bounds(omp_get_num_threads());
    }
    const int64_t part = omp_get_thread_num(), parts = omp_get_num_threads();
    const auto [m0, m1] = share_of(M, part, parts);  // this thread's packed rows for the per-token steps
    const auto product = [&](const Q8Inputs& in, const at::Tensor& w, float* y) {
      const auto [g0, g1] = share_of(w.size(0), part, parts);
      q8_rows_groups(in, w, y, g0, g1);
      barrier.wait();
    };
    const auto round = [&](const float* rows, Q8Inputs& in) {
      q8_round_rows(rows, m0, m1, in);
      barrier.wait();
    };
    for (int64_t layer = 0; layer < layers; ++layer) {
      const at::Tensor* w = weights.data() + layer * per_layer;
      for (int64_t m = m0; m < m1; ++m) {
        if (layer > 0)
          for (size_t c = 0; c < capture.size(); ++c)
            if (capture[c] == layer - 1) {
              float* row = captured[c].data_ptr<float>() + m * hidden;
              for (int64_t i = 0; i < hidden; ++i) row[i] = x[m * hidden + i] + dp[m * hidden + i];
            }
        add_rms_norm_row(x + m * hidden, layer > 0 ? dp + m * hidden : nullptr, w[0].data_ptr<float>(),
                         hp + m * hidden, hidden, eps);
      }
      round(hp, rounded_hidden);
      product(rounded_hidden, w[1], qkvp);
      for (int64_t m = m0; m < m1; ++m) {
        float* row = qkvp + m * width;
        if (head_norms) {
          norm_heads_row(row, 0, H, D, w[kWeightsPerLayer].data_ptr<float>(), eps);
          norm_heads_row(row, H, KV, D, w[kWeightsPerLayer + 1].data_ptr<float>(), eps);
        }
        rotate_row(row, H + KV, D, cos + m * D, sin + m * D);
        const int64_t r = row_of[m], i = position_of[m];
        write_cache_row(row, keys + layer * layer_stride, values + layer * layer_stride,
                        slots[r] * slot_stride + (p.starts[r] + i) * D, head_stride, H, KV, D);
        group_queries_row(qp, row, r, i, H, p.Q, D);
      }
      barrier.wait();
      AttentionWork attention = layer0;
      attention.keys = keys + layer * layer_stride;
      attention.values = values + layer * layer_stride;
      attention.run(attention_bounds[part], attention_bounds[part + 1]);
      barrier.wait();
      if (attention.split) {
        const auto [j0, j1] = share_of(attention.R * attention.KV * attention.M, part, parts);
        attention.merge(j0, j1);
        barrier.wait();
      }
      for (int64_t m = m0; m < m1; ++m) ungroup_outputs_row(ap + m * H * D, op, row_of[m], position_of[m], H, p.Q, D);
      round(ap, rounded_heads);
      product(rounded_heads, w[2], pp);
      for (int64_t m = m0; m < m1; ++m)
        add_rms_norm_row(x + m * hidden, pp + m * hidden, w[3].data_ptr<float>(), hp + m * hidden, hidden, eps);
      round(hp, rounded_hidden);
      product(rounded_hidden, w[4], gp);
      for (int64_t m = m0; m < m1; ++m) silu_mul_row(gp + m * 2 * inner, actp + m * inner, inner);
      round(actp, rounded_inner);
      product(rounded_inner, w[5], dp);
    }
    for (int64_t m = m0; m < m1; ++m)
      for (size_t c = 0; c < capture.size(); ++c)
        if (capture[c] == layers - 1) {
          float* row = captured[c].data_ptr<float>() + m * hidden;
          for (int64_t i = 0; i < hidden; ++i) row[i] = x[m * hidden + i] + dp[m * hidden + i];
        }
  }
  return delta;
}

}  // namespace

// x (N, hidden): the residual stream after the embedding, updated in place, the rows' tokens packed (row r's
// counts[r] tokens after the rows before it; N = the sum of counts, so the linears never run on padding).
// weights: six per layer (see kWeightsPerLayer), eight with head_norms. keys, values (layers, slots, KV,
// capacity, D). cos, sin (N, D). limits (R, group * Q) and, for a tree, paths (R, group * Q, width): what query
// (g, i) of row r sees, as the grouped queries of cached_attention, Q the longest row (attention alone runs on
// rows padded to Q). Returns the last layer's output (to be added by the final norm), then x + output of each
// layer in `capture`, in that order.
std::vector<at::Tensor> decoder_layers(at::Tensor x, std::vector<at::Tensor> weights, at::Tensor keys,
                                          at::Tensor values, at::Tensor cos, at::Tensor sin,
                                          at::Tensor slots, c10::IntArrayRef starts, c10::IntArrayRef counts,
                                          at::Tensor limits, c10::optional<at::Tensor> paths, int64_t heads,
                                          int64_t kv_heads, bool head_norms, double eps, c10::IntArrayRef capture) {
  const int64_t per_layer = kWeightsPerLayer + (head_norms ? kHeadNormWeights : 0);
  const int64_t layers = static_cast<int64_t>(weights.size()) / per_layer;
  TORCH_CHECK(layers * per_layer == static_cast<int64_t>(weights.size()),
              "decoder_layers: six weights a layer (eight with head norms)");
  const bool bf16_cache = keys.scalar_type() == at::kBFloat16;
  TORCH_CHECK(keys.size(0) == layers && (bf16_cache || keys.scalar_type() == at::kFloat) &&
                  values.scalar_type() == keys.scalar_type() && keys.is_contiguous() && values.is_contiguous(),
              "decoder_layers: a contiguous float32 or bfloat16 cache with one entry per layer");
  const int64_t R = static_cast<int64_t>(counts.size()), M = x.size(0);
  const int64_t H = heads, KV = kv_heads, D = keys.size(4), group = H / KV, Q = limits.size(1) / group;
  std::vector<int64_t> first(R + 1, 0);  // row r's tokens are rows first[r] .. first[r + 1] - 1 of x
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(1 <= counts[r] && counts[r] <= Q, "decoder_layers: a row holds 1 .. Q tokens");
    first[r + 1] = first[r] + counts[r];
  }
  TORCH_CHECK(R == slots.size(0) && first[R] == M && static_cast<int64_t>(starts.size()) == R,
              "decoder_layers: rows");
  TORCH_CHECK(std::is_sorted(capture.begin(), capture.end()) &&
                  std::all_of(capture.begin(), capture.end(), [&](int64_t c) { return 0 <= c && c < layers; }),
              "decoder_layers: captured layers in increasing order");
  slots = slots.contiguous();
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  const double scale = std::pow(static_cast<double>(D), -0.5);  // as the Python loop computes D ** -0.5
  const c10::optional<at::Tensor> path_starts =
      paths.has_value() ? c10::optional<at::Tensor>(at::tensor(starts.vec(), slots.options())) : c10::nullopt;
  bool team = at::get_num_threads() > 1 && !at::in_parallel_region() && x.is_contiguous() && cos.is_contiguous() &&
              sin.is_contiguous() && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat;
  for (int64_t layer = 0; team && layer < layers; ++layer) {  // qkv, o, gate_up, down: rows of the widths they meet
    const at::Tensor* w = weights.data() + layer * per_layer;
    for (const int64_t i : {1, 2, 4, 5}) team = team && q8_rows_weights(w[i]);
    team = team && w[1].size(1) * 32 == x.size(1) && w[1].size(0) * kQ8GroupRows == (H + 2 * KV) * D &&
           w[2].size(1) * 32 == H * D && w[4].size(1) * 32 == x.size(1) && w[4].size(0) * kQ8GroupRows == 2 * w[5].size(1) * 32;
  }
  if (team) {
    const auto path_entries = paths.has_value() ? paths->contiguous() : at::Tensor();
    Pass pass{x, keys, values, cos, sin, slots, limits.contiguous(), paths.has_value() ? &path_entries : nullptr,
              paths.has_value() ? &*path_starts : nullptr, starts, counts, first, R, M, H, KV, D, group, Q, scale,
              eps};
    std::vector<at::Tensor> captured;
    auto delta = bf16_cache ? team_layers<at::BFloat16>(pass, weights, per_layer, head_norms, capture, captured)
                            : team_layers<float>(pass, weights, per_layer, head_norms, capture, captured);
    captured.insert(captured.begin(), delta);
    return captured;
  }
  auto q = at::zeros({R, KV, group * Q, D}, x.options());  // padded queries stay zero: finite, never read
  auto attended = at::empty({M, H * D}, x.options());
  std::vector<at::Tensor> captured;
  c10::optional<at::Tensor> delta;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const at::Tensor* w = weights.data() + layer * per_layer;
    auto h = add_rms_norm(x, delta, w[0], eps);
    auto qkv = few_rows_linear(h, w[1]);  // (M, (H + 2 KV) D)
    if (head_norms) {
      norm_heads_(qkv, 0, H, D, w[kWeightsPerLayer], eps);
      norm_heads_(qkv, H, KV, D, w[kWeightsPerLayer + 1], eps);
    }
    rotate_(qkv.view({M, -1, D}), H + KV, cos, sin);
    auto layer_keys = keys.select(0, layer), layer_values = values.select(0, layer);
    if (bf16_cache)
      write_cache<at::BFloat16>(qkv, layer_keys, layer_values, slot_ptr, starts, counts, first, H, KV, D);
    else
      write_cache<float>(qkv, layer_keys, layer_values, slot_ptr, starts, counts, first, H, KV, D);
    // query head kv * group + g at position i goes to (kv, g * Q + i): the heads sharing a kv head together
    const float* src = qkv.data_ptr<float>();
    float* qp = q.data_ptr<float>();
    const int64_t width = qkv.size(1);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t i = 0; i < counts[r]; ++i) group_queries_row(qp, src + (first[r] + i) * width, r, i, H, Q, D);
    auto out = cached_attention(q, layer_keys, layer_values, slots, limits, scale, paths,
                                path_starts);  // (R, KV, group * Q, D)
    const float* op = out.data_ptr<float>();
    float* ap = attended.data_ptr<float>();
    for (int64_t r = 0; r < R; ++r)
      for (int64_t i = 0; i < counts[r]; ++i) ungroup_outputs_row(ap + (first[r] + i) * H * D, op, r, i, H, Q, D);
    h = add_rms_norm(x, few_rows_linear(attended, w[2]), w[3], eps);
    auto gate_up = few_rows_linear(h, w[4]);
    delta = few_rows_linear(silu_mul(gate_up), w[5]);
    for (const int64_t c : capture)
      if (c == layer) captured.push_back(x + *delta);
  }
  captured.insert(captured.begin(), *delta);
  return captured;
}

// A block drafter's new context rows into its cache, in one call: features (N, F) of committed tokens, row r's
// counts[r] rows packed after the rows before it, projected by fc (H, F) and normed with `norm` (H) into one
// context vector each, then by kv_weight (layers * 2 * KV * D, H) into every layer's keys and values at once;
// keys RMS-normed per head with k_norms[layer] (none: no head norms), all rotated by cos, sin (N, D), and
// written at entries starts[r] .. starts[r] + counts[r] - 1 of slot slots[r] of keys, values (layers, slots, KV,
// capacity, D). The kernels and their order are those of the Python glue it replaces where the plan runs
// few-rows kernels (drafters/block_kernels.py: the products, add_rms_norm, rotate_, a tensor copy per layer into
// the cache), so the cache gets the same values; the glue cost a drafting round 0.14-0.25 ms (stop 56).
void project_context(at::Tensor features, at::Tensor fc, at::Tensor norm, at::Tensor kv_weight,
                     std::vector<at::Tensor> k_norms, at::Tensor keys, at::Tensor values, at::Tensor cos,
                     at::Tensor sin, at::Tensor slots, c10::IntArrayRef starts, c10::IntArrayRef counts,
                     double eps) {
  const int64_t layers = keys.size(0), KV = keys.size(2), D = keys.size(4), N = features.size(0);
  const bool bf16_cache = keys.scalar_type() == at::kBFloat16;
  TORCH_CHECK(features.dim() == 2 && features.scalar_type() == at::kFloat, "project_context: float32 feature rows");
  TORCH_CHECK((bf16_cache || keys.scalar_type() == at::kFloat) && values.scalar_type() == keys.scalar_type() &&
                  keys.is_contiguous() && values.is_contiguous(),
              "project_context: a contiguous float32 or bfloat16 cache");
  TORCH_CHECK(k_norms.empty() || static_cast<int64_t>(k_norms.size()) == layers, "project_context: a key norm a layer");
  const int64_t R = static_cast<int64_t>(counts.size());
  std::vector<int64_t> first(R + 1, 0);
  for (int64_t r = 0; r < R; ++r) first[r + 1] = first[r] + counts[r];
  TORCH_CHECK(R == slots.size(0) && static_cast<int64_t>(starts.size()) == R && first[R] == N,
              "project_context: rows");
  slots = slots.contiguous();
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  auto context = add_rms_norm(few_rows_linear(features.contiguous(), fc), c10::nullopt, norm, eps);
  auto kv = few_rows_linear(context, kv_weight);  // (N, layers * 2 * KV * D): per layer its keys, then values
  TORCH_CHECK(kv.size(1) == layers * 2 * KV * D, "project_context: kv_weight's outputs");
  auto heads = kv.view({N, layers * 2 * KV, D});
  for (int64_t layer = 0; layer < layers; ++layer) {
    const int64_t at = layer * 2 * KV;  // this layer's first key head among the heads of a row
    if (!k_norms.empty()) norm_heads_(kv, at, KV, D, k_norms[layer], eps);
    rotate_(heads.narrow(1, at, KV), KV, cos, sin);
    auto layer_keys = keys.select(0, layer), layer_values = values.select(0, layer);
    if (bf16_cache)
      write_cache<at::BFloat16>(kv, layer_keys, layer_values, slot_ptr, starts, counts, first, at, KV, D);
    else
      write_cache<float>(kv, layer_keys, layer_values, slot_ptr, starts, counts, first, at, KV, D);
  }
}

TORCH_LIBRARY_FRAGMENT(specdecode, m) {
  m.def(
      "decoder_layers(Tensor(a!) x, Tensor[] weights, Tensor(b!) keys, Tensor(c!) values, Tensor cos, Tensor sin, "
      "Tensor slots, int[] starts, int[] counts, Tensor limits, Tensor? paths, int heads, int kv_heads, bool head_norms, "
      "float eps, "
      "int[] capture) "
      "-> Tensor[]",
      &decoder_layers);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
  m.def(
      "project_context(Tensor features, Tensor fc, Tensor norm, Tensor kv_weight, Tensor[] k_norms, Tensor(a!) keys, "
      "Tensor(b!) values, Tensor cos, Tensor sin, Tensor slots, int[] starts, int[] counts, float eps) -> ()",
      &project_context);
}
