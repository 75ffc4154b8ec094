// q8_rows_linear: y (M, N) = x (M, K) . w (N, K)^T over GGUF Q4_1 or Q8_0 weights with the rows x rounded to
// 8 bits, as llama.cpp computes such a matrix (its Q8_1 / Q8_0 activations), for the few rows of a decode step or
// a verify pass.
//
// Why: on a CPU without native bfloat16 (a Zen 3 EPYC, AVX2) the float32 kernel over the same rows rebuilds
// every weight in float32 before its product and runs at ~12 GB/s, a third of what plain reads reach; the pass
// is instruction-bound. Here 32 products of 4- or 8-bit weights and 8-bit inputs are one vpmaddubsw, so a
// one-row pass streams the weights at the memory's speed (Zen 3, a 75 MB Q4_1 matrix: 42 GB/s against 12). On a
// Zen 4 with native bfloat16 it beat bfloat16 weights too (a decoder-sized stack 5.3 ms against 10.6: stop 61).
// Layout: the rows in groups of sixteen (AVX512-VNNI, zmm) or eight (AVX2, ymm), each group block by block
// (`Q4_1Groups`, `Q8_0Groups` below). One load gives each row of the group four weights, and a broadcast of four
// input bytes meets them: the products of a row land in its own lane, so a block's sums leave as one vector, and
// a group's outputs are one vector with no sums across lanes.
// Each input row, block by block: d_x = max |x| / 127, q = round(x / d_x), s_x = d_x * sum(q) (Q8_1); the block's
// product with a Q4_1 row is d_w d_x sum(q_w q) + m_w s_x, with a Q8_0 row d_w d_x sum(q_w q). The integer sums
// are exact; each output adds its blocks' terms to one float32 lane in block order whatever M and the tile are,
// so a row's result never depends on the other rows of its pass: a verify pass over k + 1 positions computes
// bit for bit what k + 1 one-token steps compute (tested). Against the float32 weights the result differs by
// the inputs' rounding to 8 bits (~0.4% of a block's largest input), the precision class of a bfloat16 row.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <vector>

#include "parts.h"

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>

namespace {

// Each thread's groups are one contiguous stream; asking for the bytes 2 KB ahead as it goes took the model's
// one-row linears (~0.3-1.7 MB each, too short for the hardware prefetcher to ramp up) from 3.0 to 2.5 ms on a
// Zen 3 EPYC (1, 2, 4 and 8 KB ahead: 2.74 / 2.52 / 2.53 / 2.52 ms; four rows 3.83 -> 3.67).
constexpr int64_t kPrefetchBytes = 2048;

using InputScale = Q8Scale;  // d_x, d_x * sum(q) and sum(q) of one block of one input row

// One row of K inputs -> K bytes q and K / 32 scales. With AVX-512 a block is two registers, its bytes in order
// without the AVX2 form's packing and permute (a pass over 8 positions rounds ~480 rows a thread); the same
// maximum, products, rounding to nearest even and integer sum, so the same bytes and scales.
void quantize_row(const float* x, int8_t* q, InputScale* scales, int64_t K) {
#if defined(__AVX512F__)
  for (int64_t b = 0; b < K / 32; ++b) {
    const __m512 low = _mm512_loadu_ps(x + b * 32), high = _mm512_loadu_ps(x + b * 32 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
    const __m512 inverse = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i first = _mm512_cvtps_epi32(_mm512_mul_ps(low, inverse));  // round to nearest even
    const __m512i second = _mm512_cvtps_epi32(_mm512_mul_ps(high, inverse));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 32), _mm512_cvtsepi32_epi8(first));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 32 + 16), _mm512_cvtsepi32_epi8(second));
    const float d = amax / 127.f;
    const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(first, second));
    scales[b] = {d, d * static_cast<float>(total), total};
  }
