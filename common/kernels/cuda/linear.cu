#include "common/kernels/cuda/linear.cuh"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "common/kernels/cuda/device_util.cuh"
#include "common/kernels/cuda/ops.cuh"
#include "common/kernels/cuda/runtime.cuh"

namespace preft::kernels::cuda {
namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // cuBLAS's recommendation for Hopper

int BlasError(cublasStatus_t s) { return s == CUBLAS_STATUS_SUCCESS ? 0 : kBlasErrorBase + s; }

}  // namespace

int Blas::Create(void* stream, Blas** out) {
  auto* b = new Blas();
  cublasHandle_t h = nullptr;
  if (const cublasStatus_t s = cublasCreate(&h); s != CUBLAS_STATUS_SUCCESS) {
    delete b;
    return BlasError(s);
  }
  b->handle_ = h;
  b->stream_ = stream;
  if (const cublasStatus_t s = cublasSetStream(h, AsStream(stream));
      s != CUBLAS_STATUS_SUCCESS) {
    delete b;
    return BlasError(s);
  }
  if (const cudaError_t e = cudaMalloc(&b->workspace_, kWorkspaceBytes); e != cudaSuccess) {
    b->workspace_ = nullptr;
    delete b;
    return e;
  }
  if (const cublasStatus_t s = cublasSetWorkspace(h, b->workspace_, kWorkspaceBytes);
      s != CUBLAS_STATUS_SUCCESS) {
    delete b;
    return BlasError(s);
  }
  *out = b;
  return 0;
}

int Blas::Reserve(int64_t elems) {
  if (elems <= xb_elems_) return 0;
  if (xb_ != nullptr) cudaFree(xb_);
  xb_ = nullptr;
  xb_elems_ = 0;
  ++generation_;
  if (const cudaError_t e = cudaMalloc(&xb_, elems * sizeof(uint16_t)); e != cudaSuccess) return e;
  xb_elems_ = elems;
  return 0;
}

Blas::~Blas() {
  if (handle_ != nullptr) cublasDestroy(static_cast<cublasHandle_t>(handle_));
  if (xb_ != nullptr) cudaFree(xb_);
  if (workspace_ != nullptr) cudaFree(workspace_);
}

int Blas::Linear(const float* x, int64_t m, const uint16_t* w, int64_t n, int64_t k,
                 const float* bias, float* y) {
  if (m == 0 || n == 0) return 0;
  if (const int e = Reserve(m * k); e != 0) return e;
  if (int e = RoundToBf16(x, m * k, xb_, stream_); e != 0) return e;
  // Column-major view: yᵀ [n, m] = W [n, k] (W row-major is Wᵀ column-major, hence OP_T)
  // times xᵀ [k, m] (x row-major is xᵀ column-major).
  const float alpha = 1.f, beta = 0.f;
  const cublasStatus_t s = cublasGemmEx(
      static_cast<cublasHandle_t>(handle_), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n),
      static_cast<int>(m), static_cast<int>(k), &alpha, w, CUDA_R_16BF, static_cast<int>(k), xb_,
      CUDA_R_16BF, static_cast<int>(k), &beta, y, CUDA_R_32F, static_cast<int>(n),
      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (s != CUBLAS_STATUS_SUCCESS) return BlasError(s);
  return bias != nullptr ? AddBias(y, bias, m, n, stream_) : 0;
}

}  // namespace preft::kernels::cuda
