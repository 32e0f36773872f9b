// The packed AVX-512-BF16 GEMM behind Linear for batched x (BLIS-style): panels of w are
// repacked on the fly into the vdpbf16ps pair layout and multiplied by broadcast pairs of x,
// so the accumulators hold rows of y and need no horizontal reduction. Compiled for
// AVX-512-BF16 and only reached after the run-time check in linear.cc.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>

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

// Microkernel shape: kMr rows of x times kNv vectors (16 columns each) of a w panel, 24
// accumulators: enough independent vdpbf16ps chains to cover their latency on both pipes.
constexpr int kMr = 6;
constexpr int kNv = 4;
constexpr int64_t kNr = 16 * kNv;  // columns of y (rows of w) per panel
// Elements of k per packed block of a panel: the block (kNr x kMaxKc bf16, 128 KB), the
// next one being prefetched and a few row blocks of x share L2 (1 MB on Zen 4/5). Larger
// blocks thrash L2 at k = 4864; smaller ones re-read and re-write y more often.
constexpr int64_t kMaxKc = 1024;
// Rows of x per work item: w is packed once per item, so more rows amortise the packing;
// fewer keep the rows of x an item streams per k block closer (measured: 768 is best at
// m = 512 and 2048).
constexpr int64_t kMaxMc = 768;

// Packs w[j0 .. j0+kNr, c0 .. c0+kc] into panel[kc/2 (rounded up)][kNr] pairs of bf16, rows
// past n and elements past kc zero. Masked loads never touch w beyond the block.
void PackPanel(const uint16_t* w, int64_t n, int64_t k, int64_t j0, int64_t c0, int64_t kc,
               uint32_t* panel) {
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t g = 0; g * 32 < kc; ++g) {
    const int64_t left = kc - g * 32;
    const __mmask32 mask = left >= 32 ? ~__mmask32{0} : (__mmask32{1} << left) - 1;
    const int64_t pairs = std::min<int64_t>(16, (left + 1) / 2);
    for (int v = 0; v < kNv; ++v) {
      __m512i in[16], out[16];
      const int64_t row0 = j0 + 16 * v;
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) {
        in[r] =
            row0 + r < n ? _mm512_maskz_loadu_epi16(mask, w + (row0 + r) * k + c0 + g * 32) : zero;
      }
      Transpose16x16(in, out);
      uint32_t* dst = panel + g * 16 * kNr + 16 * v;
      for (int64_t c = 0; c < pairs; ++c) _mm512_storeu_si512(dst + c * kNr, out[c]);
    }
  }
}

// Rows of w a tile prefetches into L2 while it runs, one line per step of k, so that the
// loads of the next block are spread over the compute: `rows` segments of `lines` cache
// lines, `stride` bytes apart.
struct Prefetch {
  const char* at = nullptr;
  int64_t stride = 0;
  int64_t lines = 0;
  int64_t rows = 0;
};

// y[i0 .. i0+R, j0 .. j0+cols] (+)= x[i0 .. i0+R, pairs p0 .. p0+np] · panel. first: the
// first k block, which stores (with bias) instead of adding.
template <int R>
void PackedTile(const uint16_t* xb, int64_t ldx, const uint32_t* panel, int64_t p0, int64_t np,
                float* y, int64_t ldy, int64_t cols, const float* bias, bool first,
                const Prefetch& prefetch) {
  Prefetch pf = prefetch;
  const uint32_t* xr[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) xr[i] = reinterpret_cast<const uint32_t*>(xb + i * ldx) + p0;
  __m512 acc[R][kNv];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < kNv; ++v) acc[i][v] = _mm512_setzero_ps();
  int64_t pf_line = 0;
  for (int64_t p = 0; p < np; ++p) {
    if (pf.rows > 0) {
      _mm_prefetch(pf.at + 64 * pf_line, _MM_HINT_T1);
      if (++pf_line == pf.lines) {
        pf_line = 0;
        pf.at += pf.stride;
        --pf.rows;
      }
    }
    __m512bh wv[kNv];
#pragma GCC unroll 4
    for (int v = 0; v < kNv; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(panel + p * kNr + 16 * v);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[i][p]));
#pragma GCC unroll 4
      for (int v = 0; v < kNv; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], xv, wv[v]);
    }
  }
#pragma GCC unroll 4
  for (int v = 0; v < kNv; ++v) {
    const int64_t left = cols - 16 * v;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
    __m512 add = _mm512_setzero_ps();
    if (first && bias != nullptr) add = _mm512_maskz_loadu_ps(mask, bias + 16 * v);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      float* dst = y + i * ldy + 16 * v;
      const __m512 base = first ? add : _mm512_maskz_loadu_ps(mask, dst);
      _mm512_mask_storeu_ps(dst, mask, _mm512_add_ps(acc[i][v], base));
    }
  }
}