#else
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < K / 32; ++b) {
    __m256 v[4], top = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + b * 32 + 8 * i);
      top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    const __m256 inverse = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m256i ints[4], sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      ints[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));  // round to nearest even
      sum = _mm256_add_epi32(sum, ints[i]);
    }
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]), _mm256_packs_epi32(ints[2], ints[3]));
    const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * 32), ordered);
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s = _mm_hadd_epi32(s, s);
    s = _mm_hadd_epi32(s, s);
    const float d = amax / 127.f;
    const int32_t total = _mm_cvtsi128_si32(s);
    scales[b] = {d, d * static_cast<float>(total), total};
  }
#endif
}

// The weights' two formats, interleaved (models/gguf_rows.py `interleave`): per group of G = kQ8GroupRows rows
// (16 where the CPU has AVX512-VNNI: a zmm register's lanes; else 8, a ymm's) and block,
// Q4_1: four steps of 4 G bytes (step s: row r's weights 8 s + t in the low nibbles of bytes 4 r + t, t < 4, and
// 8 s + 4 + t in their high nibbles), then the G d, then the G m (float16): 20 G bytes;
// Q8_0: eight steps of 4 G bytes (step s: row r's weights 4 s + t in bytes 4 r + t), then the G d: 34 G bytes.
// Q8_0 weights are signed bytes in groups of eight; in groups of sixteen they are stored plus 128 (unsigned: the
// operand vpdpbusd takes unsigned; AVX-512 has no vpsignb to move their sign onto the inputs as AVX2 does).
struct Q4_1Groups {
  static constexpr int64_t kBytes = 20 * kQ8GroupRows;
};
struct Q8_0Groups {
  static constexpr int64_t kBytes = 34 * kQ8GroupRows;
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// With AVX512-VNNI (Zen 4, Ice Lake and later) four products of unsigned bytes u and signed bytes s add into each
// 32-bit lane in one vpdpbusd, where AVX2 takes vpmaddubsw, vpmaddwd and an add: the same integer sums (neither
// saturates here). In zmm registers a group is sixteen rows: a block's float32 terms, the input broadcasts and
// the nibble unpacking are shared by twice the products of the ymm form, which in a probe (one thread, a
// 1536 x 576 matrix in the L2, Zen 4) took Q4_1 at 4 / 8 input rows from 128 / 136 to 158 / 161 GMAC/s and Q8_0
// (unsigned weights: no sign moves) from 91 / 94 to 170 / 170, of vpdpbusd's ~217 a core. Its latency (~4
// cycles) would set the pace of one running sum, so each input row of a tile of up to three keeps two, added at
// the block's end. The steps' loops are written out apart from AVX2's: walked by one helper with a lambda per
// instruction set, GCC 12 spilled more of the tiles' sums.
#define SPECDECODE_VNNI 1
using Sums = __m512i;  // a block's integer sums of one input row, a lane per weight row
using Acc = __m512;    // an input row's outputs of one group
inline Acc zero_acc() { return _mm512_setzero_ps(); }
inline void store_acc(float* y, Acc a) { _mm512_storeu_ps(y, a); }
inline Acc load_halves(const uint8_t* p) {  // the group's G float16 at p
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline Acc broadcast(float f) { return _mm512_set1_ps(f); }
inline Acc to_float(Sums s) { return _mm512_cvtepi32_ps(s); }
inline Acc mul(Acc a, Acc b) { return _mm512_mul_ps(a, b); }
inline Acc fmadd(Acc a, Acc b, Acc c) { return _mm512_fmadd_ps(a, b, c); }
// Keeps a running sum in its register and its adds in order (the AVX2 one below says why); emits nothing.
inline void keep_in_register(__m512i& sum) { __asm__("" : "+v"(sum)); }

template <int MB>
inline void block_sums(Q4_1Groups, const uint8_t* block, const int8_t* const* xq, const InputScale*, Sums* sums) {
  constexpr bool kTwoSums = MB < 4;  // four rows and more are enough running sums
  const __m512i nibble = _mm512_set1_epi8(15);
  __m512i high_sums[MB];
  for (int i = 0; i < MB; ++i) sums[i] = high_sums[i] = _mm512_setzero_si512();
  for (int s = 0; s < 4; ++s) {
    const __m512i packed = _mm512_loadu_si512(block + 64 * s);
    const __m512i low = _mm512_and_si512(packed, nibble);
    const __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
    for (int i = 0; i < MB; ++i) {
      int32_t first, second;
      __builtin_memcpy(&first, xq[i] + 8 * s, 4);
      __builtin_memcpy(&second, xq[i] + 8 * s + 4, 4);
      sums[i] = _mm512_dpbusd_epi32(sums[i], low, _mm512_set1_epi32(first));
      __m512i& other = kTwoSums ? high_sums[i] : sums[i];
      other = _mm512_dpbusd_epi32(other, high, _mm512_set1_epi32(second));
      keep_in_register(sums[i]);
      if (kTwoSums) keep_in_register(high_sums[i]);
    }
  }
  if (kTwoSums)
    for (int i = 0; i < MB; ++i) sums[i] = _mm512_add_epi32(sums[i], high_sums[i]);
}

// Unsigned weights w + 128 against the signed inputs: each sum starts at -128 sum(q), exact in 32 bits.
template <int MB>
inline void block_sums(Q8_0Groups, const uint8_t* block, const int8_t* const* xq, const InputScale* scales,
                       Sums* sums) {
  constexpr bool kTwoSums = MB < 4;
  __m512i odd_sums[MB];
  for (int i = 0; i < MB; ++i) {
    sums[i] = _mm512_set1_epi32(-128 * scales[i].sum);
    odd_sums[i] = _mm512_setzero_si512();
  }
  for (int s = 0; s < 8; s += 2) {
    const __m512i w0 = _mm512_loadu_si512(block + 64 * s);
    const __m512i w1 = _mm512_loadu_si512(block + 64 * s + 64);
    for (int i = 0; i < MB; ++i) {
      int32_t four0, four1;
      __builtin_memcpy(&four0, xq[i] + 4 * s, 4);
      __builtin_memcpy(&four1, xq[i] + 4 * s + 4, 4);
      sums[i] = _mm512_dpbusd_epi32(sums[i], w0, _mm512_set1_epi32(four0));
      __m512i& other = kTwoSums ? odd_sums[i] : sums[i];
      other = _mm512_dpbusd_epi32(other, w1, _mm512_set1_epi32(four1));
      keep_in_register(sums[i]);
      if (kTwoSums) keep_in_register(odd_sums[i]);
    }
  }
  if (kTwoSums)
    for (int i = 0; i < MB; ++i) sums[i] = _mm512_add_epi32(sums[i], odd_sums[i]);
}

#else
using Sums = __m256i;
using Acc = __m256;
inline Acc zero_acc() { return _mm256_setzero_ps(); }
inline void store_acc(float* y, Acc a) { _mm256_storeu_ps(y, a); }
inline Acc load_halves(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline Acc broadcast(float f) { return _mm256_set1_ps(f); }
inline Acc to_float(Sums s) { return _mm256_cvtepi32_ps(s); }
inline Acc mul(Acc a, Acc b) { return _mm256_mul_ps(a, b); }
inline Acc fmadd(Acc a, Acc b, Acc c) { return _mm256_fmadd_ps(a, b, c); }

// Keeps a running sum where it is: with K known only at run time GCC 12 regroups a block's integer adds into trees
// (integer addition reassociates freely) whose partial sums outlive the 16 vector registers, and the spills made
// the Q4_1 tiles ~1.3x slower at 4 and 8 input rows than the same code compiled for a fixed K (Zen 3, one thread,
// a 1536 x 576 matrix in the L2: 8 rows 105 -> 81 us; Q8_0 125 -> 117). An empty asm the sum passes through
// fixes the order of the adds; it emits nothing.
inline void keep_in_register(__m256i& sum) { __asm__("" : "+x"(sum)); }

// The eight rows' integer sums of one block against MB input rows, as 32-bit lanes (one per weight row).
// Q4_1: 4-bit weights against 8-bit inputs, pair sums |.| <= 2 * 15 * 127 and eight of them per 16-bit lane
// (< 2^15), widened once. Q8_0: signed by signed through vpmaddubsw's unsigned operand (|w| against the
// inputs carrying w's sign, as llama.cpp does), pair sums up to 2 * 128 * 127: widened every step.
template <int MB>
inline void block_sums(Q4_1Groups, const uint8_t* block, const int8_t* const* xq, const InputScale*, Sums* sums) {
  const __m256i nibble = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256i wide[MB];
  for (int i = 0; i < MB; ++i) wide[i] = _mm256_setzero_si256();
  for (int s = 0; s < 4; ++s) {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * s));
    const __m256i low = _mm256_and_si256(packed, nibble);
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
    for (int i = 0; i < MB; ++i) {
      int32_t first, second;
      __builtin_memcpy(&first, xq[i] + 8 * s, 4);
      __builtin_memcpy(&second, xq[i] + 8 * s + 4, 4);
      wide[i] = _mm256_add_epi16(wide[i], _mm256_maddubs_epi16(low, _mm256_set1_epi32(first)));
      wide[i] = _mm256_add_epi16(wide[i], _mm256_maddubs_epi16(high, _mm256_set1_epi32(second)));
      keep_in_register(wide[i]);
    }
  }
  for (int i = 0; i < MB; ++i) sums[i] = _mm256_madd_epi16(wide[i], ones);
}

template <int MB>
inline void block_sums(Q8_0Groups, const uint8_t* block, const int8_t* const* xq, const InputScale*, Sums* sums) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int i = 0; i < MB; ++i) sums[i] = _mm256_setzero_si256();
  for (int s = 0; s < 8; ++s) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * s));
    const __m256i magnitude = _mm256_sign_epi8(w, w);
    for (int i = 0; i < MB; ++i) {
      int32_t four;
      __builtin_memcpy(&four, xq[i] + 4 * s, 4);
      const __m256i signed_x = _mm256_sign_epi8(_mm256_set1_epi32(four), w);
      sums[i] = _mm256_add_epi32(sums[i], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), ones));
      keep_in_register(sums[i]);
    }
  }
}
#endif

