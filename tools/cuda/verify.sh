#!/usr/bin/env bash
# The GPU verification run: the one command to run on a GPU machine, from the repository root,
# with the folder tools/cuda/pack.sh filled (.gpu/) beside it. It runs every check and benchmark
# of issue #36 that exists, fastest first, each under its own time limit and all within a budget
# (default 450 s), and writes after every step:
#
#   OUT/gpu-report.json   {"device", "driver", "commit", "checks": {NAME: {"pass", "max_abs_diff",
#                          "tolerance", ...}}, "bench": {NAME: {"rltune_s", "trl_s", "ratio", ...}},
#                          "skipped": {NAME: why}}
#   OUT/verify.log        every step's output, one after the other
#   OUT/logs.tar.gz       one log per step (at the end; a remote runner may return few files)
#
# It exits 1 when a check fails, 2 when it cannot start. A run cut short still leaves the report
# of the steps it reached.
#
#   tools/cuda/verify.sh                       # on the GPU machine: --device cuda, .gpu/rltune.xz
#   tools/cuda/verify.sh --rehearse            # here: the same steps on the CPU, with the CPU
#                                              # release binary (or --bin PATH)
#   tools/cuda/verify.sh --rehearse --quick --bin target/debug/rltune   # what CI runs
#
# Options: --out DIR (default $OUT, else target/verify), --bin PATH, --budget SECONDS, --quick
# (the checks only: no full quickstart, no benchmarks), --pack DIR (default .gpu), --only LIST
# (the steps whose names start with one of LIST's comma-separated prefixes, e.g.
# `--only nccl,quickstart-bf16,bench-ppo-qwen2`: a second run in the same session).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT="$PWD"

REHEARSE=0 QUICK=0 BIN="" PACK=".gpu" BUDGET=450 ONLY=""
OUTDIR="${OUT:-}"
while [ $# -gt 0 ]; do
  case "$1" in
    --rehearse) REHEARSE=1 ;;
    --quick) QUICK=1 ;;
    --out) OUTDIR="$2"; shift ;;
    --bin) BIN="$2"; shift ;;
    --pack) PACK="$2"; shift ;;
    --budget) BUDGET="$2"; shift ;;
    --only) ONLY="$2"; shift ;;
    -h | --help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "verify.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
PACK="$(cd "$PACK" 2>/dev/null && pwd || echo "$ROOT/$PACK")" # the steps run in a scratch folder
OUTDIR="${OUTDIR:-$ROOT/target/verify}"
mkdir -p "$OUTDIR" || exit 2
OUTDIR="$(cd "$OUTDIR" && pwd)"
WORK="$(mktemp -d /tmp/rltune-verify.XXXXXX)"
LOGS="$WORK/logs"
mkdir -p "$LOGS"
STEPS="$WORK/steps.jsonl" # one JSON object per finished step, merged into the report
: >"$STEPS"
: >"$OUTDIR/verify.log"
START=$(date +%s)
FAILED=0

if [ "$REHEARSE" = 1 ]; then DEVICE=cpu; else DEVICE=cuda; fi

# --- the binary --------------------------------------------------------------------------------
if [ -z "$BIN" ]; then
  if [ "$REHEARSE" = 1 ] && [ -x target/release/rltune ]; then
    BIN=target/release/rltune
  elif [ -f "$PACK/rltune.xz" ]; then
    BIN="$WORK/rltune"
    xz -dc "$PACK/rltune.xz" >"$BIN" && chmod +x "$BIN" || { echo "verify.sh: cannot unpack $PACK/rltune.xz" >&2; exit 2; }
  elif [ -x "$PACK/rltune" ]; then
    BIN="$PACK/rltune"
  else
    echo "verify.sh: no binary: run tools/cuda/pack.sh first (or pass --bin PATH)" >&2
    exit 2
  fi
fi
BIN="$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")"
[ -x "$BIN" ] || { echo "verify.sh: $BIN is not executable" >&2; exit 2; }

