#!/usr/bin/env bash
# ctest entry of deploy_manifests (main.mjs). kubectl renders the manifests: where it is not
# installed the test is skipped (exit 77); node and the npm packages are required.
# Usage: run.sh SOURCE_DIR BUILD_DIR WORK_DIR
set -u
here=$(cd "$(dirname "$0")" && pwd)
if ! command -v node > /dev/null; then
  echo "FAIL: node is not installed (scripts/install-deps.sh installs it)"
  exit 1
fi
if [[ ! -d "$here/node_modules/kubernetes-models" ]]; then
  echo "FAIL: $here/node_modules is missing: run scripts/install-deps.sh (npm ci there)"
  exit 1
fi
if ! command -v kubectl > /dev/null; then
  echo "SKIP: kubectl is not installed; it renders deploy/kustomize (kubectl kustomize)"
  exit 77
fi
exec node "$here/main.mjs" "$@"