inline Acc block_term(Sums sums, Acc d, float d_x, Acc acc) {  // acc + d_w d_x sum
  return fmadd(to_float(sums), mul(d, broadcast(d_x)), acc);
}

// A block's float32 terms into the input rows' accumulators: d_w d_x sum, then (Q4_1) m_w s_x.
template <int MB>
inline void block_terms(Q4_1Groups, const uint8_t* block, const Sums* sums, const InputScale* scales, Acc* acc) {
  const Acc d = load_halves(block + 16 * kQ8GroupRows), m = load_halves(block + 18 * kQ8GroupRows);
  for (int i = 0; i < MB; ++i) acc[i] = fmadd(m, broadcast(scales[i].s), block_term(sums[i], d, scales[i].d, acc[i]));
}

template <int MB>
inline void block_terms(Q8_0Groups, const uint8_t* block, const Sums* sums, const InputScale* scales, Acc* acc) {
  const Acc d = load_halves(block + 32 * kQ8GroupRows);
  for (int i = 0; i < MB; ++i) acc[i] = block_term(sums[i], d, scales[i].d, acc[i]);
}

// Input rows m0 .. m0 + MB - 1 against the G weight rows of group g: each output one float32 lane, its blocks
// added in order.
template <int MB, typename Format>
inline void group_tile(const int8_t* Xq, const InputScale* Xs, const uint8_t* P, float* Y, int64_t m0, int64_t g,
                       int64_t K, int64_t N) {
  const int64_t blocks = K / 32;
  Acc acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = zero_acc();
  const uint8_t* group = P + g * blocks * Format::kBytes;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = group + b * Format::kBytes;
    for (int64_t line = 0; line < Format::kBytes; line += 64) __builtin_prefetch(block + kPrefetchBytes + line);
    const int8_t* xq[MB];
    InputScale scales[MB];
    for (int i = 0; i < MB; ++i) {
      xq[i] = Xq + (m0 + i) * K + b * 32;
      scales[i] = Xs[(m0 + i) * blocks + b];
    }
    Sums sums[MB];
    block_sums<MB>(Format{}, block, xq, scales, sums);
    block_terms<MB>(Format{}, block, sums, scales, acc);
  }
  for (int i = 0; i < MB; ++i) store_acc(Y + (m0 + i) * N + g * kQ8GroupRows, acc[i]);
}

