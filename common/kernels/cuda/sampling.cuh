#pragma once

// Token choice on the GPU, so a decode step copies back a token per row instead of a row of
// logits: greedy picks and their log-probabilities, as common/engine/sampler.cc computes them.

#include <cstdint>

namespace preft::kernels::cuda {

// For each row of logits [rows, vocab]: token[r] = argmax (the lowest id on ties, as the CPU
// sampler) and logprob[r] = its log-softmax under the full distribution (sums in double).
int GreedyLogprob(const float* logits, int64_t rows, int64_t vocab, int32_t* token,
                  float* logprob, void* stream);

}  // namespace preft::kernels::cuda
