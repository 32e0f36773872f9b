#pragma once

// Content addresses of full KV blocks, for prefix caching: a block's hash names everything its
// K and V depend on, so two blocks with one hash hold the same bytes. Attention is causal, so a
// block's KV is fixed by the tokens up to its end and by which of them the adapter touched: the
// hash chains the parent block's hash, a salt (the adapter's weights, 0 for the base model), the
// block's token ids and its adapter mask. SHA-256 (OpenSSL): clients choose the tokens, and a
// hash they could collide would let one client's prompt read KV computed for another's.

#include <array>
#include <cstdint>

namespace preft::kv {

using BlockHash = std::array<uint8_t, 32>;

// The hash of a block of `n` tokens whose predecessor's hash is `parent` (all zeros for the
// first block). `mask[i]` is whether the adapter ran on token i (null: on none).
BlockHash HashBlock(const BlockHash& parent, uint64_t salt, const int32_t* tokens,
                    const uint8_t* mask, int64_t n);

}  // namespace preft::kv
