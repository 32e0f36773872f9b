#pragma once

// Causal attention of new query tokens over a paged KV cache (GQA-aware).

#include <cstdint>

namespace preft::kernels::cpu {

// Where one layer's K and V blocks live. Block b of a sequence holds K at
// `k_base + block_table[b] * block_stride` laid out [kv_head][head_dim][block_tokens]
// (transposed), and V at the same place plus `v_offset`, laid out
// [kv_head][block_tokens][head_dim].
struct PagedKvLayout {
  const float* k_base = nullptr;
  int64_t block_stride = 0;  // floats between consecutive blocks
  int64_t v_offset = 0;      // floats from a block's K to its V
  int64_t block_tokens = 16;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
};

// One sequence's attention work in a batch. The new tokens sit at positions
// [context_len - num_new, context_len); their K/V must already be in the cache.
struct AttentionSeq {
  const float* q = nullptr;  // [num_new, num_heads, head_dim]
  float* out = nullptr;      // [num_new, num_heads, head_dim]
  const int32_t* block_table = nullptr;
  int64_t num_new = 0;
  int64_t context_len = 0;
};

// Runs every sequence (parallel over sequences and heads). softmax scale = `scale`. With
// `window` > 0 (Mistral's sliding window) a query at position i sees keys j with
// i - window < j <= i; otherwise every j <= i.
void PagedAttention(const AttentionSeq* seqs, int64_t num_seqs, const PagedKvLayout& layout,
                    int64_t num_heads, float scale, int64_t window = 0);

}  // namespace preft::kernels::cpu
