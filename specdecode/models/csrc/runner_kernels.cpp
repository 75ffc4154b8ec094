// The runner's CPU kernels. few_rows_linear:
// y (M, N) = x (M, K) . w (N, K)^T for a few rows M (a decode step, a verify pass, a small batch).
//
// Why: at M <= 16 a linear is a stream over the weights; MKL's small-M paths reach 9-20 GB/s on some of
// the CPUs we run on, a fifth to a third of what plain reads reach. Here a group of weight rows streams
// together and every input row takes the group while it is in cache, so the weights leave memory once
// per pass for any M.
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

// Eight bfloat16 weights widened to float32: a bfloat16 is the top half of a float32, so the widening is
// exact and costs a shift; the weights stream at half the bytes, the arithmetic stays float32.
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
static inline v8 load8(const at::BFloat16* p) {
  u16x8 half;
  __builtin_memcpy(&half, p, sizeof(half));
  const u32x8 wide = __builtin_convertvector(half, u32x8) << 16;
  v8 v;
  __builtin_memcpy(&v, &wide, sizeof(v));
  return v;
}

static inline float lane_sum(v8 v) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

// Input rows m0 .. m0 + MB against weight rows n .. n + NB: NB * MB accumulators, each weight and input
// vector loaded once per step.
template <int NB, int MB, typename T>
static inline void tile(const float* X, const T* W, float* Y, int64_t m0, int64_t n, int64_t K, int64_t N) {
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
      const T* wr = W + (n + j) * K;
      float s = lane_sum(acc[j][i]);
      for (int64_t k = K8; k < K; ++k) s += xr[k] * static_cast<float>(wr[k]);
      Y[(m0 + i) * N + n + j] = s;
    }
  }
}

// Every input row against weight rows n .. n + NB, MB (<= 4) rows at a time.
template <int NB, int MB, typename T>
static inline void column(const float* X, const T* W, float* Y, int64_t n, int64_t M, int64_t K, int64_t N) {
  int64_t m0 = 0;
  for (; m0 + MB <= M; m0 += MB) tile<NB, MB>(X, W, Y, m0, n, K, N);
  switch (M - m0) {
    case 3: tile<NB, 3>(X, W, Y, m0, n, K, N); break;
    case 2: tile<NB, 2>(X, W, Y, m0, n, K, N); break;
    case 1: tile<NB, 1>(X, W, Y, m0, n, K, N); break;
    default: break;
  }
}

// The tile shape per weight dtype, measured on an AVX2 EPYC at 1-8 rows: float32 weights stream fastest as
// eight rows at once against one input row (more streams in flight; the group, tens of KB, is still in
// cache for the next input row), 12-24% faster than 3 x 4; bfloat16 weights are bound by their widening,
// which 3 weight rows x 4 input rows amortizes over the inputs.
template <typename T> struct Tile { static constexpr int NB = 8, MB = 1; };
template <> struct Tile<at::BFloat16> { static constexpr int NB = 3, MB = 4; };

template <typename T>
static void linear(const float* X, const T* W, float* Y, int64_t M, int64_t K, int64_t N) {
  constexpr int NB = Tile<T>::NB, MB = Tile<T>::MB;
  at::parallel_for(0, (N + NB - 1) / NB, 16, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n = c * NB;
      if (n + NB <= N) {
        column<NB, MB>(X, W, Y, n, M, K, N);
      } else {
        for (int64_t r = n; r < N; ++r) column<1, MB>(X, W, Y, r, M, K, N);
      }
    }
  });
}

// x float32; w float32 or bfloat16 (widened on the fly); y float32.
torch::Tensor few_rows_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "few_rows_linear: x (M, K), w (N, K)");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "few_rows_linear: float32 inputs");
  TORCH_CHECK(w.is_contiguous(), "few_rows_linear: w must be contiguous");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (w.scalar_type() == at::kBFloat16) {
    linear(x.data_ptr<float>(), w.data_ptr<at::BFloat16>(), y.data_ptr<float>(), M, K, N);
  } else {
    TORCH_CHECK(w.scalar_type() == at::kFloat, "few_rows_linear: float32 or bfloat16 weights");
    linear(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), M, K, N);
  }
  return y;
}

// The small ops between the linears: at a few rows each is microseconds of math, but a chain of stock ops
// (upcast, square, mean, rsqrt, multiply; slice, negate, concatenate) costs tens of microseconds in
// dispatch, and a pass runs 60 norms and 30 rotations. One loop each, over float32 rows.

// residual (M, H) += delta (when given); returns residual / rms(residual) * weight.
torch::Tensor add_rms_norm(torch::Tensor residual, c10::optional<torch::Tensor> delta, torch::Tensor weight,
                           double eps) {
  TORCH_CHECK(residual.is_contiguous() && residual.scalar_type() == at::kFloat, "add_rms_norm: float32 rows");
  const int64_t H = residual.size(-1), M = residual.numel() / H;
  float* r = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  torch::Tensor d;
  if (delta) d = delta->contiguous();
  const float* dp = delta ? d.data_ptr<float>() : nullptr;
  auto out = torch::empty_like(residual);
  float* o = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    float* row = r + m * H;
    float sum = 0.f;
    for (int64_t i = 0; i < H; ++i) {
      if (dp) row[i] += dp[m * H + i];
      sum += row[i] * row[i];
    }
    const float scale = 1.f / std::sqrt(sum / H + static_cast<float>(eps));
    for (int64_t i = 0; i < H; ++i) o[m * H + i] = row[i] * scale * w[i];
  }
  return out;
}

// Rotates, in place, the first `heads` heads of every token of x (N, all_heads, D) by its angles:
// x * cos + rotate_half(x) * sin, with cos and sin (N, D) and rotate_half(x) = [-x2, x1].
void rotate_(torch::Tensor x, int64_t heads, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.stride(2) == 1 && x.stride(1) == x.size(2), "rotate_: float32");
  const int64_t N = x.size(0), D = x.size(2), half = D / 2, stride = x.stride(0);
  cos = cos.contiguous();
  sin = sin.contiguous();
  float* base = x.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    const float* cn = c + n * D;
    const float* sn = s + n * D;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = base + n * stride + h * D;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * cn[i] - b * sn[i];
        v[i + half] = b * cn[i + half] + a * sn[i + half];
      }
    }
  }
}

TORCH_LIBRARY(specdecode, m) {
  m.def("few_rows_linear(Tensor x, Tensor w) -> Tensor", &few_rows_linear);
  m.def("add_rms_norm(Tensor(a!) residual, Tensor? delta, Tensor weight, float eps) -> Tensor", &add_rms_norm);
  m.def("rotate_(Tensor(a!) x, int heads, Tensor cos, Tensor sin) -> ()", &rotate_);
}
