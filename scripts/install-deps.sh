#!/usr/bin/env bash
# Installs every Debian package preft needs. Idempotent: installs only what is missing.
# Called by `make demo`, `make test`, CI and the Dockerfiles.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  libabsl-dev libucx-dev ucx-utils prometheus-cpp-dev
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

if [[ ${#missing[@]} -eq 0 ]]; then
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
