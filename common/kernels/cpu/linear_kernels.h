#pragma once

// The ISA-specific kernels behind cpu::Linear (linear.h), for the dispatcher and for tests.
// All compute y[m, n] = x[m, k] · wᵀ (+ bias[n]) with w [n, k] row-major, borrowed (never
// copied whole), x and y f32 dense. Each runs its own OpenMP parallel region; call them from
// one thread at a time, and only on a CPU that has the ISA in the name.

#include <cstdint>

#include "common/kernels/cpu/isa.h"
#include "common/kernels/dtype.h"

namespace preft::kernels::cpu {

// One weight of the calls below that share x (q, k, v; gate, up): y[m, n] = x · wᵀ (+ bias).
struct Bf16Output {
  const uint16_t* w;
  int64_t n;
  const float* bias;
  float* y;
};

// Plain C++ (no SIMD assumptions). w f32, bf16 or f16.
void LinearScalar(const float* x, int64_t m, const void* w, DType w_dtype, int64_t n, int64_t k,
                  const float* bias, float* y);

// AVX2 + FMA + F16C: w f32, or bf16 or f16 widened to f32; f32 FMA (x not rounded). Each
// output sums in one order at every m, so f32 weights take these too, not OpenBLAS (whose
// sgemv and sgemm orders differ).
void LinearFmaAvx2(const float* x, int64_t m, const void* w, DType w_dtype, int64_t n, int64_t k,
                  const float* bias, float* y);

// AVX-512 F/BW/VL: as LinearFmaAvx2, 16 lanes.
void LinearFmaAvx512(const float* x, int64_t m, const void* w, DType w_dtype, int64_t n,
                    int64_t k, const float* bias, float* y);

// AVX-512-BF16 (vdpbf16ps): w bf16, x rounded to bf16 once, f32 accumulation. Streams w once
// per 64-row block of x, so it is a bandwidth-bound GEMV for small m: Linear's on AMX CPUs
// (the others take LinearBf16Avx512Lanes, whose sums match their GEMM's).
void LinearBf16Avx512Bf16(const float* x, int64_t m, const uint16_t* w, int64_t n, int64_t k,
                          const float* bias, float* y);
// The same over several weights of one x, in one parallel region per four: x is rounded
// once and work items are slices of every output.
void LinearBf16Avx512Bf16Shared(const float* x, int64_t m, int64_t k, const Bf16Output* outs,
                                int64_t count);

// AVX-512-BF16, packed GEMM for batched x: blocks of w (64 rows x up to 1024 of k) are
// repacked per call into the vdpbf16ps pair layout in per-thread scratch and multiplied by
// broadcast pairs of x into 6 x 64 tiles of y. Rounds x to bf16 like LinearBf16Avx512Bf16 and
// beats it from about 24 rows; each w element is read once per 768 rows of x. Linear takes
// LinearBf16Avx512Broadcast instead (level at 512 .. 2048 rows, ahead below); kept for tests
// and the benchmark.
void LinearBf16Avx512Packed(const float* x, int64_t m, const uint16_t* w, int64_t n, int64_t k,
                            const float* bias, float* y);

// AVX-512-BF16, "w-broadcast" GEMM: computes yᵀ = w · xᵀ with x packed per call into the
// vdpbf16ps pair layout across rows (padded to 16) and bf16 pairs of w broadcast straight
// from the borrowed matrix, so w is never repacked. Rounds x to bf16 like the kernels above.
// Linear's bf16 kernel without AMX from 8 rows of x; each w element is read once per 512.
void LinearBf16Avx512Broadcast(const float* x, int64_t m, const uint16_t* w, int64_t n,
                               int64_t k, const float* bias, float* y);
// The same over several weights of one x, as LinearBf16Avx512Bf16Shared: x packed once.
void LinearBf16Avx512BroadcastShared(const float* x, int64_t m, int64_t k,
                                     const Bf16Output* outs, int64_t count);

// AVX-512-BF16 GEMV with the w-broadcast GEMM's sums: per output the same vdpbf16ps steps
// in the same order (BroadcastKBlock blocks), so each row of y has the bits the GEMM gives it
// at any m, at the speed of a GEMV: outputs sit in lanes (16 x 16 blocks of w's pairs
// transposed in registers) and pairs of x are broadcast. Linear's bf16 kernel without AMX
// below 8 rows of x.
void LinearBf16Avx512Lanes(const float* x, int64_t m, const uint16_t* w, int64_t n, int64_t k,
                           const float* bias, float* y);
// The same over several weights of one x, as LinearBf16Avx512Bf16Shared.
void LinearBf16Avx512LanesShared(const float* x, int64_t m, int64_t k, const Bf16Output* outs,
                                 int64_t count);

// Rounds rows of x [m, k] to bf16 (RNE, as vdpbf16ps would) into xb [m, ldx], ldx a multiple
// of 32 at least k, zero-padded. Needs AVX-512-BF16; shared by the kernels above.
void ConvertRowsToBf16(const float* x, int64_t m, int64_t k, int64_t ldx, uint16_t* xb);

// AMX-BF16: computes yᵀ = w · xᵀ with w tiles loaded straight from the borrowed matrix and
// x packed per call into the VNNI layout. x rounded to bf16, f32 accumulation.
void LinearBf16Amx(const float* x, int64_t m, const uint16_t* w, int64_t n, int64_t k,
                   const float* bias, float* y);

// LinearBf16Amx over several weights of one x (q, k, v; gate, up): x is packed once and the
// w blocks of all outputs are spread over the threads in one parallel region.
void LinearBf16AmxShared(const float* x, int64_t m, int64_t k, const Bf16Output* outs,
                         int64_t count);

// silu(x · gateᵀ) * (x · upᵀ) into out [m, n] (gate and up [n, k]): each work item takes the
// same blocks of both, and the epilogue applies SiLU (the bits of SiluMulSeparate), so the
// two projections are never written out.
void LinearBf16AmxSwiGlu(const float* x, int64_t m, const uint16_t* gate, const uint16_t* up,
                         int64_t n, int64_t k, float* out);

// The AMX kernel's exact loop nest and packing with the tile instructions emulated in C++,
// so its indexing is testable on CPUs without AMX. Needs AVX-512-BF16; slow.
void LinearBf16AmxEmulatedForTesting(const float* x, int64_t m, const uint16_t* w, int64_t n,
                                     int64_t k, const float* bias, float* y);
// The same for LinearBf16AmxShared (items numbered over several outputs) and
// LinearBf16AmxSwiGlu (items holding blocks of two weights).
void LinearBf16AmxSharedEmulatedForTesting(const float* x, int64_t m, int64_t k,
                                           const Bf16Output* outs, int64_t count);
void LinearBf16AmxSwiGluEmulatedForTesting(const float* x, int64_t m, const uint16_t* gate,
                                           const uint16_t* up, int64_t n, int64_t k, float* out);

}  // namespace preft::kernels::cpu
