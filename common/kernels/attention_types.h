#pragma once

// The paged KV cache layout and per-sequence attention work, shared by the CPU and CUDA
// attention kernels so one cache format serves both. Pointers are host memory for the CPU
// kernels and device memory for the CUDA ones.

#include <cstdint>

namespace preft::kernels {

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

}  // namespace preft::kernels
