#!/usr/bin/env bash
# `preft bench` against `preft serve`: its accounting (every request served, every token counted)
# and its failure path (one clear line, exit 1). Timings are printed, not asserted.
# Usage: bench_cli_test.sh PREFT WORK_DIR
set -u
preft=$1
work=$2
rm -rf "$work" && mkdir -p "$work"
"$preft" make-model --preset tiny --seed 4 --out "$work/model" > /dev/null || exit 1
"$preft" serve --model "$work/model" --listen 127.0.0.1:0 --threads 1 > "$work/serve.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
for _ in $(seq 1 300); do grep -q "listening on" "$work/serve.log" && break; sleep 0.1; done
addr=$(sed -n 's/.*listening on \([^ ]*\).*/\1/p' "$work/serve.log" | head -1)
failures=0
out=$("$preft" bench --server "$addr" --requests 12 --concurrency 3 --prompt-tokens 20 \
      --max-tokens 7 --json) || { echo "FAIL: bench exited $?"; failures=$((failures + 1)); }
/usr/bin/python3 - "$out" <<'PY' || failures=$((failures + 1))
import json, sys
r = json.loads(sys.argv[1])
ok = r["requests"] == 12 and r["failed"] == 0 and r["generated_tokens"] == 12 * 7 and \
     r["ttft_ms"]["p50"] > 0 and r["output_tokens_per_s"] > 0
print(("ok: " if ok else "FAIL: ") + json.dumps(r))
sys.exit(0 if ok else 1)
PY
# Poisson arrivals and uniform lengths: still every requested token generated.
out=$("$preft" bench --server "$addr" --requests 20 --concurrency 4 --prompt-tokens 10:30 \
      --max-tokens 3:9 --rate 200 --seed 5 --json) || { echo "FAIL: poisson bench"; failures=$((failures + 1)); }
/usr/bin/python3 - "$out" <<'PY' || failures=$((failures + 1))
import json, sys
r = json.loads(sys.argv[1])
ok = r["failed"] == 0 and 20 * 3 <= r["requested_tokens"] <= 20 * 9 and \
     r["generated_tokens"] == r["requested_tokens"] and r["rate"] == 200
print(("ok: " if ok else "FAIL: ") + json.dumps(r))
sys.exit(0 if ok else 1)
PY
# Lengths replayed from JSONL, cycled over the requests.
printf '{"prompt_tokens": 5, "max_tokens": 2}\n\n{"prompt_tokens": 40, "max_tokens": 6}\n' > "$work/lengths.jsonl"
out=$("$preft" bench --server "$addr" --requests 5 --concurrency 2 --lengths "$work/lengths.jsonl" \
      --json) || { echo "FAIL: lengths bench"; failures=$((failures + 1)); }
/usr/bin/python3 - "$out" <<'PY' || failures=$((failures + 1))
import json, sys
r = json.loads(sys.argv[1])
ok = r["failed"] == 0 and r["requested_tokens"] == 3 * 2 + 2 * 6 == r["generated_tokens"] and \
     r["requested_prompt_tokens"] == 3 * 5 + 2 * 40
print(("ok: " if ok else "FAIL: ") + json.dumps(r))
sys.exit(0 if ok else 1)
PY
# A shared system prompt and three-turn conversations, one at a time. Turn 1 of the second finds
# the shared 64 tokens cached; every later turn finds its conversation so far in full blocks
# (base model: the replies too, but for the last reply token, never fed back). A turn's prompt
# is the last one, its reply and a new message.
out=$("$preft" bench --server "$addr" --requests 2 --concurrency 1 --prompt-tokens 20 \
      --max-tokens 12 --shared-prefix-tokens 64 --turns 3 --json) || { echo "FAIL: turns bench"; failures=$((failures + 1)); }
/usr/bin/python3 - "$out" <<'PY' || failures=$((failures + 1))
import json, sys
r = json.loads(sys.argv[1])
t = r.get("by_turn", [])
ok = r["failed"] == 0 and r["generated_tokens"] == 2 * 3 * 12 and len(t) == 3 and \
     [x["prompt_tokens"] for x in t] == [84, 116, 148] and \
     t[0]["cached_tokens"] == 32 and t[1]["cached_tokens"] == 80 and t[2]["cached_tokens"] == 112 and \
     r["cached_prompt_tokens"] == 2 * (32 + 80 + 112)
print(("ok: " if ok else "FAIL: ") + json.dumps(r))
sys.exit(0 if ok else 1)
PY
printf '{"prompt_tokens": 5, "max_tokens": 2}\n{"prompt_tokens": 0, "max_tokens": 2}\n' > "$work/bad.jsonl"
if "$preft" bench --server "$addr" --lengths "$work/bad.jsonl" > /dev/null 2> "$work/err"; then
  echo "FAIL: a zero prompt length was accepted"; failures=$((failures + 1))
elif ! grep -q "bad.jsonl:2 is not" "$work/err"; then
  echo "FAIL: $(cat "$work/err")"; failures=$((failures + 1))
else
  echo "ok: $(cat "$work/err")"
fi
if "$preft" bench --server "$addr" --max-tokens 9:3 > /dev/null 2> "$work/err"; then
  echo "FAIL: a reversed range was accepted"; failures=$((failures + 1))
elif ! grep -q "max-tokens '9:3' is not N or LO:HI" "$work/err"; then
  echo "FAIL: $(cat "$work/err")"; failures=$((failures + 1))
else
  echo "ok: $(cat "$work/err")"
fi
if "$preft" bench --server "$addr" --requests 2 --adapters nobody > /dev/null 2> "$work/err"; then
  echo "FAIL: bench with an unknown adapter succeeded"; failures=$((failures + 1))
elif ! grep -q "NOT_FOUND: adapter 'nobody'" "$work/err"; then
  echo "FAIL: $(cat "$work/err")"; failures=$((failures + 1))
else
  echo "ok: $(cat "$work/err")"
fi
echo "bench cli: $failures failures"
[[ $failures == 0 ]]
