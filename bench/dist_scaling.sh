#!/usr/bin/env bash
# Data-parallel scaling on the CPU (issue #40): the same PPO run (global batch B) as
#   1 process  × 1 thread    (the baseline),
#   1 process  × 2 threads   (the kernels' own threads),
#   2 processes × 1 thread   (mpirun -np 2, B/2 each).
# Prints wall time, samples per second and the all-reduce share of the PPO step, from the
# runs' metrics.jsonl. Needs OpenMPI and rltune built with MPI:
#
#   cargo build --release -p rltune-cli --features mpi
#   bench/dist_scaling.sh [target/release/rltune] [STEPS] [GLOBAL_BATCH]
#
# The workload: the tiny sentiment quickstart with a 3.2M-parameter policy (4 layers, d = 256,
# built first) and its classifier reward; PPO with 24-token responses, 2 epochs of minibatches
# of B/4. Compare only within one run of this
# script: the CPU and its load change between sessions.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${1:-target/release/rltune}"
STEPS="${2:-6}"
B="${3:-64}"
OUT="${BENCH_OUT:-target/bench-dist}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 RUST_LOG=warn
rm -rf "$OUT" && mkdir -p "$OUT"
# A 3.2M-parameter GPT-2 (4 layers, d = 256) trained briefly by the tiny quickstart.
"$BIN" quickstart --preset tiny --output "$OUT/qs" --set policy_dim=256 --set policy_layers=4 \
  --set policy_heads=4 >/dev/null 2>&1
common=(ppo --config "$OUT/qs/ppo.toml" --set "ppo.steps=$STEPS" --set ppo.ppo_epochs=2
  --set generation.max_new_tokens=24 --set generation.min_new_tokens=24 --set data.max_query_tokens=8)

run() { # run NAME PROCESSES THREADS
  local name=$1 np=$2 threads=$3 b=$((B / $2))
  local args=("${common[@]}" --set "logging.dir=\"$OUT/$name\"" --set "ppo.batch_size=$b"
    --set "ppo.mini_batch_size=$((b / 4))")
  local t0 t1
  t0=$(date +%s.%N)
  if [ "$np" = 1 ]; then
    RAYON_NUM_THREADS=$threads "$BIN" "${args[@]}" >/dev/null 2>&1
  else
    mpirun -np "$np" --oversubscribe --bind-to none -x RAYON_NUM_THREADS="$threads" -x RUST_LOG \
      "$BIN" "${args[@]}" >/dev/null 2>&1
  fi
  t1=$(date +%s.%N)
  python3 - "$OUT/$name/metrics.jsonl" "$name" "$np" "$threads" "$t0" "$t1" "$STEPS" "$B" <<'EOF'
import json, sys
path, name, np_, threads, t0, t1, steps, b = sys.argv[1:]
rows = [json.loads(l) for l in open(path)][1:]  # the first step warms up
wall = float(t1) - float(t0)
step = sum(r["time/ppo/total"] for r in rows) / len(rows)
gen = sum(r["time/rollout/generation"] for r in rows) / len(rows)
ar = sum(r.get("time/dist/all_reduce", 0.0) for r in rows) / len(rows)
print(f"| {name} | {np_} × {threads} | {wall:.1f} | {int(steps) * int(b) / wall:.1f} | {gen:.3f} | {step:.3f} | {100 * ar / step:.1f}% |")
EOF
}

echo "host: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $(date -u +%F); load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "PPO, global batch $B, $STEPS steps (the first excluded from the per-step means)"
echo
echo "| run | processes × threads | wall s | samples/s | generation s/step | PPO step s | all-reduce share of the step |"
echo "|---|---|---|---|---|---|---|"
run one-thread 1 1
run two-threads 1 2
run two-processes 2 1
