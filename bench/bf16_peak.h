#pragma once

// The compute reference of the benchmarks: what this CPU's fastest bf16 dot product does
// here, in this run.

namespace preft::bench {

struct Bf16Peak {
  const char* unit = "none";  // "AMX tiles", "vdpbf16ps" or "none"
  double tflops = 0;
};

// bf16 TFLOP/s of register-resident dot products (independent accumulators, no loads) on
// every OpenMP thread at once, best of a few rounds: AMX tiles where the CPU has them, else
// AVX-512-BF16 vdpbf16ps, else none (0). On a shared host this moves with the other tenants,
// as the triad does: the same run's figure is the one to divide by.
Bf16Peak MeasureBf16Peak();

}  // namespace preft::bench
