// cached_attention: the attention of a pass's few queries per row over that row's KV-cache slot.
//
// Why: in a batched decode step every row attends over its own slot of the cache. Stock SDPA needs the
// rows' keys and values gathered into one tensor first (a copy of the whole cache, every layer: 132 ms a
// layer for 64 rows of 1024 entries on a 2-core EPYC) and then ran at ~2.5 GB/s. Here each (row, kv head)
// reads its slot in place, once, for all the queries that share that kv head (grouped-query attention
// without expanding the keys), so the step streams the cache at memory speed.
// Row r's query m sees cache entries 0 .. limits[r][m] - 1: a causal chain or a batch of chains; or, in a
// tree, the cached prefix and then the entries of its ancestors and itself (`paths`). Other masks stay on SDPA.
// Every query is computed on its own, in the same order whatever the other queries and rows are, so a
// row's result never depends on its batch: a verify pass over k + 1 positions attends bit for bit like
// k + 1 one-token steps. A slot is attended in chunks of 256 entries, and a query's chunks are joined in order;
// where a call's (row, kv head) pairs are too few for the threads, each chunk is its own work item: one request's
// three pairs then keep both threads of a 2-core machine busy, each reading its entries once (they split the
// pair's queries instead, and each share read the whole slot: attention over 1,024 cached tokens 3.7 -> 2.4 ms,
// 30 layers, Zen 3 EPYC).
// The cache holds float32 or bfloat16 entries (half the bytes a step streams); a bfloat16 entry is widened
// exactly (a 16-bit shift) as it is loaded, and every product and sum runs in float32 as before. Where the
// CPU has native bfloat16 dot products (AVX512-BF16), attention over a bfloat16 cache multiplies in pairs: the
// scores take the queries rounded to bfloat16, as the linears take their rows, and the value sums the softmax
// weights rounded to bfloat16, two keys per instruction (`paired scores`, `paired value sums` below).
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "parts.h"
#include "vectors.h"

