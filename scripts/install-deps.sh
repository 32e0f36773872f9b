#!/usr/bin/env bash
# Installs every Debian package preft needs. Idempotent: installs only what is missing.
# Called by `make demo`, `make test`, CI and the Dockerfiles (docker/).
#   (no option)  everything to build and test preft
#   --runtime    only the shared libraries the built binaries load: no compiler, no -dev package
#                (the images' runtime stage); no npm either
#   --cuda       adds the CUDA 13 toolkit, or with --runtime its run-time libraries, from NVIDIA's
#                apt repository, which must be set up first (docker/Dockerfile.cuda does)
#   --print      prints the package list, one a line, and installs nothing
set -euo pipefail

runtime=0 cuda=0 print=0
for arg in "$@"; do
  case "$arg" in
    --runtime) runtime=1 ;;
    --cuda) cuda=1 ;;
    --print) print=1 ;;
    *) echo "install-deps: unknown option '$arg' (--runtime, --cuda, --print)" >&2; exit 2 ;;
  esac
done

# What preft-router, preft-prefill, preft-decode and preft load (ldd), less what every Debian
# image has (libc6, libstdc++6, libgcc-s1, zlib1g, libpcre2-8-0); tests/docker measures it.
RUNTIME_PACKAGES=(
  libgrpc++1.51 libgrpc29 libprotobuf32 libabsl20220623 libre2-9 libc-ares2 libssl3
  libucx0 libnuma1 libprometheus-cpp-core1.0 libcpp-httplib0.11 libbrotli1
  libopenblas0-pthread libgfortran5 libquadmath0 libgomp1 libutf8proc2 libspdlog1.10 libfmt9
  # libpq5 (the router's --registry postgresql://) and what it loads: Kerberos, LDAP, GnuTLS.
  libpq5 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libcom-err2 libkrb5support0 libkeyutils1
  libldap-2.5-0 libsasl2-2 libgnutls30 libp11-kit0 libidn2-0 libunistring2 libtasn1-6
  libnettle8 libhogweed6 libgmp10 libffi8
)
CUDA_PACKAGES=(cuda-nvcc-13-0 cuda-cudart-dev-13-0 cuda-cccl-13-0 libcublas-dev-13-0)
CUDA_RUNTIME_PACKAGES=(cuda-cudart-13-0 libcublas-13-0)

DEV_PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  libabsl-dev libucx-dev ucx-utils prometheus-cpp-dev prometheus openssl libssl-dev
  libopenblas-dev nlohmann-json3-dev libpcre2-dev libcpp-httplib-dev libcli11-dev libutf8proc-dev
  libboost-dev libpq-dev postgresql libspdlog-dev libfmt-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  clang libclang-rt-14-dev
  python3 python3-numpy python3-grpcio python3-grpc-tools python3-jinja2 gnuplot-nox
)
# torch is large: the Python oracle (python3-torch) and the trainer's libtorch (libtorch-dev, the
# same libtorch1.13). PREFT_SKIP_TORCH=1 leaves both out: the oracle's tests skip and the
# trainer is not built (PREFT_ENABLE_TRAIN=AUTO).
if [[ "${PREFT_SKIP_TORCH:-0}" != "1" ]]; then
  DEV_PACKAGES+=(python3-torch libtorch-dev)
fi

if [[ $runtime -eq 1 ]]; then
  PACKAGES=("${RUNTIME_PACKAGES[@]}")
  if [[ $cuda -eq 1 ]]; then PACKAGES+=("${CUDA_RUNTIME_PACKAGES[@]}"); fi
else
  PACKAGES=("${DEV_PACKAGES[@]}")
  if [[ $cuda -eq 1 ]]; then PACKAGES+=("${CUDA_PACKAGES[@]}"); fi
fi
if [[ $print -eq 1 ]]; then
  printf '%s\n' "${PACKAGES[@]}"
  exit 0
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
# Not with --runtime (images have no tests/).
NPM_DIRS=()
repo_root="$(cd "$(dirname "$0")/.." && pwd)"
if [[ $runtime -eq 0 ]]; then
  for lock in "$repo_root"/tests/*/package-lock.json; do
    [[ -f "$lock" ]] && NPM_DIRS+=("$(dirname "$lock")")
  done
fi
if [[ ${#NPM_DIRS[@]} -gt 0 ]] && ! command -v npm >/dev/null 2>&1; then
  missing+=(nodejs npm)
fi

if [[ $cuda -eq 1 && ${#missing[@]} -gt 0 ]] && ! compgen -G "/etc/apt/sources.list.d/cuda*" >/dev/null; then
  echo "install-deps: --cuda needs NVIDIA's CUDA apt repository (the cuda-keyring package;" \
       "docker/Dockerfile.cuda shows how)" >&2
  exit 1
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