#if defined(SPECDECODE_VNNI)
// With 32 vector registers a tile of up to eight rows keeps its sums in registers, so the rows left after whole
// tiles of eight are one tile of their own size (five rows were a tile of four and one of one).
template <typename Format>
void q8_groups_by_rows(const int8_t* Xq, const InputScale* Xs, const uint8_t* P, float* Y, int64_t M, int64_t K,
                       int64_t N, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    int64_t m0 = 0;
    for (; m0 + 8 <= M; m0 += 8) group_tile<8, Format>(Xq, Xs, P, Y, m0, g, K, N);
    switch (M - m0) {
      case 7: group_tile<7, Format>(Xq, Xs, P, Y, m0, g, K, N); break;
      case 6: group_tile<6, Format>(Xq, Xs, P, Y, m0, g, K, N); break;
      case 5: group_tile<5, Format>(Xq, Xs, P, Y, m0, g, K, N); break;
      case 4: group_tile<4, Format>(Xq, Xs, P, Y, m0, g, K, N); break;
      case 3: group_tile<3, Format>(Xq, Xs, P, Y, m0, g, K, N); break;
      case 2: group_tile<2, Format>(Xq, Xs, P, Y, m0, g, K, N); break;
      case 1: group_tile<1, Format>(Xq, Xs, P, Y, m0, g, K, N); break;
    }
  }
}

