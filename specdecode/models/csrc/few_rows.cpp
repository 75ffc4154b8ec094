// y (M, N) = x (M, K) . w (N, K)^T for a few rows M (a decode step, a verify pass, a small batch).
//
// Why: at M <= 16 a linear is a stream over the weights; MKL's small-M paths reach 9-20 GB/s on some of
// the CPUs we run on, a fifth to a third of what plain reads reach. Here each pair of weight rows is
// loaded once and multiplied into every input row, so the weights stream at memory speed for any M.
// Every output is summed in the same order whatever M is (8-lane partial sums along K, then the lanes
// in order), so a row's result never depends on the other rows of its pass: a verify pass over k + 1
// positions computes bit for bit what k + 1 one-token steps compute.
// GCC vector extensions: -march=native picks AVX2, AVX-512 or NEON on the machine. Built with
// -ffp-contract=off, so the compiler never fuses a multiply-add on its own (it did so in some tile shapes
// and not in others, which broke the row independence); where the CPU has FMA it is asked for explicitly.
#include <torch/extension.h>
#include <ATen/Parallel.h>

typedef float v8 __attribute__((vector_size(32)));

#if defined(__FMA__)
#include <immintrin.h>
static inline v8 fma8(v8 a, v8 b, v8 c) { return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#else
static inline v8 fma8(v8 a, v8 b, v8 c) { return a * b + c; }
#endif

static inline v8 load8(const float* p) {
  v8 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

static inline float lane_sum(v8 v) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

// Input rows m0 .. m0 + MB against weight rows n .. n + NB: NB * MB accumulators, each weight and input
// vector loaded once per step (3 x 4 uses 12 of the 16 AVX2 registers for sums, 4 for operands).
template <int NB, int MB>
static inline void tile(const float* X, const float* W, float* Y, int64_t m0, int64_t n, int64_t K, int64_t N) {
  const int64_t K8 = K / 8 * 8;
  v8 acc[NB][MB] = {};
  for (int64_t k = 0; k < K8; k += 8) {
    v8 w[NB];
    for (int j = 0; j < NB; ++j) w[j] = load8(W + (n + j) * K + k);
    for (int i = 0; i < MB; ++i) {
      const v8 xv = load8(X + (m0 + i) * K + k);
      for (int j = 0; j < NB; ++j) acc[j][i] = fma8(xv, w[j], acc[j][i]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    const float* xr = X + (m0 + i) * K;
    for (int j = 0; j < NB; ++j) {
      const float* wr = W + (n + j) * K;
      float s = lane_sum(acc[j][i]);
      for (int64_t k = K8; k < K; ++k) s += xr[k] * wr[k];
      Y[(m0 + i) * N + n + j] = s;
    }
  }
}

// Every input row against weight rows n .. n + NB.
template <int NB>
static inline void column(const float* X, const float* W, float* Y, int64_t n, int64_t M, int64_t K, int64_t N) {
  int64_t m0 = 0;
  for (; m0 + 4 <= M; m0 += 4) tile<NB, 4>(X, W, Y, m0, n, K, N);
  switch (M - m0) {
    case 3: tile<NB, 3>(X, W, Y, m0, n, K, N); break;
    case 2: tile<NB, 2>(X, W, Y, m0, n, K, N); break;
    case 1: tile<NB, 1>(X, W, Y, m0, n, K, N); break;
    default: break;
  }
}

torch::Tensor few_rows_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "few_rows_linear: x (M, K), w (N, K)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "few_rows_linear: float32 only");
  TORCH_CHECK(w.is_contiguous(), "few_rows_linear: w must be contiguous");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* X = x.data_ptr<float>();
  const float* W = w.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  constexpr int64_t NB = 3;
  at::parallel_for(0, (N + NB - 1) / NB, 16, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n = c * NB;
      switch (std::min<int64_t>(NB, N - n)) {
        case 3: column<3>(X, W, Y, n, M, K, N); break;
        case 2: column<2>(X, W, Y, n, M, K, N); break;
        default: column<1>(X, W, Y, n, M, K, N); break;
      }
    }
  });
  return y;
}

TORCH_LIBRARY(specdecode, m) { m.def("few_rows_linear(Tensor x, Tensor w) -> Tensor", &few_rows_linear); }
