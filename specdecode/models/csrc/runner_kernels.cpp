// The runner's CPU kernels. few_rows_linear:
// y (M, N) = x (M, K) . w (N, K)^T for a few rows M (a decode step, a verify pass, a small batch).
//
// Why: at M <= 16 a linear is a stream over the weights; MKL's small-M paths reach 9-20 GB/s on some of
// the CPUs we run on, a fifth to a third of what plain reads reach. Here a group of weight rows streams
// together and every input row takes the group while it is in cache, so the weights leave memory once
// per pass for any M.
// Every output is summed in the same order whatever M is (lane-wise partial sums along K, then the lanes
// as a fixed tree), so a row's result never depends on the other rows of its pass: a verify pass over k + 1
// positions computes bit for bit what k + 1 one-token steps compute. The tile shape may change with M
// (it only decides which accumulators live together), the order of each sum never does.
// GCC vector extensions: -march=native picks the width (16 floats with AVX-512, else 8). Built with
// -ffp-contract=off, so the compiler never fuses a multiply-add on its own (it did so in some tile shapes
// and not in others, which broke the row independence); where the CPU has FMA it is asked for explicitly.
// bfloat16 weights: where the CPU has AVX512-BF16 the rows are rounded to bfloat16 once and multiplied
// pairwise in hardware (vdpbf16ps: twice the products of a float32 FMA, as llama.cpp's BF16 path does);
// elsewhere the weights are widened exactly to float32 and the rows stay float32.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <type_traits>
#include <vector>

#include "vectors.h"

