#include "common/kernels/cpu/threads.h"

#include <omp.h>

extern "C" void openblas_set_num_threads(int);

namespace preft::kernels::cpu {

void InitThreads(int num_threads) {
  if (num_threads > 0) omp_set_num_threads(num_threads);
  openblas_set_num_threads(1);
}

int NumThreads() { return omp_get_max_threads(); }

}  // namespace preft::kernels::cpu
