#!/usr/bin/env bash
# `preft train rl` against a live multi-process cluster (scripts/local-cluster.sh: router,
# 2 prefill and 2 decode workers over UCX; the decode workers also serve the all-position
# baseline, so they *could* load adapters). A tiny model, a LoRAP adapter starting at zero
# update (registered as version 1), and a reward it can learn through the prompt's KV alone:
# the fraction of generated tokens whose id is a multiple of 3 (an external command, the
# plug-in path). Checks: mean reward rises from its start to >= 0.8 within 10 iterations;
# every rollout of iteration i ran on version i + 1; the trainer's logprobs equal the
# server's within 1e-4; no decode worker ever acquired an adapter; the final adapter serves.
# Usage: rl_cluster_test.sh SOURCE_DIR BUILD_DIR WORK_DIR
set -u
src=$1
build=$2
work=$3
rm -rf "$work" && mkdir -p "$work/adapters"
export RUN_DIR="$work/run"
preft="$build/tools/preft"
py=/usr/bin/python3
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

"$preft" make-model --preset tiny --seed 5 --out "$work/model" > /dev/null || exit 1
"$preft" make-adapter --model "$work/model" --kind lora --rank 8 --seed 1 --zero-update \
  --positions prompt --out "$work/adapters/policy" > /dev/null 2>&1 || exit 1
cat > "$work/reward.py" <<'PY'
import json, sys
for line in sys.stdin:
    ids = json.loads(line)["completion_ids"]
    print(sum(1 for t in ids if t % 3 == 0) / len(ids) if ids else 0.0)
PY
$py -c "
import json
for i in range(16): print(json.dumps({'prompt': f'Task {i}: write something nice about number {i * 7}.'}))
" > "$work/prompts.jsonl"

addr=$(bash "$src/scripts/local-cluster.sh" start "$build" "$work/model" "$work/adapters") || {
  echo "FAIL: the cluster did not start"; exit 1; }
trap 'bash "$src/scripts/local-cluster.sh" stop' EXIT
"$preft" client --server "$addr" register --name policy --path policy > /dev/null ||
  fail "register"

"$preft" train rl --router "$addr" --adapter policy --model "$work/model" \
  --init "$work/adapters/policy" --prompts "$work/prompts.jsonl" \
  --reward "command:$py $work/reward.py" --group 8 --batch 4 --iterations 10 --max-tokens 16 \
  --lr 2e-2 --seed 3 --threads 1 --out "$work/out" 2> "$work/train.err" ||
  { cat "$work/train.err"; fail "preft train rl failed"; }
cat "$work/train.err"

$py - "$work/out/rl_log.jsonl" <<'PY' || failures=$((failures + 1))
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
bad = []
if len(rows) != 10: bad.append(f"{len(rows)} iterations logged, not 10")
for i, r in enumerate(rows):
    if r["version"] != i + 1 or r["next_version"] != i + 2:
        bad.append(f"iteration {i}: version {r['version']} -> {r['next_version']}")
    if r["stale_discarded"] != 0 or r["trained_rollouts"] != r["rollouts"]:
        bad.append(f"iteration {i}: {r['stale_discarded']} rollouts on another version")
    if r["agreement_max"] > 1e-4:
        bad.append(f"iteration {i}: max |trainer - server| logprob {r['agreement_max']:.3g}")
start, best = rows[0]["reward_mean"], max(r["reward_mean"] for r in rows)
if start > 0.6: bad.append(f"starting reward {start:.3f} leaves nothing to learn")
if best < 0.8: bad.append(f"reward rose from {start:.3f} to {best:.3f} only")
print(f"reward {start:.3f} -> {rows[-1]['reward_mean']:.3f} (best {best:.3f}); "
      f"max logprob diff {max(r['agreement_max'] for r in rows):.2g}")
for b in bad: print("FAIL:", b)
sys.exit(1 if bad else 0)
PY

# Without --init the trainer starts a fresh zero-update adapter (here a DiReFTP with an fN+lM
# selection) and pushes it first: the registered random weights become version 2, and the
# iterations run on 2 and 3, still in agreement with the server.
"$preft" make-adapter --model "$work/model" --kind direft --rank 4 --seed 2 \
  --out "$work/adapters/fresh" > /dev/null 2>&1 || fail "make-adapter fresh"
"$preft" client --server "$addr" register --name fresh --path fresh > /dev/null || fail "register fresh"
"$preft" train rl --router "$addr" --adapter fresh --model "$work/model" --kind direft --rank 4 \
  --prompt-positions f2+l2 --prompts "$work/prompts.jsonl" --reward "command:$py $work/reward.py" \
  --group 4 --batch 2 --iterations 2 --max-tokens 8 --lr 1e-2 --threads 1 --out "$work/fresh" \
  2> "$work/fresh.err" || { cat "$work/fresh.err"; fail "preft train rl (fresh) failed"; }
$py - "$work/fresh/rl_log.jsonl" <<'PY' || failures=$((failures + 1))
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
got = [(r["version"], r["next_version"]) for r in rows]
ok = got == [(2, 3), (3, 4)] and all(r["agreement_max"] <= 1e-4 for r in rows)
print(("ok" if ok else "FAIL") + f": fresh DiReFTP versions {got}, "
      f"max logprob diff {max(r['agreement_max'] for r in rows):.2g}")
sys.exit(0 if ok else 1)
PY

# The decode tier never acquired an adapter (it runs the base model for PreFT requests).
while read -r name target; do
  metrics=$(curl -sf "http://$target/metrics") || { fail "$name: no /metrics"; continue; }
  if [[ $name == decode-* ]]; then
    acquired=$(awk '/^preft:adapter_acquires_total/ {s += $2} END {print s + 0}' <<< "$metrics")
    [[ "$acquired" == 0 ]] || fail "$name acquired adapters $acquired times"
  elif [[ $name == prefill-* ]]; then
    acquired=$(awk '/^preft:adapter_acquires_total/ {s += $2} END {print s + 0}' <<< "$metrics")
    [[ "$acquired" != 0 ]] || fail "$name never acquired the adapter"
  fi
done < "$RUN_DIR/metrics-targets"

# A writer that expects an old version is refused, and the version does not move.
if "$preft" client --server "$addr" update --name policy --path "$work/out" --expected-version 3 \
     > "$work/update.out" 2>&1; then
  fail "an update expecting version 3 was accepted: $(cat "$work/update.out")"
else
  grep -q FAILED_PRECONDITION "$work/update.out" || fail "stale update: $(cat "$work/update.out")"
fi
# The final adapter (written to --out) is what version 11 serves.
want=$("$preft" generate --model "$work/model" --adapter "$work/out" --prompt "Task 3: hi" \
       --max-tokens 8 --ignore-eos --json | sed -n 's/.*"token_ids":\(\[[^]]*\]\).*/\1/p')
got=$("$preft" client --server "$addr" generate --model policy --prompt "Task 3: hi" \
      --max-tokens 8 --ignore-eos --json | sed -n 's/.*"token_ids":\(\[[^]]*\]\).*/\1/p')
[[ -n "$want" && "$want" == "$got" ]] || fail "served $got, the final adapter gives $want"

echo "rl cluster: $failures failures"
[[ $failures == 0 ]]
