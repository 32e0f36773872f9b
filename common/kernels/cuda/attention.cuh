#pragma once

// Causal attention of new query tokens over a paged KV cache on the GPU (GQA-aware), over
// the cache layout the CPU kernel reads (attention_types.h).

#include <cstdint>

#include "common/kernels/attention_types.h"

namespace preft::kernels::cuda {

inline constexpr int64_t kMaxHeadDim = 256;

using kernels::AttentionSeq;   // attention_types.h; pointers in device memory
using kernels::PagedKvLayout;  // head_dim <= kMaxHeadDim

// Stores the K and V of num_tokens new tokens ([T, num_kv_heads, head_dim] each) into one
// layer's blocks at layer_base, in the geometry of `layout` (its k_base is not read): token t
// goes to block slots[t] / block_tokens, at offset slots[t] % block_tokens. The cache holds
// layout.dtype: f32, bf16 (rounded to nearest even, as the CPU writes it) or fp8 e4m3 (divided
// by layout.k_scales / v_scales, device arrays of one per KV head, then rounded as the CPU
// rounds it).
int WriteKv(const float* k, const float* v, const int64_t* slots, int64_t num_tokens,
            void* layer_base, const PagedKvLayout& layout, void* stream);

// ApplyRope (ops.cuh) on q in place and on k, then WriteKv of the rotated k and of v, in one
// launch: the cache gets exactly what the two calls store, and q what ApplyRope leaves; k
// itself is left unrotated (only the cache reads it after).
int RopeWriteKv(const int32_t* positions, const float* inv_freq, float* q, int64_t num_heads,
                const float* k, const float* v, const int64_t* slots, int64_t num_tokens,
                void* layer_base, const PagedKvLayout& layout, void* stream);

// seqs is a device array of num_seqs; max_new bounds their num_new. A query at position i sees
// keys j <= i, and with window > 0 only i - window < j (Mistral's sliding window). One block
// per (sequence, head, query) with an online softmax over tiles of keys.
// Decode calls (max_new == 1) with GQA groups of up to 8 heads and cache blocks of a power of
// two tokens up to 32 take a flash-decoding kernel instead: one block per (sequence, KV head,
// split) reads each K and V once for the whole group, and long contexts are split across
// blocks (enough to fill the device) whose partial softmaxes are merged in `workspace`.
// Prompt calls within the same limits take that kernel too, a block per (sequence, KV head,
// query), unsplit.
// AttentionWorkspaceFloats says how many floats that call needs (0: none, workspace may be
// null); it depends only on the arguments, so a recorded graph's workspace stays right.
inline constexpr int kMaxDecodeSplits = 64;
int64_t AttentionWorkspaceFloats(int64_t num_seqs, int64_t max_new, const PagedKvLayout& layout,
                                 int64_t num_heads);
int PagedAttention(const AttentionSeq* seqs, int64_t num_seqs, int64_t max_new,
                   const PagedKvLayout& layout, int64_t num_heads, float scale, int64_t window,
                   float* workspace, void* stream);

}  // namespace preft::kernels::cuda
