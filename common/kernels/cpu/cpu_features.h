#pragma once

namespace preft::kernels::cpu {

// What this CPU (and OS) lets the kernels use, read once at first call.
// PREFT_CPU_ISA=avx2|avx512|avx512bf16|amx caps the level, for tests of the fallbacks.
struct CpuFeatures {
  enum class Vendor { kOther, kIntel, kAmd };
  Vendor vendor = Vendor::kOther;  // kernels tuned per microarchitecture ask this
  bool avx2 = false;
  bool avx512 = false;      // F + BW + VL
  bool avx512_bf16 = false;
  bool amx_bf16 = false;    // hardware support and the OS granted tile state
};

const CpuFeatures& GetCpuFeatures();

}  // namespace preft::kernels::cpu
