#!/usr/bin/env bash
# scripts/local-cluster.sh end to end: five processes over UCX (with PREFT_COLOCATED=1 the
# colocated deployment: a router and two colocated workers), a registered adapter, requests
# through `preft client` equal to `preft generate`, bad requests with their gRPC codes, and a
# graceful stop that leaves no process behind. With PREFT_DEVICE=cuda (and PREFT_COLOCATED=1)
# the workers and the reference `preft generate` run on the GPU; exit 77 (skipped) without one.
# Usage: local_cluster_test.sh SOURCE_DIR BUILD_DIR WORK_DIR
set -u
src=$1
build=$2
work=$3
device=${PREFT_DEVICE:-cpu}
if [[ "$device" != cpu ]] && ! nvidia-smi > /dev/null 2>&1; then
  echo "SKIP: PREFT_DEVICE=$device but no GPU is visible"
  exit 77
fi
rm -rf "$work" && mkdir -p "$work/adapters"
export RUN_DIR="$work/run"
# Every process logs JSON lines at debug level: checked below (request ids across the tiers).
export PREFT_LOG_FLAGS="--log-format json --log-level debug"
preft="$build/tools/preft"
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

"$preft" make-model --preset tiny --seed 5 --out "$work/model" > /dev/null || exit 1
"$preft" make-adapter --model "$work/model" --kind lora --rank 4 --seed 9 --out "$work/adapters/u1" > /dev/null || exit 1
addr=$(bash "$src/scripts/local-cluster.sh" start "$build" "$work/model" "$work/adapters") || {
  echo "FAIL: the cluster did not start"; exit 1; }
trap 'bash "$src/scripts/local-cluster.sh" stop' EXIT
echo "router at $addr"
client=("$preft" client --server "$addr" --timeout-s 60)

"${client[@]}" register --name u1 --path u1 > "$work/reg" || fail "register: $(cat "$work/reg")"
listed=$("$preft" adapters --server "$addr" list) || fail "adapters list failed"
grep -q '"name": "u1"' <<< "$listed" || fail "adapters list: $listed"
for spec in "none prompt" "u1 prompt" "u1 all"; do
  read -r adapter positions <<< "$spec"
  if [[ $adapter == none ]]; then
    got=$("${client[@]}" generate --prompt "hello cluster" --max-tokens 10 --ignore-eos --json)
    want=$("$preft" generate --model "$work/model" --device "$device" --prompt "hello cluster" --max-tokens 10 --ignore-eos --json)
  else
    got=$("${client[@]}" generate --model u1 --adapter-positions "$positions" --prompt "hello cluster" \
          --max-tokens 10 --ignore-eos --json)
    want=$("$preft" generate --model "$work/model" --device "$device" --adapter "$work/adapters/u1" \
           --adapter-positions "$positions" --prompt "hello cluster" --max-tokens 10 --ignore-eos --json)
  fi
  g=$(sed -n 's/.*"token_ids":\(\[[^]]*\]\).*/\1/p' <<< "$got")
  w=$(sed -n 's/.*"token_ids":\(\[[^]]*\]\).*/\1/p' <<< "$want")
  if [[ -z "$g" || "$g" != "$w" ]]; then fail "$spec: cluster $g, engine $w"; else echo "ok: $spec $g"; fi
done

expect_code() {  # CODE ARGS...: a client call fails with that gRPC code on stderr
  local code=$1
  shift
  if "${client[@]}" "$@" > /dev/null 2> "$work/err"; then
    fail "client $* succeeded"
  elif ! grep -q "$code" "$work/err"; then
    fail "client $*: $(cat "$work/err")"
  else
    echo "ok: $code: $(head -1 "$work/err")"
  fi
}
expect_code NOT_FOUND generate --model nobody --prompt hi
expect_code INVALID_ARGUMENT generate --prompt-ids 1,99999
expect_code INVALID_ARGUMENT register --name evil --path ../../..

bash "$src/scripts/local-cluster.sh" stop
trap - EXIT
for log in "$RUN_DIR"/*.log; do
  grep -q "signal" "$log" || [[ $log == *router.log ]] || fail "$(basename "$log") did not drain: $(tail -2 "$log")"
done
# Logs: every stderr line a JSON object; a request's lines carry its id, in each tier it crossed.
/usr/bin/python3 - "$RUN_DIR" <<'PY' || fail "JSON logs: see above"
import glob, json, os, sys
ids = {}
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.log"))):
    tier = os.path.basename(path).split("-")[0].split(".")[0]
    for line in open(path):
        if not line.startswith("{"):
            continue  # stdout: "listening on", "metrics on"
        j = json.loads(line)
        assert {"time", "level", "service", "msg"} <= j.keys(), j
        if "request_id" in j:
            ids.setdefault(j["request_id"], set()).add(tier)
both = [i for i, tiers in ids.items() if {"prefill", "decode"} <= tiers]
colocated = os.environ.get("PREFT_COLOCATED") == "1"
if not ids or (not colocated and not both):
    sys.exit(f"no request's id on lines of both tiers: {ids}")
print(f"ok: JSON logs, {len(ids)} request ids ({len(both)} seen by prefill and decode)")
PY
if pgrep -f "$work/model" > /dev/null; then fail "processes left behind"; fi
echo "local cluster: $failures failures"
[[ $failures == 0 ]]