#else
// Without VNNI (AVX2: 16 vector registers) tiles of up to four input rows share each loaded group (eight rows a
// tile spilled registers: 1.3x the time); three rows left after whole tiles are one tile, not three (the model's
// linears at seven rows: 8.9 -> 7.5 ms; at three rows 5.9 -> 4.3). Written as few tile sizes per loop as that
// needs: a loop choosing among all four sizes per group got GCC 12 to regroup the sums of the four-row tile into
// spilled trees (four rows 1.3x slower).
template <int MB, typename Format>
void q8_groups(const int8_t* Xq, const InputScale* Xs, const uint8_t* P, float* Y, int64_t M, int64_t K, int64_t N,
               int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    int64_t m0 = 0;
    for (; m0 + MB <= M; m0 += MB) group_tile<MB, Format>(Xq, Xs, P, Y, m0, g, K, N);
    if (MB == 4 && M - m0 == 3) {
      group_tile<3, Format>(Xq, Xs, P, Y, m0, g, K, N);
      continue;
    }
    for (; m0 < M; ++m0) group_tile<1, Format>(Xq, Xs, P, Y, m0, g, K, N);
  }
}

template <typename Format>
void q8_groups_by_rows(const int8_t* Xq, const InputScale* Xs, const uint8_t* P, float* Y, int64_t M, int64_t K,
                       int64_t N, int64_t g0, int64_t g1) {
  if (M == 3)
    q8_groups<3, Format>(Xq, Xs, P, Y, M, K, N, g0, g1);
  else if (M >= 4)
    q8_groups<4, Format>(Xq, Xs, P, Y, M, K, N, g0, g1);
  else if (M >= 2)
    q8_groups<2, Format>(Xq, Xs, P, Y, M, K, N, g0, g1);
  else
    q8_groups<1, Format>(Xq, Xs, P, Y, M, K, N, g0, g1);
}
#endif

