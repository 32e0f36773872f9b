#pragma once

// One threading model for the CPU kernels: OpenMP threads split the work and every BLAS call
// runs single-threaded inside them, so OpenBLAS's own pool never competes with OpenMP for
// the same cores (on 2 cores that contention costs more than the BLAS work).

namespace preft::kernels::cpu {

// Sets the OpenMP thread count (`num_threads` <= 0 keeps the default: all cores) and pins
// OpenBLAS to one thread. Idempotent; call before the first forward.
void InitThreads(int num_threads = 0);

// The thread count in use.
int NumThreads();

}  // namespace preft::kernels::cpu
