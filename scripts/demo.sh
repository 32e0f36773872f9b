#!/usr/bin/env bash
# `make demo`: makes the demo model if absent and sends real requests through the engine.
# Usage: scripts/demo.sh BUILD_DIR MODEL_DIR
set -euo pipefail
build=${1:-build}
model=${2:-models/demo-tiny}
preft="$build/tools/preft"

if [[ ! -f "$model/config.json" ]]; then
  echo "== making the demo model ($model): random weights, real Hugging Face format"
  "$preft" make-model --preset tiny --dtype f32 --seed 7 --out "$model"
fi

echo "== greedy, streamed text"
"$preft" generate --model "$model" --prompt "The quick brown fox" --max-tokens 24
echo "== seeded sampling (temperature 0.8, top-p 0.9): same seed, same tokens"
"$preft" generate --model "$model" --prompt "Once upon a time" --max-tokens 24 \
  --temperature 0.8 --top-p 0.9 --seed 42
echo "== JSON with logprobs"
"$preft" generate --model "$model" --prompt-ids 1,2,3,4 --max-tokens 4 --logprobs 2 --json
echo "== bad input gets a clear error (exit code shown)"
"$preft" generate --model "$model" --prompt-ids 1,2,999999 --max-tokens 4 || echo "exit code $?"
