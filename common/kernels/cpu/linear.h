#pragma once

// Dense linear layers on the CPU: y = x · Wᵀ (+ bias), the hot path of every forward.

#include <cstdint>
#include <initializer_list>

#include "common/kernels/matrix.h"

namespace preft::kernels::cpu {

// y[m, w.rows] = x[m, w.cols] · wᵀ (+ bias[w.rows] when not null). x and y are f32,
// row-major and dense. w may be f32, f16 or bf16; the kernel is chosen by dtype, m and the
// CPU's features (AMX-BF16 > AVX-512-BF16 > AVX-512 > AVX2). Parallel over OpenMP threads;
// call from one thread at a time.
void Linear(const float* x, int64_t m, const MatrixView& w, const float* bias, float* y);

// One weight of LinearShared.
struct LinearOutput {
  MatrixView w;
  const float* bias;  // may be null
  float* y;
};

// Linear for several weights of the same x (q, k, v; gate, up), with the same results as
// one Linear per output. With bf16 weights x is rounded (or packed) once and all outputs
// share one parallel region (q/k/v: 1.1-1.2x on Zen 5 from m = 1, 1.2-1.4x on AMX).
void LinearShared(const float* x, int64_t m, std::initializer_list<LinearOutput> outputs);

// A SwiGLU MLP's first half: out[m, n] = silu(x · gateᵀ) * (x · upᵀ), the bits of LinearShared
// followed by SiluMulSeparate. On AMX one fused kernel (neither projection is written out);
// elsewhere up's product goes through up_scratch [m, n].
void LinearSwiGlu(const float* x, int64_t m, const MatrixView& gate, const MatrixView& up,
                  float* out, float* up_scratch);

}  // namespace preft::kernels::cpu
