#include "common/kernels/cpu/isa.h"

#include <algorithm>
#include <atomic>

#include "common/kernels/cpu/cpu_features.h"

namespace preft::kernels::cpu {
namespace {

std::atomic<int> g_isa_cap{static_cast<int>(LinearIsa::kAmx)};

LinearIsa BestIsa() {
  const CpuFeatures& f = GetCpuFeatures();
  if (f.amx_bf16) return LinearIsa::kAmx;
  if (f.avx512_bf16) return LinearIsa::kAvx512Bf16;
  if (f.avx512) return LinearIsa::kAvx512;
  if (f.avx2) return LinearIsa::kAvx2;
  return LinearIsa::kScalar;
}

}  // namespace

const char* LinearIsaName(LinearIsa isa) {
  switch (isa) {
    case LinearIsa::kScalar: return "scalar";
    case LinearIsa::kAvx2: return "avx2";
    case LinearIsa::kAvx512: return "avx512";
    case LinearIsa::kAvx512Bf16: return "avx512bf16";
    case LinearIsa::kAmx: return "amx";
  }
  return "?";
}

LinearIsa ActiveLinearIsa() {
  return static_cast<LinearIsa>(
      std::min(static_cast<int>(BestIsa()), g_isa_cap.load(std::memory_order_relaxed)));
}

void SetLinearIsaCapForTesting(LinearIsa cap) {
  g_isa_cap.store(static_cast<int>(cap), std::memory_order_relaxed);
}

}  // namespace preft::kernels::cpu