// The lanes of a partial sum added as a fixed tree (halves, then quarters, ...): the same order for every
// output, and a short chain (a sequential sum of 16 lanes cost more than the 576-long dot product itself).
typedef float v4 __attribute__((vector_size(16)));
static inline float lane_sum(v8 v) {
  const v4 a = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  return (a[0] + a[2]) + (a[1] + a[3]);
}
#if defined(__AVX512F__)
static inline float lane_sum(vf v) {
  return lane_sum(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}

// lane_sum of eight vectors at once, the same tree in vector arithmetic: each step adds the halves of two
// outputs' partial sums in one instruction (eight scalar trees cost as much as a 576-long dot product).
static inline v8 lane_sums8(const vf* a) {
  vf h[4], q[2];
  for (int p = 0; p < 4; ++p)
    h[p] = __builtin_shufflevector(a[2 * p], a[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * p], a[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int p = 0; p < 2; ++p)
    q[p] = __builtin_shufflevector(h[2 * p], h[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(h[2 * p], h[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const vf e = __builtin_shufflevector(q[0], q[1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(q[0], q[1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(e, e, 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(e, e, 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

// out[c] = lane_sum(a[c]) for C partial sums.
template <int C>
static inline void lane_sums(const vf* a, float* out) {
  int c = 0;
#if defined(__AVX512F__)
  for (; c + 8 <= C; c += 8) {
    const v8 r = lane_sums8(a + c);
    __builtin_memcpy(out + c, &r, sizeof(r));
  }
#endif
  for (; c < C; ++c) out[c] = lane_sum(a[c]);
}

// A tile's outputs: each partial sum's lanes, then the K tail past the vector loop (from `tail`), in order.
template <int NB, int MB, typename XT, typename T>
static inline void store_tile(const vf (&acc)[NB][MB], const XT* X, const T* W, float* Y, int64_t m0, int64_t n,
                              int64_t K, int64_t N, int64_t tail) {
  float sums[NB * MB];
  lane_sums<NB * MB>(&acc[0][0], sums);
  for (int j = 0; j < NB; ++j) {
    const T* wr = W + (n + j) * K;
    for (int i = 0; i < MB; ++i) {
      const XT* xr = X + (m0 + i) * K;
      float s = sums[j * MB + i];
      for (int64_t k = tail; k < K; ++k) s += static_cast<float>(xr[k]) * static_cast<float>(wr[k]);
      Y[(m0 + i) * N + n + j] = s;
    }
  }
}

// How a tile asks the caches for the next column's weights (they follow this column's in memory): a column's
// rows are short (576 weights), too short for the hardware to see them as streams.
// - kNone: not at all;
// - kSameOffset: each step asks for the next column's rows at the step's own offset (a column of one tile);
// - kShare: the tile asks for its share of the next column, spread over its steps (a column of several tiles:
//   with kSameOffset memory idled while the later tiles multiplied the column from cache; 8 positions through
//   the model's linears 0.83-0.91x the time, AVX2 Zen 3 EPYC). Each step earns `lines` credits and a line costs
//   `steps` (the tile's own count, set by `begin`): no division in a loop of a few FMAs a step.
enum Ask { kNone, kSameOffset, kShare };

struct Share {
  const char* next;
  int64_t lines, steps = 1, credit = 0;
  inline void begin(int64_t tile_steps) { steps = tile_steps; }
  inline void step() {
    for (credit += lines; credit >= steps; credit -= steps, next += 64) __builtin_prefetch(next);
  }
};

// Input rows m0 .. m0 + MB against weight rows n .. n + NB: NB * MB accumulators, each weight and input
// vector loaded once per step; `share`: the lines to ask for with kShare.
template <int NB, int MB, Ask A, typename T>
__attribute__((noinline)) static void tile(const float* X, const T* W, float* Y, int64_t m0, int64_t n, int64_t K, int64_t N,
                        Share share) {
  const int64_t Kv = K / kLanes * kLanes;
  share.begin(Kv / kLanes);
  vf acc[NB][MB] = {};
  for (int64_t k = 0; k < Kv; k += kLanes) {
    vf w[NB];
    for (int j = 0; j < NB; ++j) w[j] = load_v(W + (n + j) * K + k);
    if constexpr (A == kSameOffset) {
      for (int j = 0; j < NB; ++j) __builtin_prefetch(W + (n + NB + j) * K + k);
    } else if constexpr (A == kShare) {
      share.step();
    }
    for (int i = 0; i < MB; ++i) {
      const vf xv = load_v(X + (m0 + i) * K + k);
      for (int j = 0; j < NB; ++j) acc[j][i] = fma_v(xv, w[j], acc[j][i]);
    }
  }
  store_tile<NB, MB>(acc, X, W, Y, m0, n, K, N, Kv);
}

#if defined(__AVX512BF16__)
// The same tile with bfloat16 rows (X, rounded once per pass) and weights, 32 products per instruction:
// each lane sums its pair of products into its float32 partial sum.
template <int NB, int MB, Ask A>
__attribute__((noinline)) static void tile(const at::BFloat16* X, const at::BFloat16* W, float* Y, int64_t m0, int64_t n, int64_t K,
                        int64_t N, Share share) {
  const int64_t K32 = K / 32 * 32;
  share.begin(K32 / 32);
  vf acc[NB][MB] = {};
  for (int64_t k = 0; k < K32; k += 32) {
    __m512bh w[NB];
    for (int j = 0; j < NB; ++j) w[j] = (__m512bh)_mm512_loadu_si512(W + (n + j) * K + k);
    if constexpr (A == kSameOffset) {
      for (int j = 0; j < NB; ++j) __builtin_prefetch(W + (n + NB + j) * K + k);
    } else if constexpr (A == kShare) {
      share.step();
    }
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(X + (m0 + i) * K + k);
      for (int j = 0; j < NB; ++j) acc[j][i] = (vf)_mm512_dpbf16_ps((__m512)acc[j][i], xv, w[j]);
    }
  }
  store_tile<NB, MB>(acc, X, W, Y, m0, n, K, N, K32);
}
#endif

// GGUF rows: a row of a Q4_1 or Q8_0 matrix is K / 32 blocks of 32 weights. Q4_1: weight t is d * q_t + m, with
// d and m float16 and q_t four bits (the low nibble of byte t for t < 16, else the high nibble of byte t - 16),
// 20 bytes a block. Q8_0: weight t is d * q_t with q_t a signed byte, 34 bytes a block. Here the blocks are
// read as stored and each weight is rebuilt in registers in float32: d * q is exact (11 by 4 or 8 bits), so the
// weight is bit for bit the float32 value the model was converted to, and every output sums the same products
// in the same order as the float32 tile: the same bits as the float32 weights, at any M, for a fifth (Q4_1) or
// a quarter (Q8_0) of the bytes.
struct Q4_1 {
  uint16_t d, m;
  uint8_t q[16];
};
struct Q8_0 {
  uint16_t d;
  int8_t q[32];
};
static_assert(sizeof(Q4_1) == 20 && sizeof(Q8_0) == 34, "GGUF blocks are 20 and 34 bytes");

typedef int32_t i32v __attribute__((vector_size(kLanes * 4)));

// kLanes bytes widened to 32-bit lanes, as unsigned or signed as `Byte` (one vpmovzxbd / vpmovsxbd where the
// compiler would go byte by byte).
template <typename Byte>
static inline i32v widen_bytes(const Byte* p) {
  constexpr bool is_signed = std::is_signed<Byte>::value;
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (i32v)(is_signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (i32v)(is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
#else
  typedef Byte bytes_v __attribute__((vector_size(kLanes)));
  bytes_v bytes;
  __builtin_memcpy(&bytes, p, sizeof(bytes));
  return __builtin_convertvector(bytes, i32v);
#endif
}

// A float16 (its bits) as float32 in every lane: exact, and in hardware where the CPU has F16C.
static inline vf half_splat(uint16_t bits) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(bits)));
#elif defined(__F16C__)
  return (vf)_mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(bits)));
#else
  return vf{} + c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// Weights part * kLanes .. part * kLanes + kLanes - 1 of a block, from its d and m (Q4_1) as float32 vectors.
// d * q + m in one fused multiply-add: d * q is exact, so rounding once is what rounding twice gives.
static inline vf block_weights(const Q4_1& block, int part, vf d, vf m) {
  const i32v q = (widen_bytes(block.q + part * kLanes % 16) >> (part * kLanes / 16 * 4)) & 15;
  return fma_v(d, __builtin_convertvector(q, vf), m);
}

static inline vf block_weights(const Q8_0& block, int part, vf d, vf) {
  return d * __builtin_convertvector(widen_bytes(block.q + part * kLanes), vf);
}

static inline vf block_min(const Q4_1& block) { return half_splat(block.m); }
static inline vf block_min(const Q8_0&) { return vf{}; }

template <int NB, int MB, typename B>
static void block_tile(const float* X, const B* W, float* Y, int64_t m0, int64_t n, int64_t K, int64_t N) {
  const int64_t blocks = K / 32;
  vf acc[NB][MB] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    vf d[NB], m[NB];
    for (int j = 0; j < NB; ++j) {
      const B& block = W[(n + j) * blocks + b];
      d[j] = half_splat(block.d);
      m[j] = block_min(block);
      __builtin_prefetch(&W[(n + NB + j) * blocks + b]);  // the next column, as the float32 tile asks
    }
    for (int part = 0; part < 32 / kLanes; ++part) {
      const int64_t k = b * 32 + part * kLanes;
      vf w[NB];
      for (int j = 0; j < NB; ++j) w[j] = block_weights(W[(n + j) * blocks + b], part, d[j], m[j]);
      for (int i = 0; i < MB; ++i) {
        const vf xv = load_v(X + (m0 + i) * K + k);
        for (int j = 0; j < NB; ++j) acc[j][i] = fma_v(xv, w[j], acc[j][i]);
      }
    }
  }
  store_tile<NB, MB>(acc, X, static_cast<const float*>(nullptr), Y, m0, n, K, N, K);  // K % 32 == 0: no tail
}

template <int NB, int MB, Ask A>
__attribute__((noinline)) static void tile(const float* X, const Q4_1* W, float* Y, int64_t m0, int64_t n, int64_t K,
                                           int64_t N, Share) {
  block_tile<NB, MB>(X, W, Y, m0, n, K, N);
}

template <int NB, int MB, Ask A>
__attribute__((noinline)) static void tile(const float* X, const Q8_0* W, float* Y, int64_t m0, int64_t n, int64_t K,
                                           int64_t N, Share) {
  block_tile<NB, MB>(X, W, Y, m0, n, K, N);
}

// One tile of exactly `rows` input rows (1 .. MB) from m0.
template <int NB, int MB, Ask A, typename X, typename T>
static inline void tile_of(int64_t rows, const X* x, const T* W, float* Y, int64_t m0, int64_t n, int64_t K, int64_t N,
                           Share share) {
  if constexpr (MB > 1) {
    if (rows < MB) return tile_of<NB, MB - 1, A>(rows, x, W, Y, m0, n, K, N, share);
  }
  tile<NB, MB, A>(x, W, Y, m0, n, K, N, share);
}

// Input rows 0 .. M - 1 against weight rows n .. n + NB, in near-equal tiles of at most MB rows (a remainder
// tile of one row would run on NB dependent chains, too few to hide the FMA latency).
template <int NB, int MB, bool Prefetch, typename X, typename T>
static inline void column(const X* x, const T* W, float* Y, int64_t n, int64_t M, int64_t K, int64_t N) {
  const int64_t tiles = (M + MB - 1) / MB;
  if (tiles == 1) return tile_of<NB, MB, Prefetch ? kSameOffset : kNone>(M, x, W, Y, 0, n, K, N, Share{});
  const int64_t lines = Prefetch && n + NB < N ? NB * K * static_cast<int64_t>(sizeof(T)) / 64 : 0;
  const char* next = lines ? reinterpret_cast<const char*>(W + (n + NB) * K) : nullptr;
  for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
    const int64_t rows = (M - m0) / (tiles - t), first = t * lines / tiles, last = (t + 1) * lines / tiles;
    tile_of<NB, MB, Prefetch ? kShare : kNone>(rows, x, W, Y, m0, n, K, N, Share{next + first * 64, last - first});
    m0 += rows;
  }
}

template <int NB, int MB, bool Prefetch, typename X, typename T>
static void linear(const X* x, const T* W, float* Y, int64_t M, int64_t K, int64_t N) {
  at::parallel_for(0, (N + NB - 1) / NB, 16, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n = c * NB;
      if (n + NB <= N) {
        column<NB, MB, Prefetch>(x, W, Y, n, M, K, N);
      } else {
        for (int64_t r = n; r < N; ++r) column<1, MB, Prefetch>(x, W, Y, r, M, K, N);
      }
    }
  });
}

// The tile shape per row count, measured over the model's own linears (Zen 4 EPYC with AVX-512, Zen 3 with AVX2;
// A/B in one process, interleaved, medians):
// - one row: one weight row at a time, so the weights are read front to back as one stream (eight rows in
//   flight read ~half as fast: eight short streams of 576 weights each), asking for the next row as it goes
//   (Zen 3: 0.89-0.92x the time of the hardware's prefetch alone);
// - two to four rows: still one weight row, taken by every input row of the tile at once. Each partial sum
//   is one chain of dependent FMAs along K, so a tile needs several chains to hide the FMA latency: with 8
//   float lanes (AVX2) a row's chain is 72 FMAs long, and two rows one after the other cost 1.4-1.7x one
//   row where one 1 x 2 tile costs ~1.0x (Zen 3: two rows 0.56-0.68x, three 0.64-0.86x the time of the
//   earlier 1 x 1 and 1 x 2 + 1 x 1 tiles). Native bfloat16 products take two input rows at a time, in two
//   passes over the row (in cache for the second): the model's linears at four rows 15.7-16.1 -> 11.0-11.6 ms
//   (fastest of 16 interleaved sweeps) against one 1 x 4 tile with prefetch, which float32 arithmetic keeps;
// - more: the arithmetic binds, and a tile of NB weight rows x MB input rows shares every load among several
//   products: NB = 2 for native bfloat16 products; for float32 arithmetic 4 x 4 where AVX-512 has 32 vector
//   registers, 2 x 6 with AVX2's 16 (4 x 4 accumulators, 4 weights and an input spilled there; Zen 3: 6 to 16
//   rows 0.67-0.90x the time).
// The tile never changes the order of any one sum, so every shape computes the same bits.
template <typename X> struct MidTile { static constexpr int MB = 4; static constexpr bool prefetch = true; };
template <> struct MidTile<at::BFloat16> { static constexpr int MB = 2; static constexpr bool prefetch = false; };
template <typename X> struct WideTile { static constexpr int NB = kLanes == 16 ? 4 : 2, MB = kLanes == 16 ? 4 : 6; };
template <> struct WideTile<at::BFloat16> { static constexpr int NB = 2, MB = 4; };

template <typename X, typename T>
static void linear_by_rows(const X* x, const T* W, float* Y, int64_t M, int64_t K, int64_t N) {
  if (M == 1) {
    linear<1, 1, true>(x, W, Y, M, K, N);
  } else if (M <= 4) {
    linear<1, MidTile<X>::MB, MidTile<X>::prefetch>(x, W, Y, M, K, N);
  } else {
    linear<WideTile<X>::NB, WideTile<X>::MB, true>(x, W, Y, M, K, N);
  }
}

// GGUF rows: four weight rows at a time at one input row (four chains of FMAs), 2 x 4 tiles up to four rows,
// then one weight row against up to 8 input rows (each rebuilt weight vector serves the whole tile).
template <typename B>
static void block_linear(const float* x, const B* W, float* Y, int64_t M, int64_t K, int64_t N) {
  if (M == 1) {
    linear<4, 1, false>(x, W, Y, M, K, N);
  } else if (M <= 4) {
    linear<2, 4, false>(x, W, Y, M, K, N);
  } else {
    linear<1, 8, false>(x, W, Y, M, K, N);
  }
}

#if defined(__AVX512BF16__)
// bfloat16 weights packed in panels (models/linear.py `pack_panels`): (N / 64, K / 2, 128), where group g, pair
// j holds outputs 64 g .. 64 g + 63 as four vectors of 16 outputs x (k = 2 j, 2 j + 1). A tile keeps 4 x MT
// accumulators of 16 outputs each and, per pair, loads 256 contiguous bytes of weights and broadcasts each
// row's pair: no lane sums at the end, every weight load serves MT rows, and a thread's weights are one
// sequential stream. Each output is one accumulator summed pair by pair from k = 0 whatever M and the tile
// are, so a row's result never depends on the other rows of its pass.
constexpr int64_t kPanelOutputs = 64;

// Rows 0 .. MT - 1 of X (and Y) against G consecutive groups from P: 4 G MT accumulators of 16 outputs each.
// `ahead` (or null): this tile's share of the next group's weights, `ahead_lines` 64-byte lines asked of the
// caches along the way. Whatever G is, each output is summed pair by pair from k = 0.
// G > 1 serves one or two rows: one group gives them 4 or 8 chains of products, too few to hide the vdpbf16ps
// latency. On a Zen 4 EPYC a one-row pass streamed its weights at 38 GB/s against 41-44 at 2-4 rows; two groups at
// a time made the model's one-row linears 2-10% faster, four another 2-6%, and two rows two groups at a time 1-5%
// (three rows: mixed, the LM head 3-5% slower; interleaved A/Bs).
template <int MT, int G>
static inline void panel_groups(const uint32_t* X, const at::BFloat16* P, float* Y, int64_t n0, int64_t K2, int64_t N,
                                const char* ahead = nullptr, int64_t ahead_lines = 0) {
  __m512 acc[G][MT][4];
  for (int g = 0; g < G; ++g)
    for (int m = 0; m < MT; ++m)
      for (int p = 0; p < 4; ++p) acc[g][m][p] = _mm512_setzero_ps();
  int64_t asked = 0;
  for (int64_t j = 0; j < K2; ++j) {
    if (ahead != nullptr) {
      for (const int64_t due = (j + 1) * ahead_lines / K2; asked < due; ++asked)
        _mm_prefetch(ahead + asked * 64, _MM_HINT_T1);
    }
    for (int g = 0; g < G; ++g) {
      __m512bh w[4];
      for (int p = 0; p < 4; ++p) w[p] = (__m512bh)_mm512_loadu_si512(P + g * K2 * 128 + j * 128 + p * 32);
      for (int m = 0; m < MT; ++m) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(X[m * K2 + j]));
        for (int p = 0; p < 4; ++p) acc[g][m][p] = _mm512_dpbf16_ps(acc[g][m][p], xb, w[p]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int m = 0; m < MT; ++m)
      for (int p = 0; p < 4; ++p) _mm512_storeu_ps(Y + m * N + n0 + g * kPanelOutputs + p * 16, acc[g][m][p]);
}

// Rows 0 .. MT - 1 (one tile) against groups g0 .. g1 - 1, G at a time, then the rest one by one.
template <int MT, int G>
static inline void panel_span(const uint32_t* X, const at::BFloat16* P, float* Y, int64_t g0, int64_t g1, int64_t K2,
                              int64_t N) {
  int64_t g = g0;
  for (; g + G <= g1; g += G) panel_groups<MT, G>(X, P + g * K2 * 128, Y, g * kPanelOutputs, K2, N);
  for (; g < g1; ++g) panel_groups<MT, 1>(X, P + g * K2 * 128, Y, g * kPanelOutputs, K2, N);
}

static inline void panel_rows(const uint32_t* X, const at::BFloat16* P, float* Y, int64_t m0, int64_t rows,
                              int64_t n0, int64_t K2, int64_t N, const char* ahead, int64_t ahead_lines) {
  X += m0 * K2;
  Y += m0 * N;
  switch (rows) {
    case 1: return panel_groups<1, 1>(X, P, Y, n0, K2, N, ahead, ahead_lines);
    case 2: return panel_groups<2, 1>(X, P, Y, n0, K2, N, ahead, ahead_lines);
    case 3: return panel_groups<3, 1>(X, P, Y, n0, K2, N, ahead, ahead_lines);
    case 4: return panel_groups<4, 1>(X, P, Y, n0, K2, N, ahead, ahead_lines);
    case 5: return panel_groups<5, 1>(X, P, Y, n0, K2, N, ahead, ahead_lines);
    case 6: return panel_groups<6, 1>(X, P, Y, n0, K2, N, ahead, ahead_lines);
    case 7: return panel_groups<7, 1>(X, P, Y, n0, K2, N, ahead, ahead_lines);
    default: return panel_groups<8, 1>(X, P, Y, n0, K2, N, ahead, ahead_lines);
  }
}

// n floats rounded to bfloat16 (c10's nearest even, as x.to(torch.bfloat16) rounds), packed in pairs. An ATen
// conversion per linear cost ~1-2 us of dispatch and allocation, 122 of them a one-token pass.
static std::vector<uint32_t> bfloat16_pairs(const float* x, int64_t n) {
  std::vector<uint32_t> pairs((n + 1) / 2);
  auto* halves = reinterpret_cast<uint16_t*>(pairs.data());
  for (int64_t i = 0; i < n; ++i) halves[i] = c10::BFloat16(x[i]).x;
  return pairs;
}

// From nine rows, rows split into near-equal tiles of at most six (24 accumulators + 4 weight vectors fit the 32
// registers); a group's weights come from memory for the first tile and from cache for the others. Measured on a Zen 4
// EPYC (2 cores, 233 G products/s of vdpbf16ps at peak): 160-180 G/s at 4-16 rows on a 3072 x 576 matrix;
// the model's linears at 8 rows cost 1.1-1.3x one row (the row-layout tiles: 1.5-2x).
// Seven and eight rows (a block drafter's block, a verify pass of six or seven drafts) take one tile all the
// same: their 28 and 32 accumulators do not all fit and the compiler keeps some in L1, yet a whole pass at 7
// positions measured 12.3 -> 11.6 ms (128 cached tokens) and 14.6 -> 13.5 ms (512) against a 4 + 3 split, and
// at 8 positions 11.15 -> 10.41, 12.62 -> 11.79 and 14.02 -> 13.27 ms (128 / 512 / 1,024) against 4 + 4, the
// model's linears alone 1.12-1.25x faster (Zen 4 EPYC, interleaved, medians of 20-25; the same bits). At 12
// and 16 rows two tiles of 8 tied and lost (0.90-0.95x) against tiles of at most six.
// With more than one tile, memory would idle while the later tiles multiply from cache, so every tile asks
// for its share of the next group's weights as it goes: a whole pass at 8 positions 21.1 -> 18.6 ms, 16
// positions 29.7 -> 26.8 ms (one position 12.1 ms either way; interleaved, 300 cached tokens, Zen 4 EPYC).
// One tile (up to eight rows) streams well on the hardware's own prefetch; asking ahead there measured slower.
static at::Tensor panel_linear(at::Tensor x, at::Tensor panels) {
  const int64_t M = x.size(0), groups = panels.size(0), K2 = panels.size(1), N = groups * kPanelOutputs;
  TORCH_CHECK(x.size(1) == 2 * K2 && panels.size(2) == 128 && panels.is_contiguous(), "few_rows_linear: panels");
  const std::vector<uint32_t> rows = bfloat16_pairs(x.data_ptr<float>(), M * 2 * K2);  // once per pass
  const uint32_t* X = rows.data();
  const at::BFloat16* P = panels.data_ptr<at::BFloat16>();
  auto y = at::empty({M, N}, x.options());
  float* Y = y.data_ptr<float>();
  const int64_t tiles = M <= 8 ? 1 : (M + 5) / 6;
  if (M <= 2) {
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      if (M == 1) panel_span<1, 4>(X, P, Y, g0, g1, K2, N);
      else panel_span<2, 2>(X, P, Y, g0, g1, K2, N);
    });
    return y;
  }
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const char* next = tiles > 1 && g + 1 < g1 ? reinterpret_cast<const char*>(P + (g + 1) * K2 * 128) : nullptr;
      const int64_t lines = K2 * 4;  // 256 bytes of weights a step
      int64_t m0 = 0;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t count = (M - m0) / (tiles - t), first = t * lines / tiles, last = (t + 1) * lines / tiles;
        panel_rows(X, P + g * K2 * 128, Y, m0, count, g * kPanelOutputs, K2, N, next ? next + first * 64 : nullptr,
                   last - first);
        m0 += count;
      }
    }
  });
  return y;
}
#endif

at::Tensor q8_rows_linear(at::Tensor x, at::Tensor w);  // csrc/q8_rows.cpp

bool bfloat16_panels() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// x float32; w float32 or bfloat16 (N, K), bfloat16 panels (see panel_linear), GGUF rows, or interleaved Q4_1 or
// Q8_0 groups (uint8, three dimensions: csrc/q8_rows.cpp, where x is rounded to 8 bits); y float32.
at::Tensor few_rows_linear(at::Tensor x, at::Tensor w) {
  if (w.dim() == 3 && w.scalar_type() == at::kByte) return q8_rows_linear(x, w);
#if defined(__AVX512BF16__)
  if (w.dim() == 3) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && w.scalar_type() == at::kBFloat16,
                "few_rows_linear: float32 rows, bfloat16 panels");
    return panel_linear(x.contiguous(), w);
  }
