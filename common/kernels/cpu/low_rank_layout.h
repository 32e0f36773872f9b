#pragma once

// How adapter matrices are laid out for the low-rank kernels (low_rank.h), decided when an
// adapter loads. Apart from the kernels so that loaders (the router's too) need no OpenMP or
// OpenBLAS.

#include <cstdint>

#include "common/kernels/matrix.h"

namespace preft::kernels::cpu {

inline constexpr int64_t kMaxRank = 1024;
// Widest output a decode row's expand sums on the stack (Llama 3.1 70B's MLP is 28672).
inline constexpr int64_t kMaxExpandOut = 32768;

// Chunked matrices (MatrixView::chunked, [cols / 32][rows][32]) are these kernels' faster
// layout for bf16 adapters: each matrix one sequential stream (the multi-LoRA decode step is
// bound by streaming them). A group's shrink and expand are chunked together or not at all,
// the expand with its rows paired (MatrixView::paired, the shrink not), and only matrices for
// which LowRankChunkable holds: bf16, rows a multiple of 4, cols of 32, on a CPU with
// AVX-512-BF16. Results are bit-identical to the row-major layout's, except for shrinks of
// rank 16, 32, ... (stored by column pairs, kernels::ColumnPaired), whose sums run in an order
// of their own (the same for every row and group size): equal to rounding.
bool LowRankChunkable(const MatrixView& m);
// dst = src [rows, cols] row-major, chunked (rows paired if `paired`; by column pairs where
// ColumnPaired). cols a multiple of 32.
void ChunkColumns(const uint16_t* src, int64_t rows, int64_t cols, bool paired, uint16_t* dst);

}  // namespace preft::kernels::cpu
