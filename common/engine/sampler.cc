#include "common/engine/sampler.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/base/fnv.h"

namespace preft::engine {
namespace {

constexpr float kGreedyEpsilon = 1e-5f;

}  // namespace

double UniformFromCounter(uint64_t seed, uint64_t step) {
  const uint64_t bits = base::SplitMix64(base::SplitMix64(seed) ^
                                         base::SplitMix64(step + 0x632be59bd9b4e019ull));
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

namespace {

// The distribution SampleToken draws from: candidates (scaled logit, id), best first when a
// filter needed the order; unnormalised weights (0 for tokens min-p drops); the first `keep`
// candidates survive top-p; `total` is the kept weight.
struct Distribution {
  std::vector<double> weights;
  size_t keep = 0;
  double total = 0;
};

void BuildDistribution(const float* logits, int64_t vocab, const SamplingParams& params,
                       std::vector<std::pair<float, int32_t>>* scratch, Distribution* d) {
  auto& cand = *scratch;
  cand.clear();
  const float inv_t = 1.f / params.temperature;
  for (int64_t i = 0; i < vocab; ++i) cand.emplace_back(logits[i] * inv_t, static_cast<int32_t>(i));
  auto better = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  const bool need_order = params.top_k > 0 || params.top_p < 1.f;
  if (params.top_k > 0 && params.top_k < vocab) {
    std::partial_sort(cand.begin(), cand.begin() + params.top_k, cand.end(), better);
    cand.resize(params.top_k);
  } else if (need_order) {
    std::sort(cand.begin(), cand.end(), better);
  }
  float max_logit = -INFINITY;
  for (const auto& c : cand) max_logit = std::max(max_logit, c.first);
  std::vector<double>& probs = d->weights;
  probs.resize(cand.size());
  double sum = 0.0;
  for (size_t i = 0; i < cand.size(); ++i) sum += probs[i] = std::exp(static_cast<double>(cand[i].first - max_logit));
  size_t keep = cand.size();
  if (params.top_p < 1.f) {  // smallest prefix whose mass reaches top_p
    double acc = 0.0;
    for (size_t i = 0; i < cand.size(); ++i) {
      acc += probs[i] / sum;
      if (acc >= params.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  // min_p relative to the most likely token (whose unnormalised weight is 1).
  const double min_weight = params.min_p;
  double total = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    if (probs[i] < min_weight) probs[i] = 0.0;
    total += probs[i];
  }
  d->keep = keep;
  d->total = total;
}

}  // namespace

int32_t SampleToken(const float* logits, int64_t vocab, const SamplingParams& params,
                    uint64_t seed, uint64_t step,
                    std::vector<std::pair<float, int32_t>>* scratch) {
  if (params.temperature <= kGreedyEpsilon) {
    return static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
  }
  Distribution d;
  BuildDistribution(logits, vocab, params, scratch, &d);
  const auto& cand = *scratch;
  const std::vector<double>& probs = d.weights;
  double target = UniformFromCounter(seed, step) * d.total;
  for (size_t i = 0; i < d.keep; ++i) {
    if (probs[i] == 0.0) continue;
    target -= probs[i];
    if (target < 0.0) return cand[i].second;
  }
  for (size_t i = d.keep; i-- > 0;)  // rounding left a sliver: last non-zero candidate
    if (probs[i] > 0.0) return cand[i].second;
  return cand[0].second;
}

TokenLogprob ComputeProcessedLogprobs(const float* logits, int64_t vocab,
                                      const SamplingParams& params, int32_t token, int32_t top_n,
                                      std::vector<std::pair<float, int32_t>>* scratch) {
  if (params.temperature <= kGreedyEpsilon) return ComputeLogprobs(logits, vocab, token, top_n);
  Distribution d;
  BuildDistribution(logits, vocab, params, scratch, &d);
  const auto& cand = *scratch;
  const double log_total = std::log(d.total);
  TokenLogprob out;
  out.token_id = token;
  out.logprob = -INFINITY;
  // Kept candidates with their logprob, most likely first (ties: lower id).
  std::vector<std::pair<double, int32_t>> kept;
  for (size_t i = 0; i < d.keep; ++i) {
    if (d.weights[i] == 0.0) continue;
    const double lp = std::log(d.weights[i]) - log_total;
    if (cand[i].second == token) out.logprob = lp;
    kept.emplace_back(lp, cand[i].second);
  }
  if (top_n > 0) {
    const size_t n = std::min<size_t>(top_n, kept.size());
    std::partial_sort(kept.begin(), kept.begin() + n, kept.end(), [](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    for (size_t i = 0; i < n; ++i) out.top.emplace_back(kept[i].second, kept[i].first);
  }
  return out;
}

TokenLogprob LogprobsFor(const float* logits, int64_t vocab, const SamplingParams& params,
                         int32_t token, std::vector<std::pair<float, int32_t>>* scratch) {
  const int32_t top_n = params.logprobs.value_or(0);
  return params.logprobs_mode == LogprobsMode::kProcessed
             ? ComputeProcessedLogprobs(logits, vocab, params, token, top_n, scratch)
             : ComputeLogprobs(logits, vocab, token, top_n);
}

TokenLogprob ComputeLogprobs(const float* logits, int64_t vocab, int32_t token, int32_t top_n) {
  double max_logit = -INFINITY;
  for (int64_t i = 0; i < vocab; ++i) max_logit = std::max(max_logit, static_cast<double>(logits[i]));
  double sum = 0.0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(logits[i] - max_logit);
  const double log_z = max_logit + std::log(sum);
  TokenLogprob out;
  out.token_id = token;
  out.logprob = logits[token] - log_z;
  if (top_n > 0) {
    std::vector<int32_t> ids(vocab);
    for (int64_t i = 0; i < vocab; ++i) ids[i] = static_cast<int32_t>(i);
    const int64_t n = std::min<int64_t>(top_n, vocab);
    std::partial_sort(ids.begin(), ids.begin() + n, ids.end(), [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    for (int64_t i = 0; i < n; ++i) out.top.emplace_back(ids[i], logits[ids[i]] - log_z);
  }
  return out;
}

}  // namespace preft::engine
