#!/usr/bin/env bash
# Builds llama.cpp from source on this machine with -march=native (GGML_NATIVE), as the peer that benchmarks and
# reference-output recorders compare against. The source is the git bundle that node-llama-cpp ships (npm registry
# only, no GitHub access needed): `npm install` in benchmarks/peer brings it.
#
#   bash scripts/build-llama-cpp.sh [DIR]     # default DIR: benchmarks/peer/llama.cpp (ignored by git)
#
# Prints the directory holding the binaries (llama-bench, llama-server, llama-quantize, llama-cli,
# llama-batched-bench, llama-simple) on its last line. Rebuilds only what changed on a second run.
# CONDUIT_LLAMA_CPP_TARGETS="llama-quantize" builds only the listed targets (CI builds llama-quantize alone, for the
# tests that compare Conduit with files llama.cpp quantized itself).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
DIR=${1:-${CONDUIT_LLAMA_CPP_DIR:-$ROOT/benchmarks/peer/llama.cpp}}
BUNDLE=$ROOT/benchmarks/peer/node_modules/node-llama-cpp/llama/gitRelease.bundle
if [ ! -f "$BUNDLE" ]; then
  echo "installing benchmarks/peer (node-llama-cpp ships the llama.cpp source bundle)" >&2
  (cd benchmarks/peer && npm install --no-audit --no-fund >&2)
fi
if [ ! -d "$DIR/src/.git" ]; then
  rm -rf "$DIR/src"
  mkdir -p "$DIR"
  git clone -q "$BUNDLE" "$DIR/src" 2>/dev/null
fi
# A CPU with AMX under a kernel (or hypervisor) that does not grant processes the tile data state: -march=native
# still compiles ggml's AMX matmul, whose first tile instruction then faults (llama-bench dies on any prefill). Such
# a machine gets the build without AMX, as Conduit's own kernels fall back to avx512 there (native/cpu.cc). The
# check asks as native/cpu.cc does: arch_prctl ARCH_GET_XCOMP_SUPP must list XTILEDATA (bit 18), the request
# ARCH_REQ_XCOMP_PERM succeed, and ARCH_GET_XCOMP_PERM then list it.
# Set either way, so a build directory configured on another machine does not keep the other choice.
EXTRA_FLAGS=(-DCMAKE_C_FLAGS= -DCMAKE_CXX_FLAGS=)
BUILT_WITH="GGML_NATIVE=ON"
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null && ! python3 - <<'PY' 2>/dev/null
import ctypes, sys
libc, mask = ctypes.CDLL(None), ctypes.c_uint64(0)
arch_prctl = lambda code, arg: libc.syscall(158, code, arg)  # SYS_arch_prctl on x86_64
ok = arch_prctl(0x1022, ctypes.byref(mask)) == 0 and mask.value >> 18 & 1 and arch_prctl(0x1023, 18) == 0
ok = ok and arch_prctl(0x1025, ctypes.byref(mask)) == 0 and mask.value >> 18 & 1
sys.exit(0 if ok else 1)
PY
then
  echo "AMX present but its tile data not granted to processes: building llama.cpp without AMX" >&2
  EXTRA_FLAGS=(-DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
  BUILT_WITH="GGML_NATIVE=ON without AMX (tile data not granted)"
fi
read -r -a TARGETS <<< "${CONDUIT_LLAMA_CPP_TARGETS:-llama-bench llama-server llama-quantize llama-cli llama-batched-bench llama-simple}"
cmake -S "$DIR/src" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF "${EXTRA_FLAGS[@]}" >&2
cmake --build "$DIR/build" -j "$(nproc)" --target "${TARGETS[@]}" >&2
# The version recorded next to reference outputs: what the binary says of itself (the bundle's commit) and the
# node-llama-cpp release that shipped the bundle.
NLC=$(node -e "console.log(require('./benchmarks/peer/node_modules/node-llama-cpp/package.json').version)")
if [ -x "$DIR/build/bin/llama-cli" ]; then SELF=$("$DIR/build/bin/llama-cli" --version 2>&1 | head -1); else SELF="commit $(git -C "$DIR/src" rev-parse --short HEAD)"; fi
echo "llama.cpp $SELF from node-llama-cpp $NLC's source bundle, $BUILT_WITH" > "$DIR/VERSION"
cat "$DIR/VERSION" >&2
echo "$DIR/build/bin"
