#pragma once

// The compute reference of the benchmarks: what the AMX tiles do here, in this run.

namespace preft::bench {

// bf16 TFLOP/s of register-resident tile dot products (4 independent accumulators, no
// loads) on every OpenMP thread at once, best of a few rounds; 0 without AMX-BF16. On a
// shared host this moves with the other tenants, as the triad does: the same run's figure
// is the one to divide by.
double AmxPeakTflops();

}  // namespace preft::bench
