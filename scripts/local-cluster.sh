#!/usr/bin/env bash
# Starts a multi-process preft cluster on 127.0.0.1: 2 decode workers, 2 prefill workers and a
# router, with UCX between the tiers (shared memory by default; PREFT_UCX_TLS=tcp,self and
# PREFT_UCX_NET_DEVICES=lo for TCP). Each process logs to RUN_DIR/<name>.log.
#
#   scripts/local-cluster.sh start BUILD_DIR MODEL_DIR [ADAPTER_ROOT]   # prints the router address
#   scripts/local-cluster.sh stop                                       # SIGTERM (graceful drain)
#
# PREFT_TLS_DIR=DIR (from scripts/make-dev-certs.sh) runs every gRPC hop over mutual TLS;
# PREFT_TRANSPORT=grpc moves KV onto gRPC (WriteKv) instead of UCX.
# PREFT_COLOCATED=1 starts the colocated deployment instead (needs ADAPTER_ROOT): 2 decode
# workers with --colocated, each running whole requests in one engine as vLLM does without
# disaggregation, and the router with --colocated; no prefill workers, no KV between processes.
# With PREFT_DEVICE=cuda every worker runs its forward on the GPU (1 GiB of KV cache each;
# prefill and disaggregated decode workers stage KV through a host mirror of that size).
# RUN_DIR (default /tmp/preft-local-cluster) holds pids and addresses between the two calls;
# RUN_DIR/metrics-targets lists "NAME HOST:PORT" of each process's Prometheus endpoint.
set -euo pipefail
run=${RUN_DIR:-/tmp/preft-local-cluster}
tls=${PREFT_UCX_TLS:-posix,self}
devices=${PREFT_UCX_NET_DEVICES:-}

wait_address() {  # log file -> address from its "listening on ADDR" line
  local log=$1
  for _ in $(seq 1 600); do
    if grep -q "listening on" "$log" 2>/dev/null; then
      sed -n 's/.*listening on \([^ ]*\).*/\1/p' "$log" | head -1
      return 0
    fi
    sleep 0.1
  done
  echo "local-cluster: $(basename "$log" .log) did not start; its log:" >&2
  cat "$log" >&2
  return 1
}

record_metrics() {  # NAME -> appends "NAME HOST:PORT" from its log's "metrics on" line
  local name=$1
  local addr
  addr=$(sed -n 's|.*metrics on http://\([^/]*\)/metrics.*|\1|p' "$run/$name.log" | head -1)
  [[ -n "$addr" ]] && echo "$name $addr" >> "$run/metrics-targets"
  return 0
}

