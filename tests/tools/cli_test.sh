#!/usr/bin/env bash
# The preft CLI (and the server binaries' flags) on bad input: a clear message on stderr and a
# non-zero exit code, never a crash.
# Usage: cli_test.sh PREFT_BINARY WORK_DIR ROUTER_BINARY DECODE_BINARY PREFILL_BINARY
set -u
preft=$1
work=$2
router=$3
decode=$4
prefill=$5
rm -rf "$work" && mkdir -p "$work"
failures=0
checks=0

# expect_of BINARY CODE PATTERN -- ARGS...: runs BINARY ARGS, checks the exit code and that
# stderr matches.
expect_of() {
  local binary=$1 want_code=$2 pattern=$3
  checks=$((checks + 1))
  shift 4
  "$binary" "$@" > "$work/out" 2> "$work/err"
  local code=$?
  local name
  name=$(basename "$binary")
  if [[ $code -ne $want_code ]] || ! grep -qE -- "$pattern" "$work/err"; then
    echo "FAIL: $name $* -> exit $code (want $want_code), stderr:"; sed 's/^/  /' "$work/err"
    failures=$((failures + 1))
  else
    echo "ok: $name $* -> exit $code: $(head -c 160 "$work/err" | head -1)"
  fi
}
# expect CODE PATTERN -- ARGS...: the same for preft.
expect() { expect_of "$preft" "$@"; }

expect 0 "wrote" -- make-model --preset tiny --seed 3 --out "$work/m"
expect 1 "gpt-5" -- make-model --preset gpt-5 --out "$work/x"
expect 1 "/nonexistent" -- generate --model /nonexistent --prompt-ids 1,2
expect 1 "token id 4000 is outside the vocabulary" -- generate --model "$work/m" --prompt-ids 1,4000
expect 1 "'x' is not an integer" -- generate --model "$work/m" --prompt-ids 1,x
expect 2 "give --prompt or --prompt-ids" -- generate --model "$work/m"
expect 2 "required" -- generate --prompt-ids 1
expect 2 "subcommand" -- wat
expect 1 "top_p must be in \(0, 1\]" -- generate --model "$work/m" --prompt-ids 1 --top-p 2
expect 1 "max_tokens must be >= 1" -- generate --model "$work/m" --prompt-ids 1 --max-tokens 0
expect 1 "invalid UTF-8|UTF-8" -- generate --model "$work/m" --prompt $'\xff\xfe'
expect 2 "excludes|Excludes" -- generate --model "$work/m" --prompt a --prompt-ids 1
# A corrupt weight file names the file.
cp -r "$work/m" "$work/bad" && truncate -s 100 "$work/bad/model.safetensors"
expect 1 "model.safetensors" -- generate --model "$work/bad" --prompt-ids 1
# Adapters: made, served, and refused with clear messages.
expect 0 "wrote|" -- make-adapter --model "$work/m" --kind lora --rank 4 --seed 1 --out "$work/lora"
expect 0 "wrote|" -- make-adapter --model "$work/m" --kind direft --rank 2 --seed 1 --out "$work/direft"
expect 2 "kind" -- make-adapter --model "$work/m" --kind dora --seed 1 --out "$work/x"
expect 1 "rank" -- make-adapter --model "$work/m" --kind lora --rank 0 --seed 1 --out "$work/x"
expect 1 "/nonexistent" -- generate --model "$work/m" --prompt-ids 1,2 --adapter /nonexistent
expect 2 "adapter-positions" -- generate --model "$work/m" --prompt-ids 1,2 --adapter "$work/lora" --adapter-positions some
expect 1 "--adapter-positions needs --adapter" -- generate --model "$work/m" --prompt-ids 1,2 --adapter-positions prompt
# An adapter made for another base (only config.json matters to make-adapter).
mkdir -p "$work/other" && sed 's/"intermediate_size": *[0-9]*/"intermediate_size": 96/' "$work/m/config.json" > "$work/other/config.json"
"$preft" make-adapter --model "$work/other" --kind lora --rank 4 --seed 1 --out "$work/lora-other" > /dev/null 2>&1
expect 1 "shape|does not match" -- generate --model "$work/m" --prompt-ids 1,2 --adapter "$work/lora-other"
cp -r "$work/lora" "$work/lora-bad" && truncate -s 50 "$work/lora-bad/adapter_model.safetensors"
expect 1 "adapter_model.safetensors" -- generate --model "$work/m" --prompt-ids 1,2 --adapter "$work/lora-bad"
expect 0 "requests" -- generate --model "$work/m" --prompt-ids 1,2,3 --max-tokens 4 --adapter "$work/lora" --adapter "$work/direft" --adapter none --concurrency 6 --adapter-positions prompt
# --json with --concurrency: one object per line, adapters round-robin.
checks=$((checks + 1))
lines=$("$preft" generate --model "$work/m" --prompt-ids 1,2,3 --max-tokens 4 --adapter "$work/lora" --adapter none --concurrency 4 --json | grep -c '"token_ids"')
with_adapter=$("$preft" generate --model "$work/m" --prompt-ids 1,2,3 --max-tokens 4 --adapter "$work/lora" --adapter none --concurrency 4 --json | grep -c '"adapter_positions":"all"')
if [[ "$lines" != 4 || "$with_adapter" != 2 ]]; then
  echo "FAIL: --concurrency 4 --json gave $lines results, $with_adapter with an adapter"; failures=$((failures + 1))
