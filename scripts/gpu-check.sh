#!/usr/bin/env bash
# The CUDA backend's checks on a GPU machine, in one command that prints one table: the `gpu`
# tests (every CUDA kernel against the CPU kernel it mirrors) and bench/cuda_bench (copy
# bandwidth, bf16 GEMM rate, decode projections against the bandwidth bound, low-rank kernel
# against its byte bound). Sized to finish in well under 8 minutes.
#
#   scripts/gpu-check.sh [BUILD_DIR]        on a GPU machine with the project's packages
#                                           (scripts/install-deps.sh --cuda): build and run
#   scripts/gpu-check.sh --bundle DIR       here, without a GPU: build the GPU binaries and
#                                           copy them, with the shared libraries they need
#                                           that a bare CUDA image lacks, into DIR
#   scripts/gpu-check.sh --run-bundle DIR   on a bare CUDA machine (only the CUDA toolkit and
#                                           driver): run what --bundle made
# A bundle under build-gpu/ (ignored by git) travels to a lent machine as a carried path:
#   here:  scripts/gpu-check.sh --bundle build-gpu/bundle          (~40 MB: OpenBLAS, libgomp)
#   there: scripts/gpu-check.sh --run-bundle build-gpu/bundle      (carry: build-gpu/bundle)
set -euo pipefail
cd "$(dirname "$0")/.."

gpu_targets=(cuda_ops_test cuda_bench)

build() {
  local dir=$1
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPREFT_ENABLE_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90;80}" >/dev/null
  cmake --build "$dir" --target "${gpu_targets[@]}"
}

# Runs the test binary $1 and the benchmark $2 and prints the results.
run_checks() {
  local tests=$1 bench=$2
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  echo "== gpu tests"
  local rc=0
  timeout 300 "$tests" --gtest_brief=1 || rc=$?
  echo "== cuda_bench"
  timeout 240 "$bench" || rc=$?
  return $rc
}

case "${1:-}" in
  --bundle)
    out=${2:?usage: gpu-check.sh --bundle DIR}
    build build-gpu
    rm -rf "$out" && mkdir -p "$out/lib"
    cp build-gpu/tests/gpu/cuda_ops_test build-gpu/bench/cuda_bench "$out/"
    # Libraries beyond glibc and CUDA's own (the CUDA image has the toolkit; cuBLAS is too
    # large to carry): OpenBLAS, OpenMP, gfortran and the like.
    for bin in "$out/cuda_ops_test" "$out/cuda_bench"; do
      ldd "$bin" | awk '/=> \// {print $1, $3}' | while read -r name path; do
        case "$name" in
          libc.so*|libm.so*|libpthread*|libdl.so*|librt.so*|ld-linux*|libcuda.so*|libcudart*|libcublas*|libstdc++*|libgcc_s*) ;;
          *) cp -n "$path" "$out/lib/" ;;
        esac
      done
    done
    du -sh "$out"
    ;;
  --run-bundle)
    dir=${2:?usage: gpu-check.sh --run-bundle DIR}
    cuda_libs=$(find /usr/local /usr/lib /opt \( -name 'libcublas.so.13' -o -name 'libcudart.so.13' \) -printf '%h\n' 2>/dev/null | sort -u | paste -sd:)
    export LD_LIBRARY_PATH="$dir/lib:${cuda_libs}:${LD_LIBRARY_PATH:-}"
    run_checks "$dir/cuda_ops_test" "$dir/cuda_bench"
    ;;
  *)
    dir=${1:-build-gpu}
    build "$dir"
    run_checks "$dir/tests/gpu/cuda_ops_test" "$dir/bench/cuda_bench"
    ;;
esac
