#pragma once

// Causal attention of new query tokens over a paged KV cache (GQA-aware).

#include <cstdint>

#include "common/kernels/attention_types.h"

namespace preft::kernels::cpu {

using kernels::AttentionSeq;
using kernels::PagedKvLayout;

// Runs every sequence (parallel over sequences and heads). softmax scale = `scale`. With
// `window` > 0 (Mistral's sliding window) a query at position i sees keys j with
// i - window < j <= i; otherwise every j <= i.
void PagedAttention(const AttentionSeq* seqs, int64_t num_seqs, const PagedKvLayout& layout,
                    int64_t num_heads, float scale, int64_t window = 0);

}  // namespace preft::kernels::cpu
