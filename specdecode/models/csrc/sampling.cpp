// tempered_softmax and sample_index: the target's distribution p = softmax(z / t) of logit rows, and one draw
// from a row of weights by inverting its CDF at a given uniform number; greedy_tokens: each logit row's argmax;
// block_verify: block verification of a sampled chain, from p and q to the kept drafts and the token after them.
//
// Why: every sampled token (normal decoding at T > 0, a verify round's last token, each row of a batched step)
// draws from a 49k-entry distribution. In ATen the two-level CDF (block sums, their CDF, a scan of one block)
// is ~8 dispatched ops: 0.07 ms warm and 0.14-0.22 ms right after a target pass on a 2-core EPYC, ~3% of a
// one-token step, and once per row of a batch. Here it is one pass over the weights and a scan of one block.
// The softmax before it (a division, then ATen's softmax) took another 0.16-0.24 ms right after a pass.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <tuple>
#include <vector>

#include "vectors.h"

namespace {

constexpr int64_t kBlock = 256;  // entries of one CDF block
constexpr int64_t kChunk = 512;  // entries of the softmax whose exponentials are summed in float lanes
constexpr float kUnderflow = -87.f;  // below it exp8 clamps; exp is then under float's smallest normal: 0 here, so a
                                     // token whose logit is -inf (or far below the best) has p = 0 and is never drawn

// The float64 sum of n floats in four interleaved chains (independent additions the CPU overlaps).
double block_sum(const float* p, int64_t n) {
  double a = 0, b = 0, c = 0, d = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    a += p[i];
    b += p[i + 1];
    c += p[i + 2];
    d += p[i + 3];
  }
  for (; i < n; ++i) a += p[i];
  return (a + b) + (c + d);
}

}  // namespace

// The index i whose CDF step [F(i - 1), F(i)) holds u * total, for weights (n) >= 0 with a positive total and u
// in [0, 1): the block whose cumulative block sum first passes the target, then the entry inside it. A zero weight
// is never drawn (its step is empty); where rounding leaves the target at or past a total (u close to 1), the
// last entry of nonzero weight of that block (or of the row) is drawn.
int64_t sample_row(const float* p, int64_t n, double u) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<double> cdf(blocks);
  double total = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    total += block_sum(p + b * kBlock, std::min(kBlock, n - b * kBlock));
    cdf[b] = total;
  }
  const double target = u * total;
  int64_t block = 0;
  while (block < blocks && cdf[block] <= target) ++block;
  if (block == blocks) {  // the target rounded up to the total: the last block of nonzero weight
    block = blocks - 1;
    while (block > 0 && cdf[block] == cdf[block - 1]) --block;
  }
  const int64_t first = block * kBlock, end = std::min(first + kBlock, n);
  const double rest = target - (block > 0 ? cdf[block - 1] : 0.0);
  double run = 0;
  int64_t last = first;  // the block's last entry of nonzero weight so far
  for (int64_t i = first; i < end; ++i) {
    if (p[i] > 0) last = i;
    run += p[i];
    if (run > rest) return i;  // the first step past `rest`: never an empty one
  }
  return last;  // `rest` reached the block's own total, which rounds apart from its interleaved sum
}

// sample_row of a 1-D float32 CPU tensor.
int64_t sample_index(at::Tensor weights, double u) {
  TORCH_CHECK(weights.dim() == 1 && weights.scalar_type() == at::kFloat && weights.device().is_cpu(),
              "sample_index: a 1-D float32 CPU tensor");
  TORCH_CHECK(weights.numel() > 0, "sample_index: no weights");
  weights = weights.contiguous();
  return sample_row(weights.data_ptr<float>(), weights.numel(), u);
}

