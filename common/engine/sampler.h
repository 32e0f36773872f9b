#pragma once

// Token sampling as a pure function of (logits, params, seed, step): a request's tokens do
// not depend on which worker ran it or on what else shared its batch.

#include <cstdint>
#include <vector>

#include "common/engine/request_params.h"

namespace preft::engine {

// Counter-based uniform in [0, 1) keyed by (seed, step).
double UniformFromCounter(uint64_t seed, uint64_t step);

// Picks the next token: greedy (lowest id on ties) or temperature + top-k + top-p + min-p,
// in vLLM's order. `scratch` avoids reallocations across calls.
int32_t SampleToken(const float* logits, int64_t vocab, const SamplingParams& params,
                    uint64_t seed, uint64_t step, std::vector<std::pair<float, int32_t>>* scratch);

// log-softmax of `token` and the `top_n` most likely tokens, computed in double.
TokenLogprob ComputeLogprobs(const float* logits, int64_t vocab, int32_t token, int32_t top_n);

// The logprobs of the distribution SampleToken draws from for `params` (temperature, top-k,
// top-p, min-p; renormalised over the tokens it keeps): `token` and the `top_n` most likely
// kept tokens. A token that could not be drawn gets -infinity. Greedy: ComputeLogprobs.
TokenLogprob ComputeProcessedLogprobs(const float* logits, int64_t vocab,
                                      const SamplingParams& params, int32_t token, int32_t top_n,
                                      std::vector<std::pair<float, int32_t>>* scratch);

// The token's logprobs in the request's logprobs_mode (params.logprobs alternatives).
TokenLogprob LogprobsFor(const float* logits, int64_t vocab, const SamplingParams& params,
                         int32_t token, std::vector<std::pair<float, int32_t>>* scratch);

}  // namespace preft::engine
