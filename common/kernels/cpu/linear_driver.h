#pragma once

// Shared plumbing of the Linear kernels (linear_kernels.h): blocking and threading of the
// dot-product kernels, and per-thread scratch. Compiled for the baseline ISA, so it can be
// called from every kernel file; the ISA-specific work sits behind function pointers.

#include <cstddef>
#include <cstdint>

#include "common/kernels/dtype.h"
#include "common/base/math.h"

namespace preft::kernels::cpu {

using base::CeilDiv;
using base::RoundUp;

// Elements of k per block of the w-broadcast GEMM and of its GEMV twin (LinearBf16Avx512Lanes):
// each output sums the pairs of a block in order and adds the blocks into y in order, so this
// depends on k alone, never on m, and a row of y has the same bits at every m. Even blocks of
// at most 6144 (a multiple of 32 but the last): the GEMM's x block of 64 lanes then stays in
// L2 (768 KB), and k up to 6144 (every projection of the 0.5B preset) is one block, so y is
// written once. Measured on Zen 5 against 1024-element blocks for m > 64: level at
// m = 512, 0-14% ahead at m = 2048 (bench/NOTES.md, step 19).
inline int64_t BroadcastKBlock(int64_t k) {
  constexpr int64_t kMaxKc = 6144;
  return RoundUp(CeilDiv(k, CeilDiv(k, kMaxKc)), 32);
}

// Operands of one Linear call as the tile functions see them. x is the kernel's own view of
// the activations (f32, or bf16 rows padded with zeros), ldx its row stride in elements.
struct DotArgs {
  const void* x = nullptr;
  int64_t ldx = 0;
  const void* w = nullptr;  // [n, k] of w_dtype
  DType w_dtype = DType::kBF16;
  int64_t n = 0;
  int64_t k = 0;
  const float* bias = nullptr;
  float* y = nullptr;
};

// Computes y[i0 .. i0+MR, j0 .. j0+NR] over the whole of k, bias included.
using DotTileFn = void (*)(const DotArgs& args, int64_t i0, int64_t j0);

// Tile functions by row count: full[mr - 1] covers NR = nr rows of w, single[mr - 1] one row
// (the n tail). mr runs 1 .. max_mr (at most kMaxDotRows).
struct DotKernelTable {
  int max_mr = 1;
  int nr = 1;
  static constexpr int kMaxDotRows = 7;
  DotTileFn full[kMaxDotRows] = {};
  DotTileFn single[kMaxDotRows] = {};
};

// Splits n across the OpenMP threads (contiguous ranges of whole nr-blocks) and walks x in
// chunks of rows small enough for L2, so w is streamed once per chunk: once in all for the
// GEMV case.
void RunDotKernel(const DotArgs& args, int64_t m, const DotKernelTable& table);

// RunDotKernel over several weights of the same x (their DotArgs differ only in w, n, bias
// and y) in one parallel region: work items are slices of each output in turn.
void RunDotKernelShared(const DotArgs* outs, int64_t count, int64_t m,
                        const DotKernelTable& table);

// The vdpbf16ps dot kernels' driver: x rounded to bf16 once (rows padded to 32), then
// RunDotKernelShared over the outputs, four per parallel region. Needs AVX-512-BF16.
struct Bf16Output;
void RunBf16DotShared(const float* x, int64_t m, int64_t k, const Bf16Output* outs,
                      int64_t count, const DotKernelTable& table);

// Work items over several outputs (anything with a row count `n`), each cut into blocks of
// `block` rows and numbered output after output: how many blocks there are in all, and which
// output block number *b is (*b becomes the block's index within that output).
template <class Output>
int64_t CountBlocks(const Output* outs, int64_t count, int64_t block) {
  int64_t blocks = 0;
  for (int64_t o = 0; o < count; ++o) blocks += CeilDiv(outs[o].n, block);
  return blocks;
}
template <class Output>
int64_t OutputOfBlock(const Output* outs, int64_t block, int64_t* b) {
  int64_t o = 0;
  while (*b >= CeilDiv(outs[o].n, block)) *b -= CeilDiv(outs[o].n, block), ++o;
  return o;
}

// Whether a call of this size gains from the OpenMP threads (see linear_driver.cc).
bool WorthThreads(int64_t m, int64_t n, int64_t k);

// Scratch memory of the calling thread, 64-byte aligned, grown on demand and kept for the
// thread's life. slot tells apart buffers that are live at the same time.
void* ThreadScratch(int slot, size_t bytes);
// The slot LowRankAdd's prompt path uses (the linears use 0 .. 3).
constexpr int kLowRankScratchSlot = 4;

}  // namespace preft::kernels::cpu
