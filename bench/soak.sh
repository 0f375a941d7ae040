#!/usr/bin/env bash
# Soak benchmark (issue #28): 1,000 PPO steps of the tiny quickstart models with a checkpoint
# (optimizer state included) every 10 steps, the process's resident set sampled as the steps go.
#
#   bench/soak.sh [STEPS] [OUT_DIR]        # defaults: 1000, target/soak
#
# RLTUNE_BIN=path/to/rltune uses that binary instead of building target/release/rltune.
# Prints one line per 10 steps, "step N rss_kib R", from /proc/PID/status (VmRSS) at the moment
# metrics.jsonl reaches N lines, and at the end the RSS at steps 100 and STEPS and their ratio.
# The numbers go to BENCHMARKS.md ("Soak"). Needs Linux (/proc) and a release build.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-1000}
out=${2:-target/soak}
bin=${RLTUNE_BIN:-target/release/rltune}
[ -n "${RLTUNE_BIN:-}" ] || cargo build --release -p rltune-cli
rm -rf "$out"
mkdir -p "$out"
"$bin" quickstart --preset tiny --output "$out/qs" >/dev/null 2>&1
"$bin" ppo --config "$out/qs/ppo.toml" \
  --set "logging.dir=\"$out/run\"" --set "ppo.steps=$steps" \
  --set checkpoint.every=10 --set checkpoint.optimizer_state=true \
  >/dev/null 2>"$out/stderr" &
pid=$!
next=10
: >"$out/rss.tsv"
while kill -0 "$pid" 2>/dev/null; do
  n=$( (wc -l <"$out/run/metrics.jsonl") 2>/dev/null || echo 0)
  if [ "$n" -ge "$next" ]; then
    rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo "")
    [ -n "$rss" ] && printf 'step %d rss_kib %d\n' "$n" "$rss" | tee -a "$out/rss.tsv"
    next=$(( (n / 10 + 1) * 10 ))
  fi
  sleep 0.002
done
wait "$pid"
awk -v last="$steps" '
  $2 >= 100 && !a { a = $4; sa = $2 }
  { b = $4; sb = $2 }
  END { printf "rss at step %d: %d KiB; at step %d: %d KiB; ratio %.3f\n", sa, a, sb, b, b / a }
' "$out/rss.tsv"