start() {
  local build=$1 model=$2 root=${3:-}
  mkdir -p "$run"
  : > "$run/pids"
  : > "$run/metrics-targets"
  local worker_flags=(--transport "${PREFT_TRANSPORT:-ucx}" --metrics-listen 127.0.0.1:0)
  [[ "${PREFT_TRANSPORT:-ucx}" == ucx ]] && worker_flags+=(--ucx-tls "$tls")
  [[ -n "$devices" ]] && worker_flags+=(--ucx-net-devices "$devices")
  local tls_flags=()
  if [[ -n "${PREFT_TLS_DIR:-}" ]]; then
    tls_flags=(--tls-cert "$PREFT_TLS_DIR/server.pem" --tls-key "$PREFT_TLS_DIR/server.key"
               --tls-ca "$PREFT_TLS_DIR/ca.pem")
    worker_flags+=("${tls_flags[@]}")
  fi
  local adapter_flags=() decode_flags=()
  [[ -n "$root" ]] && adapter_flags=(--adapter-root "$root")
  # With adapters, decode workers also serve the all-position baseline (LoRA/DiReFT on every
  # token); PREFT_DECODE_ADAPTERS=0 runs pure PreFT decode workers (no adapter ever loaded).
  if [[ -n "$root" && "${PREFT_DECODE_ADAPTERS:-1}" != 0 ]]; then
    decode_flags=(--adapters all-positions)
  fi
  local device_flags=()
  if [[ "${PREFT_DEVICE:-cpu}" != cpu ]]; then
    device_flags=(--device "$PREFT_DEVICE" --kv-bytes $((1 << 30)))
  fi
  worker_flags+=("${device_flags[@]}")
  # PREFT_LOG_FLAGS (e.g. "--log-format json --log-level debug") go to every process.
  local log_flags=()
  read -r -a log_flags <<< "${PREFT_LOG_FLAGS:-}"
  worker_flags+=("${log_flags[@]}")
  if [[ "${PREFT_COLOCATED:-0}" == 1 ]]; then
    start_colocated "$build" "$model" "$root"
    return
  fi
  for i in 0 1; do
    "$build/services/decode/preft-decode" --model "$model" "${worker_flags[@]}" "${adapter_flags[@]}" \
      "${decode_flags[@]}" \
      > "$run/decode-$i.log" 2>&1 &
    echo $! >> "$run/pids"
    "$build/services/prefill/preft-prefill" --model "$model" "${worker_flags[@]}" "${adapter_flags[@]}" \
      > "$run/prefill-$i.log" 2>&1 &
    echo $! >> "$run/pids"
  done
  local decode prefill
  decode="$(wait_address "$run/decode-0.log"),$(wait_address "$run/decode-1.log")"
  prefill="$(wait_address "$run/prefill-0.log"),$(wait_address "$run/prefill-1.log")"
  "$build/services/router/preft-router" --model "$model" --prefill "$prefill" --decode "$decode" \
    --listen "${PREFT_ROUTER_LISTEN:-127.0.0.1:0}" --metrics-listen 127.0.0.1:0 \
    "${tls_flags[@]}" "${adapter_flags[@]}" "${log_flags[@]}" > "$run/router.log" 2>&1 &
  echo $! >> "$run/pids"
  wait_address "$run/router.log" > "$run/router.addr"
  for name in decode-0 decode-1 prefill-0 prefill-1 router; do record_metrics "$name"; done
  cat "$run/router.addr"
}

start_colocated() {  # after start's set-up; uses its tls_flags and device_flags
  local build=$1 model=$2 root=$3
  if [[ -z "$root" ]]; then
    echo "local-cluster: PREFT_COLOCATED=1 needs ADAPTER_ROOT (colocated workers load adapters)" >&2
    return 2
  fi
  # The KV never leaves a colocated worker: the in-process transport stays idle.
  for i in 0 1; do
    "$build/services/decode/preft-decode" --model "$model" --colocated --adapter-root "$root" \
      --transport inproc --metrics-listen 127.0.0.1:0 "${tls_flags[@]}" "${device_flags[@]}" \
      "${log_flags[@]}" \
      > "$run/decode-$i.log" 2>&1 &
    echo $! >> "$run/pids"
  done
  local decode
  decode="$(wait_address "$run/decode-0.log"),$(wait_address "$run/decode-1.log")"
  "$build/services/router/preft-router" --model "$model" --colocated --decode "$decode" \
    --listen "${PREFT_ROUTER_LISTEN:-127.0.0.1:0}" --metrics-listen 127.0.0.1:0 \
    "${tls_flags[@]}" "${log_flags[@]}" --adapter-root "$root" > "$run/router.log" 2>&1 &
  echo $! >> "$run/pids"
  wait_address "$run/router.log" > "$run/router.addr"
  for name in decode-0 decode-1 router; do record_metrics "$name"; done
  cat "$run/router.addr"
}

stop() {
  [[ -f "$run/pids" ]] || return 0
  # Router first (it drains its streams), then the workers.
  tac "$run/pids" | while read -r pid; do kill -TERM "$pid" 2>/dev/null || true; done
  for _ in $(seq 1 100); do
    local alive=0
    while read -r pid; do kill -0 "$pid" 2>/dev/null && alive=1; done < "$run/pids"
    [[ $alive == 0 ]] && break
    sleep 0.1
  done
  while read -r pid; do kill -KILL "$pid" 2>/dev/null || true; done < "$run/pids"
  rm -f "$run/pids"
}

case ${1:-} in
  start) shift; start "$@" ;;
  stop) stop ;;
  *) sed -n '2,13p' "$0"; exit 2 ;;
esac
