// parts.h: kernels that split their work into parts any thread may run, for callers that keep one team of
// threads for a whole pass (decoder_layers.cpp) instead of forking one per kernel call.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <utility>
#include <vector>

// Input rows rounded to 8 bits block by block (csrc/q8_rows.cpp): d_x, d_x * sum(q) and sum(q) of every block of 32.
struct Q8Scale {
  float d, s;
  int32_t sum;
};

// Weight rows per interleaved group of the 8-bit-input kernel: one vector of 32-bit lanes, a row each (csrc/q8_rows.cpp).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int64_t kQ8GroupRows = 16;
#else
constexpr int64_t kQ8GroupRows = 8;
#endif

struct Q8Inputs {
  std::vector<int8_t> q;        // (M, K)
  std::vector<Q8Scale> scales;  // (M, K / 32)
  int64_t M = 0, K = 0;
  void size_for(int64_t rows, int64_t width) {  // M rows of K inputs, the buffers grown where they are short
    M = rows;
    K = width;
    if (q.size() < static_cast<size_t>(M * K)) q.resize(M * K);
    if (scales.size() < static_cast<size_t>(M * K / 32)) scales.resize(M * K / 32);
  }
};

// True where w is interleaved Q4_1 or Q8_0 groups (N / G, K / 32, 20 G or 34 G), G = kQ8GroupRows, and this build
// has the kernel.
bool q8_rows_weights(const at::Tensor& w);
// Rounds x (M, K) into `in`, reusing its buffers.
void q8_round_inputs(const float* x, int64_t M, int64_t K, Q8Inputs& in);
// Rounds rows m0 .. m1 - 1 of x (in.M, in.K) into `in`, sized for them (`size_for`).
void q8_round_rows(const float* x, int64_t m0, int64_t m1, Q8Inputs& in);
// Groups g0 .. g1 - 1 of kQ8GroupRows output columns of y (M, N) = rounded rows . w^T; each output is computed the same
// way whichever part holds it.
void q8_rows_groups(const Q8Inputs& in, const at::Tensor& w, float* y, int64_t g0, int64_t g1);

// Each query's softmax over each chunk of its entries before they are joined: the maximum score, the total of
// exp(score - maximum) and the values weighted so (D each), query q's chunk c at q * chunks + c.
struct Partials {
  float *best, *total, *acc;
};

// One cached_attention call (csrc/cached_attention.cpp) with its checks done: items 0 .. items - 1, each a
// (row, kv head, share of its queries), attended by `run(begin, end)` into `out`; or, `split`, each a chunk of
// such a share's entries, into `part`, and then `merge(begin, end)` joins the chunks of queries begin .. end - 1
// (of R * KV * M) into `out`.
struct AttentionWork {
  const float* q;
  const void* keys;
  const void* values;
  bool bf16;
  const int64_t *slots, *limits, *paths, *starts;
  float* out;
  Partials part;
  int64_t R, KV, M, D, slot_stride, head_stride, width;
  float scale;
  int64_t chunks;
  bool split;
  int64_t shares, per_share, items;
  void run(int64_t begin, int64_t end) const;
  void merge(int64_t begin, int64_t end) const;
  // Where each of `parts` threads' items begin (parts + 1 bounds): about as many cached entries each to attend,
  // where the items' count split one request at 1,024 cached tokens (4 chunks of 256 entries and one of 8 a kv
  // head) as 7 whole chunks against 5, and one thread waited ~1 ms of a 9 ms pass over 8 positions.
  std::vector<int64_t> bounds(int64_t parts) const;
};

// q (R, KV, M, D) float32 contiguous; keys, values a layer's cache; slots (R), limits (R, M), paths (R, M, width)
// and starts (R) contiguous int64 (paths null for chains); out like q; `partials` (float32) resized to hold the
// chunks' partial results. Checks what cached_attention checks.
AttentionWork attention_work(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                             const at::Tensor& slots, const at::Tensor& limits, double scale,
                             const at::Tensor* paths, const at::Tensor* starts, at::Tensor& out,
                             at::Tensor& partials);

// A barrier for a team of threads that meets hundreds of times a pass: a spinning counter costs ~0.25 us where
// an OpenMP barrier costs ~0.6 us and a fork and join of the team ~2 us (2-core EPYC).
class SpinBarrier {
 public:
  void reset(int threads) { threads_ = threads; }  // before any thread waits
  void wait() {
    const int phase = phase_.load(std::memory_order_relaxed);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == threads_ - 1) {
      count_.store(0, std::memory_order_relaxed);
      phase_.store(phase + 1, std::memory_order_release);
      return;
    }
    while (phase_.load(std::memory_order_acquire) == phase) {
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    }
  }

 private:
  int threads_ = 1;
  alignas(64) std::atomic<int> count_{0};
  alignas(64) std::atomic<int> phase_{0};
};

// Part `part` of `parts` of the range [0, n), as at::parallel_for splits it.
inline std::pair<int64_t, int64_t> share_of(int64_t n, int64_t part, int64_t parts) {
  const int64_t chunk = (n + parts - 1) / parts, begin = std::min(n, part * chunk);
  return {begin, std::min(n, begin + chunk)};
}

// One row's kernels (csrc/runner_kernels.cpp, csrc/decoder_layers.cpp), which the whole-tensor ops run row by row.
void rms_norm_row(const float* in, float* out, const float* weight, int64_t n, float eps);
// residual += delta (when not null), then out = residual / rms(residual) * weight.
void add_rms_norm_row(float* residual, const float* delta, const float* weight, float* out, int64_t n, float eps);
// Rotates the first `heads` heads (D values each) of one token's row in place by its angles cos c and sin s (D).
void rotate_row(float* row, int64_t heads, int64_t D, const float* c, const float* s);
// out (n) = silu(gate) * up of one row [gate | up] (2 n).
void silu_mul_row(const float* gate_up, float* out, int64_t n);
