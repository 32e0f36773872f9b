// The "W-broadcast" AVX-512-BF16 GEMM: computes yᵀ = w · xᵀ without repacking w. x is packed
// once per call into the vdpbf16ps pair layout across rows (xp[pair][lane], lanes = rows of x
// padded to 16), and a microkernel runs NR rows of w against MR vectors of 16 lanes: per pair
// of k it loads MR vectors of xp and broadcasts one bf16 pair of each w row straight from
// the borrowed matrix (embedded-broadcast memory operand). The accumulators hold columns of
// y, so each tile ends with an 8 x 16 in-register transpose per group of w rows. Compiled for
// AVX-512-BF16 and only reached after the run-time check in linear.cc.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <numeric>

#include "common/kernels/cpu/linear_driver.h"
#include "common/kernels/cpu/linear_kernels.h"

// GCC 12's intrinsics headers build "undefined" vectors by self-initialisation.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

#include "common/kernels/cpu/transpose_avx512.h"

namespace preft::kernels::cpu {
namespace {

// Lanes (rows of x) per chunk of xp: 4 vectors of 16.
constexpr int64_t kMaxMr = 4;
constexpr int64_t kChunkLanes = 16 * kMaxMr;
// Bytes of w per work item and k block: read from memory for the first chunk of lanes, from
// L2 for the others.
constexpr int64_t kItemBlockBytes = 192 << 10;
// Lanes (rows of x) per work item, a multiple of kChunkLanes: the y block an item updates
// per k block stays in L2 with xp and w (measured: m = 2048 gains ~10% at k = 4864).
constexpr int64_t kMaxMc = 512;
// Bytes ahead of the current pair at which the w rows are prefetched (measured: 0 .. 1024
// within noise; kept for CPUs with weaker stream prefetchers).
constexpr int64_t kPrefetchBytes = 512;

// Rows of w per tile for MR vectors of lanes: 24 accumulators (16 for MR = 1).
constexpr int NrFor(int mr) { return mr == 4 ? 6 : mr == 3 ? 8 : mr == 2 ? 12 : 16; }

// Lane width of the chunk of xp that starts at lane i0.
inline int64_t ChunkWidth(int64_t m_pad, int64_t i0) { return std::min(kChunkLanes, m_pad - i0); }

// Packs rows r0 .. r0+16 (zero past m) and pairs p0 .. p0+16 (zero past k) of x into xp,
// rounded to bf16 (RNE). Chunk c of xp holds lanes 64c .. at xp + 64c * pairs, [pair][width].
void PackX16x16(const float* x, int64_t m, int64_t k, int64_t m_pad, int64_t pairs, int64_t r0,
                int64_t p0, uint32_t* xp) {
  __m512i in[16], out[16];
  const int64_t c = 2 * p0, left = k - c;
  const __mmask16 lo = left >= 16 ? 0xffff : left > 0 ? (1u << left) - 1 : 0;
  const __mmask16 hi = left >= 32 ? 0xffff : left > 16 ? (1u << (left - 16)) - 1 : 0;
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    if (r0 + r < m) {
      const float* src = x + (r0 + r) * k + c;
      const __m512 vlo = _mm512_maskz_loadu_ps(lo, src);
      const __m512 vhi = _mm512_maskz_loadu_ps(hi, src + 16);
      in[r] = (__m512i)_mm512_cvtne2ps_pbh(vhi, vlo);
    } else {
      in[r] = _mm512_setzero_si512();
    }
  }
  Transpose16x16(in, out);
  const int64_t i0 = r0 / kChunkLanes * kChunkLanes;
  const int64_t width = ChunkWidth(m_pad, i0);
  uint32_t* dst = xp + i0 * pairs + p0 * width + (r0 - i0);
  const int64_t np = std::min<int64_t>(16, pairs - p0);
  for (int64_t p = 0; p < np; ++p) _mm512_storeu_si512(dst + p * width, out[p]);
}

// Adds (or, first, stores with bias) one 8 x 16 group of accumulators into y: a[r] lane l is
// y[l, r]. y points at [lane 0, row 0]; rows and lanes give the valid part.
inline void StoreGroup(const __m512 (&a)[8], float* y, int64_t ldy, int rows, int lanes,
                       const float* bias, bool first) {
  // t: per 128-bit lane L, pairs of rows; u[q] (u[4 + q]): rows 0-3 (4-7) of column 4L + q.
  __m512 t[8], u[8];
#pragma GCC unroll 4
  for (int r = 0; r < 8; r += 2) {
    t[r] = _mm512_unpacklo_ps(a[r], a[r + 1]);
    t[r + 1] = _mm512_unpackhi_ps(a[r], a[r + 1]);
  }
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    u[4 * h + 0] = _mm512_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
    u[4 * h + 1] = _mm512_shuffle_ps(t[4 * h], t[4 * h + 2], 0xee);
    u[4 * h + 2] = _mm512_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
    u[4 * h + 3] = _mm512_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xee);
  }
  const __mmask16 rmask = static_cast<__mmask16>((1u << rows) - 1);
  const __m256 b = first && bias != nullptr ? _mm256_maskz_loadu_ps(rmask, bias)
                                            : _mm256_setzero_ps();
  // Column q + 4s (s = 0..3) from lane s of u[q] and u[4 + q].
  const __m512i idx_even = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25,
                                             26, 27);  // columns q, q + 8
  const __m512i idx_odd = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29,
                                            30, 31);  // columns q + 4, q + 12
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {
    const __m512 e = _mm512_permutex2var_ps(u[q], idx_even, u[4 + q]);
    const __m512 o = _mm512_permutex2var_ps(u[q], idx_odd, u[4 + q]);
    const __m256 cols[4] = {_mm512_castps512_ps256(e), _mm512_castps512_ps256(o),
                            _mm512_extractf32x8_ps(e, 1), _mm512_extractf32x8_ps(o, 1)};
    const int lane[4] = {q, q + 4, q + 8, q + 12};
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
      if (lane[s] >= lanes) continue;
      float* dst = y + lane[s] * ldy;
      const __m256 base = first ? b : _mm256_maskz_loadu_ps(rmask, dst);
      _mm256_mask_storeu_ps(dst, rmask, _mm256_add_ps(cols[s], base));
    }
  }
}

