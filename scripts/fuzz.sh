#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz) with clang and runs each for SECONDS on a scratch copy
# of its seed corpus. Fails when a fuzzer finds a crash; the reproducer is left in
# BUILD_DIR/fuzz-artifacts/. Usage: scripts/fuzz.sh [BUILD_DIR] [SECONDS]
set -euo pipefail

BUILD_DIR=${1:-build-fuzz}
SECONDS_PER_TARGET=${2:-20}
TARGETS=(safetensors_fuzz config_fuzz train_data_fuzz openai_fuzz)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

if ! command -v clang++ >/dev/null 2>&1; then
  echo "fuzz: clang++ not found (make deps installs clang and libclang-rt-14-dev)" >&2
  exit 1
fi

# A separate, CUDA-free clang build; only the fuzz targets are compiled.
mkdir -p "$BUILD_DIR"
CC=clang CXX=clang++ cmake -S . -B "$BUILD_DIR" -G Ninja \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPREFT_BUILD_FUZZERS=ON -DPREFT_BUILD_TESTS=ON -DPREFT_ENABLE_CUDA=OFF \
  >"$BUILD_DIR/configure.log" 2>&1 || { cat "$BUILD_DIR/configure.log" >&2; exit 1; }
cmake --build "$BUILD_DIR" --target "${TARGETS[@]}"

status=0
for t in "${TARGETS[@]}"; do
  corpus="$BUILD_DIR/fuzz-corpus/$t"
  artifacts="$BUILD_DIR/fuzz-artifacts"
  rm -rf "$corpus"
  mkdir -p "$corpus" "$artifacts"
  cp tests/fuzz/corpus/"$t"/* "$corpus"/
  echo "fuzz: $t for ${SECONDS_PER_TARGET}s"
  if ! "$BUILD_DIR/tests/fuzz/$t" "$corpus" \
      -max_total_time="$SECONDS_PER_TARGET" -max_len=16384 -rss_limit_mb=2048 -timeout=10 \
      -print_final_stats=1 -artifact_prefix="$artifacts/$t-" >"$BUILD_DIR/$t.log" 2>&1; then
    tail -n 60 "$BUILD_DIR/$t.log" >&2
    echo "fuzz: $t FAILED; reproducer in $artifacts/" >&2
    status=1
  else
    grep -E "^(stat::number_of_executed_units|stat::new_units_added)" "$BUILD_DIR/$t.log" | sed "s/^/fuzz: $t /" || true
    echo "fuzz: $t ok"
  fi
done
exit $status