// The index of row z's largest entry (n > 0), as torch.argmax gives it: the first of equal largest entries, and the
// first NaN where there is one. Eight lanes each keep their largest entry and its first index, then the lanes meet.
// Why: ATen's argmax reads a 49k-entry row at ~2.3 GB/s on a 2-core EPYC (87 us a row): 1.5% of a one-token step
// and ~3% of a verify pass over 8 positions, whose every row it reads at temperature 0.
int64_t argmax_row(const float* z, int64_t n) {
  typedef int32_t i8v __attribute__((vector_size(32)));
  v8 tops = splat(-INFINITY);
  i8v where{}, lane{0, 1, 2, 3, 4, 5, 6, 7};
  i8v nan{};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    v8 x;
    std::memcpy(&x, z + i, sizeof(x));
    const i8v above = x > tops;  // strictly: a lane keeps its first index of equal entries
    tops = above ? x : tops;
    where = above ? lane : where;
    nan |= x != x;
    lane += 8;
  }
  float top = -INFINITY;
  int64_t best = 0;
  bool any_nan = false;
  for (int l = 0; l < 8; ++l) {
    any_nan |= nan[l] != 0;
    if (tops[l] > top || (tops[l] == top && where[l] < best)) top = tops[l], best = where[l];
  }
  if (any_nan) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(z[j])) return j;
  }
  for (; i < n; ++i) {
    if (std::isnan(z[i])) return i;
    if (z[i] > top) top = z[i], best = i;
  }
  return best;
}

// softmax(z / t) of one row of n logits into out: the largest z / t, then exp(z / t - max) summed in eight lanes
// (exp8: relative error ~2e-7), then each entry divided by the sum. A row's result does not depend on the rows
// beside it or on the number of threads.
void tempered_softmax_row(const float* z, float* out, int64_t n, float t) {
  v8 tops = splat(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    v8 x;
    std::memcpy(&x, z + i, sizeof(x));
    x = x / splat(t);
    std::memcpy(out + i, &x, sizeof(x));
    tops = x > tops ? x : tops;
  }
  float top = -INFINITY;
  for (int lane = 0; lane < 8; ++lane) top = std::max(top, tops[lane]);
  for (; i < n; ++i) top = std::max(top, out[i] = z[i] / t);
  double sum = 0.0;  // of the chunks' lane sums: a float chain over 49k entries drifted 7e-6 from the total
  for (i = 0; i + 8 <= n;) {
    v8 sums{};
    for (const int64_t end = std::min(n, i + kChunk); i + 8 <= end; i += 8) {
      v8 x;
      std::memcpy(&x, out + i, sizeof(x));
      x -= splat(top);
      x = x < splat(kUnderflow) ? splat(0.f) : exp8(x);
      std::memcpy(out + i, &x, sizeof(x));
      sums += x;
    }
    for (int lane = 0; lane < 8; ++lane) sum += sums[lane];
  }
  for (; i < n; ++i) sum += (out[i] = out[i] - top < kUnderflow ? 0.f : exp1(out[i] - top));
  const float scale = static_cast<float>(1.0 / sum);
  for (i = 0; i < n; ++i) out[i] *= scale;
}

// p = softmax(logits / t) over the last dimension of float32 logits (..., V), t > 0; rows on the threads.
at::Tensor tempered_softmax(at::Tensor logits, double temperature) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.device().is_cpu() && logits.dim() >= 1,
              "tempered_softmax: float32 CPU logits");
  TORCH_CHECK(temperature > 0, "tempered_softmax: a temperature > 0");
  logits = logits.contiguous();
  auto out = at::empty_like(logits);
  const int64_t V = logits.size(-1), R = V ? logits.numel() / V : 0;
  const float* z = logits.data_ptr<float>();
  float* p = out.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) tempered_softmax_row(z + r * V, p + r * V, V, static_cast<float>(temperature));
  });
  return out;
}

