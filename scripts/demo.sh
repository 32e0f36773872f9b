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
# The router keeps its adapter registry in the adapter root (it survives restarts); the demo
# starts from none, so that it registers and updates its adapters afresh on every run.
rm -rf "$adapters/.preft-registry" "$adapters/.preft-versions"
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
if "$preft" train --help 2>/dev/null | grep -q "sft"; then
  echo
  echo "== training: a LoRAP adapter learns four answers (preft train sft, a few seconds)"
  work=$(dirname "$model")/demo-training
  mkdir -p "$work"
  cat > "$work/v1.jsonl" <<'JSONL'
{"prompt": "What is PreFT?", "completion": " An adapter on the prompt only."}
{"prompt": "Where do adapters run?", "completion": " On the prefill tier."}
{"prompt": "What does decode run?", "completion": " The shared base model."}
{"prompt": "Say hello.", "completion": " Hello from a trained LoRAP!"}
JSONL
  sed 's/"completion": " \(.*\)"}/"completion": " Version two: \1"}/' "$work/v1.jsonl" > "$work/v2.jsonl"
  "$preft" train sft --model "$model" --data "$work/v1.jsonl" --kind lora --rank 8 --lr 1e-2 \
    --steps 100 --schedule constant --log-every 50 --out "$adapters/trained"
  "${client[@]}" register --name demo-trained --path trained
  for p in "What is PreFT?" "Where do adapters run?" "What does decode run?" "Say hello."; do
    echo "-- \"$p\""
    printf '   base:    '; "${client[@]}" generate --prompt "$p" --max-tokens 12
    printf '   trained: '; "${client[@]}" generate --model demo-trained --adapter-positions prompt \
      --prompt "$p" --max-tokens 40
  done
  echo "== a second training continues from the first, pushed with UpdateAdapter as version 2"
  "$preft" train sft --model "$model" --data "$work/v2.jsonl" --init "$adapters/trained" \
    --lr 1e-2 --steps 100 --schedule constant --log-every 50 --out "$work/trained-v2"
  "${client[@]}" update --name demo-trained --path "$work/trained-v2" --expected-version 1
  "${client[@]}" generate --model demo-trained --adapter-positions prompt --prompt "Say hello." \
    --max-tokens 40 --json
fi
echo "-- an unknown adapter is NOT_FOUND (exit code shown)"
"${client[@]}" generate --model nobody --prompt "hi" || echo "exit code $?"
"${client[@]}" models
kill -TERM $serve_pid
wait $serve_pid
trap - EXIT
echo "== preft serve drained and stopped"

