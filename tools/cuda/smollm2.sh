#!/usr/bin/env bash
# The SmolLM2 GRPO + LoRA example (examples/smollm2-grpo) on the GPU machine. The GGUF (98 MB)
# is larger than the 64 MiB one remote call carries, and the machine has no network, so it
# travels in two parts, carried by two calls to the same warm machine (ignored files that a
# call carried stay there for the next call) and joined there.
#
# Here (no GPU):
#   tools/models/fetch_smollm2.sh && python3 examples/smollm2-grpo/make_data.py --out target/smollm2-grpo
#   tools/cuda/pack.sh --no-wheels          # .gpu/rltune.xz
#   tools/cuda/smollm2.sh split             # -> target/gpu-carry/{smol.a, smol.b, *.jsonl, SHA256}
# Then two calls on the GPU machine, one right after the other:
#   1. carry .gpu/rltune.xz and target/gpu-carry/smol.a:  tools/cuda/smollm2.sh stage
#   2. carry target/gpu-carry/smol.b:                     tools/cuda/smollm2.sh run --out "$OUT" [--limit S]
# `run` joins the parts (checking the SHA-256), runs the example with --device cuda under a time
# limit (default 300 s), and writes the run's metrics, eval.jsonl and log into OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY=target/gpu-carry
GGUF=target/models/SmolLM2-135M-Instruct.Q4_1.gguf
cmd="${1:-}"; shift || true
OUTDIR="${OUT:-target/smollm2-gpu}" LIMIT=300
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUTDIR="$2"; shift ;;
    --limit) LIMIT="$2"; shift ;;
    *) echo "smollm2.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done

case "$cmd" in
  split)
    [ -f "$GGUF" ] || { echo "smollm2.sh: $GGUF is missing: run tools/models/fetch_smollm2.sh" >&2; exit 2; }
    [ -f target/smollm2-grpo/train.jsonl ] || { echo "smollm2.sh: run examples/smollm2-grpo/make_data.py --out target/smollm2-grpo first" >&2; exit 2; }
    rm -rf "$CARRY" && mkdir -p "$CARRY"
    # 44 MiB in the first part, which also carries the 12 MiB binary; the rest in the second.
    head -c $((44 * 1048576)) "$GGUF" >"$CARRY/smol.a"
    tail -c +$((44 * 1048576 + 1)) "$GGUF" >"$CARRY/smol.b"
    cp target/smollm2-grpo/train.jsonl target/smollm2-grpo/heldout.jsonl "$CARRY/"
    sha256sum "$GGUF" | cut -d' ' -f1 >"$CARRY/SHA256"
    du -b "$CARRY"/* | awk '{printf "  %6.2f MiB  %s\n", $1 / 1048576, $2}'
    ;;
  stage)
    [ -f "$CARRY/smol.a" ] && [ -f .gpu/rltune.xz ] || { echo "smollm2.sh: stage needs $CARRY/smol.a and .gpu/rltune.xz carried" >&2; exit 2; }
    ls -l "$CARRY/smol.a" .gpu/rltune.xz
    ;;
  run)
    for f in "$CARRY/smol.a" "$CARRY/smol.b" .gpu/rltune.xz; do
      [ -f "$f" ] || { echo "smollm2.sh: $f is not here (the machine was released between the two calls?): stage again" >&2; exit 2; }
    done
    mkdir -p "$OUTDIR" "$(dirname "$GGUF")" target/smollm2-grpo
    cat "$CARRY/smol.a" "$CARRY/smol.b" >"$GGUF"
    [ "$(sha256sum "$GGUF" | cut -d' ' -f1)" = "$(cat "$CARRY/SHA256")" ] || { echo "smollm2.sh: the joined GGUF's SHA-256 differs" >&2; exit 2; }
    cp "$CARRY"/train.jsonl "$CARRY"/heldout.jsonl target/smollm2-grpo/
    BIN="$(mktemp -d)/rltune"
    xz -dc .gpu/rltune.xz >"$BIN" && chmod +x "$BIN"
    # shellcheck source=tools/cuda/cuda_libs.sh
    . tools/cuda/cuda_libs.sh
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$OUTDIR/device.txt" 2>&1 || true
    RUN=/tmp/smollm2-run
    t0=$(date +%s)
    rc=0
    timeout --kill-after=5 "$LIMIT" "$BIN" ppo --config examples/smollm2-grpo/grpo-lora.toml --device cuda \
      --set logging.dir="$RUN" --set checkpoint.every=1000 >"$OUTDIR/run.log" 2>&1 || rc=$?
    echo "exit $rc after $(($(date +%s) - t0)) s" | tee -a "$OUTDIR/run.log"
    for f in metrics.jsonl eval.jsonl samples.jsonl; do [ -f "$RUN/$f" ] && cp "$RUN/$f" "$OUTDIR/"; done
    tail -n 5 "$OUTDIR/run.log"
    [ -f "$OUTDIR/eval.jsonl" ] && cat "$OUTDIR/eval.jsonl"
    exit "$rc"
    ;;
  *) sed -n '2,17p' "$0"; exit 2 ;;
esac