// Each row's argmax over the last dimension of float32 logits (..., V): int64 (...); rows on the threads.
at::Tensor greedy_tokens(at::Tensor logits) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.device().is_cpu() && logits.dim() >= 1 &&
                  logits.size(-1) > 0,
              "greedy_tokens: float32 CPU logits with a nonempty last dimension");
  TORCH_CHECK(logits.size(-1) < INT32_MAX, "greedy_tokens: rows of fewer than 2^31 entries");
  logits = logits.contiguous();
  const int64_t V = logits.size(-1), R = logits.numel() / V;
  auto out = at::empty(logits.sizes().slice(0, logits.dim() - 1), logits.options().dtype(at::kLong));
  const float* z = logits.data_ptr<float>();
  int64_t* tokens = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 2, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) tokens[r] = argmax_row(z + r * V, V);
  });
  return out;
}

// Block verification of k >= 1 drafts (verify.py `verify_block`, Sun et al. 2025), one call from the target's
// probabilities to the kept count tau and the token drawn after them: w_0 = 1, w_i = min(1, w_{i-1} p_i(x_i) /
// q_i(x_i)); r_i = sum_x max(0, w_i p_{i+1}(x) - q_{i+1}(x)) (one-hot q: w_i (1 - p_{i+1}(x_{i+1}))); the block up
// to draft i kept with h_i = r_i / (r_i + 1 - w_i), h_k = w_k; tau the longest kept block, drawn at u_tau from
// P(tau = t) = h_t prod_{s > t} (1 - h_s); then the token from p_{k+1} (tau = k) or from the residual
// max(0, w_tau p_{tau+1} - q_{tau+1}) at u_token. The weights, the law of tau and its draw are the Python's, in
// float64; the masses r_i and the residual are float32 products summed in float64 (the Python sums them in
// float32 through ATen), so the two agree to float32 rounding. Why: in ATen the same steps are ~20 dispatched
// ops, 0.41 ms of a ~6.7 ms round at T = 1 right after a target pass on a 2-core EPYC.
// target_probs (k + 1 or more, V) float32; draft_tokens (k) int64 target ids; draft_probs (k, N) float32, the q
// each draft was drawn from (none: deterministic drafts); support (N) int64, the increasing target ids of q's
// columns (none: N = V).
std::tuple<int64_t, int64_t> block_verify(at::Tensor target_probs, at::Tensor draft_tokens,
                                          c10::optional<at::Tensor> draft_probs,
                                          c10::optional<at::Tensor> support, double u_tau, double u_token) {
  const int64_t k = draft_tokens.numel();
  TORCH_CHECK(target_probs.dim() == 2 && target_probs.scalar_type() == at::kFloat && target_probs.device().is_cpu() &&
                  draft_tokens.scalar_type() == at::kLong && k >= 1 && target_probs.size(0) > k,
              "block_verify: float32 CPU probabilities (k + 1, V) and k >= 1 int64 drafts");
  target_probs = target_probs.contiguous();
  draft_tokens = draft_tokens.contiguous();
  const int64_t V = target_probs.size(1);
  const float* P = target_probs.data_ptr<float>();
  const int64_t* x = draft_tokens.data_ptr<int64_t>();
  const auto in_vocabulary = [V](int64_t t) { return 0 <= t && t < V; };
  TORCH_CHECK(std::all_of(x, x + k, in_vocabulary), "block_verify: a draft outside the vocabulary");
  at::Tensor q_rows, columns;
  const float* Q = nullptr;
  const int64_t* S = nullptr;
  int64_t N = V;
  if (draft_probs) {
    q_rows = draft_probs->contiguous();
    TORCH_CHECK(q_rows.dim() == 2 && q_rows.size(0) >= k && q_rows.scalar_type() == at::kFloat,
                "block_verify: float32 draft probabilities (k, N)");
    N = q_rows.size(1);
    Q = q_rows.data_ptr<float>();
    if (support) {
      columns = support->contiguous();
      TORCH_CHECK(columns.scalar_type() == at::kLong && columns.numel() == N, "block_verify: a support of N int64 ids");
      S = columns.data_ptr<int64_t>();
      TORCH_CHECK(std::all_of(S, S + N, in_vocabulary), "block_verify: a support id outside the vocabulary");
    } else {
      TORCH_CHECK(N == V, "block_verify: q over the whole vocabulary without a support");
    }
  }
  const auto column = [&](int64_t token) -> int64_t {  // where q holds a draft (its place in the support)
    if (!S) return token;
    const int64_t at = std::lower_bound(S, S + N, token) - S;
    TORCH_CHECK(at < N && S[at] == token, "block_verify: a draft outside q's support");
    return at;
  };
  std::vector<double> weights(k + 1, 1.0), masses(k, 0.0);
  for (int64_t i = 0; i < k; ++i) {
    const double p = P[i * V + x[i]], q = Q ? Q[i * N + column(x[i])] : 1.0;
    weights[i + 1] = q > 0 ? std::min(1.0, weights[i] * p / q) : 0.0;
  }
  for (int64_t i = 1; i < k; ++i) {  // r_i over row i of p and of q
    if (!Q) {
      masses[i] = weights[i] * (1 - static_cast<double>(P[i * V + x[i]]));
      continue;
    }
    const float w = static_cast<float>(weights[i]);
    const float *p = P + i * V, *q = Q + i * N;
    double mass = 0, covered = 0;
    for (int64_t j = 0; j < N; ++j) {
      const float pj = p[S ? S[j] : j];
      mass += std::max(0.f, w * pj - q[j]);
      covered += pj;
    }
    if (S) mass += w * std::max(0.0, 1 - covered);  // off q's support max(0, w p - 0): w times p's mass there
    masses[i] = mass;
  }
  std::vector<double> keep(k + 1), stops(k + 1);
  keep[0] = 1;  // h_0: the empty block is always kept
  for (int64_t i = 1; i < k; ++i) {
    const double free = masses[i] + 1 - weights[i];
    keep[i] = free > 0 ? masses[i] / free : 1.0;  // free = 0 only where tau = i cannot happen
  }
  keep[k] = weights[k];
  double later_fail = 1;
  for (int64_t t = k; t >= 0; --t) {
    stops[t] = keep[t] * later_fail;
    later_fail *= 1 - keep[t];
  }
  std::vector<double> cdf(k + 1);  // tau: the first CDF step above u_tau times the total (`sample_weights`)
  std::partial_sum(stops.begin(), stops.end(), cdf.begin());
  int64_t tau = std::upper_bound(cdf.begin(), cdf.end(), u_tau * cdf[k]) - cdf.begin();
  if (tau == k + 1)  // u rounded up to the total: the last nonzero weight
    for (tau = k; tau > 0 && !(stops[tau] > 0); --tau) {
    }
  const float* p = P + tau * V;
  if (tau == k) return {tau, sample_row(p, V, u_token)};
  // max(0, w p - q): w p less min(w p, q), in the calling thread's buffer (every entry written below; a fresh
  // vector a round would allocate and zero 49k floats only to overwrite them)
  thread_local std::vector<float> residual;
  residual.resize(V);
  const float w = static_cast<float>(weights[tau]);
  for (int64_t j = 0; j < V; ++j) residual[j] = p[j] * w;
  if (!Q) {
    residual[x[tau]] = 0;  // w p(x) - 1 <= 0 at the one-hot draft
  } else {
    const float* q = Q + tau * N;
    for (int64_t j = 0; j < N; ++j) {
      float& r = residual[S ? S[j] : j];
      r -= std::min(r, q[j]);
    }
  }
  if (!(block_sum(residual.data(), V) > 0)) return {tau, sample_row(p, V, u_token)};  // only through rounding, w p == q
  return {tau, sample_row(residual.data(), V, u_token)};
}

TORCH_LIBRARY_FRAGMENT(specdecode, m) {
  m.def("greedy_tokens(Tensor logits) -> Tensor", &greedy_tokens);
  m.def("sample_index(Tensor weights, float u) -> int", &sample_index);
  m.def("tempered_softmax(Tensor logits, float temperature) -> Tensor", &tempered_softmax);
  m.def(
      "block_verify(Tensor target_probs, Tensor draft_tokens, Tensor? draft_probs, Tensor? support, float u_tau, "
      "float u_token) -> (int, int)",
      &block_verify);
}
