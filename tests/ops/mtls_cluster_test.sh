#!/usr/bin/env bash
# Every gRPC hop of a multi-process cluster over mutual TLS (router -> workers, prefill ->
# decode with the gRPC KV transport, clients -> router): requests with a client certificate
# equal `preft generate`; clients without one, with one from another CA, or in plaintext are
# refused, at the router and at each worker.
# Usage: mtls_cluster_test.sh SOURCE_DIR BUILD_DIR WORK_DIR
set -u
src=$1
build=$2
work=$3
rm -rf "$work" && mkdir -p "$work/adapters"
export RUN_DIR="$work/run" PREFT_TLS_DIR="$work/certs" PREFT_TRANSPORT=grpc
preft="$build/tools/preft"
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

bash "$src/scripts/make-dev-certs.sh" "$PREFT_TLS_DIR" > /dev/null || exit 1
"$preft" make-model --preset tiny --seed 7 --out "$work/model" > /dev/null || exit 1
"$preft" make-adapter --model "$work/model" --kind direft --rank 4 --seed 2 --out "$work/adapters/d1" \
  > /dev/null || exit 1
addr=$(bash "$src/scripts/local-cluster.sh" start "$build" "$work/model" "$work/adapters") || {
  echo "FAIL: the cluster did not start"; exit 1; }
trap 'bash "$src/scripts/local-cluster.sh" stop' EXIT
certs=$PREFT_TLS_DIR
mtls=(--tls-ca "$certs/ca.pem" --tls-cert "$certs/client.pem" --tls-key "$certs/client.key")

"$preft" client --server "$addr" "${mtls[@]}" register --name d1 --path d1 > /dev/null ||
  fail "register over mTLS"
got=$("$preft" client --server "$addr" "${mtls[@]}" generate --model d1 --prompt "secure hello" \
      --max-tokens 8 --ignore-eos --json)
want=$("$preft" generate --model "$work/model" --adapter "$work/adapters/d1" --prompt "secure hello" \
       --max-tokens 8 --ignore-eos --json)
g=$(sed -n 's/.*"token_ids":\(\[[^]]*\]\).*/\1/p' <<< "$got")
w=$(sed -n 's/.*"token_ids":\(\[[^]]*\]\).*/\1/p' <<< "$want")
if [[ -z "$g" || "$g" != "$w" ]]; then fail "mTLS cluster $g, engine $w"; else echo "ok: mTLS generate $g"; fi

refused() {  # WHAT ARGS...: the call must fail with UNAVAILABLE (the handshake is refused)
  local what=$1
  shift
  if "$preft" client --timeout-s 5 "$@" > /dev/null 2> "$work/err"; then
    fail "$what was served"
  elif ! grep -q UNAVAILABLE "$work/err"; then
    fail "$what: $(cat "$work/err")"
  else
    echo "ok: $what refused"
  fi
}
workers=$(sed -n 's/.*listening on \([^ ]*\).*/\1/p' "$RUN_DIR"/prefill-*.log "$RUN_DIR"/decode-*.log)
for target in "$addr" $workers; do
  refused "no client certificate at $target" --server "$target" --tls-ca "$certs/ca.pem" health
  refused "another CA's client at $target" --server "$target" --tls-ca "$certs/ca.pem" \
    --tls-cert "$certs/rogue.pem" --tls-key "$certs/rogue.key" health
  refused "plaintext at $target" --server "$target" health
  "$preft" client --server "$target" "${mtls[@]}" health > /dev/null || fail "mTLS health at $target"
done
refused "generate without a client certificate" --server "$addr" --tls-ca "$certs/ca.pem" \
  generate --prompt hi

bash "$src/scripts/local-cluster.sh" stop
trap - EXIT
echo "mTLS cluster: $failures failures"
[[ $failures == 0 ]]
