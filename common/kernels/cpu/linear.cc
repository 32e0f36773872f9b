#include "common/kernels/cpu/linear.h"

#include <algorithm>
#include <atomic>

#include "common/kernels/cpu/cpu_features.h"
#include "common/kernels/cpu/linear_kernels.h"
#include "common/kernels/cpu/ops.h"

namespace preft::kernels::cpu {
namespace {

// Up to this many rows of x, bf16 weights take the vdpbf16ps GEMV even with AMX: the call is
// bound by streaming w, and AMX would pad x to 16 rows.
constexpr int64_t kMaxGemvRows = 4;
// From this many rows of x, bf16 weights without AMX take the w-broadcast GEMM. Measured on
// Zen 5, 2 threads, Qwen2.5-0.5B shapes: even with the dot kernel at 8 rows, 15-40% ahead of it
// from 10 and of the packed GEMM (LinearBf16Avx512Packed) at 16 .. 64 rows, level with
// the packed GEMM at 512 .. 2048 (lm_head: 5-8% ahead).
constexpr int64_t kMinBroadcastRows = 8;

// Which bf16 kernel runs m rows of x against w [rows, k], for Linear and the shared calls
// alike. kNone: none of the bf16 kernels (another dtype or ISA, or a shape they do not
// take); the FMA dot kernels then run. AMX tiles sum in their own order (not batch-invariant);
// without AMX the w-broadcast GEMM and its GEMV twin sum each row alike.
enum class Bf16Kernel { kNone, kAmx, kBroadcast, kGemv, kLanes };

Bf16Kernel Bf16KernelFor(const MatrixView& w, int64_t m, int64_t k) {
  if (w.dtype != DType::kBF16 || w.cols != k || w.rows <= 0 || k <= 0 || m <= 0) {
    return Bf16Kernel::kNone;
  }
  const LinearIsa isa = ActiveLinearIsa();
  if (isa == LinearIsa::kAmx) return m > kMaxGemvRows ? Bf16Kernel::kAmx : Bf16Kernel::kGemv;
  if (isa >= LinearIsa::kAvx512Bf16) {
    return m >= kMinBroadcastRows ? Bf16Kernel::kBroadcast : Bf16Kernel::kLanes;
  }
  return Bf16Kernel::kNone;
}

// One kernel for all of `outputs` (the same Linear would pick for each), or kNone.
Bf16Kernel SharedKernel(int64_t m, std::initializer_list<LinearOutput> outputs) {
  const int64_t k = outputs.size() > 0 ? outputs.begin()->w.cols : 0;
  Bf16Kernel kernel = Bf16Kernel::kNone;
  for (const LinearOutput& o : outputs) {
    const Bf16Kernel mine = Bf16KernelFor(o.w, m, k);
    if (mine == Bf16Kernel::kNone || (kernel != Bf16Kernel::kNone && mine != kernel)) {
      return Bf16Kernel::kNone;
    }
    kernel = mine;
  }
  return kernel;
}

void RunShared(Bf16Kernel kernel, const float* x, int64_t m, int64_t k, const Bf16Output* outs,
               int64_t count) {
  switch (kernel) {
    case Bf16Kernel::kAmx:
      LinearBf16AmxShared(x, m, k, outs, count);
      return;
    case Bf16Kernel::kBroadcast:
      LinearBf16Avx512BroadcastShared(x, m, k, outs, count);
      return;
    case Bf16Kernel::kGemv:
      LinearBf16Avx512Bf16Shared(x, m, k, outs, count);
      return;
    case Bf16Kernel::kLanes:
      LinearBf16Avx512LanesShared(x, m, k, outs, count);
      return;
    case Bf16Kernel::kNone:
      return;
  }
}

}  // namespace

void Linear(const float* x, int64_t m, const MatrixView& w, const float* bias, float* y) {
  const int64_t n = w.rows, k = w.cols;
  if (m <= 0 || n <= 0) return;
  if (k == 0) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) y[i * n + j] = bias != nullptr ? bias[j] : 0.f;
    return;
  }
  const Bf16Kernel kernel = Bf16KernelFor(w, m, k);
  if (kernel != Bf16Kernel::kNone) {
    const Bf16Output out{static_cast<const uint16_t*>(w.data), n, bias, y};
    RunShared(kernel, x, m, k, &out, 1);
    return;
  }
  const LinearIsa isa = ActiveLinearIsa();
  if (isa >= LinearIsa::kAvx512) {
    LinearFmaAvx512(x, m, w.data, w.dtype, n, k, bias, y);
  } else if (isa >= LinearIsa::kAvx2) {
    LinearFmaAvx2(x, m, w.data, w.dtype, n, k, bias, y);
  } else {
    LinearScalar(x, m, w.data, w.dtype, n, k, bias, y);
  }
}

void LinearShared(const float* x, int64_t m, std::initializer_list<LinearOutput> outputs) {
  constexpr int64_t kMaxOutputs = 4;
  const Bf16Kernel kernel = outputs.size() <= kMaxOutputs ? SharedKernel(m, outputs)
                                                          : Bf16Kernel::kNone;
  if (kernel == Bf16Kernel::kNone) {
    for (const LinearOutput& o : outputs) Linear(x, m, o.w, o.bias, o.y);
    return;
  }
  Bf16Output outs[kMaxOutputs];
  int64_t count = 0;
  for (const LinearOutput& o : outputs) {
    outs[count++] = {static_cast<const uint16_t*>(o.w.data), o.w.rows, o.bias, o.y};
  }
  RunShared(kernel, x, m, outputs.begin()->w.cols, outs, count);
}

void LinearSwiGlu(const float* x, int64_t m, const MatrixView& gate, const MatrixView& up,
                  float* out, float* up_scratch) {
  const int64_t n = gate.rows, k = gate.cols;
  // Only the AMX kernel gains from the fused epilogue: on Zen 5 the w-broadcast and GEMV
  // kernels measured level with LinearShared + SiluMulSeparate at every m (1 .. 512).
  if (SharedKernel(m, {{gate, nullptr, out}, {up, nullptr, up_scratch}}) == Bf16Kernel::kAmx &&
      up.rows == n) {
    LinearBf16AmxSwiGlu(x, m, static_cast<const uint16_t*>(gate.data),
                        static_cast<const uint16_t*>(up.data), n, k, out);
    return;
  }
  LinearShared(x, m, {{gate, nullptr, out}, {up, nullptr, up_scratch}});
  SiluMulSeparate(out, up_scratch, m * n, out);
}

}  // namespace preft::kernels::cpu
