#!/usr/bin/env bash
# Fills the folder a GPU verification run carries (default .gpu/, git-ignored), on a machine
# without a GPU: the CUDA release binary (stripped, xz-compressed), the TRL wheels the
# benchmarks need that the GPU machine lacks, and the commit. tools/cuda/verify.sh runs there
# from the repository root; the fixtures it reads are tracked files and travel with the tree.
#
#   tools/cuda/pack.sh                 # CUDA build (tools/cuda/build.sh; ~25 min cold) + wheels
#   tools/cuda/pack.sh --cpu           # the CPU release build instead: rehearses the packing
#   tools/cuda/pack.sh --no-wheels     # the binary only
#   tools/cuda/pack.sh --nccl          # the CUDA build with NCCL too (verify.sh's "nccl 1-rank")
#   tools/cuda/pack.sh --out DIR       # another folder
#
# Then, on the GPU machine (a runner that carries .gpu; 64 MiB at most in all):
#   tools/cuda/verify.sh --out "$OUT"
#
# The binary: one `rltune` holds every check (`rltune selftest` compares the models, the
# sampler, PPO, GRPO, RLOO and DPO with their golden fixtures on the device), so no test
# binaries travel. The wheels (Python 3.12, manylinux x86-64):
#   wheels/trl011: TRL 0.11.4 with the transformers 4.46.3 it was tested with (the machine's
#     transformers 5 breaks it), and what they need that the machine's image lacks;
#   wheels/trl116: TRL 1.16.0 (for the GRPO benchmark) and its missing needs, on the machine's
#     own transformers.
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT_DIR=".gpu" CPU=0 WHEELS=1 NCCL=0
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) CPU=1 ;;
    --no-wheels) WHEELS=0 ;;
    --nccl) NCCL=1 ;;
    --out) OUT_DIR="$2"; shift ;;
    -h | --help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "pack.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
LIMIT_MIB=60 # a remote runner carries 64 MiB per call, the working tree's own files included

mkdir -p "$OUT_DIR"
if [ "$CPU" = 1 ]; then
  cargo build --release -p rltune-cli
  BIN=target/release/rltune
else
  # A target folder of its own, so that the CPU and CUDA release builds do not replace each other.
  if [ "$NCCL" = 1 ]; then
    CARGO_TARGET_DIR="$PWD/target/cuda" RLTUNE_CUDA_NCCL=1 tools/cuda/build.sh build --features nccl
  else
    CARGO_TARGET_DIR="$PWD/target/cuda" tools/cuda/build.sh
  fi
  BIN=target/cuda/release/rltune
fi
strip -o "$OUT_DIR/rltune" "$BIN"
xz -T0 -6 -f "$OUT_DIR/rltune" # -> rltune.xz, the uncompressed copy removed
{ git rev-parse --short HEAD; git diff --quiet HEAD -- crates Cargo.lock Cargo.toml || echo "+ uncommitted changes"; } \
  | paste -sd' ' >"$OUT_DIR/COMMIT"
echo "$([ "$CPU" = 1 ] && echo cpu || echo cuda)$([ "$NCCL" = 1 ] && echo ,nccl)" >"$OUT_DIR/FEATURES"

