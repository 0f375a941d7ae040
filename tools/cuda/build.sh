#!/usr/bin/env bash
# Builds rltune with CUDA on a machine without the CUDA toolkit (and without a GPU): installs
# nvcc, the CUDA headers and the libraries candle links from PyPI into an ignored venv
# (.venv-cuda), then runs cargo with them.
#
#   tools/cuda/build.sh                      # cargo build --release --features cuda -p rltune-cli
#   tools/cuda/build.sh check --workspace    # cargo check --features cuda --workspace
#   tools/cuda/build.sh check --stub-kernels --workspace   # the same with candle's kernels stubbed
#                                            # (what CI runs; see tools/cuda/stub_nvcc.sh)
#   tools/cuda/build.sh env                  # print the exports, e.g.: eval "$(tools/cuda/build.sh env)"
#   tools/cuda/build.sh setup                # only install the toolchain (what `check` needs)
#   tools/cuda/build.sh cargo test ...       # any cargo command with the toolkit's environment
#   RLTUNE_CUDA_NCCL=1 tools/cuda/build.sh build --features nccl   # with NCCL (libnccl from PyPI)
#
# The toolkit is CUDA 13.0 (pinned): the GPU machines run driver 580, which is CUDA 13.0, and a
# driver cannot load PTX from a newer nvcc. CUDA_COMPUTE_CAP (default 90, H100/H200) picks the
# GPU generation the kernels are built for, since nvidia-smi cannot tell on a machine without
# one. Downloads 104 MB for `check`, 644 MB for `build` (1.3 GiB installed); see the README,
# "Building with CUDA".
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV="${RLTUNE_CUDA_VENV:-$PWD/.venv-cuda}"
PYTHON="${PYTHON:-python3}"
CUDA_VERSION_PIN="13.0.*"
# What nvcc needs to compile candle's kernels (and the build to link libcudart): ~104 MB.
TOOLCHAIN=(
  "nvidia-cuda-nvcc==$CUDA_VERSION_PIN"     # nvcc, ptxas, fatbinary
  "nvidia-nvvm==$CUDA_VERSION_PIN"          # cicc (nvcc's front end); unpinned it pulls the newest
  "nvidia-cuda-crt==$CUDA_VERSION_PIN"      # crt/host_config.h and friends
  "nvidia-cuda-runtime==$CUDA_VERSION_PIN"  # cuda_runtime.h, cuda_fp16.h, cuda_bf16.h, libcudart
  "nvidia-cuda-cccl==$CUDA_VERSION_PIN"     # cub / thrust / cuda/std headers of the kernels
)
# What the binary loads at run time through cudarc (dlopen), for a GPU machine without a CUDA
# install: ~540 MB more (cuBLAS alone 421 MB). `check` skips them.
RUNTIME_LIBS=(
  "nvidia-cuda-nvrtc==$CUDA_VERSION_PIN"
  "nvidia-cublas==13.0.*"
  "nvidia-curand==10.4.0.*"                 # the CUDA 13.0 release of cuRAND
)

install() { # install MARKER PACKAGES...
  local marker="$VENV/.installed-$1"; shift
  [ -e "$marker" ] && return 0
  echo "tools/cuda/build.sh: installing $* from PyPI into $VENV" >&2
  [ -x "$VENV/bin/pip" ] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "$@"
  touch "$marker"
}
install toolchain "${TOOLCHAIN[@]}"
case "${1:-build}" in check | setup) ;; *) install runtime-libs "${RUNTIME_LIBS[@]}" ;; esac
# NCCL (a build with --features nccl links libnccl; RLTUNE_CUDA_NCCL=1, which pack.sh --nccl
# sets): the CUDA 13 wheel, ~200 MB. The GPU machine's PyTorch ships the same library.
NCCL_LIB=""
if [ "${RLTUNE_CUDA_NCCL:-0}" = 1 ]; then
  install nccl "nvidia-nccl-cu13"
  NCCL_LIB="$("$VENV/bin/python" -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))')"
  [ -e "$NCCL_LIB/libnccl.so" ] || ln -s "$(basename "$(ls "$NCCL_LIB"/libnccl.so.* | head -1)")" "$NCCL_LIB/libnccl.so"