#endif
  if (w.scalar_type() == at::kByte) {  // GGUF rows: the row width tells Q4_1 from Q8_0
    const int64_t K = x.dim() == 2 ? x.size(1) : 0, width = w.dim() == 2 ? w.size(1) : -1;
    const bool q4_1 = width == K / 32 * static_cast<int64_t>(sizeof(Q4_1));
    TORCH_CHECK(x.scalar_type() == at::kFloat && K % 32 == 0 && w.is_contiguous() &&
                    (q4_1 || width == K / 32 * static_cast<int64_t>(sizeof(Q8_0))),
                "few_rows_linear: float32 x (M, K), Q4_1 or Q8_0 blocks w (N, K / 32 * 20 or 34)");
    x = x.contiguous();
    auto y = at::empty({x.size(0), w.size(0)}, x.options());
    const uint8_t* blocks = w.data_ptr<uint8_t>();
    if (q4_1)
      block_linear(x.data_ptr<float>(), reinterpret_cast<const Q4_1*>(blocks), y.data_ptr<float>(), x.size(0), K,
                   w.size(0));
    else
      block_linear(x.data_ptr<float>(), reinterpret_cast<const Q8_0*>(blocks), y.data_ptr<float>(), x.size(0), K,
                   w.size(0));
    return y;
  }
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "few_rows_linear: x (M, K), w (N, K)");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "few_rows_linear: float32 inputs");
  TORCH_CHECK(w.is_contiguous(), "few_rows_linear: w must be contiguous");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  if (w.scalar_type() == at::kBFloat16) {
#if defined(__AVX512BF16__)
    const auto rows = x.to(at::kBFloat16);  // round to nearest even, once per pass
    linear_by_rows(rows.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), y.data_ptr<float>(), M, K, N);