namespace {

constexpr int64_t kBlock = 64;  // keys scored at once per query before their softmax weights are applied
constexpr int64_t kChunk = 4 * kBlock;  // entries of a slot one work item attends over (`AttentionWork::merge`)
constexpr int64_t kTile = 3;    // queries that see the same keys and share each key and value load
constexpr int kSlices = 4;      // vectors of a head each tile query keeps in registers

inline v8 load8(const float* p) {
  v8 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, v8 v) { __builtin_memcpy(p, &v, sizeof(v)); }

// Eight bfloat16 entries (their bits) widened to float32.
inline v8 load8(const uint16_t* p) { return widen_bits<v8, h8, u8>(p); }

#if defined(__FMA__)
inline v8 fma8(v8 a, v8 b, v8 c) { return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#else
inline v8 fma8(v8 a, v8 b, v8 c) { return a * b + c; }
#endif

typedef float v4 __attribute__((vector_size(16)));

// The eight lanes of a partial dot product added as a fixed tree: (0+4, 1+5, 2+6, 3+7), then pairs two apart,
// then the last two. dots8 computes the same tree for eight keys at once.
inline float lane_sum(v8 v) {
  const v4 a = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  return (a[0] + a[2]) + (a[1] + a[3]);
}

#if defined(__AVX512F__)
// With AVX-512 a head is read 32 dimensions at a time as two 16-lane vectors (half the multiply-adds of 8
// lanes), and the two halves of a dot product's partial sums are added first: every query still gets one
// fixed order.
typedef float v16 __attribute__((vector_size(64)));
inline v16 load16(const float* p) {
  v16 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
inline void store16(float* p, v16 v) { __builtin_memcpy(p, &v, sizeof(v)); }
inline v16 fma16(v16 a, v16 b, v16 c) { return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
inline v8 halves(v16 v) {
  return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
}
// 32 dimensions of an entry. float: dimensions 0-15, then 16-31. bfloat16: the even dimensions, then the odd
// ones: one load, a shift and a mask (each 32-bit lane holds an even and an odd entry; its high half read as a
// float is the odd one exactly), where widening in order costs a shuffle per 16. Queries and value sums that
// meet bfloat16 entries are kept in that order (`split` in `attend`) and put back at the end.
inline void load32(const float* p, v16& lo, v16& hi) {
  lo = load16(p);
  hi = load16(p + 16);
}
inline void load32(const uint16_t* p, v16& lo, v16& hi) {
  const __m512i bits = _mm512_loadu_si512(p);
  lo = (v16)_mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
  hi = (v16)_mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
constexpr bool kWide = true;
#else
constexpr bool kWide = false;
#endif

#if defined(__AVX512BF16__)
// Paired scores: a bfloat16 query (rounded to nearest even once per call) against bfloat16 keys, 32 dimensions
// per instruction (vdpbf16ps), each lane adding the products of a pair of dimensions (2i, 2i + 1) to its float32
// partial sum. Widening the keys and two float32 multiply-adds per 32 dimensions took four instructions; the
// scores were half of a long context's attention, bound by multiply-adds (stop 43). The partial sums then meet
// the same lane trees as the float32 path, and every query still sums in one fixed order.
constexpr bool kPairedScores = true;
inline v16 add_pairs(v16 acc, const uint16_t* q, const uint16_t* k) {
  return (v16)_mm512_dpbf16_ps((__m512)acc, (__m512bh)_mm512_loadu_si512(q), (__m512bh)_mm512_loadu_si512(k));
}
#else
constexpr bool kPairedScores = false;
#endif

// Whether a head of D dimensions is read 32 at a time (else 8 at a time, in order, widening bfloat16 entries
// one by one), and so whether bfloat16 entries meet queries and sums in the split order.
inline bool wide(int64_t D) { return kWide && D % 32 == 0; }

// The partial sums (eight lanes) of the dot product of a query and an entry (float or bfloat16 bits).
template <typename Entry>
inline v8 partial_dot(const float* q, const Entry* k, int64_t D) {
#if defined(__AVX512F__)
  if (wide(D)) {
    v16 acc = {}, lo, hi;
    for (int64_t d = 0; d < D; d += 32) {
      load32(k + d, lo, hi);
      acc = fma16(load16(q + d), lo, acc);
      acc = fma16(load16(q + d + 16), hi, acc);
    }
    return halves(acc);
  }
#endif
  v8 acc = splat(0.f);
  for (int64_t d = 0; d < D; d += 8) acc = fma8(load8(q + d), load8(k + d), acc);
  return acc;
}

#if defined(__AVX512BF16__)
inline v8 partial_dot(const uint16_t* q, const uint16_t* k, int64_t D) {
  v16 acc = {};
  for (int64_t d = 0; d < D; d += 32) acc = add_pairs(acc, q + d, k + d);
  return halves(acc);
}
#endif

template <typename Query, typename Entry>
inline float dot(const Query* q, const Entry* k, int64_t D) {
  return lane_sum(partial_dot(q, k, D));
}

// Inlined without asking: GCC compiled lane_sums8 and softmax_block as calls, 27% of a 24-query pass's samples
// (calls and spills around them); forced inline, attention over one row's cache ran 8-18% faster (stop 46).
#define ALWAYS_INLINE __attribute__((always_inline)) inline

// The lane trees of eight partial sums (lane_sum of each) as one transposition: eight values.
ALWAYS_INLINE v8 lane_sums8(const v8* acc) {
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

// dot(q, k_i) for eight consecutive keys, bit for bit what `dot` gives each, with the eight lane trees done
// as one transposition (a sequential lane sum per key cost more than the products). A head size known when
// compiling (FixedD: 64 or 128) unrolls the loop over dimensions: the score part of attention at 24 queries
// (Zen 3, AVX2) ~13% faster, 3 queries ~5-10%.
template <int64_t FixedD = 0, typename Entry>
inline v8 dots8(const float* q, const Entry* k, int64_t D) {
  if constexpr (FixedD > 0) D = FixedD;
  v8 acc[8];
#if defined(__AVX512F__)
  if (wide(D)) {
    v16 sums[8] = {}, lo, hi;
    for (int64_t d = 0; d < D; d += 32) {
      const v16 q_lo = load16(q + d), q_hi = load16(q + d + 16);
      for (int i = 0; i < 8; ++i) {
        load32(k + i * D + d, lo, hi);
        sums[i] = fma16(q_hi, hi, fma16(q_lo, lo, sums[i]));
      }
    }
    for (int i = 0; i < 8; ++i) acc[i] = halves(sums[i]);
  } else
#endif
  {
    for (int i = 0; i < 8; ++i) acc[i] = splat(0.f);
    for (int64_t d = 0; d < D; d += 8) {
      const v8 qd = load8(q + d);
      for (int i = 0; i < 8; ++i) acc[i] = fma8(qd, load8(k + i * D + d), acc[i]);
    }
  }
  return lane_sums8(acc);
}

#if defined(__AVX512BF16__)
// dots8 for T queries with paired scores: each key's line loaded once for the tile, each query's sums as alone
// (the same partial sums `partial_dot` gives each key, the same lane trees). Head sizes 64 and 128 unroll the
// loop over dimensions (its counter and branch were a third of the loop's instructions at D = 64).
template <int T, int64_t FixedD = 0>
inline void dots8_tile(const uint16_t* q, const uint16_t* k, int64_t D, v8* out) {
  if constexpr (FixedD == 0) {
    if (D == 64) return dots8_tile<T, 64>(q, k, D, out);
    if (D == 128) return dots8_tile<T, 128>(q, k, D, out);
  } else {
    D = FixedD;
  }
  v8 acc[T][8];
  for (int i = 0; i < 8; ++i) {
    v16 sums[T] = {};
    for (int64_t d = 0; d < D; d += 32) {
      const __m512bh key = (__m512bh)_mm512_loadu_si512(k + i * D + d);
      for (int t = 0; t < T; ++t)
        sums[t] = (v16)_mm512_dpbf16_ps((__m512)sums[t], (__m512bh)_mm512_loadu_si512(q + t * D + d), key);
    }
    for (int t = 0; t < T; ++t) acc[t][i] = halves(sums[t]);
  }
  for (int t = 0; t < T; ++t) out[t] = lane_sums8(acc[t]);
}

// dots8 with paired scores: a tile of one query.
inline v8 dots8(const uint16_t* q, const uint16_t* k, int64_t D) {
  v8 out;
  dots8_tile<1>(q, k, D, &out);
  return out;
}
#endif

#if defined(__AVX512F__)
// dots8 for T queries (T rows of D floats) at once on the 32-wide path: each key's entries are loaded and
// widened once for the whole tile, and every query's sums take the very multiply-adds, in the same order,
// that dots8 gives it alone.
template <int T, typename Entry>
inline void dots8_tile(const float* q, const Entry* k, int64_t D, v8* out) {
  v8 acc[T][8];
  for (int i = 0; i < 8; ++i) {
    v16 sums[T] = {}, lo, hi;
    for (int64_t d = 0; d < D; d += 32) {
      load32(k + i * D + d, lo, hi);
      for (int t = 0; t < T; ++t)
        sums[t] = fma16(load16(q + t * D + d + 16), hi, fma16(load16(q + t * D + d), lo, sums[t]));
    }
    for (int t = 0; t < T; ++t) acc[t][i] = halves(sums[t]);
  }
  for (int t = 0; t < T; ++t) out[t] = lane_sums8(acc[t]);
}
#endif

// acc (D floats) += sum over b of weights[b] * v[b]: for head sizes 64 and 128 the accumulator stays in
// registers over the block's keys. Each dimension sums the same products in the same order whatever the
// path (the values' order only decides where a dimension sits).
template <int64_t D, typename Entry>
inline void add_weighted_fixed(float* acc, const Entry* v, const float* weights, int64_t visible) {
#if defined(__AVX512F__)
  constexpr int64_t S = D / 16;
  v16 slices[S];
  for (int64_t i = 0; i < S; ++i) slices[i] = load16(acc + 16 * i);
  for (int64_t b = 0; b < visible; ++b) {
    const v16 w = v16{} + weights[b];  // weights are exp() values >= 0: adding to zero copies them
    for (int64_t i = 0; i < S; i += 2) {
      v16 lo, hi;
      load32(v + b * D + 16 * i, lo, hi);
      slices[i] = fma16(w, lo, slices[i]);
      slices[i + 1] = fma16(w, hi, slices[i + 1]);
    }
  }
  for (int64_t i = 0; i < S; ++i) store16(acc + 16 * i, slices[i]);
#else
  constexpr int64_t S = D / 8;
  v8 slices[S];
  for (int64_t i = 0; i < S; ++i) slices[i] = load8(acc + 8 * i);
  for (int64_t b = 0; b < visible; ++b) {
    const v8 w = splat(weights[b]);
    for (int64_t i = 0; i < S; ++i) slices[i] = fma8(w, load8(v + b * D + 8 * i), slices[i]);
  }
  for (int64_t i = 0; i < S; ++i) store8(acc + 8 * i, slices[i]);
#endif
}

template <typename Entry>
inline void add_weighted(float* acc, const Entry* v, const float* weights, int64_t visible, int64_t D) {
  if (D == 64) return add_weighted_fixed<64>(acc, v, weights, visible);
  if (D == 128) return add_weighted_fixed<128>(acc, v, weights, visible);
  for (int64_t b = 0; b < visible; ++b) {
#if defined(__AVX512F__)
    if (wide(D)) {
      const v16 w16 = v16{} + weights[b];
      for (int64_t d = 0; d < D; d += 32) {
        v16 lo, hi;
        load32(v + b * D + d, lo, hi);
        store16(acc + d, fma16(w16, lo, load16(acc + d)));
        store16(acc + d + 16, fma16(w16, hi, load16(acc + d + 16)));
      }
      continue;
    }
#endif
    const v8 w = splat(weights[b]);
    for (int64_t d = 0; d < D; d += 8) store8(acc + d, fma8(w, load8(v + b * D + d), load8(acc + d)));
  }
}

// The vector arithmetic of the weighted-sum tiles: 8 lanes, a value's slice read in order, or (AVX-512) 16
// lanes, a value read 32 dimensions at a time as two vectors (`load32`, the split order for bfloat16 entries).
struct Lanes8 {
  typedef v8 V;
  static constexpr int kWidth = 8, kPerLoad = 1;
  static V load(const float* p) { return load8(p); }
  static void store(float* p, V x) { store8(p, x); }
  static V fma(V a, V b, V c) { return fma8(a, b, c); }
  static V broadcast(float x) { return splat(x); }
  template <typename Entry>
  static void load_values(const Entry* p, V* out) { out[0] = load8(p); }
};

#if defined(__AVX512F__)
struct Lanes16 {
  typedef v16 V;
  static constexpr int kWidth = 16, kPerLoad = 2;
  static V load(const float* p) { return load16(p); }
  static void store(float* p, V x) { store16(p, x); }
  static V fma(V a, V b, V c) { return fma16(a, b, c); }
  static V broadcast(float x) { return V{} + x; }
  template <typename Entry>
  static void load_values(const Entry* p, V* out) { load32(p, out[0], out[1]); }
};
#endif

// A tile of T queries' weighted sums over one block (acc: T rows of D floats; weights: T rows), S vectors of
// dimensions from d0: the queries share each load (and widening) of a value, and S T chains of multiply-adds
// hide their latency where one query's did not. Each dimension of each query sums the same products in the
// same order as `add_weighted`.
template <typename L, int T, int S, typename Entry>
inline void add_weighted_slices(float* acc, const Entry* v, const float (*weights)[kBlock], int64_t visible,
                                int64_t D, int64_t d0) {
  typename L::V sums[T][S];
  for (int t = 0; t < T; ++t)
    for (int s = 0; s < S; ++s) sums[t][s] = L::load(acc + t * D + d0 + L::kWidth * s);
  for (int64_t b = 0; b < visible; ++b) {
    typename L::V values[S];
    for (int s = 0; s < S; s += L::kPerLoad) L::load_values(v + b * D + d0 + L::kWidth * s, values + s);
    for (int t = 0; t < T; ++t) {
      const typename L::V w = L::broadcast(weights[t][b]);
      for (int s = 0; s < S; ++s) sums[t][s] = L::fma(w, values[s], sums[t][s]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int s = 0; s < S; ++s) L::store(acc + t * D + d0 + L::kWidth * s, sums[t][s]);
}

// The tile over a whole head: slices of kSlices vectors, then the rest (8 lanes: one vector at a time; 16 lanes:
// D is a multiple of 32, so two).
template <typename L, int T, typename Entry>
inline void add_weighted_tile(float* acc, const Entry* v, const float (*weights)[kBlock], int64_t visible,
                              int64_t D) {
  constexpr int kRest = L::kPerLoad;
  int64_t d0 = 0;
  for (; d0 + L::kWidth * kSlices <= D; d0 += L::kWidth * kSlices)
    add_weighted_slices<L, T, kSlices>(acc, v, weights, visible, D, d0);
  for (; d0 < D; d0 += L::kWidth * kRest) add_weighted_slices<L, T, kRest>(acc, v, weights, visible, D, d0);
}

#if defined(__AVX512BF16__)
// Paired value sums, with paired scores: keys b and b + 1 multiplied in one vdpbf16ps, their bfloat16 values
// interleaved dimension by dimension (unpacklo / unpackhi of the two entries: per 128-bit lane, dimensions 0-3
// then 4-7 of each 8, `pair_index`) against their two weights, side by side in `weights` as bfloat16
// (`softmax_block_paired`: one 32-bit broadcast a pair). A tile of T queries over S vectors of 16 dimensions
// from d0; a lone last key is paired with itself at weight 0. Each query's sums are the same whatever its tile.
template <int T, int S>
inline void add_pairs_slices(float* acc, const uint16_t* v, const uint16_t (*weights)[kBlock], int64_t visible,
                             int64_t D, int64_t d0) {
  v16 sums[T][S];
  for (int t = 0; t < T; ++t)
    for (int s = 0; s < S; ++s) sums[t][s] = load16(acc + t * D + d0 + 16 * s);
  for (int64_t b = 0; b < visible; b += 2) {
    const bool lone = b + 1 == visible;
    const uint16_t* first = v + b * D + d0;
    const uint16_t* second = lone ? first : first + D;
    __m512i values[S];
    for (int s = 0; s < S; s += 2) {
      const __m512i x = _mm512_loadu_si512(first + 16 * s), y = _mm512_loadu_si512(second + 16 * s);
      values[s] = _mm512_unpacklo_epi16(x, y);
      values[s + 1] = _mm512_unpackhi_epi16(x, y);
    }
    for (int t = 0; t < T; ++t) {
      int32_t pair;  // weights b and b + 1 (past `visible`: 0)
      __builtin_memcpy(&pair, &weights[t][b], sizeof(pair));
      const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
      for (int s = 0; s < S; ++s)
        sums[t][s] = (v16)_mm512_dpbf16_ps((__m512)sums[t][s], (__m512bh)values[s], w);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int s = 0; s < S; ++s) store16(acc + t * D + d0 + 16 * s, sums[t][s]);
}

template <int T>
inline void add_pairs_tile(float* acc, const uint16_t* v, const uint16_t (*weights)[kBlock], int64_t visible,
                           int64_t D) {
  int64_t d0 = 0;
  for (; d0 + 16 * kSlices <= D; d0 += 16 * kSlices) add_pairs_slices<T, kSlices>(acc, v, weights, visible, D, d0);
  for (; d0 < D; d0 += 32) add_pairs_slices<T, 2>(acc, v, weights, visible, D, d0);
}
#endif

#if defined(__AVX512F__)
// A tile's value sums on the 32-wide path: paired where the scores were (bfloat16 queries, their weights in
// `paired`), else in float32.
template <int T, typename Query, typename Entry>
inline void add_values_tile(float* acc, const Entry* v, const float (*weights)[kBlock],
                            const uint16_t (*paired)[kBlock], int64_t visible, int64_t D) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same<Query, uint16_t>::value) return add_pairs_tile<T>(acc, v, paired, visible, D);
#endif
  add_weighted_tile<Lanes16, T>(acc, v, weights, visible, D);
}
#endif

// A block whose maximum tops the running one `best`: what was summed so far (`total` and the D sums in `am`) is
// rescaled to the new maximum, which becomes `best` (both softmax paths).
ALWAYS_INLINE void raise_maximum(float block_max, int64_t D, float& best, float& total, float* am) {
  if (!(block_max > best)) return;  // a NaN maximum leaves the sums alone
  const float shrink = exp1(best - block_max);
  total *= shrink;
  for (int64_t d = 0; d < D; d += 8) store8(am + d, load8(am + d) * splat(shrink));
  best = block_max;
}

// One query's scores of a block (scaled, in `weights`) turned into its softmax weights against the running
// maximum `best` (what was summed so far, am and total, rescaled when it grows), the block's share added to
// `total`.
ALWAYS_INLINE void softmax_block(float* weights, int64_t visible, int64_t D, float& best, float& total, float* am) {
  float block_max = -INFINITY;
  int64_t b = 0;
  v8 maxima = splat(-INFINITY);  // a maximum is exact in any order: eight lanes, then the rest
  for (; b + 8 <= visible; b += 8) {
    const v8 w = load8(weights + b);
    maxima = w > maxima ? w : maxima;
  }
  for (; b < visible; ++b) block_max = std::max(block_max, weights[b]);
  for (int i = 0; i < 8; ++i) block_max = std::max(block_max, maxima[i]);
  raise_maximum(block_max, D, best, total, am);
  for (b = visible; b < (visible + 7) / 8 * 8; ++b) weights[b] = -INFINITY;  // exp gives 0 there
  v8 block_total = splat(0.f);
  for (b = 0; b < visible; b += 8) {
    const v8 w = exp8(load8(weights + b) - splat(best));
    store8(weights + b, w);
    block_total += w;
  }
  for (int i = 0; i < 8; ++i) total += block_total[i];
}

#if defined(__AVX512BF16__)
// exp(x) of sixteen x <= 0 for the paired softmax, whose weights are then rounded to bfloat16 (8 bits): the
// range reduction of exp8 with fused multiply-adds, a degree-5 polynomial (relative error ~3e-6) and
// vscalefps for the power of two. Half the instructions of exp8's float arithmetic; exp was a fifth of the
// attention of a verify pass over 8 positions at 1,024 cached tokens (Zen 4 EPYC, stop 50).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 120.f);
  for (const float c : {1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// softmax_block for paired value sums: the weights rounded to bfloat16 (nearest even, vcvtneps2bf16, which
// makes 0 of a weight under 2^-126: a score ~87 below the block's maximum) and kept so in `paired`, zero from
// `visible` on to the next 16 (the last key of an odd block pairs with a 0), their sum added to `total`.
ALWAYS_INLINE void softmax_block_paired(const float* weights, int64_t visible, int64_t D, float& best, float& total,
                                        float* am, uint16_t* paired) {
  __m512 maxima = _mm512_set1_ps(-INFINITY);
  for (int64_t b = 0; b < visible; b += 16) {
    const __mmask16 live = visible - b >= 16 ? 0xFFFF : (1u << (visible - b)) - 1;
    maxima = _mm512_max_ps(maxima, _mm512_mask_loadu_ps(maxima, live, weights + b));
  }
  const float block_max = _mm512_reduce_max_ps(maxima);  // a maximum is exact in any order
  raise_maximum(block_max, D, best, total, am);
  __m512 block_total = _mm512_setzero_ps();
  for (int64_t b = 0; b < visible; b += 16) {
    const __mmask16 live = visible - b >= 16 ? 0xFFFF : (1u << (visible - b)) - 1;
    const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(live, weights + b), _mm512_set1_ps(best));
    const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_maskz_mov_ps(live, exp16(x)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(paired + b), (__m256i)rounded);
    const __m512i widened = _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)rounded), 16);  // exact
    block_total = _mm512_add_ps(block_total, _mm512_castsi512_ps(widened));
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, block_total);
  for (const float lane : lanes) total += lane;
}
#endif

// Keys b .. b + 7's share of the next block's keys and values (`ahead_lines` lines of 64 bytes each), asked
// of the caches along the way; nothing without `ahead_k`.
inline void ask_ahead(int64_t b, const char* ahead_k, const char* ahead_v, int64_t ahead_lines) {
  if (!ahead_k) return;
  for (int64_t l = b * ahead_lines / kBlock, to = (b + 8) * ahead_lines / kBlock; l < to; ++l) {
    __builtin_prefetch(ahead_k + 64 * l, 0, 2);
    __builtin_prefetch(ahead_v + 64 * l, 0, 2);
  }
}

// dots8 unrolled for the head sizes of the registry's models (float queries; paired scores have their own).
template <typename Query, typename Entry>
inline v8 dots8_sized(const Query* q, const Entry* k, int64_t D) {
  if constexpr (std::is_same<Query, float>::value) {
    if (D == 64) return dots8<64>(q, k, D);
    if (D == 128) return dots8<128>(q, k, D);
  }
  return dots8(q, k, D);
}

// One query's scores over one block of `visible` keys k (D entries each), turned into its softmax weights.
template <typename Query, typename Entry>
inline void score_block(const Query* qm, const Entry* k, int64_t visible, int64_t D, float scale, float& best,
                        float& total, float* am, float* weights, const char* ahead_k, const char* ahead_v,
                        int64_t ahead_lines) {
  int64_t b = 0;
  for (; b + 8 <= visible; b += 8) {
    ask_ahead(b, ahead_k, ahead_v, ahead_lines);
    store8(weights + b, dots8_sized(qm, k + b * D, D) * splat(scale));
  }
  for (; b < visible; ++b) weights[b] = dot(qm, k + b * D, D) * scale;
  softmax_block(weights, visible, D, best, total, am);
}

#if defined(__AVX512F__)
// score_block for T consecutive queries (q, acc: T rows of D) that see the same keys, on the 32-wide path:
// the same scores and weights, each key loaded and widened once for the tile.
template <int T, typename Query, typename Entry>
inline void score_block_tile(const Query* q, const Entry* k, int64_t visible, int64_t D, float scale, float* best,
                             float* total, float* acc, float (*weights)[kBlock], uint16_t (*paired)[kBlock],
                             const char* ahead_k, const char* ahead_v, int64_t ahead_lines) {
  int64_t b = 0;
  for (; b + 8 <= visible; b += 8) {
    ask_ahead(b, ahead_k, ahead_v, ahead_lines);
    v8 scores[T];
    dots8_tile<T>(q, k + b * D, D, scores);
    for (int t = 0; t < T; ++t) store8(weights[t] + b, scores[t] * splat(scale));
  }
  for (; b < visible; ++b)
    for (int t = 0; t < T; ++t) weights[t][b] = dot(q + t * D, k + b * D, D) * scale;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same<Query, uint16_t>::value) {
    for (int t = 0; t < T; ++t) softmax_block_paired(weights[t], visible, D, best[t], total[t], acc + t * D, paired[t]);
    return;
  }
#endif
  for (int t = 0; t < T; ++t) softmax_block(weights[t], visible, D, best[t], total[t], acc + t * D);
}
#endif

// Dimension d of a head in the order bfloat16 entries are read (`load32`): within each 32, the even ones
// first, then the odd ones.
inline int64_t split_index(int64_t d) { return d / 32 * 32 + (d % 2) * 16 + d % 32 / 2; }

// Dimension d of a head in the order paired value sums keep it (`add_pairs_slices`): within each 32, dimensions
// 0-3 of every 8 first, then 4-7.
inline int64_t pair_index(int64_t d) { return d / 32 * 32 + (d % 8 >= 4) * 16 + d % 32 / 8 * 4 + d % 4; }

// Where query m's entries lie when they are not 0, 1, 2, ... of the slot: a tree pass, whose query at depth d
// sees the cached prefix (entries 0 .. start - 1) and then its ancestors and itself, written anywhere after it.
struct Paths {
  const int64_t* entries = nullptr;  // (M, width): the entries of the query's logical positions start, start + 1, ...
  int64_t width = 0;
  int64_t start = 0;
};

// The blocks of one chunk of one (row, kv head): M queries (float, or bfloat16 bits for paired scores) over the
// slot's keys and values, each query's running maximum `best`, softmax `total` and weighted sum `acc` (M rows of
// D) updated. Query m sees logical entries 0 .. limits[m] - 1 in blocks of kBlock, of which this call attends
// over those of entries chunk * kChunk .. (chunk + 1) * kChunk - 1; with `paths` a block that reaches past
// the prefix is gathered first, so a tree's query sums exactly what a chain's query at that depth sums, in
// the same blocks and order (a tree verify pass equals one-token steps bit for bit).
template <typename Query, typename Entry>
void attend_blocks(const Query* q, const Entry* k, const Entry* v, const int64_t* limits, int64_t M, int64_t D,
                   float scale, Paths paths, int64_t chunk, float* best, float* total, float* acc) {
  int64_t seen = 0;  // entries the queries see, and of them those up to the chunk's end
  for (int64_t m = 0; m < M; ++m) seen = std::max(seen, limits[m]);
  const int64_t longest = std::min(seen, (chunk + 1) * kChunk);
  std::vector<Entry> gathered(paths.entries ? 2 * kBlock * D : 0);
  alignas(32) float weights[kTile][kBlock];
  [[maybe_unused]] alignas(64) uint16_t paired[kTile][kBlock];  // the weights as paired value sums take them
  Entry *gathered_k = gathered.data(), *gathered_v = gathered.empty() ? nullptr : gathered.data() + kBlock * D;
  for (int64_t j0 = chunk * kChunk; j0 < longest; j0 += kBlock) {
    // a block reaching past the prefix: its prefix part is copied once, each query's path after it
    const bool tail = paths.entries && j0 + std::min(longest - j0, kBlock) > paths.start;
    const int64_t prefix = tail ? std::clamp(paths.start - j0, int64_t{0}, kBlock) : 0;
    std::copy(k + j0 * D, k + (j0 + prefix) * D, gathered_k);
    std::copy(v + j0 * D, v + (j0 + prefix) * D, gathered_v);
    // entries of the next block, asked for past the chunk's end too (the next chunk is mostly the same thread's)
    const int64_t next = std::min(seen - j0 - kBlock, kBlock);
    const char* ahead_k = next > 0 ? reinterpret_cast<const char*>(k + (j0 + kBlock) * D) : nullptr;
    const char* ahead_v = next > 0 ? reinterpret_cast<const char*>(v + (j0 + kBlock) * D) : nullptr;
    const int64_t ahead_lines = next > 0 ? (next * D * static_cast<int64_t>(sizeof(Entry)) + 63) / 64 : 0;
    const char* ask_k = ahead_k;  // the block's first query asks for the next block
    for (int64_t m = 0; m < M;) {
      const int64_t visible = std::min(limits[m] - j0, kBlock);
      if (visible <= 0) {
        ++m;
        continue;
      }
      const Entry *kb = k + j0 * D, *vb = v + j0 * D;
      const bool own = tail && visible > prefix;  // a tree query's path: a block of its own
      if (own) {
        for (int64_t b = prefix; b < visible; ++b) {
          const int64_t entry = paths.entries[m * paths.width + j0 + b - paths.start];
          std::copy(k + entry * D, k + (entry + 1) * D, gathered_k + b * D);
          std::copy(v + entry * D, v + (entry + 1) * D, gathered_v + b * D);
        }
        kb = gathered_k;
        vb = gathered_v;
      }
      // the queries from m on that see the same keys: one tile, which loads (and widens) each key and value once
      // for up to three queries. On the 32-wide path since stop 43 (Zen 4 EPYC, 2 cores, bfloat16 cache, 30 layers'
      // worth, interleaved medians): 64 rows at 1024 entries 67.4 -> 60.3 ms, 48 queries 10.4 -> 9.5 ms, 24 queries
      // unchanged; whole passes over 16 positions at 512 / 1024 cached tokens ~22.5 -> 20.6 / 27.5 -> 25.4 ms.
      int64_t tile = 1;
      while (!own && tile < kTile && m + tile < M && std::min(limits[m + tile] - j0, kBlock) == visible) ++tile;
      float* am = acc + m * D;
      const char* ask = visible == kBlock ? ask_k : nullptr;
      if (visible == kBlock) ask_k = nullptr;
#if defined(__AVX512F__)
      if (wide(D) && (tile > 1 || std::is_same<Query, uint16_t>::value)) {  // paired: every query in a tile
        const auto run = [&](auto size) {
          constexpr int T = decltype(size)::value;
          score_block_tile<T>(q + m * D, kb, visible, D, scale, best + m, total + m, am, weights, paired, ask,
                              ahead_v, ahead_lines);
          add_values_tile<T, Query>(am, vb, weights, paired, visible, D);
        };
        if (tile == 3) run(std::integral_constant<int, 3>{});
        else if (tile == 2) run(std::integral_constant<int, 2>{});
        else run(std::integral_constant<int, 1>{});
        m += tile;
        continue;
      }
#endif
      for (int64_t t = 0; t < tile; ++t)
        score_block(q + (m + t) * D, kb, visible, D, scale, best[m + t], total[m + t], am + t * D, weights[t],
                    t == 0 ? ask : nullptr, ahead_v, ahead_lines);
      if (tile == 3) add_weighted_tile<Lanes8, 3>(am, vb, weights, visible, D);
      else if (tile == 2) add_weighted_tile<Lanes8, 2>(am, vb, weights, visible, D);
      else add_weighted(am, vb, weights[0], visible, D);
      m += tile;
    }
  }
}

// One chunk of one (row, kv head): M queries (M, D) over that slot's keys and values (D entries each, float or
// bfloat16), each query's maximum, softmax total and weighted sum (dimensions in order, not yet divided by the
// total) written to `part` (`Partials`: query m at m * stride).
template <typename Entry>
void attend(const float* q, const Entry* k, const Entry* v, const int64_t* limits, Partials part, int64_t stride,
            int64_t M, int64_t D, float scale, Paths paths, int64_t chunk) {
  std::vector<float> best(M, -INFINITY), total(M, 0.f), acc(M * D, 0.f);
  const bool split = std::is_same<Entry, uint16_t>::value && wide(D);  // value sums in the split order
  if (split) {
    if constexpr (kPairedScores && std::is_same<Entry, uint16_t>::value) {
      std::vector<uint16_t> rounded(M * D);
      for (int64_t i = 0; i < M * D; ++i) rounded[i] = c10::BFloat16(q[i]).x;  // nearest even
      attend_blocks(rounded.data(), k, v, limits, M, D, scale, paths, chunk, best.data(), total.data(), acc.data());
    } else {  // the queries in the order the entries are widened
      std::vector<float> split_q(M * D);
      for (int64_t i = 0; i < M * D; ++i) split_q[i / D * D + split_index(i % D)] = q[i];
      attend_blocks(split_q.data(), k, v, limits, M, D, scale, paths, chunk, best.data(), total.data(), acc.data());
    }
  } else {
    attend_blocks(q, k, v, limits, M, D, scale, paths, chunk, best.data(), total.data(), acc.data());
  }
  for (int64_t m = 0; m < M; ++m) {
    const int64_t at = m * stride;
    part.best[at] = best[m];
    part.total[at] = total[m];
    for (int64_t d = 0; d < D; ++d)
      part.acc[at * D + d] = acc[m * D + (!split ? d : kPairedScores ? pair_index(d) : split_index(d))];
  }
}

// A query's chunks are joined in order: a later chunk's maximum b, total t and sums acc join the running ones
// (best, total, y; total 0: none yet) at the larger of the two maxima, the other side rescaled, as a block's are
// within a chunk. A chunk the query does not reach (t = 0) is passed over.
inline void join_chunk(float& best, float& total, float* y, float b, float t, const float* acc, int64_t D) {
  if (t == 0.f) return;
  if (total == 0.f) {
    best = b;
    total = t;
    std::copy(acc, acc + D, y);
    return;
  }
  const float top = std::max(best, b);
  const float old = std::exp(best - top), add = std::exp(b - top);
  total = total * old + t * add;
  for (int64_t d = 0; d < D; ++d) y[d] = y[d] * old + acc[d] * add;
  best = top;
}

// The joined sums divided by the total (a query that sees no entry: zeros). One chunk: its sums divided by its
// total, bit for bit what attending in one piece gave.
inline void finish_query(float* y, float total, int64_t D) {
  if (total == 0.f) {
    std::fill(y, y + D, 0.f);
    return;
  }
  const float inv = 1.f / total;
  for (int64_t d = 0; d < D; ++d) y[d] *= inv;
}

// Items begin .. end - 1 of one call, over a cache of `Entry`s. Split: item i is chunk i % chunks of (row, kv
// head) i / chunks / shares for share i / chunks % shares of that pair's queries, into `part`. Else item i is
// (row, kv head) i / shares for share i % shares, its chunks attended one after another and joined as they come
// (the same arithmetic, no buffer of every chunk). Paths (R, M, width) or null.
template <typename Entry>
void attend_items(const AttentionWork& w, const Entry* kp, const Entry* vp, int64_t begin, int64_t end) {
  for (int64_t item = begin; item < end; ++item) {
    const int64_t chunk = w.split ? item % w.chunks : 0, unit = w.split ? item / w.chunks : item;
    const int64_t pair = unit / w.shares, m0 = unit % w.shares * w.per_share;
    const int64_t count = std::min(w.per_share, w.M - m0);
    if (count <= 0) continue;
    const int64_t r = pair / w.KV, h = pair % w.KV;
    const int64_t base = w.slots[r] * w.slot_stride + h * w.head_stride;
    const int64_t first = pair * w.M + m0;
    Paths row_paths;
    if (w.paths) row_paths = {w.paths + (r * w.M + m0) * w.width, w.width, w.starts[r]};
    const float* q = w.q + first * w.D;
    const int64_t* limits = w.limits + r * w.M + m0;
    if (w.split) {
      const int64_t at = first * w.chunks + chunk;
      const Partials part{w.part.best + at, w.part.total + at, w.part.acc + at * w.D};
      attend(q, kp + base, vp + base, limits, part, w.chunks, count, w.D, w.scale, row_paths, chunk);
      continue;
    }
    std::vector<float> b(count), t(count), acc(count * w.D), best(count, -INFINITY), total(count, 0.f);
    float* y = w.out + first * w.D;
    // the chunks these queries reach (a short row of a batch beside a long one reaches fewer than the call's)
    const int64_t reach = (*std::max_element(limits, limits + count) + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < reach; ++c) {
      attend(q, kp + base, vp + base, limits, Partials{b.data(), t.data(), acc.data()}, 1, count, w.D, w.scale,
             row_paths, c);
      for (int64_t m = 0; m < count; ++m)
        join_chunk(best[m], total[m], y + m * w.D, b[m], t[m], acc.data() + m * w.D, w.D);
    }
    for (int64_t m = 0; m < count; ++m) finish_query(y + m * w.D, total[m], w.D);
  }
}

}  // namespace

void AttentionWork::run(int64_t begin, int64_t end) const {
  if (bf16)  // bfloat16 read as its bits
    attend_items(*this, static_cast<const uint16_t*>(keys), static_cast<const uint16_t*>(values), begin, end);
  else
    attend_items(*this, static_cast<const float*>(keys), static_cast<const float*>(values), begin, end);
}

// Split work: the chunks of queries begin .. end - 1 joined in order (`join_chunk`) into `out`. A query's result
// depends on its own entries only, never on how its pass split the work.
void AttentionWork::merge(int64_t begin, int64_t end) const {
  for (int64_t query = begin; query < end; ++query) {
    float* y = out + query * D;
    float best = -INFINITY, total = 0.f;
    for (int64_t at = query * chunks; at < (query + 1) * chunks; ++at)
      join_chunk(best, total, y, part.best[at], part.total[at], part.acc + at * D, D);
    finish_query(y, total, D);
  }
}

std::vector<int64_t> AttentionWork::bounds(int64_t parts) const {
  std::vector<int64_t> cost(items + 1, 0);  // cost[i]: items 0 .. i - 1's queries times (the entries each sees + 1)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t chunk = split ? item % chunks : 0, unit = split ? item / chunks : item;
    const int64_t pair = unit / shares, m0 = unit % shares * per_share;
    const int64_t count = std::max<int64_t>(0, std::min(per_share, M - m0));
    const int64_t* reach = limits + pair / KV * M + m0;
    const int64_t seen = count ? *std::max_element(reach, reach + count) : 0;
    const int64_t entries = split ? std::clamp(seen - chunk * kChunk, int64_t{0}, kChunk) : seen;
    cost[item + 1] = cost[item] + count * (entries + 1);
  }
  std::vector<int64_t> at(parts + 1, items);
  at[0] = 0;
  for (int64_t p = 1; p < parts; ++p) {  // the bound nearest an even share of the entries
    const int64_t even = cost[items] * p / parts;
    int64_t i = std::lower_bound(cost.begin() + at[p - 1], cost.end(), even) - cost.begin();
    if (i > at[p - 1] && even - cost[i - 1] < cost[i] - even) --i;
    at[p] = i;
  }
  return at;
}

AttentionWork attention_work(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                             const at::Tensor& slots, const at::Tensor& limits, double scale,
                             const at::Tensor* paths, const at::Tensor* starts, at::Tensor& out,
                             at::Tensor& partials) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous(), "cached_attention computes in float32");
  TORCH_CHECK((keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kBFloat16) &&
                  values.scalar_type() == keys.scalar_type(),
              "cached_attention reads a float32 or bfloat16 cache");
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes(), "bad shapes");
  TORCH_CHECK(keys.stride(3) == 1 && keys.stride(2) == keys.size(3) && values.strides() == keys.strides(),
              "cache entries must be contiguous per (slot, head)");
  const int64_t R = q.size(0), KV = q.size(1), M = q.size(2), D = q.size(3), C = keys.size(2);
  TORCH_CHECK(keys.size(1) == KV && keys.size(3) == D, "queries and cache disagree on heads or head size");
  TORCH_CHECK(D % 8 == 0, "cached_attention needs a head size that is a multiple of 8");
  TORCH_CHECK(limits.size(0) == R && limits.size(1) == M, "limits must be (rows, queries)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && limits.scalar_type() == at::kLong && slots.numel() == R &&
                  slots.is_contiguous() && limits.is_contiguous(),
              "cached_attention: int64 slots (one a row) and limits");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == at::kFloat,
              "cached_attention: an output like the queries");
  // scanned in place: limit.max().item() was two dispatched ops, ~2 us of a ~10 us one-token call
  const int64_t *sp = slots.data_ptr<int64_t>(), *lp = limits.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(sp, sp + R, [&](int64_t s) { return 0 <= s && s < keys.size(0); }),
              "a row's slot lies outside the cache");
  TORCH_CHECK(std::all_of(lp, lp + R * M, [C](int64_t l) { return l <= C; }),
              "a query would read past the cache's capacity");
  const int64_t longest = R * M ? *std::max_element(lp, lp + R * M) : 0;
  int64_t width = 0;
  if (paths) {
    TORCH_CHECK(starts, "cached_attention: paths need the rows' starts");
    TORCH_CHECK(paths->is_contiguous() && starts->is_contiguous(), "cached_attention: contiguous paths and starts");
    width = paths->size(2);
    TORCH_CHECK(paths->size(0) == R && paths->size(1) == M && starts->size(0) == R,
                "paths must be (rows, queries, width) and starts (rows)");
    TORCH_CHECK(paths->numel() == 0 || (paths->min().item<int64_t>() >= 0 && paths->max().item<int64_t>() < C),
                "a path entry lies outside the cache");
    TORCH_CHECK((limits - starts->view({R, 1})).max().item<int64_t>() <= width, "a query's path is too short");
  }
  // Work items are (row, kv head, a share of its queries), each attending its chunks in order; where the pairs are
  // too few for the threads (one request: 3), each chunk of a pair is its own item (split), its partial results
  // kept for `merge`: each item reads its entries once for all its queries (one request at 1,024 cached tokens:
  // 12 items, where two shares of each pair's queries each read the whole slot). Shares only where items are
  // still too few: each query is computed on its own anyway. Split only while the partials stay small (a long
  // prompt's prefill has thousands of queries a pair, and its shares keep the threads busy).
  const int64_t chunks = std::max<int64_t>(1, (longest + kChunk - 1) / kChunk);
  const int64_t pairs = R * KV, threads = at::get_num_threads();
  const int64_t partial_floats = pairs * M * chunks * (D + 2);
  const bool split = chunks > 1 && pairs < 2 * threads && partial_floats <= (int64_t{1} << 20);
  const int64_t units = split ? pairs * chunks : pairs;
  const int64_t shares = std::min(M, units >= 2 * threads ? int64_t{1} : (2 * threads + units - 1) / units);
  partials.resize_({split ? partial_floats : 0});
  float* part = partials.data_ptr<float>();
  const bool bf16 = keys.scalar_type() == at::kBFloat16;
  return AttentionWork{q.data_ptr<float>(),
                       bf16 ? static_cast<const void*>(keys.data_ptr<at::BFloat16>()) : keys.data_ptr<float>(),
                       bf16 ? static_cast<const void*>(values.data_ptr<at::BFloat16>()) : values.data_ptr<float>(),
                       bf16,
                       sp,
                       lp,
                       width ? paths->data_ptr<int64_t>() : nullptr,
                       paths ? starts->data_ptr<int64_t>() : nullptr,
                       out.data_ptr<float>(),
                       Partials{part, part + pairs * M * chunks, part + 2 * pairs * M * chunks},
                       R,
                       KV,
                       M,
                       D,
                       keys.stride(0),
                       keys.stride(1),
                       width,
                       static_cast<float>(scale),
                       chunks,
                       split,
                       shares,
                       (M + shares - 1) / shares,
                       units * shares};
}

