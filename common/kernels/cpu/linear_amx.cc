// AMX-BF16 kernel of Linear. It computes yᵀ = w · xᵀ: 16-row slices of the borrowed weight
// are the tile "A" operand, loaded in place with row stride k, and only x is packed per call
// into the VNNI "B" layout (k pairs interleaved), which is cheap because x is small. The same
// loop nest runs over real tiles or over a C++ emulation of them (for tests on CPUs without
// AMX), chosen by the Tiles policy.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "common/kernels/cpu/linear_driver.h"
#include "common/kernels/cpu/linear_kernels.h"
#include "common/kernels/cpu/silu_avx2.h"

// GCC 12's intrinsics headers build "undefined" vectors by self-initialisation, which -Wall
// reports inside gathers.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")

#include "common/kernels/cpu/amx_tiles.h"
#include "common/kernels/cpu/transpose_avx512.h"

namespace preft::kernels::cpu {
namespace {

// Tile registers: C accumulators 0-3 (2 w slices x 2 x tiles), w slices 4-5, x tiles 6-7.
// Every tile is 16 rows x 64 bytes.
constexpr int kTileRows = 16;
constexpr int kTileBytes = 1024;
// n rows per block (two A tiles) and k per pass (the C tiles go through memory between
// passes). 32 rows x 256 of w (16 KB) stay in L1 while every group of x runs over them;
// measured on Sapphire Rapids, 2 threads: level with 1024 at m = 512, up to 1.15x at m = 64.
constexpr int64_t kBlockRows = 32;
constexpr int64_t kKPass = 256;
// Elements of k ahead at which the first group's pass prefetches the 32 rows of w: tile
// loads from 32 strided rows outrun the hardware prefetcher (measured: 1.1-1.4x at m = 64).
constexpr int64_t kPrefetchAhead = 64;
// Packed x above this many bytes no longer stays in L2 beside w; then work items take spans
// of up to kMaxSpan w blocks (see AmxLinear).
constexpr int64_t kMaxL2XBytes = 1 << 20;
constexpr int64_t kMaxSpan = 8;

// The tile macros paste their register number into the asm text, hence the literal cases.
// The asm has no memory operands the compiler can see, so loads and stores carry a memory
// clobber to order them against plain stores to (and reads of) the same buffers.
struct HwTiles {
  static void Configure() { ConfigureFullTiles(); }
  static void Release() { _tile_release(); }

  template <int T>
  static void Zero() {
    if constexpr (T == 0) _tile_zero(0);
    else if constexpr (T == 1) _tile_zero(1);
    else if constexpr (T == 2) _tile_zero(2);
    else if constexpr (T == 3) _tile_zero(3);
  }
  template <int T>
  static void Load(const void* p, int64_t stride_bytes) {
    __asm__ volatile("" ::: "memory");
    if constexpr (T == 0) _tile_loadd(0, p, stride_bytes);
    else if constexpr (T == 1) _tile_loadd(1, p, stride_bytes);
    else if constexpr (T == 2) _tile_loadd(2, p, stride_bytes);
    else if constexpr (T == 3) _tile_loadd(3, p, stride_bytes);
    else if constexpr (T == 4) _tile_loadd(4, p, stride_bytes);
    else if constexpr (T == 5) _tile_loadd(5, p, stride_bytes);
    else if constexpr (T == 6) _tile_loadd(6, p, stride_bytes);
    else if constexpr (T == 7) _tile_loadd(7, p, stride_bytes);
  }
  template <int T>
  static void Store(void* p, int64_t stride_bytes) {
    if constexpr (T == 0) _tile_stored(0, p, stride_bytes);
    else if constexpr (T == 1) _tile_stored(1, p, stride_bytes);
    else if constexpr (T == 2) _tile_stored(2, p, stride_bytes);
    else if constexpr (T == 3) _tile_stored(3, p, stride_bytes);
    __asm__ volatile("" ::: "memory");
  }
  template <int C, int A, int B>
  static void Dot() {
    if constexpr (C == 0 && A == 4 && B == 6) _tile_dpbf16ps(0, 4, 6);
    else if constexpr (C == 1 && A == 5 && B == 6) _tile_dpbf16ps(1, 5, 6);
    else if constexpr (C == 2 && A == 4 && B == 7) _tile_dpbf16ps(2, 4, 7);
    else if constexpr (C == 3 && A == 5 && B == 7) _tile_dpbf16ps(3, 5, 7);
    else static_assert(C < 0, "unused tile combination");
  }
};

// TDPBF16PS semantics in C++: C[i][j] += Σp A[i][2p]·B[p][2j] + A[i][2p+1]·B[p][2j+1].
struct EmulatedTiles {
  alignas(64) static inline thread_local uint8_t tiles[8][kTileBytes];

