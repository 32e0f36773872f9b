#pragma once

// The engine's side of prefix caching (kv::BlockAllocator keeps the blocks): which tokens a
// sequence's adapter runs on, and the content addresses of its full blocks.
//
// The PreFT rules follow from what a block's hash covers (kv::HashBlock): the token ids up to
// the block's end, the adapter's weights (their serial: a new version, a reload or another
// adapter is another salt; the base model is 0) and, token by token, whether the adapter ran.
// So a multi-turn chat's previous reply, decoded without a prompt-only adapter, never serves the
// next turn, where it is prompt and adapted (its mask differs); a base request's reply does
// (no mask on either side). pyreft position specs that depend on the prompt's length ("l3", or
// "f3" clamped to half a short prompt) share a block across lengths only where the block's mask
// comes out the same, which is exactly when its KV is the same.

#include <cstdint>
#include <vector>

#include "common/kv/block_hash.h"
#include "common/model/adapter_weights.h"

namespace preft::engine {

// What shapes a sequence's KV besides its tokens.
struct AdapterRun {
  const model::AdapterWeights* weights = nullptr;  // null: the base model
  model::AdapterPositions positions = model::AdapterPositions::kAll;
  int64_t num_prompt = 0;

  // Whether the adapter runs on the token at `position`: the prompt tokens its selection
  // picks; generated ones only when it runs on all positions.
  bool RunsAt(int64_t position) const;
};

// Extends `hashes` (the chained hashes of the first blocks of `tokens`, in order) to the first
// `num_blocks` blocks of `block_tokens` tokens each; `tokens` must cover them.
void ExtendBlockHashes(const std::vector<int32_t>& tokens, int64_t num_blocks,
                       int64_t block_tokens, const AdapterRun& run,
                       std::vector<kv::BlockHash>* hashes);

}  // namespace preft::engine