// Products a second of the multiply the kernel is built on, on the calling thread: eight independent running sums
// (named registers: an array of them may live on the stack, and the loop then times store-to-load forwarding) of
// vpdpbusd in zmm registers with VNNI, else vpmaddubsw and the 16-bit add that keeps its sums, for about `seconds`.
// The least a kernel does per product, so no kernel over these instructions multiplies faster.
#if defined(SPECDECODE_VNNI)
#define PEAK_STEP(acc, a, b) acc = _mm512_dpbusd_epi32(acc, a, b); keep_in_register(acc);
using PeakSums = __m512i;
constexpr double kProductsPerStep = 64;
inline PeakSums peak_fill(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
inline PeakSums peak_add(PeakSums a, PeakSums b) { return _mm512_add_epi32(a, b); }
inline int peak_lane(PeakSums a) { return _mm_cvtsi128_si32(_mm512_castsi512_si128(a)); }
#else
#define PEAK_STEP(acc, a, b) acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(a, b)); keep_in_register(acc);
using PeakSums = __m256i;
constexpr double kProductsPerStep = 32;
inline PeakSums peak_fill(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
inline PeakSums peak_add(PeakSums a, PeakSums b) { return _mm256_add_epi16(a, b); }
inline int peak_lane(PeakSums a) { return _mm256_extract_epi16(a, 0); }
#endif

double products_per_second(double seconds, int seed) {
  PeakSums c0 = peak_fill(0), c1 = peak_fill(1), c2 = peak_fill(2), c3 = peak_fill(3);
  PeakSums c4 = peak_fill(4), c5 = peak_fill(5), c6 = peak_fill(6), c7 = peak_fill(7);
  const PeakSums a0 = peak_fill(seed), a1 = peak_fill(seed + 1), a2 = peak_fill(seed + 2), a3 = peak_fill(seed + 3);
  const PeakSums one = peak_fill(1);
  PeakSums b0 = peak_fill(seed + 5), b1 = peak_fill(seed + 7);
  constexpr int64_t kRound = 100000;
  int64_t steps = 0;
  const auto start = std::chrono::steady_clock::now();
  double elapsed = 0;
  do {
    for (int64_t n = 0; n < kRound; ++n) {
      PEAK_STEP(c0, a0, b0) PEAK_STEP(c1, a1, b0) PEAK_STEP(c2, a2, b0) PEAK_STEP(c3, a3, b0)
      PEAK_STEP(c4, a0, b1) PEAK_STEP(c5, a1, b1) PEAK_STEP(c6, a2, b1) PEAK_STEP(c7, a3, b1)
      b0 = peak_add(b0, one);
      b1 = peak_add(b1, one);
    }
    steps += 8 * kRound;
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  } while (elapsed < seconds);
  const PeakSums all = peak_add(peak_add(peak_add(c0, c1), peak_add(c2, c3)), peak_add(peak_add(c4, c5), peak_add(c6, c7)));
  volatile int sink = peak_lane(all);  // the sums are used: the loop stays
  (void)sink;
  return kProductsPerStep * static_cast<double>(steps) / elapsed;
}
#undef PEAK_STEP

}  // namespace

bool q8_rows_available() { return true; }

// The 8-bit roofline's peak (products a second, one multiply-add each): every thread of ATen's pool measures
// `products_per_second` at once, and their rates add up. torch._int_mm is no such peak where oneDNN has no 8-bit
// GEMM for the CPU (AVX2 without VNNI: 2.3 GFLOP/s on a Zen 3, where this kernel multiplies at ~190).
double q8_multiply_peak(double seconds) {
  const int64_t threads = at::get_num_threads();
  std::vector<double> rates(threads, 0.0);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) rates[t] = products_per_second(seconds, 3 + static_cast<int>(t));
  });
  double total = 0;
  for (const double r : rates) total += r;
  return total;
}