fi

CUDA_ROOT="$("$VENV/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')"
# The wheels ship versioned libraries only; the linker wants the unversioned names.
for lib in cudart cublas cublasLt curand nvrtc; do
  so="$(ls "$CUDA_ROOT/lib/lib$lib.so."* 2>/dev/null | grep -v alt | head -1 || true)"
  [ -n "$so" ] && [ ! -e "$CUDA_ROOT/lib/lib$lib.so" ] && ln -s "$(basename "$so")" "$CUDA_ROOT/lib/lib$lib.so"
done

# `--features cuda` links libcuda (cudarc's `dynamic-linking`), which only a GPU driver installs.
# The toolkit's answer is a stub to link against (lib/stubs/libcuda.so), which the wheels do not
# ship: build one from the driver functions cudarc declares (empty bodies, soname libcuda.so.1).
# At run time the driver's own libcuda.so.1 is loaded; the stub is never on LD_LIBRARY_PATH.
STUBS="$CUDA_ROOT/lib/stubs"
if [ ! -e "$STUBS/libcuda.so" ] && [ "${1:-build}" != setup ]; then
  cudarc_version="$(grep -A1 '^name = "cudarc"' Cargo.lock | sed -n 's/^version = "\(.*\)"/\1/p' | head -1)"
  registry="${CARGO_HOME:-$HOME/.cargo}/registry/src"
  decls="$(ls "$registry"/*/"cudarc-$cudarc_version"/src/driver/sys/mod.rs 2>/dev/null | head -1 || true)"
  if [ -z "$decls" ]; then cargo fetch --quiet; decls="$(ls "$registry"/*/"cudarc-$cudarc_version"/src/driver/sys/mod.rs | head -1)"; fi
  mkdir -p "$STUBS"
  grep -oE '\bfn cu[A-Za-z0-9_]+\(' "$decls" | sed -E 's/fn (cu[A-Za-z0-9_]+)\(/void \1(void) {}/' | sort -u >"$STUBS/libcuda.c"
  "${CC:-cc}" -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$STUBS/libcuda.so" "$STUBS/libcuda.c"
fi

exports() {
  cat <<EOV
export CUDA_ROOT="$CUDA_ROOT" CUDA_HOME="$CUDA_ROOT" CUDA_PATH="$CUDA_ROOT"
export NVCC="$CUDA_ROOT/bin/nvcc" PATH="$CUDA_ROOT/bin:\$PATH"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
export LIBRARY_PATH="$CUDA_ROOT/lib:$STUBS${NCCL_LIB:+:$NCCL_LIB}\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
export LD_LIBRARY_PATH="$CUDA_ROOT/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
EOV
}
eval "$(exports)"

case "${1:-build}" in
  setup) ;; # the toolchain only (CI: a failed download is told apart from a compile error)
  env) exports ;;
  check)
    shift
    if [ "${1:-}" = --stub-kernels ]; then
      # Type-checks without compiling candle's kernels (13.5 of the check's minutes): nvcc's
      # outputs are written empty, in a target folder of their own so that no build that runs
      # ever links them.
      shift
      export RLTUNE_REAL_NVCC="$NVCC" NVCC="$PWD/tools/cuda/stub_nvcc.sh"
      export CARGO_TARGET_DIR="$PWD/target/cuda-typecheck"
    fi
    exec cargo check --features cuda "$@"
    ;;
  build) shift || true; exec cargo build --release --features cuda -p rltune-cli "$@" ;;
  cargo) shift; exec cargo "$@" ;;
  *) echo "usage: tools/cuda/build.sh [build [ARGS]] | check [ARGS] | setup | env | cargo ARGS" >&2; exit 2 ;;
esac