else
  echo "ok: --concurrency 4 --json -> 4 results, 2 with the adapter"
fi
# The colocated deployment's flags: no prefill tier, so no --prefill; workers need the root.
expect 2 "excludes" -- serve --colocated --prefill-workers 2
expect_of "$router" 2 "--colocated runs whole requests on the decode workers: give no --prefill workers \(got a:1\)" -- --model "$work/m" --colocated --prefill a:1 --decode b:2
expect_of "$router" 2 "--prefill is required \(or --colocated" -- --model "$work/m" --decode b:2
expect_of "$router" 2 "--registry: .*\"file\" \(the adapter root\) or a postgresql:// URI" -- --model "$work/m" --prefill a:1 --decode b:2 --registry mysql://x
# Logs as JSON lines (--log-format json): each stderr line one object with level, service, msg.
expect_of "$router" 2 '"msg":"--prefill is required \(or --colocated' -- --model "$work/m" --decode b:2 --log-format json
checks=$((checks + 1))
if ! /usr/bin/python3 -c '
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
assert lines and all(l["service"] == "preft-router" and l["level"] == "error" and l["time"].endswith("Z") for l in lines), lines
' "$work/err"; then
  echo "FAIL: preft-router --log-format json wrote lines that are not the JSON log objects:"; sed 's/^/  /' "$work/err"
  failures=$((failures + 1))
fi
expect_of "$decode" 2 "--log-format: xml not in" -- --model "$work/m" --log-format xml
expect_of "$prefill" 2 "--log-level: loud not in" -- --model "$work/m" --log-level loud
# An unreachable database: exit 1 naming libpq's reason, never the URI's password.
expect_of "$router" 1 "--registry: UNAVAILABLE: adapter registry database: " -- --model "$work/m" --prefill a:1 --decode b:2 --registry "postgresql://preft:s3cret@127.0.0.1:1/db"
checks=$((checks + 1))
if grep -q "s3cret" "$work/err"; then
  echo "FAIL: preft-router printed the registry password"; failures=$((failures + 1))
fi
expect_of "$decode" 2 "--colocated needs --adapter-root" -- --model "$work/m" --colocated
expect_of "$decode" 2 "--colocated moves no KV between processes: leave out --transport \(or give inproc\), not ucx" -- --model "$work/m" --colocated --adapter-root "$work" --transport ucx
expect_of "$decode" 2 "excludes" -- --model "$work/m" --colocated --adapters all-positions --adapter-root "$work"
# --device: every tier may run on a GPU (prefill and disaggregated decode stage KV through
# host memory); without one they say so and exit 1.
expect_of "$decode" 2 "--device: tpu not in" -- --model "$work/m" --device tpu
if ! nvidia-smi > /dev/null 2>&1; then  # with a GPU these would start serving
  expect_of "$decode" 1 "--device cuda: " -- --model "$work/m" --colocated --adapter-root "$work" --device cuda
  expect_of "$decode" 1 "--device cuda: " -- --model "$work/m" --device cuda
  expect_of "$prefill" 1 "--device cuda: " -- --model "$work/m" --device cuda
  expect 1 "device cuda: " -- serve --model "$work/m" --colocated --device cuda --listen 127.0.0.1:0
  expect 1 "device cuda: " -- serve --model "$work/m" --device cuda --listen 127.0.0.1:0