# The kernel tracer (tools/cuda/kernel_trace.c, verify.sh's profile steps), against CUPTI 13.0's
# headers from PyPI and the CUDA headers of the build's venv; skipped with a note where either
# is missing (the CPU rehearsal does not need it).
if [ "$CPU" = 0 ]; then
  CUPTI="target/cupti"
  if [ ! -f "$CUPTI/nvidia/cu13/include/cupti.h" ]; then
    mkdir -p "$CUPTI"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps -d "$CUPTI" "nvidia-cuda-cupti==13.0.85" &&
      python3 -c 'import glob, sys, zipfile; zipfile.ZipFile(glob.glob(sys.argv[1] + "/*.whl")[0]).extractall(sys.argv[1])' "$CUPTI" ||
      echo "pack.sh: CUPTI 13.0 could not be fetched: no kernel tracer" >&2
  fi
  CUDA_INC="$(ls -d "${RLTUNE_CUDA_VENV:-.venv-cuda}"/lib/python3*/site-packages/nvidia/cu13/include 2>/dev/null | head -1)"
  if [ -f "$CUPTI/nvidia/cu13/include/cupti.h" ] && [ -n "$CUDA_INC" ]; then
    flags=(-O2 -Wall -Wextra -I "$CUPTI/nvidia/cu13/include" -I "$CUDA_INC" -L "$CUPTI/nvidia/cu13/lib")
    gcc -shared -fPIC "${flags[@]}" tools/cuda/kernel_trace.c -l:libcupti.so.13 -lpthread -o "$OUT_DIR/kernel_trace.so"
    gcc "${flags[@]}" -I tools/cuda tools/cuda/kernel_trace_check.c -l:libcupti.so.13 -lpthread -o target/kernel_trace_check
    LD_LIBRARY_PATH="$CUPTI/nvidia/cu13/lib" RLTUNE_KERNEL_TRACE=target/kernel_trace_check.json target/kernel_trace_check 2>/dev/null
    python3 - target/kernel_trace_check.json <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
k = {x["name"]: x for x in r["kernels"]}
assert r["kernel_launches"] == 14 and r["span_ms"] == 6.01 and k["ucopy_f32"]["count"] == 2, r
assert r["kernels"][0]["name"] == "ucopy_f32" and abs(r["busy"] - 5055 / 6010) < 1e-4, r
assert 'sm90_xmma_gemm "bf16"\\x' in k and "?" in k, k
assert k["ucopy_f32"]["grids"] == [{"blocks": 40, "threads": 1024, "count": 1, "total_ms": 2.0},
                                   {"blocks": 8, "threads": 1024, "count": 1, "total_ms": 1.0}], k
c = k["cast_f32_bf16"]
assert [g["blocks"] for g in c["grids"]] == list(range(10, 2, -1)), c
assert c["other_grids"] == {"count": 2, "total_ms": 0.003} and c["count"] == 10, c
EOF
    echo "pack.sh: kernel tracer built and checked"
  else
    echo "pack.sh: no kernel tracer (CUPTI or the CUDA headers missing)" >&2
  fi
fi

if [ "$WHEELS" = 1 ]; then
  download() { # download DIR SPEC...
    local dir="$OUT_DIR/wheels/$1"; shift
    mkdir -p "$dir"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
      --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
      -d "$dir" "$@"
  }
  # transformers 4.46.3 and tokenizers 0.20.3 want huggingface_hub < 1.0 (the machine has 1.x);
  # tyro is TRL 0.11's config parser; datasets 3.1 with its pinned dill and multiprocess.
  download trl011 trl==0.11.4 transformers==4.46.3 tokenizers==0.20.3 huggingface_hub==0.26.5 \
    tyro==0.9.2 docstring-parser==0.16 shtab==1.7.1 typeguard==4.4.1 datasets==3.1.0 dill==0.3.8 \
    multiprocess==0.70.16
  download trl116 trl==1.16.0 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18
fi

echo "pack.sh: $OUT_DIR"
du -ab "$OUT_DIR" | sort -k2 | awk '{printf "  %8.2f MiB  %s\n", $1 / 1048576, $2}'
total=$(du -sb "$OUT_DIR" | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
echo "pack.sh: $OUT_DIR $((total / 1048576)) MiB + tracked files $((tree / 1048576)) MiB (limit ${LIMIT_MIB} MiB)"
if [ $(((total + tree) / 1048576)) -ge "$LIMIT_MIB" ]; then
  echo "pack.sh: too large to carry: leave out the wheels (--no-wheels) or check what grew" >&2
  exit 1
fi
