#!/usr/bin/env bash
# An nvcc for type-checking only (`tools/cuda/build.sh check --stub-kernels`, what CI runs).
#
# `cargo check --features cuda` runs candle-kernels' build script, which compiles candle's CUDA
# kernels with nvcc (12 PTX files and a 15-object libmoe.a: about 13.5 minutes on 2 vCPUs), only
# for `cargo check` to embed the PTX as strings and never link the library. This stand-in writes
# the files nvcc would write, empty, and passes every other call (`--version`) to the real nvcc
# in $RLTUNE_REAL_NVCC. The Rust code is type-checked exactly as with real kernels; the kernels
# themselves are compiled by `tools/cuda/build.sh build` (and pack.sh), never by this script.
# Its outputs must never reach a build that runs: build.sh points the check at its own
# target folder (target/cuda-typecheck).
set -euo pipefail

out="" outdir="" src="" mode=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    --ptx) mode=ptx ;;
    -c) mode=obj ;;
    --lib) mode=lib ;;
    -o) out="${args[i + 1]}" ;;
    --output-directory) outdir="${args[i + 1]}" ;;
    *.cu) src="${args[i]}" ;;
  esac
done

case "$mode" in
  ptx)
    [ -n "$outdir" ] && [ -n "$src" ] || { echo "stub_nvcc: --ptx without --output-directory or a .cu file: $*" >&2; exit 2; }
    name="$(basename "$src")"
    : >"$outdir/${name%.cu}.ptx"
    ;;
  obj)
    [ -n "$out" ] || { echo "stub_nvcc: -c without -o: $*" >&2; exit 2; }
    : >"$out"
    ;;
  lib)
    [ -n "$out" ] || { echo "stub_nvcc: --lib without -o: $*" >&2; exit 2; }
    printf '!<arch>\n' >"$out" # an empty static library
    ;;
  *)
    [ -n "${RLTUNE_REAL_NVCC:-}" ] || { echo "stub_nvcc: RLTUNE_REAL_NVCC is not set" >&2; exit 2; }
    exec "$RLTUNE_REAL_NVCC" "$@"
    ;;
esac
