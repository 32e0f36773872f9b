#pragma once

// The kernels behind LowRankAdd (low_rank.h), one file per family as the Linear kernels'
// (linear_kernels.h), declared here for the driver (low_rank.cc) and for each other. Internal
// to those files (namespace low_rank_internal). A kernel with AVX-512 or AVX-512-BF16 in its
// name runs only on a CPU that has it: its callers check first.

#include <algorithm>
#include <cstdint>

#include "common/kernels/cpu/low_rank.h"
#include "common/kernels/dtype.h"
#include "common/kernels/matrix.h"

namespace preft::kernels::cpu::low_rank_internal {

// Rows handled by one work item: enough to reuse each loaded shrink/expand row a few times,
// few enough that a 64-row prompt chunk still spreads over the threads.
inline constexpr int64_t kRowsPerItem = 8;
// Elements ahead at which a decode row's shrink and expand prefetch S and E (64 rows on 64
// adapters: 1.56-2.08 x the byte bound without, 1.26-1.37 with).
inline constexpr int64_t kPrefetchElems = 1024;

// ---- AVX2 + FMA on f32, bf16 or f16 (low_rank_avx2.cc); bf16 goes on to the AVX-512 kernels
// below where the CPU has AVX-512. Instantiated for the three dtypes.

// z[r][k] = x[rows[r]] . S[k] (+ b[k]) for up to kRowsPerItem rows, four rows per pass over S.
template <DType T>
void Shrink(const float* x, int64_t x_stride, const int32_t* rows, int64_t n, const MatrixView& s,
            const float* bias, float* z);
// y[rows[r]] += scale * z[r] E, four rows per pass over E (each loaded E vector feeds four
// rows' accumulators), 16 outputs at a time with the rank loop inside.
template <DType T>
void Expand(const float* z, const int32_t* rows, int64_t n, const MatrixView& e, float scale,
            float* y, int64_t y_stride);

// ---- bf16 widened to f32 with AVX-512 F/BW/DQ/VL (low_rank_avx512.cc), for Shrink and Expand.

// z[k] = xr . S[k] (+ b[k]) for one row of x; in <= kMaxExpandOut.
void ShrinkRowBf16Avx512(const float* xr, const uint16_t* s, int64_t rank, int64_t in,
                         const float* bias, float* z);
// yr += scale * z E for one row; out <= kMaxExpandOut.
void ExpandRowBf16Avx512(const float* z, const uint16_t* e, int64_t rank, int64_t out, float scale,
                         float* yr);
// z[r][k] = x[rows[r]] . S[k] (+ b[k]) for n rows, in ShrinkRowBf16Avx512's order.
void ShrinkRowsBf16Avx512(const float* x, int64_t x_stride, const int32_t* rows, int64_t n,
                          const uint16_t* s, int64_t rank, int64_t in, const float* bias, float* z);
// y[rows[r]] += scale * z[r] E for n rows.
void ExpandRowsBf16Avx512(const float* z, const int32_t* rows, int64_t n, const uint16_t* e,
                          int64_t rank, int64_t out, float scale, float* y, int64_t y_stride);

// ---- bf16 through vdpbf16ps (AVX-512-BF16), every row of a bf16 group on such CPUs: x and z
// rounded to bf16, f32 sums.

// One work item of a group (low_rank_avx512bf16.cc): rows [0, n) of `rows`, at most
// kRowsPerItem, row-major or chunked matrices; z is scratch for [n][rank].
void RunItemDotBf16(const float* x, int64_t x_stride, float* y, int64_t y_stride,
                    const LowRankGroup& g, const int32_t* rows, int64_t n, float* z);

// Rows in lockstep through a shrink by column pairs of this rank: four accumulators per 16
// ranks and row, at most 16 in all.
inline int64_t ColumnPairRows(int64_t rank) { return std::max<int64_t>(1, 4 / (rank / 16)); }

// Decode rows (one row per group) that run in lockstep with g's: two for chunked shrinks of
// rank <= 16 (the pair's shrink accumulators fill the registers), ColumnPairRows for those
// stored by column pairs, else one.
inline int64_t LockstepRows(const LowRankGroup& g) {
  if (!g.shrink.chunked || g.num_rows != 1) return 1;
  if (ColumnPaired(g.shrink.rows, false)) return ColumnPairRows(g.shrink.rows);
  return g.shrink.rows <= 16 ? 2 : 1;
}

// Whether b's decode row can join a's lockstep: both chunked, of one rank and input width.
inline bool InLockstep(const LowRankGroup& a, const LowRankGroup& b) {
  return b.num_rows == 1 && b.shrink.chunked && b.shrink.rows == a.shrink.rows &&
         b.shrink.cols == a.shrink.cols;
}

// One decode row of each of n (1 .. 4) chunked groups g[0 .. n) (low_rank_chunked.cc), with
// n <= LockstepRows(*g[0]) and InLockstep(*g[0], *g[i]).
void RunChunkedDecodeRows(int n, const float* x, int64_t x_stride, float* y, int64_t y_stride,
                          const LowRankGroup* const* g);
// z_i[k] = xb_i . S_i[k] (+ b_i[k]) for n (1 .. ColumnPairRows(rank)) rows of x in bf16 and
// shrinks stored by column pairs (low_rank_chunked.cc): the decode rows' sums, for prompt rows.
void ShrinkColumnPairs(int n, const uint16_t* const* xb, const uint16_t* const* s,
                       const float* const* bias, int64_t rank, int64_t in, float* const* z);

}  // namespace preft::kernels::cpu::low_rank_internal
