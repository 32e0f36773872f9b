#!/usr/bin/env bash
# The router is a front door: it tokenises, routes and checks adapters, and computes nothing.
# Its binary must not load the compute stack (OpenBLAS, OpenMP, CUDA, UCX, libtorch), nor
# contain the engine, the CPU model or the kernels (they are static libraries, so a symbol
# check is what shows them).
# Usage: router_links_test.sh <preft-router>
set -euo pipefail
router=$1
fail=0

libs=$(ldd "$router" | awk '{print $1}')
for forbidden in libopenblas libgomp libomp libcudart libcublas libnccl libucp libucs libuct libtorch libc10; do
  if grep -q "^${forbidden}[.-]" <<<"$libs"; then
    echo "FAIL: $(basename "$router") loads ${forbidden}:"; grep "^${forbidden}[.-]" <<<"$libs"; fail=1
  fi
done

symbols=$(nm -C --defined-only "$router")
for forbidden in 'preft::engine::Engine::' 'preft::engine::Scheduler' 'preft::model::Model::' \
                 'preft::kernels::cpu::Linear(' 'preft::kernels::cpu::LowRankAdd' \
                 'preft::kernels::cpu::Attention' 'preft::transport::'; do
  if grep -qF -- "$forbidden" <<<"$symbols"; then
    echo "FAIL: $(basename "$router") contains ${forbidden}"; grep -F -- "$forbidden" <<<"$symbols" | head -3; fail=1
  fi
done

# The check itself must see what it looks for: the router does hold the tokenizer.
if ! grep -qF 'preft::text::Tokenizer::' <<<"$symbols"; then
  echo "FAIL: no preft::text::Tokenizer symbols found: is nm reading the right binary?"; fail=1
fi
[ "$fail" = 0 ] && echo "preft-router: $(wc -l <<<"$libs") shared libraries, no compute stack"
exit $fail
