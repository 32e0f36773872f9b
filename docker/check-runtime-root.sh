#!/usr/bin/env bash
# docker/Dockerfile's runtime stage without a Docker engine: debootstrap a Debian 12 minbase
# root (the package set debian:12-slim has), replay the stage's COPY and RUN lines in it (as
# parsed by tests/docker/stages.mjs), copy BUILD_DIR's binaries in, and start them as UID 10001:
# --help for each, then make-model, generate, and `preft serve` answering `preft client`, and
# preft-decode opening UCX over tcp. Needs root, debootstrap and Debian's archive (about two
# minutes, in a fresh temporary root each time); not run by ctest.
# Usage: docker/check-runtime-root.sh [BUILD_DIR]
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
build="$(cd "${1:-$repo/build}" && pwd)"
root="$(mktemp -d /tmp/preft-runtime-root.XXXXXX)"
chmod 755 "$root"  # its / : UID 10001 must traverse it
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  sleep 1
  for m in sys dev proc; do
    if mountpoint -q "$root/$m"; then umount "$root/$m" || return; fi
  done
  rm -rf "$root"
}
trap cleanup EXIT

echo "check-runtime-root: debootstrap --variant=minbase bookworm $root"
debootstrap --variant=minbase bookworm "$root" >"$root.log" 2>&1 || { tail -20 "$root.log"; exit 1; }
rm -f "$root.log"
mount -t proc proc "$root/proc"
mount --bind /dev "$root/dev"
mount --bind /sys "$root/sys"  # UCX's tcp transport lists /sys/class/net
cp /etc/resolv.conf "$root/etc/resolv.conf"

# The runtime stage, instruction by instruction: KIND<tab>ARGS (COPY: source<tab>destination).
stage="$(cd "$repo/tests/docker" && node --input-type=module -e '
  import { ParseStages, ReadSource } from "./stages.mjs";
  const s = ParseStages(ReadSource("docker/Dockerfile")).find((x) => x.name === "runtime");
  for (const i of s.instructions) {
    const k = i.getKeyword();
    if (k === "RUN") console.log(`RUN\t${i.getArgumentsContent()}`);
    if (k === "COPY") console.log(`COPY\t${i.getArguments().map((a) => a.getValue()).join("\t")}`);
  }')"
while IFS=$'\t' read -r kind a b; do
  case "$kind" in
    COPY) mkdir -p "$root$(dirname "$b")" && cp "$repo/$a" "$root$b" ;;
    RUN) echo "check-runtime-root: RUN $a"; chroot "$root" /bin/sh -c "$a" </dev/null ;;
  esac
done <<<"$stage"

for b in services/router/preft-router services/prefill/preft-prefill services/decode/preft-decode tools/preft; do
  cp "$build/$b" "$root/usr/local/bin/"
done
as_preft() { chroot --userspec=10001:10001 "$root" env HOME=/home/preft "$@"; }

for b in preft-router preft-prefill preft-decode preft; do
  as_preft "/usr/local/bin/$b" --help >/dev/null
  echo "check-runtime-root: $b --help ok"
done
as_preft /usr/local/bin/preft make-model --preset tiny --seed 1 --out /home/preft/m >/dev/null
as_preft /usr/local/bin/preft generate --model /home/preft/m --prompt-ids 1,2,3 --max-tokens 4 --json
# Not through as_preft, so that $! is the server's own pid (chroot and env exec it).
chroot --userspec=10001:10001 "$root" env HOME=/home/preft /usr/local/bin/preft serve \
  --model /home/preft/m --listen 127.0.0.1:50999 >"$root/serve.log" 2>&1 &
pids+=($!)
chroot --userspec=10001:10001 "$root" env HOME=/home/preft /usr/local/bin/preft-decode \
  --model /home/preft/m --listen 127.0.0.1:0 --kv-blocks 64 \
  --transport ucx --ucx-tls tcp,self --ucx-net-devices lo >"$root/decode.log" 2>&1 &
pids+=($!)
for _ in $(seq 50); do grep -q listening "$root/serve.log" && grep -q listening "$root/decode.log" && break; sleep 0.2; done
as_preft /usr/local/bin/preft client --server 127.0.0.1:50999 --timeout-s 20 generate \
  --prompt-ids 1,2,3 --max-tokens 4 --json
grep -q 'transport=ucx(tcp,self)' "$root/decode.log" ||
  { cat "$root/decode.log"; echo "check-runtime-root: preft-decode did not open UCX over tcp" >&2; exit 1; }
echo "check-runtime-root: ok (runtime stage of docker/Dockerfile, binaries from $build)"
