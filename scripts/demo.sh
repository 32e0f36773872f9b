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

echo
echo "== the embedded cluster: preft serve (router + prefill + decode workers in one process)"
log=$(mktemp)
"$preft" serve --model "$model" --adapter-root "$adapters" --listen 127.0.0.1:0 > "$log" 2>&1 &
serve_pid=$!
trap 'kill -TERM $serve_pid 2>/dev/null || true' EXIT
addr=""
for _ in $(seq 1 300); do
  addr=$(sed -n 's/.*listening on \([^ ]*\).*/\1/p' "$log" | head -1)
  [[ -n "$addr" ]] && break
  kill -0 $serve_pid 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.1
done
echo "preft serve is listening on $addr (public gRPC API preft.v1.Preft)"
client=("$preft" client --server "$addr")
"${client[@]}" register --name demo-lora --path lora
"${client[@]}" register --name demo-direft --path direft
echo "-- base model, streamed through router -> prefill -> KV transfer -> decode"
"${client[@]}" generate --prompt "The quick brown fox" --max-tokens 16
echo "-- LoRAP: the adapter runs on the prompt only; decode is the shared base model"
"${client[@]}" generate --model demo-lora --adapter-positions prompt --prompt "The quick brown fox" --max-tokens 16
echo "-- DiReFTP, as JSON (adapter version and positions reported)"
"${client[@]}" generate --model demo-direft --adapter-positions prompt --prompt "The quick brown fox" --max-tokens 8 --json
echo "-- an unknown adapter is NOT_FOUND (exit code shown)"
"${client[@]}" generate --model nobody --prompt "hi" || echo "exit code $?"
"${client[@]}" models
kill -TERM $serve_pid
wait $serve_pid
trap - EXIT
echo "== preft serve drained and stopped"