void RunTile(int64_t rows, const uint16_t* xb, int64_t ldx, const uint32_t* panel, int64_t p0,
             int64_t np, float* y, int64_t ldy, int64_t cols, const float* bias, bool first,
             const Prefetch& pf) {
  switch (rows) {
    case 6:
      return PackedTile<6>(xb, ldx, panel, p0, np, y, ldy, cols, bias, first, pf);
    case 5:
      return PackedTile<5>(xb, ldx, panel, p0, np, y, ldy, cols, bias, first, pf);
    case 4:
      return PackedTile<4>(xb, ldx, panel, p0, np, y, ldy, cols, bias, first, pf);
    case 3:
      return PackedTile<3>(xb, ldx, panel, p0, np, y, ldy, cols, bias, first, pf);
    case 2:
      return PackedTile<2>(xb, ldx, panel, p0, np, y, ldy, cols, bias, first, pf);
    default:
      return PackedTile<1>(xb, ldx, panel, p0, np, y, ldy, cols, bias, first, pf);
  }
}
static_assert(kMr == 6, "RunTile covers 1 .. kMr rows");

}  // namespace

void LinearBf16Avx512Packed(const float* x, int64_t m, const uint16_t* w, int64_t n, int64_t k,
                            const float* bias, float* y) {
  const int64_t ldx = RoundUp(k, 32);
  auto* xb = static_cast<uint16_t*>(ThreadScratch(0, m * ldx * sizeof(uint16_t)));
  ConvertRowsToBf16(x, m, k, ldx, xb);
  // Even k blocks, each a multiple of 32 elements but the last.
  const int64_t k_blocks = CeilDiv(k, kMaxKc);
  const int64_t kc = RoundUp(CeilDiv(k, k_blocks), 32);
  const int64_t m_chunks = CeilDiv(m, kMaxMc);
  const int64_t mc = RoundUp(CeilDiv(m, m_chunks), kMr);
  const int64_t panels = CeilDiv(n, kNr);
  const int64_t items = m_chunks * panels;
  const size_t panel_bytes = kc / 2 * kNr * sizeof(uint32_t);
  // Items (row chunk, panel) are handed out one ahead: a thread claims its next item before
  // it works on the current one, so its tiles can prefetch the next block of w it packs.
  // Thread t starts with item t, so that an early thread cannot claim two of a few items.
  std::atomic<int64_t> claimed{0};
#pragma omp parallel if (WorthThreads(m, n, k))
  {
    auto* panel = static_cast<uint32_t*>(ThreadScratch(1, panel_bytes));
    const int64_t team = omp_get_num_threads();
    int64_t item = omp_get_thread_num();
    while (item < items) {
      const int64_t after = team + claimed.fetch_add(1, std::memory_order_relaxed);
      const int64_t i_begin = item / panels * mc;
      const int64_t i_end = std::min(m, i_begin + mc);
      const int64_t j0 = item % panels * kNr;
      const int64_t cols = std::min(kNr, n - j0);
      const float* bias_j = bias != nullptr ? bias + j0 : nullptr;
      const int64_t tiles = CeilDiv(i_end - i_begin, kMr);
      for (int64_t c0 = 0; c0 < k; c0 += kc) {
        const int64_t len = std::min(kc, k - c0);
        PackPanel(w, n, k, j0, c0, len, panel);
        // The block packed next: this panel's next k block, or the next item's first.
        int64_t next_j0 = j0, next_c0 = c0 + kc;
        if (next_c0 >= k) {
          next_j0 = after < items ? after % panels * kNr : n;
          next_c0 = 0;
        }
        const int64_t next_rows = std::max<int64_t>(0, std::min(kNr, n - next_j0));
        const int64_t next_lines = CeilDiv(std::min(kc, k - next_c0) * 2, 64);
        const int64_t rows_per_tile = CeilDiv(next_rows, tiles);
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t i = i_begin + t * kMr;
          const int64_t rows = std::min<int64_t>(kMr, i_end - i);
          const int64_t pf_row = std::min(next_rows, t * rows_per_tile);
          const Prefetch pf{reinterpret_cast<const char*>(w + (next_j0 + pf_row) * k + next_c0),
                            k * 2, next_lines, std::min(rows_per_tile, next_rows - pf_row)};
          RunTile(rows, xb + i * ldx, ldx, panel, c0 / 2, CeilDiv(len, 2), y + i * n + j0, n, cols,
                  bias_j, c0 == 0, pf);
        }
      }
      item = after;
    }
  }
}

}  // namespace preft::kernels::cpu

#pragma GCC pop_options