// y[lanes, rows] (+)= xp[np pairs, 16 MR lanes] · w rows ᵀ over one k block. wr: NR row
// pointers at the block's first element (rows past the valid ones repeat the last valid
// row). half_last: the block's last pair holds only its first element of k (k odd), which
// is then read alone so that nothing past the last element of w is touched.
template <int MR>
void BroadcastTile(const uint32_t* xp, int64_t width, const uint16_t* const* wr, int64_t np,
                   bool half_last, float* y, int64_t ldy, int rows, int lanes, const float* bias,
                   bool first) {
  constexpr int NR = NrFor(MR);
  const char* w[NR];
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r) w[r] = reinterpret_cast<const char*>(wr[r]);
  __m512 acc[NR][MR];
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < MR; ++v) acc[r][v] = _mm512_setzero_ps();

  auto step = [&](int64_t p, auto load_w) __attribute__((always_inline)) {
    __m512bh xv[MR];
#pragma GCC unroll 4
    for (int v = 0; v < MR; ++v) xv[v] = (__m512bh)_mm512_loadu_si512(xp + p * width + 16 * v);
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) {
      const __m512bh wv = (__m512bh)_mm512_set1_epi32(load_w(r, p));
#pragma GCC unroll 4
      for (int v = 0; v < MR; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv[v], wv);
    }
  };
  auto load_pair = [&](int r, int64_t p) __attribute__((always_inline)) {
    int32_t pair;
    std::memcpy(&pair, w[r] + 4 * p, 4);
    return pair;
  };
  const int64_t full = half_last ? np - 1 : np;
  int64_t p = 0;
  for (; p + 16 <= full; p += 16) {
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) _mm_prefetch(w[r] + 4 * p + kPrefetchBytes, _MM_HINT_T0);
#pragma GCC unroll 16
    for (int64_t q = 0; q < 16; ++q) step(p + q, load_pair);
  }
  for (; p < full; ++p) step(p, load_pair);
  if (half_last) {
    step(p, [&](int r, int64_t pp) __attribute__((always_inline)) {
      uint16_t e;
      std::memcpy(&e, w[r] + 4 * pp, 2);
      return static_cast<int32_t>(e);
    });
  }

  // Transpose-store in groups of 8 rows of w.
#pragma GCC unroll 2
  for (int g = 0; g * 8 < NR; ++g) {
    const int grows = std::min(8, rows - 8 * g);
    if (grows <= 0) break;
#pragma GCC unroll 4
    for (int v = 0; v < MR; ++v) {
      const int vlanes = std::min(16, lanes - 16 * v);
      if (vlanes <= 0) break;
      __m512 a[8];
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r)
        a[r] = 8 * g + r < NR ? acc[std::min(8 * g + r, NR - 1)][v] : _mm512_setzero_ps();
      StoreGroup(a, y + 16 * v * ldy + 8 * g, ldy, grows, vlanes,
                 bias != nullptr ? bias + 8 * g : nullptr, first);
    }
  }
}

using TileFn = void (*)(const uint32_t*, int64_t, const uint16_t* const*, int64_t, bool, float*,
                        int64_t, int, int, const float*, bool);
