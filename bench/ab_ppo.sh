#!/usr/bin/env bash
# Two builds of rltune on one PPO benchmark, interleaved: `rltune bench ppo ARGS --json` with
# binary A, then B, ROUNDS times. Prints one TSV row per run (round, build, total, generation,
# forward, optimize seconds, peak RSS MiB) and each build's median per column. For an A/B of
# one change: build, copy the binary, make the change, build again.
#
#   bench/ab_ppo.sh BIN_A BIN_B ROUNDS [bench ppo arguments, e.g. --preset gpt2 --composed]
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: bench/ab_ppo.sh BIN_A BIN_B ROUNDS [bench ppo arguments]" >&2; exit 2; }
a=$1 b=$2 rounds=$3
shift 3
out=$(mktemp)
trap 'rm -f "$out"' EXIT
printf 'round\tbuild\ttotal_s\tgeneration_s\tforward_s\toptimize_s\tpeak_rss_mib\n'
for round in $(seq "$rounds"); do
  for build in A B; do
    bin=$a
    [ "$build" = B ] && bin=$b
    "$bin" bench ppo "$@" --json 2>/dev/null | tail -1 | python3 -c '
import json, sys
r = json.loads(sys.stdin.read())
keys = ["median_total_s", "median_generation_s", "median_forward_pass_s", "median_optimize_step_s"]
print("\t".join([sys.argv[1], sys.argv[2]] + ["%.3f" % r[k] for k in keys] + [str(round(r["peak_rss_mib"]))]))
' "$round" "$build" | tee -a "$out"
  done
done
python3 - "$out" <<'PY'
import statistics, sys
rows = [l.split("\t") for l in open(sys.argv[1]) if l.strip()]
for build in "AB":
    cols = list(zip(*[r[2:] for r in rows if r[1] == build]))
    print("median " + build + "\t\t" + "\t".join("%.3f" % statistics.median(map(float, c)) for c in cols))
PY
