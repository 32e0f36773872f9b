#!/usr/bin/env bash
# Installs every Debian package preft needs. Idempotent: installs only what is missing.
# Called by `make demo`, `make test`, CI and the Dockerfiles.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  libabsl-dev libucx-dev ucx-utils prometheus-cpp-dev prometheus
  libopenblas-dev nlohmann-json3-dev libpcre2-dev libcpp-httplib-dev libcli11-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  clang libclang-rt-14-dev
  python3 python3-numpy python3-grpcio python3-grpc-tools
)
# The Python oracle (torch) is large; PREFT_SKIP_TORCH=1 leaves it out (its tests then skip).
if [[ "${PREFT_SKIP_TORCH:-0}" != "1" ]]; then
  PACKAGES+=(python3-torch)
fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

# Test tools from the npm registry (schema validators, Dockerfile parser): every tests/*/
# folder with a package-lock.json gets `npm ci` when its node_modules is missing or older
# than the lock. Needs node and npm: Debian's are used when the machine has none.
NPM_DIRS=()
repo_root="$(cd "$(dirname "$0")/.." && pwd)"
for lock in "$repo_root"/tests/*/package-lock.json; do
  [[ -f "$lock" ]] && NPM_DIRS+=("$(dirname "$lock")")
done
if [[ ${#NPM_DIRS[@]} -gt 0 ]] && ! command -v npm >/dev/null 2>&1; then
  missing+=(nodejs npm)
fi

if [[ ${#missing[@]} -gt 0 ]]; then
  echo "install-deps: installing ${missing[*]}"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

for dir in "${NPM_DIRS[@]}"; do
  if [[ ! -d "$dir/node_modules" || "$dir/package-lock.json" -nt "$dir/node_modules" ]]; then
    echo "install-deps: npm ci in ${dir#"$repo_root"/}"
    (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error && touch node_modules)
  fi
done