# --- CUDA's libraries: the pip packages of the machine's PyTorch (cuBLAS, cuRAND, NVRTC) --------
if [ "$REHEARSE" = 0 ]; then
  # shellcheck source=tools/cuda/cuda_libs.sh
  . "$ROOT/tools/cuda/cuda_libs.sh"
fi

# --- the report ----------------------------------------------------------------------------------
COMMIT="$(cat "$PACK/COMMIT" 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if [ "$REHEARSE" = 1 ]; then
  GPU="cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//') (rehearsal)"
  DRIVER="none"
else
  GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
  DRIVER="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)"
fi

report() { # merges the steps so far into OUT/gpu-report.json (atomically)
  python3 - "$STEPS" "$OUTDIR/gpu-report.json" "$GPU" "$DRIVER" "$COMMIT" "$REHEARSE" <<'EOF'
import json, os, sys, datetime
steps, out, gpu, driver, commit, rehearse = sys.argv[1:]
rep = {"device": gpu, "driver": driver, "commit": commit, "rehearsal": rehearse == "1",
       "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
       "checks": {}, "bench": {}, "profile": {}, "skipped": {}}
for line in open(steps):
    line = line.strip()
    if line:
        s = json.loads(line)
        rep[s.pop("section")][s.pop("name")] = s
rep["pass"] = all(c.get("pass") for c in rep["checks"].values())
tmp = out + ".tmp"
with open(tmp, "w") as f:
    json.dump(rep, f, indent=1, sort_keys=True)
os.replace(tmp, out)
EOF
}

record() { # record SECTION NAME JSON-OBJECT
  python3 -c 'import json,sys; d=json.loads(sys.argv[3]); d["section"]=sys.argv[1]; d["name"]=sys.argv[2]; print(json.dumps(d))' "$1" "$2" "$3" >>"$STEPS"
  report
}

skip() { # skip NAME WHY
  echo "== $1: skipped: $2" | tee -a "$OUTDIR/verify.log"
  record skipped "$1" "$(python3 -c 'import json,sys; print(json.dumps({"why": sys.argv[1]}))' "$2")"
}

# run NAME LIMIT CMD...: runs CMD under a time limit within the budget; its log is LOGS/NAME.log.
# Sets RC (124 on a time-out) and SECS. Returns 1 (and records a skip) when the budget is spent.
run() {
  local name="$1" limit="$2"; shift 2
  wanted "$name" || return 1
  local left=$((BUDGET - ($(date +%s) - START)))
  if [ "$left" -lt 20 ]; then skip "$name" "the budget of ${BUDGET} s was spent"; return 1; fi
  [ "$limit" -gt "$left" ] && limit="$left"
  echo "== $name (at most ${limit} s): $*" | tee -a "$OUTDIR/verify.log"
  local t0; t0=$(date +%s.%N)
  timeout --kill-after=5 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  RC=$?
  SECS=$(python3 -c "import sys; print(round($(date +%s.%N) - $t0, 2))")
  tail -n 30 "$LOGS/$name.log" >>"$OUTDIR/verify.log"
  echo "== $name: exit $RC after ${SECS} s" | tee -a "$OUTDIR/verify.log"
  return 0
}

# wanted NAME: whether --only (if given) names a prefix of NAME.
wanted() {
  [ -z "$ONLY" ] && return 0
  local p
  for p in ${ONLY//,/ }; do
    case "$1" in "$p"*) return 0 ;; esac
  done
  return 1
}

# gpu_mem_start / gpu_mem_stop: the largest memory.used (MiB) nvidia-smi saw in between, or
# null (no nvidia-smi: a rehearsal).
gpu_mem_start() {
  MEMLOG="$WORK/gpu-mem.log"
  : >"$MEMLOG"
  if command -v nvidia-smi >/dev/null 2>&1 && [ "$REHEARSE" = 0 ]; then
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 >"$MEMLOG" 2>/dev/null &
    MEMPID=$!
  else
    MEMPID=""
  fi
}
gpu_mem_stop() {
  [ -n "${MEMPID:-}" ] && kill "$MEMPID" 2>/dev/null && wait "$MEMPID" 2>/dev/null
  MEMPID=""
  sort -n "$MEMLOG" 2>/dev/null | tail -1 | grep -E '^[0-9]+$' || echo null
}

