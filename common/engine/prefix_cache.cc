#include "common/engine/prefix_cache.h"

#include "common/base/check.h"

namespace preft::engine {

bool AdapterRun::RunsAt(int64_t position) const {
  if (weights == nullptr) return false;
  return position < num_prompt ? weights->prompt_selection.Selected(position, num_prompt)
                               : positions == model::AdapterPositions::kAll;
}

void ExtendBlockHashes(const std::vector<int32_t>& tokens, int64_t num_blocks,
                       int64_t block_tokens, const AdapterRun& run,
                       std::vector<kv::BlockHash>* hashes) {
  PREFT_CHECK(num_blocks * block_tokens <= static_cast<int64_t>(tokens.size()));
  const uint64_t salt = run.weights != nullptr ? run.weights->serial() : 0;
  std::vector<uint8_t> mask(block_tokens);
  for (int64_t b = static_cast<int64_t>(hashes->size()); b < num_blocks; ++b) {
    const int64_t begin = b * block_tokens;
    for (int64_t i = 0; i < block_tokens; ++i) mask[i] = run.RunsAt(begin + i) ? 1 : 0;
    const kv::BlockHash parent = b == 0 ? kv::BlockHash{} : (*hashes)[b - 1];
    hashes->push_back(kv::HashBlock(parent, salt, tokens.data() + begin, mask.data(), block_tokens));
  }
}

}  // namespace preft::engine
