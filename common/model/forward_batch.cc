#include "common/model/forward_batch.h"

#include "absl/strings/str_cat.h"

namespace preft::model {

void ForwardBatch::AddSequence(const int32_t* block_table, int64_t num_blocks,
                               const int32_t* tokens, int64_t num_new, int64_t context_len,
                               bool want_logits, const AdapterWeights* adapter,
                               const uint8_t* mask) {
  sequences.push_back({block_table, num_blocks, num_new, context_len, adapter});
  const int64_t first_pos = context_len - num_new;
  for (int64_t i = 0; i < num_new; ++i) {
    token_ids.push_back(tokens[i]);
    positions.push_back(static_cast<int32_t>(first_pos + i));
    adapter_mask.push_back(adapter == nullptr ? 0 : mask == nullptr ? 1 : (mask[i] != 0));
  }
  if (want_logits) logit_rows.push_back(static_cast<int32_t>(token_ids.size() - 1));
}

absl::Status ForwardBatch::Validate(int64_t vocab_size, int64_t block_tokens) const {
  if (positions.size() != token_ids.size()) {
    return absl::InvalidArgumentError("forward batch: positions and token_ids differ in length");
  }
  if (adapter_mask.size() != token_ids.size()) {
    return absl::InvalidArgumentError("forward batch: adapter_mask and token_ids differ in length");
  }
  int64_t total = 0;
  for (const Sequence& s : sequences) {
    if (s.num_new <= 0 || s.context_len < s.num_new) {
      return absl::InvalidArgumentError(
          absl::StrCat("forward batch: sequence with ", s.num_new, " new of ", s.context_len));
    }
    if (s.num_blocks * block_tokens < s.context_len) {
      return absl::InvalidArgumentError(absl::StrCat(
          "forward batch: ", s.num_blocks, " blocks cannot hold ", s.context_len, " tokens"));
    }
    if (s.adapter == nullptr) {
      for (int64_t i = total; i < total + s.num_new && i < num_tokens(); ++i) {
        if (adapter_mask[i]) {
          return absl::InvalidArgumentError(
              "forward batch: adapter mask set on a sequence without adapter");
        }
      }
    }
    total += s.num_new;
  }
  if (total != num_tokens()) {
    return absl::InvalidArgumentError("forward batch: sequences do not cover the tokens");
  }
  for (int32_t id : token_ids) {
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", id, " is outside the vocabulary [0, ", vocab_size, ")"));
    }
  }
  for (int32_t r : logit_rows) {
    if (r < 0 || r >= num_tokens()) {
      return absl::InvalidArgumentError(absl::StrCat("forward batch: logit row ", r));
    }
  }
  return absl::OkStatus();
}

}  // namespace preft::model
