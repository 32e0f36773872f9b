#pragma once

// Dense linear layers on the GPU through cuBLAS: y = x · Wᵀ (+ bias) with bf16 weights.

#include <cstdint>

namespace preft::kernels::cuda {

// One weight of a LinearShared call: y[m, n] = x · wᵀ (+ bias[n]).
struct LinearOutput {
  const uint16_t* w = nullptr;  // bf16 [n, k] row-major
  int64_t n = 0;
  const float* bias = nullptr;  // [n] or null
  float* y = nullptr;           // [m, n]
};
inline constexpr int kMaxSharedOutputs = 3;
// Rows up to which a call takes the GEMV kernel rather than cuBLAS (decode at small batch).
inline constexpr int64_t kGemvMaxRows = 4;

// A cuBLAS handle bound to one stream, with a growing bf16 workspace for x.
class Blas {
 public:
  // Returns 0 and a context in *out, or an error code (runtime.cuh).
  static int Create(void* stream, Blas** out);
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;

  // y[m, n] = x[m, k] · wᵀ (+ bias[n]): w bf16 [n, k] row-major, x and y f32, all on the
  // device. x is rounded to bf16 first, as the CPU's bf16 kernels round it; the products
  // accumulate in f32.
  int Linear(const float* x, int64_t m, const uint16_t* w, int64_t n, int64_t k,
             const float* bias, float* y);
  // The same for up to kMaxSharedOutputs weights that read one x (q, k, v; gate, up). With
  // m <= kGemvMaxRows (and k a multiple of 8, pointers 16-byte aligned) one GEMV launch
  // serves every output: weights streamed in 16-byte loads, x rounded to bf16 as it is read,
  // bias added in place; cuBLAS's small-m kernels read the weights slower and need a rounding
  // and a bias launch each. Otherwise x is rounded once and each output is a cuBLAS GEMM.
  int LinearShared(const float* x, int64_t m, int64_t k, const LinearOutput* outs, int count);

  // Grows the bf16 copy of x to hold `elems` values now (a graph capture must not allocate).
  int Reserve(int64_t elems);
  // Changes whenever that copy moves: graphs recorded before then hold a stale address.
  int64_t generation() const { return generation_; }

  void* stream() const { return stream_; }

 private:
  Blas() = default;
  void* handle_ = nullptr;  // cublasHandle_t
  void* stream_ = nullptr;
  uint16_t* xb_ = nullptr;
  int64_t xb_elems_ = 0;
  int64_t generation_ = 0;
  void* workspace_ = nullptr;  // cuBLAS's, set once so captured GEMMs never allocate
};

}  // namespace preft::kernels::cuda
