#!/usr/bin/env bash
# Runs rltune's CUDA kernels on the CPU, in the emulation of tools/cuda/emulate/cuda_emu.hpp,
# against double-precision references: what CI can check of the kernels without a GPU (their
# indexing, tiling and synchronization; not their speed). Needs g++ with C++20 (<barrier>).
#
#   tools/cuda/emulate.sh          # every test in tools/cuda/emulate/*_test.cpp; exit 1 on a failure
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${TMPDIR:-/tmp}/rltune-cuda-emulate"
mkdir -p "$OUT"
status=0
for test in tools/cuda/emulate/*_test.cpp; do
  name="$(basename "$test" .cpp)"
  g++ -std=c++20 -O1 -pthread -Wall -Wextra -Wno-unused-parameter -Wno-unknown-pragmas -I tools/cuda/emulate -I crates/rltune-kernels/src/cuda \
    -o "$OUT/$name" "$test"
  "$OUT/$name" || status=1
done
exit "$status"
