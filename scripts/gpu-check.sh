#!/usr/bin/env bash
# The CUDA backend's checks on a GPU machine, in one command that prints its tables: the `gpu`
# tests (every CUDA kernel against the CPU kernel it mirrors; the whole forward with every
# adapter mode against the CPU model; the engine), bench/cuda_bench (copy bandwidth, bf16 GEMM
# rate, projections and low-rank kernels against their bounds), bench/cuda_model_bench (decode
# at batch 1 against the bandwidth bound, 64 and 256 sequences, and the paper's 512-adapter
# setting on llama3.1-8b and qwen2.5-0.5b; on a machine of several GPUs, decode split over
# them by tensor parallelism: the 8B over 2, the 70B over 4 or 8) and, where the cluster's
# binaries are there, the
# served table on the GPU (bench/serve/matrix.py: router + one colocated --device cuda worker,
# then prefill + decode workers on the GPU; qwen2.5-0.5b, 64 adapters, every mode). Sized to
# finish in under 8 minutes.
#
#   scripts/gpu-check.sh [BUILD_DIR]        on a GPU machine with the project's packages
#                                           (scripts/install-deps.sh --cuda): build and run
#   scripts/gpu-check.sh --bundle DIR       here, without a GPU: build the GPU binaries and
#                                           copy them, with the shared libraries they need
#                                           that a bare CUDA image lacks, into DIR, and pack
#                                           DIR.tgz
#   scripts/gpu-check.sh --run-bundle DIR[.tgz]   on a bare CUDA machine (only the CUDA
#                                           toolkit and driver): run what --bundle made
# A bundle under build-gpu/ (ignored by git) travels to a lent machine as a carried path:
#   here:  scripts/gpu-check.sh --bundle build-gpu/bundle            (~35 MB packed)
#   there: scripts/gpu-check.sh --run-bundle build-gpu/bundle.tgz    (carry: build-gpu/bundle.tgz)
# SERVE=0 skips the served table (SERVE_TIMEOUT_S bounds it, default 420;
# SERVE_DEPLOYMENTS=colocated leaves out the disaggregated cells); MODEL_BENCH_FLAGS
# passes flags to cuda_model_bench. With $OUT set (the device tool's output folder), the
# served cells and worker logs are packed into $OUT/served.tgz.
set -euo pipefail
cd "$(dirname "$0")/.."

# Beside the CPU tests of their component, in the build tree.
gpu_tests=(tests/kernels/cuda_ops_test tests/backend/device_model_test tests/backend/cuda_engine_test
           tests/transport/cuda_ipc_transport_test)
gpu_benches=(cuda_bench cuda_model_bench)
cluster=(tools/preft services/prefill/preft-prefill services/decode/preft-decode
         services/router/preft-router)

build() {
  local dir=$1
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPREFT_ENABLE_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90;80}" >/dev/null
  cmake --build "$dir" --target "${gpu_tests[@]##*/}" "${gpu_benches[@]}" preft preft-prefill \
    preft-decode preft-router
}

# The served table through the public API: one colocated GPU worker behind the router, then
# a prefill and a decode worker on the same GPU (KV staged through host memory, UCX shm), then
# those tiers again with KV copied GPU to GPU (--transport cuda_ipc).
serve() {
  local build=$1 out=/tmp/preft-serve/out
  command -v python3 >/dev/null || { echo "no python3: served table skipped"; return 0; }
  echo "== served on the GPU (bench/serve/matrix.py)"
  local rc=0
  timeout "${SERVE_TIMEOUT_S:-420}" python3 bench/serve/matrix.py --build "$build" --model /tmp/preft-serve/model \
    --preset qwen2.5-0.5b --dtype bf16 --adapter-dir /tmp/preft-serve/adapters --out "$out" \
    --deployments "${SERVE_DEPLOYMENTS:-colocated,disaggregated}" --device cuda --adapters 64 \
    --concurrency 64 --requests 128 --prompt-tokens 128 --max-tokens 128 \
    | grep -v "make-adapter: wrote" || rc=$?
  # The same tiers with KV moved GPU to GPU (CUDA IPC) instead of through host mirrors.
  if [[ "${SERVE_DEPLOYMENTS:-colocated,disaggregated}" == *disaggregated* ]]; then
    timeout "${SERVE_TIMEOUT_S:-240}" python3 bench/serve/matrix.py --build "$build" \
      --model /tmp/preft-serve/model --preset qwen2.5-0.5b --dtype bf16 \
      --adapter-dir /tmp/preft-serve/adapters --out "$out/cuda_ipc" --deployments disaggregated \
      --transport cuda_ipc --modes base,lorap,direftp --device cuda --adapters 64 \
      --concurrency 64 --requests 128 --prompt-tokens 128 --max-tokens 128 \
      | grep -v "make-adapter: wrote" || rc=$?
  fi
  # One archive of the table, cells and worker logs: a lent machine returns few files.
  if [[ -n "${OUT:-}" ]]; then tar czf "$OUT/served.tgz" -C "$(dirname "$out")" "$(basename "$out")"; fi
  return $rc
}

