#include "common/kernels/cuda/linear.cuh"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/kernels/cuda/device_util.cuh"
#include "common/kernels/cuda/ops.cuh"
#include "common/kernels/cuda/runtime.cuh"

namespace preft::kernels::cuda {
namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // cuBLAS's recommendation for Hopper

int BlasError(cublasStatus_t s) { return s == CUBLAS_STATUS_SUCCESS ? 0 : kBlasErrorBase + s; }

constexpr int kGemvThreads = 256;
constexpr int kGemvWarps = kGemvThreads / 32;

struct GemvArgs {
  LinearOutput out[kMaxSharedOutputs];
  int count = 0;
};

__device__ inline float RoundBf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// One warp per output row (the outputs' rows numbered one after another): the lanes stream
// the row's weights in 16-byte loads and dot them with M rows of x (L1-resident, rounded to
// bf16 as the CPU's kernels round it); lane 0 writes the sums plus bias.
template <int M>
__global__ void __launch_bounds__(kGemvThreads)
    GemvKernel(const float* __restrict__ x, int64_t k, GemvArgs args) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int64_t row = static_cast<int64_t>(blockIdx.x) * kGemvWarps + warp;
  // Which output the row is in (unrolled: a dynamic index would copy args to local memory).
  LinearOutput out = args.out[0];
#pragma unroll
  for (int o = 1; o < kMaxSharedOutputs; ++o) {
    if (row < out.n) break;
    row -= out.n;
    out = args.out[o];
    if (o >= args.count) return;  // the whole warp: past the last output's rows
  }
  if (row >= out.n) return;
  const uint16_t* wr = out.w + row * k;
  float acc[M];
#pragma unroll
  for (int r = 0; r < M; ++r) acc[r] = 0.f;
#pragma unroll 4
  for (int64_t i = lane * 8; i < k; i += 32 * 8) {
    float w[8];
    Widen8(__ldg(reinterpret_cast<const uint4*>(wr + i)), DType::kBF16, w);
#pragma unroll
    for (int r = 0; r < M; ++r) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(x + r * k + i));
      const float4 b = __ldg(reinterpret_cast<const float4*>(x + r * k + i + 4));
      acc[r] += w[0] * RoundBf16(a.x) + w[1] * RoundBf16(a.y) + w[2] * RoundBf16(a.z) +
                w[3] * RoundBf16(a.w) + w[4] * RoundBf16(b.x) + w[5] * RoundBf16(b.y) +
                w[6] * RoundBf16(b.z) + w[7] * RoundBf16(b.w);
    }
  }
#pragma unroll
  for (int r = 0; r < M; ++r) acc[r] = WarpSum(acc[r]);
  if (lane == 0) {
    const float b = out.bias != nullptr ? out.bias[row] : 0.f;
#pragma unroll
    for (int r = 0; r < M; ++r) out.y[r * out.n + row] = acc[r] + b;
  }
}

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
  const LinearOutput out{w, n, bias, y};
  return LinearShared(x, m, k, &out, 1);
}

int Blas::LinearShared(const float* x, int64_t m, int64_t k, const LinearOutput* outs,
                       int count) {
  if (count < 1 || count > kMaxSharedOutputs) return static_cast<int>(cudaErrorInvalidValue);
  if (m == 0) return 0;
  bool gemv = m <= kGemvMaxRows && k % 8 == 0 && Aligned16(x);
  int64_t rows = 0;
  GemvArgs args;
  for (int i = 0; i < count; ++i) {
    gemv = gemv && Aligned16(outs[i].w);
    rows += outs[i].n;
    args.out[i] = outs[i];
  }
  args.count = count;
  if (rows == 0) return 0;
  if (gemv) {
    const unsigned blocks = static_cast<unsigned>((rows + kGemvWarps - 1) / kGemvWarps);
    cudaStream_t st = AsStream(stream_);
    switch (m) {
      case 1: GemvKernel<1><<<blocks, kGemvThreads, 0, st>>>(x, k, args); break;
      case 2: GemvKernel<2><<<blocks, kGemvThreads, 0, st>>>(x, k, args); break;
      case 3: GemvKernel<3><<<blocks, kGemvThreads, 0, st>>>(x, k, args); break;
      default: GemvKernel<4><<<blocks, kGemvThreads, 0, st>>>(x, k, args); break;
    }
    return LaunchStatus();
  }
  if (const int e = Reserve(m * k); e != 0) return e;
  if (int e = RoundToBf16(x, m * k, xb_, stream_); e != 0) return e;
  for (int i = 0; i < count; ++i) {
    const LinearOutput& o = outs[i];
    if (o.n == 0) continue;
    // Column-major view: yᵀ [n, m] = W [n, k] (W row-major is Wᵀ column-major, hence OP_T)
    // times xᵀ [k, m] (x row-major is xᵀ column-major).
    const float alpha = 1.f, beta = 0.f;
    const cublasStatus_t s = cublasGemmEx(
        static_cast<cublasHandle_t>(handle_), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(o.n),
        static_cast<int>(m), static_cast<int>(k), &alpha, o.w, CUDA_R_16BF, static_cast<int>(k),
        xb_, CUDA_R_16BF, static_cast<int>(k), &beta, o.y, CUDA_R_32F, static_cast<int>(o.n),
        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS) return BlasError(s);
    if (o.bias != nullptr) {
      if (const int e = AddBias(o.y, o.bias, m, o.n, stream_); e != 0) return e;
    }
  }
  return 0;
}

}  // namespace preft::kernels::cuda
