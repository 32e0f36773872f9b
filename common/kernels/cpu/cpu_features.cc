#include "common/kernels/cpu/cpu_features.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/log/log.h"

namespace preft::kernels::cpu {
namespace {

// Linux's arch_prctl codes for dynamically enabled XSAVE state (asm/prctl.h, 5.16+).
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtileData = 18;

// XCR0 bits: the OS saves these register files on context switch.
constexpr uint64_t kXcr0Avx = (1u << 1) | (1u << 2);                // SSE, AVX upper halves
constexpr uint64_t kXcr0Avx512 = (1u << 5) | (1u << 6) | (1u << 7);  // opmask, ZMM hi
constexpr uint64_t kXcr0Amx = (1u << 17) | (1u << 18);              // XTILECFG, XTILEDATA

uint64_t ReadXcr0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

bool Bit(uint32_t reg, int bit) { return (reg >> bit) & 1u; }

CpuFeatures::Vendor DetectVendor() {
  uint32_t a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return CpuFeatures::Vendor::kOther;
  char id[13] = {};
  std::memcpy(id, &b, 4);
  std::memcpy(id + 4, &d, 4);
  std::memcpy(id + 8, &c, 4);
  if (std::strcmp(id, "GenuineIntel") == 0) return CpuFeatures::Vendor::kIntel;
  if (std::strcmp(id, "AuthenticAMD") == 0) return CpuFeatures::Vendor::kAmd;
  return CpuFeatures::Vendor::kOther;
}

CpuFeatures Detect() {
  CpuFeatures f;
  f.vendor = DetectVendor();
  uint32_t a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = Bit(c, 27), avx = Bit(c, 28), fma = Bit(c, 12), f16c = Bit(c, 29);
  if (!osxsave || !avx) return f;
  const uint64_t xcr0 = ReadXcr0();
  if ((xcr0 & kXcr0Avx) != kXcr0Avx) return f;

  uint32_t max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  const uint32_t leaf7_ebx = b, leaf7_edx = d;
  __cpuid_count(7, 1, a, b, c, d);
  const uint32_t leaf7_1_eax = a;

  f.avx2 = Bit(leaf7_ebx, 5) && fma && f16c;
  const bool os_avx512 = (xcr0 & kXcr0Avx512) == kXcr0Avx512;
  f.avx512 = f.avx2 && os_avx512 && Bit(leaf7_ebx, 16) && Bit(leaf7_ebx, 30) &&
             Bit(leaf7_ebx, 31);
  f.avx512_bf16 = f.avx512 && Bit(leaf7_1_eax, 5);
  const bool hw_amx = Bit(leaf7_edx, 24) && Bit(leaf7_edx, 22);  // AMX-TILE, AMX-BF16
  if (f.avx512_bf16 && hw_amx && (xcr0 & kXcr0Amx) == kXcr0Amx) {
    // Tile data is off by default for each process; ask once, it then holds for all threads.
    f.amx_bf16 = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtileData) == 0;
  }
  return f;
}

// PREFT_CPU_ISA caps the level; unknown values are reported and ignored.
void ApplyCap(const char* cap, CpuFeatures* f) {
  if (cap == nullptr || *cap == '\0') return;
  if (std::strcmp(cap, "amx") == 0) return;
  f->amx_bf16 = false;
  if (std::strcmp(cap, "avx512bf16") == 0) return;
  f->avx512_bf16 = false;
  if (std::strcmp(cap, "avx512") == 0) return;
  f->avx512 = false;
  if (std::strcmp(cap, "avx2") == 0) return;
  if (std::strcmp(cap, "scalar") == 0 || std::strcmp(cap, "none") == 0) {
    f->avx2 = false;
    return;
  }
  log::Warn("ignoring PREFT_CPU_ISA={} (want avx2|avx512|avx512bf16|amx)", cap);
  *f = Detect();
}

}  // namespace

const CpuFeatures& GetCpuFeatures() {
  static const CpuFeatures features = [] {
    CpuFeatures f = Detect();
    ApplyCap(std::getenv("PREFT_CPU_ISA"), &f);
    return f;
  }();
  return features;
}

}  // namespace preft::kernels::cpu
