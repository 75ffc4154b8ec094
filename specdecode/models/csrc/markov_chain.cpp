// markov_chain: DSpark's sequential stage (the vanilla Markov head) in one call, greedy or sampled.
//
// Why: at inference the stage is G steps a request of a few small ops each (the previous token's Markov
// embedding, its low-rank bias over the draft vocabulary, the choice of the token, the draft-to-target id
// map): ~0.9 ms a round of dispatch at temperature 0 on a 2-core EPYC for ~4 M multiply-adds, more when
// sampling. Row r: prev = anchors[r]; for k < G: e = w1[prev]; z = base[r, k] + w2t^T e; then at temperature
// t = temperatures[r] = 0 the draft is d = argmax z (the first of equal maxima, as torch.argmax) and
// out[r, k] = z; at t > 0, q = softmax(z / t) is written to out[r, k] and d is drawn from q by inverting its
// CDF (summed in double, as sampling.sample does) at uniforms[r, k] (drawn by the caller from the request's
// generator); tokens[r, k] = d + d2t[d] (the target's id); prev = tokens[r, k]. The q returned is exactly the
// distribution d was drawn from, which is all that verification's min(1, p/q) needs.
// w2t is the low-rank bias matrix transposed (rank, N) in bfloat16 (as the drafter's linears stream it), so
// the bias is a sum of rows that vectorizes over the vocabulary; a step reads all of it (1 MB for rank 64
// over 8,192 tokens), so the cores split the vocabulary: measured 0.47 ms a 7-step greedy chain on two cores
// (0.9 ms as separate ops), most of it reading the matrix from L3.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

constexpr int64_t kChunk = 1024;  // vocabulary entries a thread takes at least

namespace {

// q = softmax(z / t) in place over N entries; returns the index where the double-precision CDF of q first
// exceeds u times its total (searchsorted right), at most N - 1.
int64_t sample_in_place(float* z, int64_t N, float t, double u) {
  float top = -INFINITY;
  for (int64_t n = 0; n < N; ++n) {
    z[n] /= t;
    top = std::max(top, z[n]);
  }
  float sum = 0.f;
  for (int64_t n = 0; n < N; ++n) {
    z[n] = std::exp(z[n] - top);
    sum += z[n];
  }
  double total = 0.0;
  for (int64_t n = 0; n < N; ++n) {
    z[n] /= sum;
    total += z[n];
  }
  const double target = u * total;
  double cdf = 0.0;
  for (int64_t n = 0; n < N; ++n) {
    cdf += z[n];
    if (cdf > target) return n;
  }
  return N - 1;
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> markov_chain(torch::Tensor base, torch::Tensor w1,
                                                                     torch::Tensor w2t,
                                                                     c10::optional<torch::Tensor> d2t,
                                                                     torch::Tensor anchors,
                                                                     std::vector<double> temperatures,
                                                                     c10::optional<torch::Tensor> uniforms) {
  TORCH_CHECK(base.dim() == 3 && base.scalar_type() == at::kFloat && w1.scalar_type() == at::kFloat &&
                  w2t.scalar_type() == at::kBFloat16 && anchors.scalar_type() == at::kLong,
              "markov_chain: float32 logits (R, G, N) and embedding (V, rank), bfloat16 bias (rank, N); long anchors");
  base = base.contiguous();
  w1 = w1.contiguous();
  w2t = w2t.contiguous();
  anchors = anchors.contiguous();
  const int64_t R = base.size(0), G = base.size(1), N = base.size(2), rank = w1.size(1);
  TORCH_CHECK(w2t.size(0) == rank && w2t.size(1) == N && anchors.size(0) == R &&
                  static_cast<int64_t>(temperatures.size()) == R,
              "markov_chain: shapes");
  const bool sampling = std::any_of(temperatures.begin(), temperatures.end(), [](double t) { return t > 0; });
  torch::Tensor draws;
  if (sampling) {
    TORCH_CHECK(uniforms && uniforms->scalar_type() == at::kDouble && uniforms->size(0) == R && uniforms->size(1) == G,
                "markov_chain: sampling needs uniforms (R, G) in float64");
    draws = uniforms->contiguous();
  }
  torch::Tensor map;
  if (d2t) {
    map = d2t->contiguous();
    TORCH_CHECK(map.scalar_type() == at::kLong && map.numel() == N, "markov_chain: d2t (N) long");
  }
  auto logits = torch::empty_like(base);
  auto embedded = torch::empty({R, G, rank}, base.options());
  auto tokens = torch::empty({R, G}, anchors.options());
  const float *bp = base.data_ptr<float>(), *w1p = w1.data_ptr<float>();
  const uint16_t* w2p = reinterpret_cast<const uint16_t*>(w2t.data_ptr<at::BFloat16>());
  const int64_t* mp = d2t ? map.data_ptr<int64_t>() : nullptr;
  const int64_t* ap = anchors.data_ptr<int64_t>();
  float *lp = logits.data_ptr<float>(), *ep = embedded.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  const int64_t vocab = w1.size(0);
  for (int64_t r = 0; r < R; ++r) {
    int64_t prev = ap[r];
    for (int64_t k = 0; k < G; ++k) {
      TORCH_CHECK(prev >= 0 && prev < vocab, "markov_chain: token id out of the embedding's range");
      const float* e = w1p + prev * rank;
      float* out = lp + (r * G + k) * N;
      std::copy(e, e + rank, ep + (r * G + k) * rank);
      at::parallel_for(0, N, kChunk, [&](int64_t begin, int64_t end) {
        std::copy(bp + (r * G + k) * N + begin, bp + (r * G + k) * N + end, out + begin);
        for (int64_t j = 0; j < rank; ++j) {
          const float ej = e[j];
          const uint16_t* row = w2p + j * N;
          for (int64_t n = begin; n < end; ++n) {
            const uint32_t bits = static_cast<uint32_t>(row[n]) << 16;  // bfloat16 -> float32, exactly
            float w;
            std::memcpy(&w, &bits, sizeof(w));
            out[n] += ej * w;
          }
        }
      });
      int64_t best = 0;
      if (temperatures[r] > 0) {
        best = sample_in_place(out, N, static_cast<float>(temperatures[r]), draws.data_ptr<double>()[r * G + k]);
      } else {
        for (int64_t n = 1; n < N; ++n)
          if (out[n] > out[best]) best = n;
      }
      prev = mp ? best + mp[best] : best;
      tp[r * G + k] = prev;
    }
  }
  return {tokens, logits, embedded};
}

TORCH_LIBRARY_FRAGMENT(specdecode, m) {
  m.def(
      "markov_chain(Tensor base, Tensor w1, Tensor w2t, Tensor? d2t, Tensor anchors, float[] temperatures, "
      "Tensor? uniforms) -> (Tensor, Tensor, Tensor)",
      &markov_chain);
}