// q (R, KV, M, D) float32: the M queries of row r that share kv head h (grouped heads times positions);
// keys, values (S, KV, C, D) float32 or bfloat16, a layer's cache, entries contiguous per (slot, head);
// slots (R) int64: row r's slot; limits (R, M) int64: how many entries query m sees. Returns (R, KV, M, D).
// Optional, for trees: paths (R, M, width) int64 and starts (R) int64: query m of row r sees entries
// 0 .. starts[r] - 1, then paths[r][m][0 .. limits[r][m] - starts[r] - 1].
at::Tensor cached_attention(at::Tensor q, at::Tensor keys, at::Tensor values, at::Tensor slots,
                               at::Tensor limits, double scale, c10::optional<at::Tensor> paths,
                               c10::optional<at::Tensor> starts) {
  q = q.contiguous();
  slots = slots.contiguous();
  limits = limits.contiguous();
  at::Tensor path_entries, path_starts;
  if (paths.has_value()) {
    TORCH_CHECK(starts.has_value(), "cached_attention: paths need the rows' starts");
    path_entries = paths->contiguous();
    path_starts = starts->contiguous();
  }
  auto out = at::empty_like(q);
  auto partials = at::empty({0}, q.options());
  const auto work = attention_work(q, keys, values, slots, limits, scale, paths ? &path_entries : nullptr,
                                   paths ? &path_starts : nullptr, out, partials);
  const std::vector<int64_t> bounds = work.bounds(at::get_num_threads());
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) work.run(bounds[p], bounds[p + 1]);
  });
  if (work.split)
    at::parallel_for(0, work.R * work.KV * work.M, 64, [&](int64_t begin, int64_t end) { work.merge(begin, end); });
  return out;
}

TORCH_LIBRARY_FRAGMENT(specdecode, m) {
  m.def(
      "cached_attention(Tensor q, Tensor keys, Tensor values, Tensor slots, Tensor limits, float scale, "
      "Tensor? paths=None, Tensor? starts=None) -> Tensor",
      &cached_attention);
}
