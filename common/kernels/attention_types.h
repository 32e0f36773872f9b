#pragma once

// The paged KV cache layout and per-sequence attention work, shared by the CPU and CUDA
// attention kernels so one cache format serves both. Pointers are host memory for the CPU
// kernels and device memory for the CUDA ones.

#include <cstdint>
#include <string_view>

namespace preft::kernels {

// The element type of a KV cache. Its own enum, not DType (dtype.h): DTypeSize answers 2 for
// every non-f32 weight type, and weight loading relies on that (docs/plans/kv-dtype.md).
// fp8 e4m3 stores each element divided by its layer's and KV head's scale (KvScales).
enum class KvDtype : uint8_t { kF32, kBF16, kFp8E4M3 };

constexpr int64_t KvDtypeBytes(KvDtype d) {
  switch (d) {
    case KvDtype::kF32: return 4;
    case KvDtype::kBF16: return 2;
    case KvDtype::kFp8E4M3: return 1;
  }
  return 4;
}

// The spelling in KvLayout (and so in its hash) and in messages; "f32" is pinned by the
// layout hash peers compare, so it must not change.
constexpr std::string_view KvDtypeName(KvDtype d) {
  switch (d) {
    case KvDtype::kF32: return "f32";
    case KvDtype::kBF16: return "bf16";
    case KvDtype::kFp8E4M3: return "fp8_e4m3";
  }
  return "f32";
}

// The dtype KvDtypeName spells `name`; false for any other name.
constexpr bool ParseKvDtype(std::string_view name, KvDtype* out) {
  for (KvDtype d : {KvDtype::kF32, KvDtype::kBF16, KvDtype::kFp8E4M3}) {
    if (KvDtypeName(d) == name) {
      *out = d;
      return true;
    }
  }
  return false;
}

// Where one layer's K and V blocks live. Block b of a sequence holds K at
// `k_base + block_table[b] * block_stride` laid out [kv_head][head_dim][block_tokens]
// (transposed), and V at the same place plus `v_offset`, laid out
// [kv_head][block_tokens][head_dim]. Offsets count elements of `dtype` (k_base is untyped so
// one layout serves every dtype); `dtype` and the scales are last so positional initialisers
// stay f32. An fp8 element reads as its e4m3 value times its KV head's scale: k_scales and
// v_scales hold this layer's, one per KV head (null: 1; f32 and bf16 ignore them).
struct PagedKvLayout {
  const void* k_base = nullptr;
  int64_t block_stride = 0;  // elements between consecutive blocks
  int64_t v_offset = 0;      // elements from a block's K to its V
  int64_t block_tokens = 16;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  KvDtype dtype = KvDtype::kF32;
  const float* k_scales = nullptr;
  const float* v_scales = nullptr;
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