constexpr TileFn kTiles[kMaxMr + 1] = {nullptr, BroadcastTile<1>, BroadcastTile<2>,
                                       BroadcastTile<3>, BroadcastTile<4>};

// LinearBf16Avx512Broadcast over the outputs of one x: x is packed once, and work items are
// (super-block of rows, block of one output's rows of w).
void BroadcastLinear(const float* x, int64_t m, int64_t k, const Bf16Output* outs,
                     int64_t count) {
  const int64_t pairs = CeilDiv(k, 2);
  const int64_t m_pad = RoundUp(m, 16);
  auto* xp = static_cast<uint32_t*>(ThreadScratch(0, m_pad * pairs * sizeof(uint32_t)));
  const int64_t kc = BroadcastKBlock(k);
  const int64_t chunks = CeilDiv(m_pad, kChunkLanes);
  // Work items: blocks of rows of w, a multiple of every tile height the chunks use.
  int64_t total_n = 0;
  for (int64_t o = 0; o < count; ++o) total_n += outs[o].n;
  const int mr_first = static_cast<int>(ChunkWidth(m_pad, 0) / 16);
  const int mr_last = static_cast<int>(ChunkWidth(m_pad, (chunks - 1) * kChunkLanes) / 16);
  const int64_t grain = std::lcm(NrFor(mr_first), NrFor(mr_last));
  const int64_t threads = omp_get_max_threads();
  int64_t block = std::max<int64_t>(1, kItemBlockBytes / (std::min(kc, k) * 2) / grain) * grain;
  block = std::min(block, RoundUp(CeilDiv(total_n, 2 * threads), grain));
  // Even out the blocks, their count a multiple of the team when it is small.
  const int64_t m_supers = CeilDiv(m_pad, kMaxMc);
  int64_t n_blocks = CeilDiv(total_n, block);
  if (n_blocks * m_supers < 8 * threads) {
    n_blocks = RoundUp(n_blocks * m_supers, threads) / m_supers;
  }
  block = RoundUp(CeilDiv(total_n, n_blocks), grain);
  n_blocks = CountBlocks(outs, count, block);
  const int64_t items = m_supers * n_blocks;
  const int64_t pack_items = m_pad / 16 * CeilDiv(pairs, 16);
  const int64_t pair_groups = CeilDiv(pairs, 16);
#pragma omp parallel if (WorthThreads(m, total_n, k))
  {
#pragma omp for schedule(static)
    for (int64_t it = 0; it < pack_items; ++it) {
      PackX16x16(x, m, k, m_pad, pairs, it / pair_groups * 16, it % pair_groups * 16, xp);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      int64_t b = item % n_blocks;
      const int64_t o = OutputOfBlock(outs, block, &b);
      const int64_t n = outs[o].n;
      const int64_t j_begin = b * block, j_end = std::min(n, j_begin + block);
      const int64_t i_begin = item / n_blocks * kMaxMc;
      const int64_t i_end = std::min(m_pad, i_begin + kMaxMc);
      const uint16_t* w = outs[o].w;
      const float* bias = outs[o].bias;
      float* y = outs[o].y;
      for (int64_t c0 = 0; c0 < k; c0 += kc) {
        const int64_t len = std::min(kc, k - c0);
        const int64_t np = CeilDiv(len, 2);
        const bool half_last = (len & 1) != 0;
        for (int64_t i0 = i_begin; i0 < i_end; i0 += kChunkLanes) {
          const int64_t width = ChunkWidth(m_pad, i0);
          const int mr = static_cast<int>(width / 16);
          const int nr = NrFor(mr);
          const int lanes = static_cast<int>(std::min(width, m - i0));
          const uint32_t* xp_block = xp + i0 * pairs + c0 / 2 * width;
          for (int64_t j = j_begin; j < j_end; j += nr) {
            const int rows = static_cast<int>(std::min<int64_t>(nr, j_end - j));
            const uint16_t* wr[16];
            for (int r = 0; r < nr; ++r) wr[r] = w + (j + std::min(r, rows - 1)) * k + c0;
            kTiles[mr](xp_block, width, wr, np, half_last, y + i0 * n + j, n, rows, lanes,
                       bias != nullptr ? bias + j : nullptr, c0 == 0);
          }
        }
      }
    }
  }
}

}  // namespace

void LinearBf16Avx512Broadcast(const float* x, int64_t m, const uint16_t* w, int64_t n,
                               int64_t k, const float* bias, float* y) {
  const Bf16Output out{w, n, bias, y};
  BroadcastLinear(x, m, k, &out, 1);
}

void LinearBf16Avx512BroadcastShared(const float* x, int64_t m, int64_t k,
                                     const Bf16Output* outs, int64_t count) {
  BroadcastLinear(x, m, k, outs, count);
}

}  // namespace preft::kernels::cpu

#pragma GCC pop_options
