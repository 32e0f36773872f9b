#!/usr/bin/env bash
# `make bench`: the engine and cluster benchmarks on the qwen2.5-0.5b preset in bf16 (made if
# absent).
# Usage: scripts/bench.sh BUILD_DIR [extra engine_bench flags]
set -euo pipefail
build=${1:-build}
shift || true
model=${PREFT_BENCH_MODEL:-models/qwen2.5-0.5b-bf16}
if [[ ! -f "$model/config.json" ]]; then
  "$build/tools/preft" make-model --preset qwen2.5-0.5b --dtype bf16 --seed 1 --out "$model"
fi
"$build/bench/linear_bench" || true
"$build/bench/engine_bench" --model "$model" "$@"
# The cluster's costs against the engine in the same run (TTFT added, throughput ratio), and
# KV transfer over UCX against a raw ucp_put_nbx probe.
"$build/bench/cluster_bench" --model "$model" --build-dir "$build" --requests 16 --concurrency 8 \
  --prompt 128 --max-tokens 32
"$build/bench/kv_transfer_bench"