bool q8_rows_weights(const at::Tensor& w) {
  const int64_t bytes = w.dim() == 3 ? w.size(2) : 0;
  return w.scalar_type() == at::kByte && (bytes == Q4_1Groups::kBytes || bytes == Q8_0Groups::kBytes) &&
         w.is_contiguous();
}

void q8_round_rows(const float* x, int64_t m0, int64_t m1, Q8Inputs& in) {
  const int64_t K = in.K;
  for (int64_t i = m0; i < m1; ++i) quantize_row(x + i * K, in.q.data() + i * K, in.scales.data() + i * (K / 32), K);
}

void q8_round_inputs(const float* x, int64_t M, int64_t K, Q8Inputs& in) {
  in.size_for(M, K);
  q8_round_rows(x, 0, M, in);
}

void q8_rows_groups(const Q8Inputs& in, const at::Tensor& w, float* y, int64_t g0, int64_t g1) {
  const int64_t N = w.size(0) * kQ8GroupRows;
  const uint8_t* P = w.data_ptr<uint8_t>();
  if (w.size(2) == Q4_1Groups::kBytes)
    q8_groups_by_rows<Q4_1Groups>(in.q.data(), in.scales.data(), P, y, in.M, in.K, N, g0, g1);
  else
    q8_groups_by_rows<Q8_0Groups>(in.q.data(), in.scales.data(), P, y, in.M, in.K, N, g0, g1);
}

// x float32 (M, K); w interleaved Q4_1 or Q8_0 groups (N / G, K / 32, 20 G or 34 G) uint8, G = kQ8GroupRows.
at::Tensor q8_rows_linear(at::Tensor x, at::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && q8_rows_weights(w) && x.size(1) == w.size(1) * 32,
              "q8_rows_linear: float32 x (M, K), interleaved Q4_1 or Q8_0 groups w (N / G, K / 32, 20 G or 34 G)");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0) * kQ8GroupRows;
  // The rounded inputs live in buffers of the calling thread, reused call after call: as two tensors a call they
  // were 240 of the ~400 tensor allocations of a one-token pass through the C++ layer loop.
  thread_local Q8Inputs buffers;
  Q8Inputs& rounded = buffers;  // the calling thread's: a thread_local named in the loop would be each worker's own
  q8_round_inputs(x.data_ptr<float>(), M, K, rounded);
  auto y = at::empty({M, N}, x.options());
  float* out = y.data_ptr<float>();
  at::parallel_for(0, N / kQ8GroupRows, 8, [&](int64_t g0, int64_t g1) { q8_rows_groups(rounded, w, out, g0, g1); });
  return y;
}

#else  // no AVX2: the kernel is never planned (q8_rows_available)

bool q8_rows_available() { return false; }
double q8_multiply_peak(double) { TORCH_CHECK(false, "q8 rows: needs AVX2"); }
bool q8_rows_weights(const at::Tensor&) { return false; }
void q8_round_inputs(const float*, int64_t, int64_t, Q8Inputs&) { TORCH_CHECK(false, "q8 rows: needs AVX2"); }
void q8_round_rows(const float*, int64_t, int64_t, Q8Inputs&) { TORCH_CHECK(false, "q8 rows: needs AVX2"); }
void q8_rows_groups(const Q8Inputs&, const at::Tensor&, float*, int64_t, int64_t) {
  TORCH_CHECK(false, "q8 rows: needs AVX2");
}

at::Tensor q8_rows_linear(at::Tensor, at::Tensor) {
  TORCH_CHECK(false, "q8_rows_linear: needs AVX2, F16C and FMA");
}

#endif

TORCH_LIBRARY_FRAGMENT(specdecode, m) {
  m.def("q8_rows_available() -> bool", &q8_rows_available);
  m.def("q8_group_rows() -> int", [] { return kQ8GroupRows; });
  m.def("q8_rows_linear(Tensor x, Tensor w) -> Tensor", &q8_rows_linear);
  m.def("q8_multiply_peak(float seconds) -> float", &q8_multiply_peak);
}
