#!/usr/bin/env bash
# Cross-compiles and links the native addon as binding.gyp builds it on a non-x86 host (arm64): the generic
# kernels only, no x86 headers. Node's own headers and node-addon-api are architecture-independent, so the object
# files are what a real arm64 `npm install` compiles; the link leaves only Node-API symbols undefined, which the
# node binary provides at load. Needs Debian's g++-aarch64-linux-gnu.
set -euo pipefail
cd "$(dirname "$0")/.."
CXX=${CXX_AARCH64:-aarch64-linux-gnu-g++}
command -v "$CXX" >/dev/null || { echo "check-arm64-build: $CXX not found (apt-get install g++-aarch64-linux-gnu)" >&2; exit 1; }
node_include="$(dirname "$(dirname "$(command -v node)")")/include/node"
napi_include="$(node -p "require('node-addon-api').include_dir")"
# The sources binding.gyp compiles on every architecture (its top-level list, not the x86 condition).
mapfile -t sources < <(python3 -c '
import ast, sys
gyp = ast.literal_eval(open("binding.gyp").read())
print("\n".join(gyp["targets"][0]["sources"]))')
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
pids=()
for src in "${sources[@]}"; do
  "$CXX" -std=c++17 -O2 -fPIC -fexceptions -Wall -Wextra -Wno-uninitialized -Wno-unused-parameter -Werror \
    -DNAPI_VERSION=8 -DNAPI_CPP_EXCEPTIONS -DNODE_API_SWALLOW_UNTHROWABLE_EXCEPTIONS \
    -I"$node_include" -I"$napi_include" -c "$src" -o "$out/$(basename "$src" .cc).o" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done  # set -e: a failed compile stops here
"$CXX" -shared -o "$out/conduit_native.node" "$out"/*.o
undefined=$(aarch64-linux-gnu-nm -u "$out/conduit_native.node" | awk '{print $2}' |
  grep -v -E '^(napi_|__|_ITM_)' | grep -v -E '@(GLIBC|GLIBCXX|CXXABI|GCC)_' || true)
if [ -n "$undefined" ]; then
  echo "check-arm64-build: symbols the arm64 addon needs but nothing defines:" >&2
  echo "$undefined" >&2
  exit 1
fi
echo "check-arm64-build: ${#sources[@]} sources compiled and linked for arm64 (generic kernels)"
