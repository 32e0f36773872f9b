#pragma once

// Causal attention of new query tokens over a paged KV cache on the GPU (GQA-aware), over
// the cache layout the CPU kernel reads (attention_types.h).

#include <cstdint>

#include "common/kernels/attention_types.h"

namespace preft::kernels::cuda {

inline constexpr int64_t kMaxHeadDim = 256;

using kernels::AttentionSeq;   // attention_types.h; pointers in device memory
using kernels::PagedKvLayout;  // head_dim <= kMaxHeadDim

// seqs is a device array of num_seqs; max_new bounds their num_new. A query at position i sees
// keys j <= i, and with window > 0 only i - window < j (Mistral's sliding window). One block
// per (sequence, head, query) with an online softmax over tiles of keys.
int PagedAttention(const AttentionSeq* seqs, int64_t num_seqs, int64_t max_new,
                   const PagedKvLayout& layout, int64_t num_heads, float scale, int64_t window,
                   void* stream);

}  // namespace preft::kernels::cuda