# Runs the tests and benchmarks whose binaries are in $1 (tests) and $2 (benchmarks), then
# the served table when $3 holds the cluster's binaries in their build layout.
run_checks() {
  local tests=$1 bench=$2 cluster_build=${3:-}
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  local rc=0
  echo "== gpu tests"
  timeout 60 "$tests/cuda_ops_test" --gtest_brief=1 || rc=$?
  timeout 120 "$tests/device_model_test" --gtest_brief=1 || rc=$?
  timeout 60 "$tests/cuda_engine_test" --gtest_brief=1 || rc=$?
  timeout 120 "$tests/cuda_ipc_transport_test" --gtest_brief=1 || rc=$?
  echo "== cuda_bench"
  timeout 60 "$bench/cuda_bench" || rc=$?
  for preset in llama3.1-8b qwen2.5-0.5b; do
    echo "== cuda_model_bench --preset $preset"
    timeout 150 "$bench/cuda_model_bench" --preset "$preset" ${MODEL_BENCH_FLAGS:-} || rc=$?
  done
  # Tensor parallelism where the machine has the GPUs: the 8B over 2, the 70B over 4 or 8.
  local gpus
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  if (( gpus >= 2 )); then
    echo "== cuda_model_bench --preset llama3.1-8b --tensor-parallel 2"
    timeout 150 "$bench/cuda_model_bench" --preset llama3.1-8b --tensor-parallel 2 || rc=$?
  fi
  if (( gpus >= 4 )); then
    local tp=$(( gpus >= 8 ? 8 : 4 ))
    echo "== cuda_model_bench --preset llama3.1-70b --tensor-parallel $tp"
    timeout 240 "$bench/cuda_model_bench" --preset llama3.1-70b --tensor-parallel "$tp" || rc=$?
  fi
  if [[ -n "$cluster_build" && -x "$cluster_build/tools/preft" && "${SERVE:-1}" == 1 ]]; then
    serve "$cluster_build" || rc=$?
  fi
  return $rc
}

case "${1:-}" in
  --bundle)
    out=${2:?usage: gpu-check.sh --bundle DIR}
    build build-gpu
    rm -rf "$out" "$out.tgz" && mkdir -p "$out/lib"
    for t in "${gpu_tests[@]}"; do cp "build-gpu/$t" "$out/"; done
    for b in "${gpu_benches[@]}"; do cp "build-gpu/bench/$b" "$out/"; done
    for c in "${cluster[@]}"; do  # in their build layout, as bench/serve/matrix.py finds them
      mkdir -p "$out/build/$(dirname "$c")" && cp "build-gpu/$c" "$out/build/$c"
    done
    bins=("$out"/cuda_* "$out"/device_model_test "${cluster[@]/#/$out/build/}")
    strip --strip-unneeded "${bins[@]}"
    # Libraries beyond glibc and CUDA's own (the CUDA image has the toolkit; cuBLAS is too
    # large to carry): OpenBLAS, OpenMP, gRPC, protobuf, UCX and the like.
    for bin in "${bins[@]}"; do
      ldd "$bin" | awk '/=> \// {print $1, $3}' | while read -r name path; do
        case "$name" in
          libc.so*|libm.so*|libpthread*|libdl.so*|librt.so*|ld-linux*|libcuda.so*|libcudart*|libcublas*|libstdc++*|libgcc_s*) ;;
          *) cp -n "$path" "$out/lib/" ;;
        esac
      done
    done
    tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")"
    du -sh "$out" "$out.tgz"
    ;;
  --run-bundle)
    dir=${2:?usage: gpu-check.sh --run-bundle DIR[.tgz]}
    if [[ "$dir" == *.tgz ]]; then
      mkdir -p /tmp/preft-bundle && tar xzf "$dir" -C /tmp/preft-bundle
      dir=/tmp/preft-bundle/$(basename "$dir" .tgz)
    fi
    cuda_libs=$(find /usr/local /usr/lib /opt \( -name 'libcublas.so.13' -o -name 'libcudart.so.13' \) -printf '%h\n' 2>/dev/null | sort -u | paste -sd:)
    export LD_LIBRARY_PATH="$dir/lib:${cuda_libs}:${LD_LIBRARY_PATH:-}"
    run_checks "$dir" "$dir" "$dir/build"
    ;;
  *)
    dir=${1:-build-gpu}
    build "$dir"
    mkdir -p "$dir/gpu-tests"  # one folder of the tests, as a bundle has them
    for t in "${gpu_tests[@]}"; do ln -sf "$(cd "$dir" && pwd)/$t" "$dir/gpu-tests/"; done
    run_checks "$dir/gpu-tests" "$dir/bench" "$dir"
    ;;
esac