# side_by_side OURS THEIRS OURS_PEAK THEIRS_PEAK TIME_KEY MFU_TIME_KEY: one benchmark's report
# entry from both sides' JSON lines. Peak GPU memory: the device's memory in use, sampled every
# 100 ms by nvidia-smi while each side ran (the same measure for both; CUDA context included).
# MFU: 6 * parameters * trained tokens (PPO: batch x (query + response) x 4 epochs; GRPO: the
# step's tokens) over the seconds under MFU_TIME_KEY (PPO: its optimize phase; GRPO: the whole
# step), against the GPU's dense bf16 peak (H100 and H200 SXM: 989.4 TFLOP/s); attention's T^2
# term is left out.
side_by_side() {
  python3 - "$@" "$GPU" <<'EOF'
import json, sys
o, t, op, tp = (json.loads(x) for x in sys.argv[1:5])
time_key, mfu_key, gpu = sys.argv[5:8]
r = {"rltune_s": o.get(time_key), "trl_s": t.get(time_key),
     "rltune_peak_mib": op, "trl_peak_mib": tp,
     "tokens_per_s": o.get("tokens_per_s"), "trl_tokens_per_s": t.get("tokens_per_s"),
     "rltune": o, "trl": t}
peak = 989.4e12 if ("H100" in gpu or "H200" in gpu) else None
def mfu(d):
    n, tok, s = d.get("n_params"), d.get("train_tokens"), d.get(mfu_key)
    return round(6 * n * tok / s / peak, 4) if peak and n and tok and s else None
r["mfu"], r["trl_mfu"] = mfu(o), mfu(t)
r["ratio"] = round(r["rltune_s"] / r["trl_s"], 3) if r["rltune_s"] and r["trl_s"] else None
print(json.dumps(r))
EOF
}

check() { # check NAME JSON: records a check; a failed one fails the run
  record checks "$1" "$2"
  if ! python3 -c 'import json,sys; sys.exit(0 if json.loads(sys.argv[1]).get("pass") else 1)' "$2"; then FAILED=1; fi
}

echo "verify.sh: $GPU, driver $DRIVER, commit $COMMIT, binary $BIN, budget ${BUDGET} s" | tee -a "$OUTDIR/verify.log"
report
cd "$WORK" || exit 2
FIX="$ROOT/tools/fixtures"

# 1. Models, sampler, PPO, GRPO, RLOO, DPO against their golden fixtures (rltune selftest).
if run selftest 150 "$BIN" selftest --device "$DEVICE" --fixtures "$FIX" --json "$WORK/selftest.jsonl"; then
  if [ -s "$WORK/selftest.jsonl" ]; then
    python3 - "$WORK/selftest.jsonl" >>"$STEPS" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    if line.strip():
        d = json.loads(line)
        d["section"] = "checks"
        print(json.dumps(d))
EOF
    report
    [ "$RC" = 0 ] || FAILED=1
  else
    check selftest "{\"pass\": false, \"exit\": $RC, \"seconds\": $SECS, \"error\": \"no results; see the selftest log\"}"
  fi
fi

# 2. The quickstart's tiny preset end to end (every stage on the device).
QS_TINY="$WORK/qs-tiny"
if run quickstart-tiny 120 "$BIN" quickstart --preset tiny --device "$DEVICE" --output "$QS_TINY"; then
  check quickstart-tiny "{\"pass\": $([ $RC = 0 ] && echo true || echo false), \"exit\": $RC, \"seconds\": $SECS}"
fi