#else
    linear_by_rows(x.data_ptr<float>(), w.data_ptr<at::BFloat16>(), y.data_ptr<float>(), M, K, N);
#endif
  } else {
    TORCH_CHECK(w.scalar_type() == at::kFloat, "few_rows_linear: float32 or bfloat16 weights");
    linear_by_rows(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), M, K, N);
  }
  return y;
}

// The small ops between the linears: at a few rows each is microseconds of math, but a chain of stock ops
// (upcast, square, mean, rsqrt, multiply; slice, negate, concatenate) costs tens of microseconds in
// dispatch, and a pass runs 60 norms and 30 rotations. One loop each, over float32 rows.

// out[0..n) = in / rms(in) * weight; in and out may be the same row.
void rms_norm_row(const float* in, float* out, const float* weight, int64_t n, float eps) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += in[i] * in[i];
  const float scale = 1.f / std::sqrt(sum / n + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = in[i] * scale * weight[i];
}

void add_rms_norm_row(float* residual, const float* delta, const float* weight, float* out, int64_t n, float eps) {
  if (delta)
    for (int64_t i = 0; i < n; ++i) residual[i] += delta[i];
  rms_norm_row(residual, out, weight, n, eps);
}

// residual (M, H) += delta (when given); returns residual / rms(residual) * weight.
at::Tensor add_rms_norm(at::Tensor residual, c10::optional<at::Tensor> delta, at::Tensor weight,
                           double eps) {
  TORCH_CHECK(residual.is_contiguous() && residual.scalar_type() == at::kFloat, "add_rms_norm: float32 rows");
  const int64_t H = residual.size(-1), M = residual.numel() / H;
  float* r = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  at::Tensor d;
  if (delta) d = delta->contiguous();
  const float* dp = delta ? d.data_ptr<float>() : nullptr;
  auto out = at::empty_like(residual);
  float* o = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    add_rms_norm_row(r + m * H, dp ? dp + m * H : nullptr, w, o + m * H, H, static_cast<float>(eps));
  return out;
}