  static void Configure() {}
  static void Release() {}
  template <int T>
  static void Zero() {
    std::memset(tiles[T], 0, kTileBytes);
  }
  template <int T>
  static void Load(const void* p, int64_t stride_bytes) {
    for (int r = 0; r < kTileRows; ++r) {
      std::memcpy(tiles[T] + r * 64, static_cast<const uint8_t*>(p) + r * stride_bytes, 64);
    }
  }
  template <int T>
  static void Store(void* p, int64_t stride_bytes) {
    for (int r = 0; r < kTileRows; ++r) {
      std::memcpy(static_cast<uint8_t*>(p) + r * stride_bytes, tiles[T] + r * 64, 64);
    }
  }
  template <int C, int A, int B>
  static void Dot() {
    auto* c = reinterpret_cast<float*>(tiles[C]);
    const auto* a = reinterpret_cast<const uint16_t*>(tiles[A]);
    const auto* b = reinterpret_cast<const uint16_t*>(tiles[B]);
    for (int i = 0; i < 16; ++i) {
      for (int j = 0; j < 16; ++j) {
        float s = c[i * 16 + j];
        for (int p = 0; p < 16; ++p) {
          s += Bf16ToF32(a[i * 32 + 2 * p]) * Bf16ToF32(b[p * 32 + 2 * j]) +
               Bf16ToF32(a[i * 32 + 2 * p + 1]) * Bf16ToF32(b[p * 32 + 2 * j + 1]);
        }
        c[i * 16 + j] = s;
      }
    }
  }
};

// Packs one 32-wide k step of one 16-row group of x (zeros past m and k) into its B tile:
// row q of the tile holds, in column j, the pair (x[16 g + j][c + 2q], x[16 g + j][c + 2q + 1]).
// xp is [m_tiles][kpad / 2][16] pairs, so one k step of one group is a contiguous 1 KiB tile;
// the pairs of 16 rows are transposed in registers.
void PackStep(const float* x, int64_t m, int64_t k, int64_t kpad, int64_t g, int64_t c,
              uint32_t* xp) {
  const int64_t left = k - c;
  const __mmask16 lo = left >= 16 ? 0xffff : (1u << left) - 1;
  const __mmask16 hi = left >= 32 ? 0xffff : left > 16 ? (1u << (left - 16)) - 1 : 0;
  __m512i in[16], out[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    const int64_t r = 16 * g + j;
    if (r < m) {
      const __m512 vlo = _mm512_maskz_loadu_ps(lo, x + r * k + c);
      const __m512 vhi = _mm512_maskz_loadu_ps(hi, x + r * k + c + 16);
      in[j] = (__m512i)_mm512_cvtne2ps_pbh(vhi, vlo);
    } else {
      in[j] = _mm512_setzero_si512();
    }
  }
  Transpose16x16(in, out);
  uint32_t* dst = xp + g * (kpad / 2) * 16 + (c / 2) * 16;
#pragma GCC unroll 16
  for (int q = 0; q < 16; ++q) _mm512_storeu_si512(dst + q * 16, out[q]);
}

// One group of 16 (or, with kPair, 32) rows of x against one 32-row block of w, over k steps
// [k_begin, k_end). The w block is a_base with row stride a_ld elements, except that the
// last step reads a_tail (32 x 32, stride 32) when it is set. With `prefetch` the pass
// fetches the w rows ahead of the tile loads (the first group's pass, which reads w from
// memory; the others find it in L1).
template <class Tiles, bool kPair>
void MultiplyGroup(const uint16_t* a_base, int64_t a_ld, const uint16_t* a_tail,
                   int64_t k_tail_begin, const uint16_t* b_base, int64_t b_group_elems,
                   int64_t k_begin, int64_t k_end, float* c, bool prefetch) {
  if (k_begin == 0) {
    Tiles::template Zero<0>();
    Tiles::template Zero<1>();
    if constexpr (kPair) {
      Tiles::template Zero<2>();
      Tiles::template Zero<3>();
    }
  } else {
    Tiles::template Load<0>(c, 64);
    Tiles::template Load<1>(c + 256, 64);
    if constexpr (kPair) {
      Tiles::template Load<2>(c + 512, 64);
      Tiles::template Load<3>(c + 768, 64);
    }
  }
  for (int64_t kk = k_begin; kk < k_end; kk += 32) {
    if (prefetch && kk + kPrefetchAhead < k_tail_begin) {
#pragma GCC unroll 32
      for (int64_t r = 0; r < kBlockRows; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(a_base + r * a_ld + kk + kPrefetchAhead),
                     _MM_HINT_T0);
      }
    }
    if (a_tail != nullptr && kk >= k_tail_begin) {
      Tiles::template Load<4>(a_tail, 64);
      Tiles::template Load<5>(a_tail + 16 * 32, 64);
    } else {
      Tiles::template Load<4>(a_base + kk, a_ld * 2);
      Tiles::template Load<5>(a_base + 16 * a_ld + kk, a_ld * 2);
    }
    const uint16_t* b = b_base + kk * 16;  // (kk / 2) rows of 32 bf16
    Tiles::template Load<6>(b, 64);
    Tiles::template Dot<0, 4, 6>();
    Tiles::template Dot<1, 5, 6>();
    if constexpr (kPair) {
      Tiles::template Load<7>(b + b_group_elems, 64);
      Tiles::template Dot<2, 4, 7>();
      Tiles::template Dot<3, 5, 7>();
    }
  }
  Tiles::template Store<0>(c, 64);
  Tiles::template Store<1>(c + 256, 64);
  if constexpr (kPair) {
    Tiles::template Store<2>(c + 512, 64);
    Tiles::template Store<3>(c + 768, 64);
  }
}

// Where the tile loads of one 32-row block of w read: the matrix in place, except a
// zero-padded copy of the last partial block and of the last k step when k is not a
// multiple of 32 (so tile loads stay inside the mapping). `slot` (the block's place in its
// work item) picks the per-thread copy: a SwiGLU item holds the partial blocks of two weights.
struct BlockOperand {
  const uint16_t* base;
  int64_t ld;
  const uint16_t* tail;
};

BlockOperand PrepareBlock(const uint16_t* w, int64_t n, int64_t k, int64_t kpad, int64_t blk,
                          int64_t slot) {
  const int64_t n0 = blk * kBlockRows;
  const int64_t rows = std::min(kBlockRows, n - n0);
  BlockOperand op{w + n0 * k, k, nullptr};
  if (rows < kBlockRows) {
    auto* panel = static_cast<uint16_t*>(ThreadScratch(2, kMaxSpan * kBlockRows * kpad * 2)) +
                  slot * kBlockRows * kpad;
    for (int64_t r = 0; r < kBlockRows; ++r) {
      uint16_t* dst = panel + r * kpad;
      if (r < rows) {
        std::memcpy(dst, op.base + r * k, k * 2);
        std::memset(dst + k, 0, (kpad - k) * 2);
      } else {
        std::memset(dst, 0, kpad * 2);
      }
    }
    return {panel, kpad, nullptr};
  }
  if (k != kpad) {
    auto* tail = static_cast<uint16_t*>(ThreadScratch(3, kMaxSpan * kBlockRows * 32 * 2)) +
                 slot * kBlockRows * 32;
    const int64_t k0 = kpad - 32;
    for (int64_t r = 0; r < kBlockRows; ++r) {
      std::memcpy(tail + r * 32, op.base + r * k + k0, (k - k0) * 2);
      std::memset(tail + r * 32 + (k - k0), 0, (kpad - k) * 2);
    }
    op.tail = tail;
  }
  return op;
}

// silu(g) * u on 16 lanes, as two halves of the op's 8-lane form (the same bits).
__m512 SiluMul16(__m512 g, __m512 u) {
  const __m256 lo = SiluMul8(_mm512_castps512_ps256(g), _mm512_castps512_ps256(u));
  const __m256 hi = SiluMul8(_mm512_extractf32x8_ps(g, 1), _mm512_extractf32x8_ps(u, 1));
  return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

// What AmxLinear writes: each output's y, or (kSwiGlu) silu(x · gateᵀ) * (x · upᵀ) into the
// first output's y, outs[0] being the gate and outs[1] the up projection, of one shape.
enum class Epilogue { kSeparate, kSwiGlu };

template <class Tiles>
void AmxLinear(const float* x, int64_t m, int64_t k, const Bf16Output* outs, int64_t num_outs,
               Epilogue epilogue) {
  const int64_t kpad = RoundUp(k, 32);
  const int64_t groups = CeilDiv(m, 16);
  const int64_t group_elems = kpad * 16;  // bf16 per packed 16-row group
  int64_t blocks = 0, total_n = 0;
  for (int64_t o = 0; o < num_outs; ++o) {
    blocks += CeilDiv(outs[o].n, kBlockRows);
    total_n += outs[o].n;
  }
  auto* xp = static_cast<uint16_t*>(ThreadScratch(1, groups * group_elems * sizeof(uint16_t)));
  const __m512i column = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(16));
  // When packed x outgrows L2 (long prompts against down_proj), each work item takes a span
  // of w blocks and runs the k passes outermost, so one pass of x serves the whole span.
  int64_t span = 1;
  if (groups * group_elems * 2 > kMaxL2XBytes) {
    span = std::clamp<int64_t>(blocks / (4 * omp_get_max_threads()), 1, kMaxSpan);
  }
  // Work items are spans of blocks of one output, numbered output after output; with SwiGLU,
  // spans of gate blocks that also take the same blocks of up.
  const bool swiglu = epilogue == Epilogue::kSwiGlu;
  const int64_t item_span = swiglu ? std::max<int64_t>(1, span / 2) : span;
  const int64_t walked = swiglu ? 1 : num_outs;
  int64_t items = 0;
  for (int64_t o = 0; o < walked; ++o) {
    items += CeilDiv(CeilDiv(outs[o].n, kBlockRows), item_span);
  }
  // Long outputs are written with streaming stores: each block writes two whole lines per row
  // of y, and a plain store would first read each line in (from DRAM: y is past L2).
  auto streamed = [&](const Bf16Output& out) {
    return m * out.n * 4 > kMaxL2XBytes && reinterpret_cast<uintptr_t>(out.y) % 64 == 0 &&
           out.n % 16 == 0;
  };
  bool any_streamed = false;
  for (int64_t o = 0; o < walked; ++o) any_streamed |= streamed(outs[o]);

#pragma omp parallel if (WorthThreads(m, total_n, k))
  {
#pragma omp for schedule(static)
    for (int64_t s = 0; s < groups * (kpad / 32); ++s) {
      PackStep(x, m, k, kpad, s % groups, s / groups * 32, reinterpret_cast<uint32_t*>(xp));
    }
    // The implicit barrier above publishes xp.
    Tiles::Configure();
    // C tiles of the item's w blocks: [block][group][half of the block][16 x 16], in f32.
    auto* cbuf = static_cast<float*>(
        ThreadScratch(0, (swiglu ? 2 : 1) * item_span * groups * 2 * kTileBytes));
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      int64_t o = 0, first = item * item_span;
      while (first >= RoundUp(CeilDiv(outs[o].n, kBlockRows), item_span)) {
        first -= RoundUp(CeilDiv(outs[o].n, kBlockRows), item_span);
        ++o;
      }
      const Bf16Output& out = outs[o];
      const int64_t n = out.n, blocks_of_out = std::min(item_span, CeilDiv(n, kBlockRows) - first);
      // Blocks [0, blocks_of_out) of the item come from `out`, the rest (SwiGLU) from up.
      const int64_t count = swiglu ? 2 * blocks_of_out : blocks_of_out;
      BlockOperand ops[kMaxSpan];
      for (int64_t s = 0; s < count; ++s) {
        const uint16_t* w = s < blocks_of_out ? out.w : outs[1].w;
        ops[s] = PrepareBlock(w, n, k, kpad, first + s % blocks_of_out, s);
      }
      for (int64_t k_begin = 0; k_begin < kpad; k_begin += kKPass) {
        const int64_t k_end = std::min(kpad, k_begin + kKPass);
        for (int64_t s = 0; s < count; ++s) {
          const BlockOperand& op = ops[s];
          for (int64_t g = 0; g < groups; g += 2) {
            const uint16_t* b = xp + g * group_elems;
            float* c = cbuf + (s * groups + g) * 2 * 256;
            if (g + 1 < groups) {
              MultiplyGroup<Tiles, true>(op.base, op.ld, op.tail, kpad - 32, b, group_elems,
                                         k_begin, k_end, c, g == 0);
            } else {
              MultiplyGroup<Tiles, false>(op.base, op.ld, op.tail, kpad - 32, b, group_elems,
                                          k_begin, k_end, c, g == 0);
            }
          }
        }
      }
      // cbuf holds yᵀ for each block: C[half][i][j] = y[16 g + j][n0 + 16 half + i]; a
      // gather down column j of each C tile yields 16 consecutive outputs of row 16 g + j.
      const bool stream = streamed(out);
      for (int64_t s = 0; s < blocks_of_out; ++s) {
        const int64_t n0 = (first + s) * kBlockRows;
        const int64_t rows = std::min(kBlockRows, n - n0);
        for (int64_t row = 0; row < m; ++row) {
          const float* c = cbuf + (s * groups + row / 16) * 2 * 256 + (row % 16);
          const float* c_up = c + blocks_of_out * groups * 2 * 256;  // SwiGLU
          float* dst = out.y + row * n + n0;
          for (int64_t half = 0; half * 16 < rows; ++half) {
            const int64_t cnt = std::min<int64_t>(16, rows - half * 16);
            const __mmask16 mask = cnt == 16 ? 0xffff : (1u << cnt) - 1;
            __m512 v = _mm512_i32gather_ps(column, c + half * 256, 4);
            if (out.bias != nullptr) {
              v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, out.bias + n0 + half * 16));
            }
            if (swiglu) {
              __m512 u = _mm512_i32gather_ps(column, c_up + half * 256, 4);
              if (outs[1].bias != nullptr) {
                u = _mm512_add_ps(u, _mm512_maskz_loadu_ps(mask, outs[1].bias + n0 + half * 16));
              }
              v = SiluMul16(v, u);
            }
            if (stream && cnt == 16) {
              _mm512_stream_ps(dst + half * 16, v);
            } else {
              _mm512_mask_storeu_ps(dst + half * 16, mask, v);
            }
          }
        }
      }
    }
    if (any_streamed) _mm_sfence();  // the streamed lines reach memory before the barrier
    Tiles::Release();
  }
}

}  // namespace