# 3. Resume: 2 steps then --resume to 4 against a straight 4-step run of the tiny quickstart's
#    PPO config: checkpoints byte for byte, metrics but wall-clock times equal.
resume_run() { # resume_run DIR STEPS [--resume]
  local dir="$1" steps="$2"; shift 2
  "$BIN" ppo --config "$QS_TINY/ppo.toml" --device "$DEVICE" --set "logging.dir=\"$dir\"" --set "ppo.steps=$steps" \
    --set checkpoint.every=2 --set checkpoint.optimizer_state=true "$@"
}
export BIN DEVICE QS_TINY WORK LOGS
# same_run A B STEP: the files of A/checkpoints/step-STEP byte for byte those of B, and the
# metrics equal but wall-clock times; prints a JSON line, fails when they differ.
same_run() {
  python3 - "$1" "$2" "$3" <<'EOF'
import json, os, sys
a, b, step = sys.argv[1:]
ck = f"checkpoints/step-{step}"
files = sorted(os.listdir(os.path.join(a, ck)))
diff = [f for f in files if open(os.path.join(a, ck, f), "rb").read() != open(os.path.join(b, ck, f), "rb").read()]
def metrics(d):
    rows = [json.loads(l) for l in open(os.path.join(d, "metrics.jsonl")) if l.strip()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]
same = metrics(a) == metrics(b)
print(json.dumps({"files": files, "differing": diff, "metrics_equal": same}))
sys.exit(0 if not diff and same else 1)
EOF
}
resume_check() {
  resume_run "$WORK/straight" 4 && resume_run "$WORK/resumed" 2 && resume_run "$WORK/resumed" 4 --resume || return 1
  same_run "$WORK/straight" "$WORK/resumed" 4
}
if [ -f "$QS_TINY/ppo.toml" ]; then
  export -f resume_run resume_check same_run
  if run resume 120 bash -c resume_check; then
    check resume "{\"pass\": $([ $RC = 0 ] && echo true || echo false), \"exit\": $RC, \"seconds\": $SECS, \"detail\": $(tail -n1 "$LOGS/resume.log" | python3 -c 'import json,sys; l=sys.stdin.read().strip(); print(l if l.startswith("{") else json.dumps(l))')}"
  fi
elif wanted resume; then
  skip resume "the tiny quickstart wrote no ppo.toml"
fi

# 3b. NCCL on one GPU (issue #40): the tiny arithmetic quickstart's GRPO stage, plain and with
#     every collective through NCCL (RLTUNE_DIST=nccl: the gradients' all-reduce, the gathers);
#     on one rank NCCL's sum is the identity, so the checkpoints must be byte for byte the plain
#     run's. Needs a binary built with NCCL (tools/cuda/pack.sh --nccl).
nccl_run() { # nccl_run DIR [DIST]: a reward that varies within each group, so every step has gradients
  RLTUNE_DIST="${2:-}" "$BIN" ppo --config "$WORK/qa/grpo.toml" --device "$DEVICE" \
    --set "logging.dir=\"$1\"" --set grpo.max_steps=3 --set generation.temperature=2.0 --set grpo.temperature=2.0 \
    --set "reward.sources=[{kind=\"command\",command=[\"python3\",\"$WORK/reward.py\"]}]"
}
nccl_check() {
  printf '%s\n' 'import json, sys' 'for line in sys.stdin:' '    r = json.loads(line)["response"]' \
    '    print(sum(c.isdigit() for c in r) - 0.5 * len(r), flush=True)' >"$WORK/reward.py"
  "$BIN" quickstart --task arithmetic --preset tiny --device "$DEVICE" --output "$WORK/qa" >/dev/null \
    && nccl_run "$WORK/nccl-plain" || return 1
  nccl_run "$WORK/nccl-1" "${NCCL_DIST:-nccl}" >"$WORK/nccl-1.log" 2>&1 || { cat "$WORK/nccl-1.log"; return 1; }
  grep -q "one process through the collectives" "$WORK/nccl-1.log" || { echo "the run did not go through the collectives"; return 1; }
  same_run "$WORK/nccl-plain" "$WORK/nccl-1" 3
}
if ! wanted nccl-1rank; then
  :
elif grep -q nccl "$PACK/FEATURES" 2>/dev/null && [ "$REHEARSE" = 0 ]; then
  export -f nccl_run nccl_check same_run
  if run nccl-1rank 120 bash -c nccl_check; then
    check nccl-1rank "{\"pass\": $([ $RC = 0 ] && echo true || echo false), \"exit\": $RC, \"seconds\": $SECS, \"detail\": $(tail -n1 "$LOGS/nccl-1rank.log" | python3 -c 'import json,sys; l=sys.stdin.read().strip(); print(l if l.startswith("{") else json.dumps(l))')}"
  fi
else
  skip "nccl 1-rank" "the binary was built without NCCL (tools/cuda/pack.sh --nccl; issue #40)"
fi

if [ "$QUICK" = 0 ]; then
  # 4. bf16 on the device: the tiny quickstart's stages with bf16 compute.
  if run quickstart-tiny-bf16 90 "$BIN" quickstart --preset tiny --device "$DEVICE" --dtype bf16 --output "$WORK/qs-bf16"; then
    check quickstart-tiny-bf16 "{\"pass\": $([ $RC = 0 ] && echo true || echo false), \"exit\": $RC, \"seconds\": $SECS, \"error\": $(grep -m1 '^error' "$LOGS/quickstart-tiny-bf16.log" | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read().strip()))')}"
  fi

  # 5. Benchmarks, rltune and TRL on the same device in the same run.
  # trl_site NAME: WORK/site-NAME, with the wheels of PACK/wheels/NAME installed (once).
  trl_site() {
    local site="$WORK/site-$1"
    if [ -d "$PACK/wheels/$1" ] && [ ! -d "$site" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$PACK/wheels/$1"/*.whl >>"$LOGS/wheels.log" 2>&1 || true
    fi
    echo "$site"
  }
  # result_line LOG: a benchmark's JSON result, its last line that opens a JSON object (`{"`), or
  # {}. (The Trainer's own log lines are Python dicts, `{'loss': ...`, in the same log.)
  result_line() {
    grep '^{"' "$1" 2>/dev/null | tail -n1 | grep . || echo '{}'
  }
  # bench_pair NAME LIMIT SITE TRL_VERSION TIME_KEY MFU_TIME_KEY: runs "${OURS_CMD[@]}" and, when
  # TRL TRL_VERSION imports from SITE, python3 "${THEIRS_CMD[@]}" with it, each under LIMIT with
  # its peak GPU memory sampled, and records the pair (side_by_side). Returns 1 when rltune's run
  # did not start (the budget is spent or NAME is not wanted).
  bench_pair() {
    local name="$1" limit="$2" site="$3" version="$4" ours theirs='{}' ours_peak theirs_peak=null
    gpu_mem_start
    if ! run "bench-$name-rltune" "$limit" "${OURS_CMD[@]}"; then
      gpu_mem_stop >/dev/null
      return 1
    fi
    ours="$(result_line "$LOGS/bench-$name-rltune.log")"
    ours_peak="$(gpu_mem_stop)"
    if PYTHONPATH="$site" python3 -c "import trl; assert trl.__version__ == '$version'" >/dev/null 2>&1; then
      gpu_mem_start
      if run "bench-$name-trl" "$limit" env PYTHONPATH="$site" python3 "${THEIRS_CMD[@]}"; then
        theirs="$(result_line "$LOGS/bench-$name-trl.log")"
      fi
      theirs_peak="$(gpu_mem_stop)"
    else
      skip "bench-$name-trl" "trl $version is not importable (tools/cuda/pack.sh ships it as wheels)"
    fi
    record bench "$name" "$(side_by_side "$ours" "$theirs" "$ours_peak" "$theirs_peak" "$5" "$6")"
  }
  # PRESET:DTYPE ITERATIONS LIMIT [MINI-BATCH]: the 0.5B preset times one iteration after its
  # warm-up; where rltune runs out of memory at the preset's mini-batch (8), both sides run
  # again at 2 (named ...-mb2).
  OOM=0
  bench_ppo() { # bench_ppo SPEC...: each "PRESET:DTYPE ITERATIONS LIMIT [MINI-BATCH]"
    local spec
    for spec in "$@"; do
      read -r pd iters limit mb <<<"$spec"
      preset="${pd%%:*}" dtype="${pd##*:}"
      name="ppo-$preset$([ "$dtype" = bf16 ] && echo -bf16)${mb:+-mb$mb}"
      wanted "bench-$name" || wanted "bench-${name%-mb*}" || continue
      [ -n "$mb" ] && [ "$OOM" = 0 ] && continue
      OURS_CMD=("$BIN" bench ppo --preset "$preset" --device "$DEVICE" --dtype "$dtype" --iters "$iters" ${mb:+--mini-batch $mb} --json)
      THEIRS_CMD=("$ROOT/bench/trl_ppo.py" --preset "$preset" --device "$DEVICE" --iters "$iters" $([ "$dtype" = bf16 ] && echo --bf16) ${mb:+--mini-batch $mb} --json)
      bench_pair "$name" "$limit" "$(trl_site trl011)" 0.11.4 median_total_s median_optimize_step_s || continue
      grep -qs "out of memory\|OUT_OF_MEMORY" "$LOGS/bench-$name-rltune.log" && OOM=1
    done
  }
  # profile BENCH PRESET DTYPE ITERATIONS LIMIT: rltune's `bench ppo` or `bench grpo` again
  # under the kernel tracer (tools/cuda/kernel_trace.c, LD_PRELOAD): the whole process's GPU time
  # by kernel and by launch size, how busy the GPU was, the copies. The trace goes to
  # OUT/profile-*.json, its summary to the report.
  profile() {
    local bench="$1"; shift
    local name="profile-$bench-$1-$2"
    wanted "$name" || return 0
    if [ ! -f "$PACK/kernel_trace.so" ] || [ "$REHEARSE" = 1 ]; then
      skip "$name" "no kernel tracer on this device (tools/cuda/pack.sh builds $PACK/kernel_trace.so)"
      return 0
    fi
    if run "$name" "$4" env LD_PRELOAD="$PACK/kernel_trace.so" RLTUNE_KERNEL_TRACE="$OUTDIR/$name.json" \
      "$BIN" bench "$bench" --preset "$1" --device "$DEVICE" --dtype "$2" --iters "$3" --json; then
      record profile "$name" "$(python3 - "$OUTDIR/$name.json" "$LOGS/$name.log" "$RC" <<'EOF'
import json, sys
path, log, rc = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    t = json.load(open(path))
except (OSError, ValueError) as e:
    t = {"error": f"no trace: {e}"}
bench = next((json.loads(l) for l in open(log) if l.startswith("{")), {})
t["kernels"] = t.get("kernels", [])[:20]
t["exit"] = rc
t["bench"] = {k: bench.get(k) for k in ("median_total_s", "median_generation_s", "median_forward_pass_s", "median_optimize_step_s", "median_step_s")}
print(json.dumps(t))
EOF
)"
    fi
  }
  bench_ppo "small:f32 3 90" "gpt2:f32 3 90" "gpt2:bf16 3 90"
  # 5b. The host settings alone (issue #53, step 1): the gpt2 bf16 iteration again with each
  #     of `--cuda-host events` (cudarc's per-allocation events back on), `trim` (the memory
  #     pool trimmed at every synchronization) and `candle` (both: candle's defaults), against
  #     the default `tuned` of bench-ppo-gpt2-bf16 above. rltune only; TRL's side is unchanged.
  for host in candle events trim; do
    name="host-ppo-gpt2-bf16-$host"
    gpu_mem_start
    if run "$name" 90 "$BIN" bench ppo --preset gpt2 --device "$DEVICE" --dtype bf16 --iters 3 --cuda-host "$host" --json; then
      peak="$(gpu_mem_stop)"
      record bench "$name" "$(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); print(json.dumps({"rltune_s": d.get("median_total_s"), "optimize_s": d.get("median_optimize_step_s"), "rltune_peak_mib": json.loads(sys.argv[2]), "cuda_host": sys.argv[3], "exit": int(sys.argv[4]), "rltune": d}))' "$(result_line "$LOGS/$name.log")" "$peak" "$host" "$RC")"
    else
      gpu_mem_stop >/dev/null
    fi
  done
  profile ppo gpt2 bf16 3 90

  # 6. The 0.5B preset (before the full quickstarts: the speed goals are measured here, and a
  #    spent budget then costs the quickstarts, which passed on the H100 before).
  bench_ppo "qwen2-0.5b:bf16 1 180" "qwen2-0.5b:bf16 1 150 2"
  # 7. One GRPO step on the 0.5B shape (16 completions of 128 + 128 tokens) beside TRL 1.16.0
  #    (wheels/trl116 on the machine's own transformers), both in bf16.
  #    With `ckpt`, both sides with gradient checkpointing (TRL 1.16.0's default).
  bench_grpo() { # bench_grpo PRESET DTYPE ITERATIONS LIMIT [ckpt]
    local name="grpo-$1$([ "$2" = bf16 ] && echo -bf16)${5:+-$5}" ckpt=()
    wanted "bench-$name" || return 0
    [ "${5:-}" = ckpt ] && ckpt=(--gradient-checkpointing)
    OURS_CMD=("$BIN" bench grpo --preset "$1" --device "$DEVICE" --dtype "$2" --iters "$3" "${ckpt[@]}" --json)
    THEIRS_CMD=("$ROOT/bench/trl_grpo.py" --preset "$1" --device "$DEVICE" --iters "$3" $([ "$2" = bf16 ] && echo --bf16) "${ckpt[@]}" --json)
    bench_pair "$name" "$4" "$(trl_site trl116)" 1.16.0 median_step_s median_step_s || true
  }
  bench_grpo qwen2-0.5b bf16 2 150
  # 7a. bf16 activations alone (issue #53): the same GRPO step with `--activations f32` (each
  #     product's result cast back to f32 and again to bf16 by the next product, as before
  #     2026-12-01), against the default (bf16 through Llama's MLP) of bench-grpo-qwen2-0.5b-bf16
  #     above. rltune only: time and peak memory (rltune_only, below, for both A/Bs).
  # 7b. Attention's products in bf16 on the tensor cores (`--attention bf16`, not yet the
  #     default), against rltune's fused f32 attention kernels of the same default step.
  rltune_only() { # rltune_only NAME LIMIT FLAG VALUE BENCH ITERS TIME_KEY: the 0.5B preset in bf16 with one runtime flag
    local name="$1"
    gpu_mem_start
    if run "bench-$name-rltune" "$2" "$BIN" bench "$5" --preset qwen2-0.5b --device "$DEVICE" --dtype bf16 --iters "$6" "--$3" "$4" --json; then
      peak="$(gpu_mem_stop)"
      record bench "$name" "$(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); print(json.dumps({"rltune_s": d.get(sys.argv[6]), "optimize_s": d.get("median_optimize_step_s"), "rltune_peak_mib": json.loads(sys.argv[2]), sys.argv[4]: sys.argv[5], "exit": int(sys.argv[3]), "rltune": d}))' "$(result_line "$LOGS/bench-$name-rltune.log")" "$peak" "$RC" "$3" "$4" "$7")"
    else
      gpu_mem_stop >/dev/null
    fi
  }
  rltune_only grpo-qwen2-0.5b-bf16-act-f32 150 activations f32 grpo 2 median_step_s
  rltune_only grpo-qwen2-0.5b-bf16-att-bf16 150 attention bf16 grpo 2 median_step_s
  #     And the 0.5B PPO iteration with bf16 attention, against bench-ppo-qwen2-0.5b-bf16 (step 6).
  rltune_only ppo-qwen2-0.5b-bf16-att-bf16 180 attention bf16 ppo 1 median_total_s
  bench_grpo qwen2-0.5b bf16 2 150 ckpt
  # 7c. The same GRPO step (the 0.5B preset's geometry, 16 × (128 + 128)) on SmolLM2-135M-Instruct's
  #     own weights (issue #55), where its GGUF is here: staged in parts by tools/cuda/rlhf.sh
  #     (`stage` four times, then `join`). `rltune convert` writes the Hugging Face directory that
  #     both sides load.
  bench_grpo_smollm2() {
    local name=grpo-smollm2-135m-bf16 gguf="$ROOT/target/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    wanted "bench-$name" || return 0
    if [ ! -f "$gguf" ]; then
      skip "bench-$name" "no SmolLM2 GGUF in target/models (tools/cuda/rlhf.sh: stage the four parts, then join)"
      return 0
    fi
    if ! "$BIN" convert "$gguf" --output "$WORK/smollm2-hf" >"$LOGS/convert-smollm2.log" 2>&1; then
      skip "bench-$name" "rltune convert failed (logs/convert-smollm2.log)"
      return 0
    fi
    OURS_CMD=("$BIN" bench grpo --preset qwen2-0.5b --model "$WORK/smollm2-hf" --device "$DEVICE" --dtype bf16 --iters 2 --json)
    THEIRS_CMD=("$ROOT/bench/trl_grpo.py" --preset qwen2-0.5b --model "$WORK/smollm2-hf" --device "$DEVICE" --iters 2 --bf16 --json)
    bench_pair "$name" 120 "$(trl_site trl116)" 1.16.0 median_step_s median_step_s || true
  }
  bench_grpo_smollm2
  # 8. The quickstart's default preset with its acceptance checks.
  #    Then the same with bf16 matrix products: learning must pass the same acceptance checks.
  for dtype in f32 bf16; do
    name="quickstart$([ "$dtype" = bf16 ] && echo -bf16)"
    if run "$name" 240 "$BIN" quickstart --device "$DEVICE" --dtype "$dtype" --output "$WORK/$name"; then
      check "$name" "{\"pass\": $([ $RC = 0 ] && echo true || echo false), \"exit\": $RC, \"seconds\": $SECS, \"acceptance\": $(grep -E '^(PASS|FAIL)' "$LOGS/$name.log" | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read().splitlines()))')}"
    fi
  done
  # 9. The 0.5B iteration and the 0.5B GRPO step under the kernel tracer, last: the largest
  #    single steps.
  profile ppo qwen2-0.5b bf16 1 150
  profile grpo qwen2-0.5b bf16 2 120

fi



tar -C "$WORK" -czf "$OUTDIR/logs.tar.gz" logs 2>/dev/null
report
cd "$ROOT" && rm -rf "$WORK"
echo "verify.sh: report in $OUTDIR/gpu-report.json ($(($(date +%s) - START)) s)"
python3 - "$OUTDIR/gpu-report.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"\n{r['device']} (driver {r['driver']}, commit {r['commit']})")
for n, c in sorted(r["checks"].items()):
    d = c.get("max_abs_diff")
    print(f"  {'PASS' if c.get('pass') else 'FAIL'}  {n:28s}" + (f" max diff {d:.2e} (tol {c.get('tolerance'):.0e})" if isinstance(d, float) else ""))
for n, b in sorted(r["bench"].items()):
    print(f"  bench {n:22s} rltune {b.get('rltune_s')} s, TRL {b.get('trl_s')} s, ratio {b.get('ratio')}")
for n, p in sorted(r.get("profile", {}).items()):
    top = ", ".join(f"{k['name'][:40]} {k['share']:.0%}" for k in p.get("kernels", [])[:3])
    print(f"  profile {n:20s} GPU busy {p.get('busy')}, {p.get('kernel_launches')} kernels; top: {top}")
for n, s in sorted(r["skipped"].items()):
    print(f"  skip  {n:28s} {s['why']}")
n_pass = sum(1 for c in r["checks"].values() if c.get("pass"))
print(f"{n_pass} passed, {len(r['checks']) - n_pass} failed, {len(r['skipped'])} skipped")
EOF
exit $FAILED
