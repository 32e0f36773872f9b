#pragma once

// What one forward pass computes: the new tokens of many sequences, grouped by sequence.
// Prompt chunks and single decode tokens mix freely (continuous batching), and so do
// adapters: each sequence names its adapter (or none) and each token says whether the
// adapter applies to it (PreFT: prompt tokens only).

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "common/model/adapter_weights.h"

namespace preft::model {

struct ForwardBatch {
  struct Sequence {
    // Blocks holding this sequence's KV; must cover `context_len` tokens.
    const int32_t* block_table = nullptr;
    int64_t num_blocks = 0;
    int64_t num_new = 0;                      // its new tokens, contiguous in `token_ids`
    int64_t context_len = 0;                  // tokens in the cache after this step
    const AdapterWeights* adapter = nullptr;  // none: base model only
  };

  std::vector<int32_t> token_ids;     // [num_tokens]
  std::vector<int32_t> positions;     // [num_tokens]: context_len - num_new + i within a sequence
  std::vector<Sequence> sequences;    // in token order
  std::vector<int32_t> logit_rows;    // indices into token_ids whose logits are wanted
  std::vector<uint8_t> adapter_mask;  // [num_tokens]: 1 = apply the sequence's adapter here

  int64_t num_tokens() const { return static_cast<int64_t>(token_ids.size()); }

  // Appends a sequence's new tokens; positions continue from context_len - tokens.size().
  // With an adapter, `mask` ([num_new], null = every token) says where it applies.
  void AddSequence(const int32_t* block_table, int64_t num_blocks, const int32_t* tokens,
                   int64_t num_new, int64_t context_len, bool want_logits,
                   const AdapterWeights* adapter = nullptr, const uint8_t* mask = nullptr);

  // Checks internal consistency against a vocabulary and block size (InvalidArgument if not).
  absl::Status Validate(int64_t vocab_size, int64_t block_tokens) const;
};

}  // namespace preft::model
