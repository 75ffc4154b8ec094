// markov_chain: DSpark's sequential stage (the vanilla Markov head) in one call, greedy or sampled.
//
// Why: at inference the stage is G steps a request of a few small ops each (the previous token's Markov
// embedding, its low-rank bias over the draft vocabulary, the choice of the token, the draft-to-target id
// map): ~0.9 ms a round of dispatch at temperature 0 on a 2-core EPYC for ~4 M multiply-adds, more when
// sampling. Row r: prev = anchors[r]; for k < G: e = w1[prev]; z = base[r, k] + w2 e; then at temperature
// t = temperatures[r] = 0 the draft is d = argmax z (the first of equal maxima, as torch.argmax) and
// out[r, k] = z; at t > 0, q = softmax(z / t) is written to out[r, k] and d is drawn from q by inverting its
// CDF (summed in double, by parts of the vocabulary) at uniforms[r, k] (drawn by the caller from the request's
// generator); tokens[r, k] = d + d2t[d] (the target's id); prev = tokens[r, k]. The q returned is exactly the
// distribution d was drawn from, which is all that verification's min(1, p/q) needs.
// The bias matrix comes in bfloat16 blocks (`markov_bias_blocks`), so a step streams it once (1 MB for rank 64
// over 8,192 tokens, from the caches after the first step) while the block's sums stay in registers; the cores
// split the vocabulary. A 7-step chain over 8,192 x 64, alone on two Zen 4 cores (medians of 200): greedy
// 169 -> 78 us, sampled 430 -> 128 us against stop 44's loop (which read w2 transposed row by row, rewrote the
// sums once per j, found the maximum in a scalar scan and sampled on one core with std::exp).
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "vectors.h"

namespace {

// Threads take whole parts of the vocabulary, and every partial result (a maximum, a sum) is a part's, added
// in part order: no draft and no q depends on the number of threads.
constexpr int64_t kPart = 1024;
constexpr int64_t kBias = 8 * kLanes;  // vocabulary entries of a block of the bias matrix (see add_bias)

struct Part {
  float top = -INFINITY;  // the largest z (greedy: the first index holding it is `best`)
  int64_t best = 0;
  float sum = 0.f;     // of exp(z - max)
  double total = 0.0;  // of q
};

// Where entry i (0 <= i < kBias) of a block row sits: entries come in pairs of vectors, the first kLanes in
// the even 16-bit slots of 2 kLanes and the next kLanes in the odd ones, so one load and a shift or a mask
// widens each vector exactly (a 32-bit lane's high half read as a float is its odd entry), without shuffles.
inline int64_t slot(int64_t i) {
  const int64_t pair = i / (2 * kLanes), at = i % (2 * kLanes);
  return pair * 2 * kLanes + (at < kLanes ? 2 * at : 2 * (at - kLanes) + 1);
}

inline float widen(uint16_t bits) {  // bfloat16 -> float32, exactly
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float w;
  std::memcpy(&w, &wide, sizeof(w));
  return w;
}

// z[n] = base[n] + sum_j e[j] w2[n, j] for n in [begin, end) (begin a multiple of kBias): per entry the
// products in order of j, each rounded and then added (built with -ffp-contract=off), as the scalar loop of
// stop 44 computed them, bit for bit. `blocks` holds w2 as `markov_bias_blocks` lays it out: (N / kBias, rank,
// kBias), zero-padded, so each block's weights are one contiguous stream, and a block keeps its entries in
// registers over the rank, so z is written once, not once per j. Read as rows of w2 transposed (rank, N)
// and widened by a generic conversion (two halves and a shuffle per vector), the bias of a step over
// 8,192 x 64 took 17 us of the step's 23 us on two Zen 4 cores; now ~8 us.
void add_bias(const float* base, const float* e, const uint16_t* blocks, int64_t rank, int64_t begin, int64_t end,
              float* z) {
  constexpr int kVectors = kBias / kLanes;
  for (int64_t n = begin; n < end; n += kBias) {
    const uint16_t* block = blocks + (n / kBias) * rank * kBias;
    if (n + kBias <= end) {
      vf acc[kVectors];
      for (int i = 0; i < kVectors; ++i) acc[i] = load_v(base + n + i * kLanes);
      for (int64_t j = 0; j < rank; ++j) {
        const vf ej = vf{} + e[j];
        const uint16_t* row = block + j * kBias;
        for (int i = 0; i < kVectors; i += 2) {
          u32v bits;
          std::memcpy(&bits, row + i * kLanes, sizeof(bits));
          const u32v even = bits << 16, odd = bits & 0xFFFF0000u;
          vf lo, hi;
          std::memcpy(&lo, &even, sizeof(lo));
          std::memcpy(&hi, &odd, sizeof(hi));
          acc[i] = acc[i] + ej * lo;
          acc[i + 1] = acc[i + 1] + ej * hi;
        }
      }
      std::memcpy(z + n, acc, sizeof(acc));
      continue;
    }
    for (int64_t i = 0; i < end - n; ++i) {  // the last, partial block
      float sum = base[n + i];
      for (int64_t j = 0; j < rank; ++j) sum += e[j] * widen(block[j * kBias + slot(i)]);
      z[n + i] = sum;
    }
  }
}

// Runs f(part, begin, end) for every part of N entries, the parts split among the threads.
template <typename F>
void for_parts(int64_t N, const F& f) {
  at::parallel_for(0, (N + kPart - 1) / kPart, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) f(p, p * kPart, std::min(N, (p + 1) * kPart));
  });
}

