#!/usr/bin/env bash
# The CUDA backend's checks on a GPU machine, in one command that prints its tables: the `gpu`
# tests (every CUDA kernel against the CPU kernel it mirrors; the whole forward with every
# adapter mode against the CPU model), bench/cuda_bench (copy bandwidth, bf16 GEMM rate,
# projections and low-rank kernels against their bounds) and bench/cuda_model_bench (decode
# at batch 1 against the bandwidth bound, 64 and 256 sequences, and the paper's 512-adapter
# setting on llama3.1-8b and qwen2.5-0.5b). Sized to finish in under 8 minutes.
#
#   scripts/gpu-check.sh [BUILD_DIR]        on a GPU machine with the project's packages
#                                           (scripts/install-deps.sh --cuda): build and run
#   scripts/gpu-check.sh --bundle DIR       here, without a GPU: build the GPU binaries and
#                                           copy them, with the shared libraries they need
#                                           that a bare CUDA image lacks, into DIR
#   scripts/gpu-check.sh --run-bundle DIR   on a bare CUDA machine (only the CUDA toolkit and
#                                           driver): run what --bundle made
# A bundle under build-gpu/ (ignored by git) travels to a lent machine as a carried path:
#   here:  scripts/gpu-check.sh --bundle build-gpu/bundle          (~46 MB, stripped: OpenBLAS, libgomp, Abseil, PCRE2)
#   there: scripts/gpu-check.sh --run-bundle build-gpu/bundle      (carry: build-gpu/bundle)
set -euo pipefail
cd "$(dirname "$0")/.."

gpu_targets=(cuda_ops_test device_model_test cuda_engine_test cuda_bench cuda_model_bench)

build() {
  local dir=$1
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPREFT_ENABLE_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90;80}" >/dev/null
  cmake --build "$dir" --target "${gpu_targets[@]}"
}

# Runs the tests and benchmarks whose binaries are in $1 (tests) and $2 (benchmarks).
run_checks() {
  local tests=$1 bench=$2
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  local rc=0
  echo "== gpu tests"
  timeout 60 "$tests/cuda_ops_test" --gtest_brief=1 || rc=$?
  timeout 120 "$tests/device_model_test" --gtest_brief=1 || rc=$?
  timeout 60 "$tests/cuda_engine_test" --gtest_brief=1 || rc=$?
  echo "== cuda_bench"
  timeout 60 "$bench/cuda_bench" || rc=$?
  for preset in llama3.1-8b qwen2.5-0.5b; do
    echo "== cuda_model_bench --preset $preset"
    timeout 150 "$bench/cuda_model_bench" --preset "$preset" ${MODEL_BENCH_FLAGS:-} || rc=$?
  done
  return $rc
}

case "${1:-}" in
  --bundle)
    out=${2:?usage: gpu-check.sh --bundle DIR}
    build build-gpu
    rm -rf "$out" && mkdir -p "$out/lib"
    cp build-gpu/tests/gpu/cuda_ops_test build-gpu/tests/gpu/device_model_test \
      build-gpu/tests/gpu/cuda_engine_test \
      build-gpu/bench/cuda_bench build-gpu/bench/cuda_model_bench "$out/"
    strip --strip-unneeded "$out"/cuda_* "$out"/device_model_test
    # Libraries beyond glibc and CUDA's own (the CUDA image has the toolkit; cuBLAS is too
    # large to carry): OpenBLAS, OpenMP, gfortran and the like.
    for bin in "$out"/cuda_* "$out"/device_model_test; do
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
    run_checks "$dir" "$dir"
    ;;
  *)
    dir=${1:-build-gpu}
    build "$dir"
    run_checks "$dir/tests/gpu" "$dir/bench"
    ;;
esac
