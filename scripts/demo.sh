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
adapters=$(dirname "$model")/demo-adapters
if [[ ! -f "$adapters/lora/adapter_config.json" ]]; then
  echo "== making two demo adapters (random PEFT LoRA rank 8, DiReFT rank 4)"
  "$preft" make-adapter --model "$model" --kind lora --rank 8 --seed 1 --out "$adapters/lora"
  "$preft" make-adapter --model "$model" --kind direft --rank 4 --seed 2 --out "$adapters/direft"
fi
echo "== the same prompt: base model, LoRAP (adapter on prompt tokens only), all-position LoRA"
"$preft" generate --model "$model" --prompt "The quick brown fox" --max-tokens 12
"$preft" generate --model "$model" --prompt "The quick brown fox" --max-tokens 12 \
  --adapter "$adapters/lora" --adapter-positions prompt
"$preft" generate --model "$model" --prompt "The quick brown fox" --max-tokens 12 \
  --adapter "$adapters/lora" --adapter-positions all
echo "== one mixed batch: LoRAP, DiReFTP and base-only requests together (JSON, one per line)"
"$preft" generate --model "$model" --prompt-ids 1,2,3,4 --max-tokens 6 --json \
  --adapter "$adapters/lora" --adapter "$adapters/direft" --adapter none \
  --adapter-positions prompt --concurrency 3
echo "== bad input gets a clear error (exit code shown)"
"$preft" generate --model "$model" --prompt-ids 1,2,999999 --max-tokens 4 || echo "exit code $?"