// The first index of the largest of z[begin .. end) (as torch.argmax) and that value: per lane the first of its
// maxima, then the lanes' (the scalar scan, one compare after another, took 8 us of a step).
typedef int32_t vi __attribute__((vector_size(kLanes * 4)));
std::pair<int64_t, float> first_max(const float* z, int64_t begin, int64_t end) {
  int64_t best = begin;
  int64_t n = begin;
  if (end - begin >= kLanes) {
    vf top = load_v(z + n), at;
    vi index, where;
    for (int i = 0; i < kLanes; ++i) index[i] = i;
    where = index;
    for (n += kLanes; n + kLanes <= end; n += kLanes) {
      at = load_v(z + n);
      index += kLanes;
      const vi larger = at > top;
      top = larger ? at : top;
      where = larger ? index : where;
    }
    best = begin + where[0];
    for (int i = 1; i < kLanes; ++i)
      if (top[i] > z[best] || (top[i] == z[best] && begin + where[i] < best)) best = begin + where[i];
  }
  for (; n < end; ++n)
    if (z[n] > z[best]) best = n;
  return {best, z[best]};
}

// The greedy draft: the first index of the largest z, computing z part by part.
int64_t greedy_step(const float* base, const float* e, const uint16_t* blocks, int64_t rank, int64_t N, float* z,
                    std::vector<Part>& parts) {
  for_parts(N, [&](int64_t p, int64_t begin, int64_t end) {
    add_bias(base, e, blocks, rank, begin, end, z);
    std::tie(parts[p].best, parts[p].top) = first_max(z, begin, end);
  });
  int64_t best = parts[0].best;
  for (const Part& part : parts)
    if (part.top > z[best]) best = part.best;
  return best;
}