void rotate_row(float* row, int64_t heads, int64_t D, const float* c, const float* s) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = row + h * D;
    for (int64_t i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      v[i] = a * c[i] - b * s[i];
      v[i + half] = b * c[i + half] + a * s[i + half];
    }
  }
}

// Rotates, in place, the first `heads` heads of every token of x (N, all_heads, D) by its angles:
// x * cos + rotate_half(x) * sin, with cos and sin (N, D) and rotate_half(x) = [-x2, x1].
void rotate_(at::Tensor x, int64_t heads, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.stride(2) == 1 && x.stride(1) == x.size(2), "rotate_: float32");
  const int64_t N = x.size(0), D = x.size(2), stride = x.stride(0);
  cos = cos.contiguous();
  sin = sin.contiguous();
  float* base = x.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n)
    rotate_row(base + n * stride, heads, D, cos.data_ptr<float>() + n * D, sin.data_ptr<float>() + n * D);
}

TORCH_LIBRARY(specdecode, m) {
  m.def("few_rows_linear(Tensor x, Tensor w) -> Tensor", &few_rows_linear);
  m.def("bfloat16_panels() -> bool", &bfloat16_panels);
  m.def("add_rms_norm(Tensor(a!) residual, Tensor? delta, Tensor weight, float eps) -> Tensor", &add_rms_norm);
  m.def("rotate_(Tensor(a!) x, int heads, Tensor cos, Tensor sin) -> ()", &rotate_);
}