fi
# --kv-dtype: a name outside the list is a usage error.
expect 0 "3 prompt tokens, 4 generated" -- generate --model "$work/m" --prompt-ids 1,2,3 --max-tokens 4 --kv-dtype bf16
expect 0 "3 prompt tokens, 4 generated" -- generate --model "$work/m" --prompt-ids 1,2,3 --max-tokens 4 --kv-dtype fp8_e4m3
expect 2 "--kv-dtype: f16 not in" -- generate --model "$work/m" --prompt-ids 1 --kv-dtype f16
expect_of "$prefill" 2 "--kv-dtype: f16 not in" -- --model "$work/m" --kv-dtype f16
expect 2 "--kv-dtype: f16 not in" -- serve --model "$work/m" --kv-dtype f16
# --tensor-parallel splits a model over GPUs, moving KV between tiers through host memory:
# refused on the CPU and with cuda_ipc before any GPU is looked for.
expect 1 "--tensor-parallel 2 splits the model over GPUs: use --device cuda" -- generate --model "$work/m" --prompt-ids 1 --tensor-parallel 2
expect 2 "--tensor-parallel: Value 0 not in range" -- generate --model "$work/m" --prompt-ids 1 --tensor-parallel 0
expect_of "$prefill" 1 "--transport cuda_ipc maps one GPU's KV pool; with --tensor-parallel 2" -- --model "$work/m" --device cuda --tensor-parallel 2 --transport cuda_ipc
expect_of "$decode" 1 "with --tensor-parallel 4 the KV is split over GPUs" -- --model "$work/m" --device cuda --tensor-parallel 4 --transport cuda_ipc
expect_of "$prefill" 1 "--tensor-parallel 2 splits the model over GPUs" -- --model "$work/m" --tensor-parallel 2
expect_of "$decode" 1 "--tensor-parallel 2 splits the model over GPUs" -- --model "$work/m" --colocated --adapter-root "$work" --tensor-parallel 2
# preft train: usage errors exit 2, bad data exits 1 naming file:line and writes nothing.
if "$preft" train --help 2>&1 | grep -q " sft"; then
  printf '{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion": ""}\n' > "$work/bad.jsonl"
  printf '{"prompt": "a", "completion": "b"}\n' > "$work/good.jsonl"
  expect 2 "give --kind" -- train sft --model "$work/m" --data "$work/good.jsonl" --out "$work/t"
  expect 2 "--kind: fuzzy not in" -- train sft --model "$work/m" --data "$work/good.jsonl" --kind fuzzy --out "$work/t"
  expect 1 "bad.jsonl:2: the completion is empty" -- train sft --model "$work/m" --data "$work/bad.jsonl" --kind lora --out "$work/t"
  expect 1 "rank 200 is over the servers' --max-rank 128" -- train sft --model "$work/m" --data "$work/good.jsonl" --kind lora --rank 200 --out "$work/t"
  expect 1 "prompt positions \"f2x\" are not" -- train sft --model "$work/m" --data "$work/good.jsonl" --kind direft --prompt-positions f2x --out "$work/t"
  expect 1 "--resume: no checkpoint" -- train sft --model "$work/m" --data "$work/good.jsonl" --kind lora --resume --out "$work/t"
  checks=$((checks + 1))
  if [[ -e "$work/t" ]]; then echo "FAIL: a refused training wrote $work/t"; failures=$((failures + 1)); fi
  expect 1 "--reward must be exact, regex:PATTERN or command:PROG" -- train rl --router 127.0.0.1:1 --adapter a --model "$work/m" --prompts "$work/good.jsonl" --reward fuzzy --out "$work/r"
  expect 1 "--group must be at least 2" -- train rl --router 127.0.0.1:1 --adapter a --model "$work/m" --prompts "$work/good.jsonl" --group 1 --out "$work/r"
  expect 1 "needs an \"answer\" for --reward exact" -- train rl --router 127.0.0.1:1 --adapter a --model "$work/m" --prompts "$work/good.jsonl" --out "$work/r"
  expect 1 "UNAVAILABLE|failed to connect|Connection refused" -- train rl --router 127.0.0.1:1 --adapter a --model "$work/m" --prompts "$work/good.jsonl" --reward "regex:x" --out "$work/r" --timeout-s 2
  expect 0 "wrote $work/t" -- train sft --model "$work/m" --data "$work/good.jsonl" --kind lora --steps 2 --out "$work/t"
  expect 0 "" -- generate --model "$work/m" --adapter "$work/t" --prompt a --max-tokens 2
fi
# Same seed, same tokens.
a=$("$preft" generate --model "$work/m" --prompt-ids 5,6,7 --temperature 1 --seed 9 --max-tokens 8 --json)
checks=$((checks + 1))
b=$("$preft" generate --model "$work/m" --prompt-ids 5,6,7 --temperature 1 --seed 9 --max-tokens 8 --json)
if [[ "$a" != "$b" || -z "$a" ]]; then echo "FAIL: seeded runs differ"; failures=$((failures + 1)); fi

echo "$((checks - failures)) passed, $failures failed"
[[ $failures -eq 0 ]]