// The sampled draft: z becomes q = softmax(z / t), and the draft is the index where the double-precision CDF of
// q first exceeds u times its total (searchsorted right), at most N - 1.
int64_t sampled_step(const float* base, const float* e, const uint16_t* blocks, int64_t rank, int64_t N, float* z,
                     float t, double u, std::vector<Part>& parts) {
  for_parts(N, [&](int64_t p, int64_t begin, int64_t end) {
    add_bias(base, e, blocks, rank, begin, end, z);
    vf tops = vf{} - INFINITY;
    int64_t n = begin;
    for (; n + kLanes <= end; n += kLanes) {
      const vf at = load_v(z + n) / t;
      std::memcpy(z + n, &at, sizeof(at));
      tops = at > tops ? at : tops;
    }
    float top = -INFINITY;
    for (int i = 0; i < kLanes; ++i) top = std::max(top, tops[i]);
    for (; n < end; ++n) top = std::max(top, z[n] /= t);
    parts[p].top = top;
  });
  float top = -INFINITY;
  for (const Part& part : parts) top = std::max(top, part.top);
  for_parts(N, [&](int64_t p, int64_t begin, int64_t end) {
    v8 sums{};
    int64_t n = begin;
    for (; n + 8 <= end; n += 8) {
      v8 x;
      std::memcpy(&x, z + n, sizeof(x));
      x = exp8(x - top);
      std::memcpy(z + n, &x, sizeof(x));
      sums += x;
    }
    float sum = 0.f;
    for (int i = 0; i < 8; ++i) sum += sums[i];
    for (; n < end; ++n) sum += (z[n] = exp1(z[n] - top));
    parts[p].sum = sum;
  });
  float sum = 0.f;
  for (const Part& part : parts) sum += part.sum;
  for_parts(N, [&](int64_t p, int64_t begin, int64_t end) {
    double totals[4] = {0.0, 0.0, 0.0, 0.0};  // four chains: a double add's latency, not its throughput
    for (int64_t n = begin; n < end; ++n) {
      z[n] /= sum;
      totals[(n - begin) % 4] += z[n];
    }
    parts[p].total = (totals[0] + totals[1]) + (totals[2] + totals[3]);
  });
  double total = 0.0;
  for (const Part& part : parts) total += part.total;
  const double target = u * total;
  double cdf = 0.0;
  size_t p = 0;
  while (p + 1 < parts.size() && cdf + parts[p].total <= target) cdf += parts[p++].total;
  for (int64_t n = static_cast<int64_t>(p) * kPart; n < N; ++n) {
    cdf += z[n];
    if (cdf > target) return n;
  }
  return N - 1;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> markov_chain(at::Tensor base, at::Tensor w1,
                                                                     at::Tensor bias_blocks,
                                                                     c10::optional<at::Tensor> d2t,
                                                                     at::Tensor anchors,
                                                                     std::vector<double> temperatures,
                                                                     c10::optional<at::Tensor> uniforms) {
  TORCH_CHECK(base.dim() == 3 && base.scalar_type() == at::kFloat && w1.scalar_type() == at::kFloat &&
                  bias_blocks.scalar_type() == at::kBFloat16 && anchors.scalar_type() == at::kLong,
              "markov_chain: float32 logits (R, G, N) and embedding (V, rank), bfloat16 bias blocks; long anchors");
  base = base.contiguous();
  w1 = w1.contiguous();
  bias_blocks = bias_blocks.contiguous();
  anchors = anchors.contiguous();
  const int64_t R = base.size(0), G = base.size(1), N = base.size(2), rank = w1.size(1);
  TORCH_CHECK(bias_blocks.dim() == 3 && bias_blocks.size(0) == (N + kBias - 1) / kBias && bias_blocks.size(1) == rank &&
                  bias_blocks.size(2) == kBias && anchors.size(0) == R &&
                  static_cast<int64_t>(temperatures.size()) == R,
              "markov_chain: shapes");
  const bool sampling = std::any_of(temperatures.begin(), temperatures.end(), [](double t) { return t > 0; });
  at::Tensor draws;
  if (sampling) {
    TORCH_CHECK(uniforms && uniforms->scalar_type() == at::kDouble && uniforms->size(0) == R && uniforms->size(1) == G,
                "markov_chain: sampling needs uniforms (R, G) in float64");
    draws = uniforms->contiguous();
  }
  at::Tensor map;
  if (d2t) {
    map = d2t->contiguous();
    TORCH_CHECK(map.scalar_type() == at::kLong && map.numel() == N, "markov_chain: d2t (N) long");
  }
  auto logits = at::empty_like(base);
  auto embedded = at::empty({R, G, rank}, base.options());
  auto tokens = at::empty({R, G}, anchors.options());
  const float *bp = base.data_ptr<float>(), *w1p = w1.data_ptr<float>();
  const uint16_t* blocks = reinterpret_cast<const uint16_t*>(bias_blocks.data_ptr<at::BFloat16>());
  const int64_t* mp = d2t ? map.data_ptr<int64_t>() : nullptr;
  const int64_t* ap = anchors.data_ptr<int64_t>();
  float *lp = logits.data_ptr<float>(), *ep = embedded.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  const int64_t vocab = w1.size(0);
  std::vector<Part> parts((N + kPart - 1) / kPart);
  for (int64_t r = 0; r < R; ++r) {
    int64_t prev = ap[r];
    for (int64_t k = 0; k < G; ++k) {
      TORCH_CHECK(prev >= 0 && prev < vocab, "markov_chain: token id out of the embedding's range");
      const float* e = w1p + prev * rank;
      const float* b = bp + (r * G + k) * N;
      float* out = lp + (r * G + k) * N;
      std::copy(e, e + rank, ep + (r * G + k) * rank);
      const int64_t best =
          temperatures[r] > 0
              ? sampled_step(b, e, blocks, rank, N, out, static_cast<float>(temperatures[r]),
                             draws.data_ptr<double>()[r * G + k], parts)
              : greedy_step(b, e, blocks, rank, N, out, parts);
      prev = mp ? best + mp[best] : best;
      tp[r * G + k] = prev;
    }
  }
  return {tokens, logits, embedded};
}

// w2 (N, rank) float32 or bfloat16 -> (ceil(N / kBias), rank, kBias) bfloat16 blocks for markov_chain, each
// entry rounded to bfloat16 (to nearest even) and placed as `slot` says; padding is zero.
at::Tensor markov_bias_blocks(at::Tensor w2) {
  TORCH_CHECK(w2.dim() == 2, "markov_bias_blocks: w2 (N, rank)");
  const auto w = w2.to(at::kBFloat16).contiguous();
  const int64_t N = w.size(0), rank = w.size(1), count = (N + kBias - 1) / kBias;
  auto blocks = at::zeros({count, rank, kBias}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(blocks.data_ptr<at::BFloat16>());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < rank; ++j) dst[((n / kBias) * rank + j) * kBias + slot(n % kBias)] = src[n * rank + j];
  return blocks;
}

TORCH_LIBRARY_FRAGMENT(specdecode, m) {
  m.def(
      "markov_chain(Tensor base, Tensor w1, Tensor bias_blocks, Tensor? d2t, Tensor anchors, float[] temperatures, "
      "Tensor? uniforms) -> (Tensor, Tensor, Tensor)",
      &markov_chain);
  m.def("markov_bias_blocks(Tensor w2) -> Tensor", &markov_bias_blocks);
}