void LinearBf16Amx(const float* x, int64_t m, const uint16_t* w, int64_t n, int64_t k,
                   const float* bias, float* y) {
  const Bf16Output out{w, n, bias, y};
  AmxLinear<HwTiles>(x, m, k, &out, 1, Epilogue::kSeparate);
}

void LinearBf16AmxShared(const float* x, int64_t m, int64_t k, const Bf16Output* outs,
                         int64_t count) {
  AmxLinear<HwTiles>(x, m, k, outs, count, Epilogue::kSeparate);
}

void LinearBf16AmxSwiGlu(const float* x, int64_t m, const uint16_t* gate, const uint16_t* up,
                         int64_t n, int64_t k, float* out) {
  const Bf16Output outs[2] = {{gate, n, nullptr, out}, {up, n, nullptr, nullptr}};
  AmxLinear<HwTiles>(x, m, k, outs, 2, Epilogue::kSwiGlu);
}

void LinearBf16AmxEmulatedForTesting(const float* x, int64_t m, const uint16_t* w, int64_t n,
                                     int64_t k, const float* bias, float* y) {
  const Bf16Output out{w, n, bias, y};
  AmxLinear<EmulatedTiles>(x, m, k, &out, 1, Epilogue::kSeparate);
}

void LinearBf16AmxSharedEmulatedForTesting(const float* x, int64_t m, int64_t k,
                                           const Bf16Output* outs, int64_t count) {
  AmxLinear<EmulatedTiles>(x, m, k, outs, count, Epilogue::kSeparate);
}

void LinearBf16AmxSwiGluEmulatedForTesting(const float* x, int64_t m, const uint16_t* gate,
                                           const uint16_t* up, int64_t n, int64_t k,
                                           float* out) {
  const Bf16Output outs[2] = {{gate, n, nullptr, out}, {up, n, nullptr, nullptr}};
  AmxLinear<EmulatedTiles>(x, m, k, outs, 2, Epilogue::kSwiGlu);
}

}  // namespace preft::kernels::cpu

#pragma GCC pop_options
