#pragma once

// Token choice on the GPU, so a decode step copies back a token per row instead of a row of
// logits: greedy picks with their log-probabilities, and the CPU sampler's full choice
// (common/engine/sampler.cc) from the same counter-based uniform, so a seeded request draws
// the same tokens on either backend.

#include <cstddef>
#include <cstdint>

namespace preft::kernels::cuda {

// For each row of logits [rows, vocab]: token[r] = argmax (the lowest id on ties, as the CPU
// sampler) and logprob[r] = its log-softmax under the full distribution (sums in double).
int GreedyLogprob(const float* logits, int64_t rows, int64_t vocab, int32_t* token,
                  float* logprob, void* stream);

// How one row is sampled: the fields of engine::SamplingParams that choose a token, and the
// (seed, step) that key its uniform draw.
struct SampleSpec {
  float temperature = 0.f;  // <= 1e-5: greedy
  float top_p = 1.f;
  float min_p = 0.f;
  int32_t top_k = 0;  // 0: off
  uint64_t seed = 0;
  uint64_t step = 0;
};

// Device workspace SampleRows needs for `rows` rows of `vocab` logits.
size_t SampleWorkspaceBytes(int64_t rows, int64_t vocab);

// token[r] = SampleToken(logits row r, specs[r], specs[r].seed, specs[r].step): greedy, or
// temperature, then top-k, top-p and min-p in vLLM's order, then the inverse CDF at
// UniformFromCounter(seed, step) - over candidates sorted best first (stable, so ties keep
// id order) when top-k or top-p asks for an order, else in id order, as the CPU does. The
// probability sums run in double but in another order than the CPU's: a uniform within
// rounding (~1e-15) of a boundary may pick the neighbour. specs is a device array.
int SampleRows(const float* logits, int64_t rows, int64_t vocab, const SampleSpec* specs,
               int32_t* token, void* workspace, size_t workspace_bytes, void* stream);

}  // namespace preft::kernels::cuda
