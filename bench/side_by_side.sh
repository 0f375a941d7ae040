#!/usr/bin/env bash
# rltune and TRL on the same PPO workload, interleaved (rltune then TRL, per preset and round),
# each run's JSON line tagged with the share of the VM's CPU time it spent in user mode, idle
# and stolen by the host (from /proc/stat; a run with much stolen is not comparable). At the end,
# per preset: each round's ratio rltune / TRL of the median iteration time, the median of those
# ratios (the host's speed drifts between rounds; a ratio is read within its pair), and each
# side's spread across the rounds (max / min − 1: how quiet the stretch was).
#
#   bench/side_by_side.sh [ROUNDS] [PRESET...]      # defaults: 1 round, small gpt2
#
# Needs the release CLI (cargo build --release -p rltune-cli) and the TRL venv at .venv
# (bench/README.md). Extra rltune flags go in RLTUNE_FLAGS, extra TRL flags in TRL_FLAGS.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-1}
shift || true
if [ $# -gt 0 ]; then presets=("$@"); else presets=(small gpt2); fi
echo "# $(nproc) CPUs, $(lscpu | grep 'Model name' | sed 's/Model name: *//'), $(date -u +%Y-%m-%dT%H:%MZ), rltune $(git rev-parse --short HEAD)"

# Prints "user U% idle I% steal S%" for the interval between two /proc/stat cpu lines.
shares() {
  python3 - "$1" "$2" <<'PY'
import sys
a, b = ([int(x) for x in s.split()[1:]] for s in sys.argv[1:3])
d = [y - x for x, y in zip(a, b)]
tot = sum(d) or 1
print(f"user {100*d[0]/tot:.0f}% idle {100*d[3]/tot:.0f}% steal {100*d[7]/tot:.0f}%")
PY
}

log=$(mktemp)
trap 'rm -f "$log"' EXIT

run() {
  local before after out
  before=$(head -1 /proc/stat)
  out=$("$@" 2>/dev/null | tail -1)
  after=$(head -1 /proc/stat)
  echo "$out [$(shares "$before" "$after")]" | tee -a "$log"
}

for preset in "${presets[@]}"; do
  for r in $(seq "$rounds"); do
    # shellcheck disable=SC2086
    run target/release/rltune bench ppo --preset "$preset" --iters 3 --json ${RLTUNE_FLAGS:-}
    # shellcheck disable=SC2086
    HF_HUB_OFFLINE=1 run .venv/bin/python bench/trl_ppo.py --preset "$preset" --iters 3 --json ${TRL_FLAGS:-}
  done
done

# One line per preset: the rounds' ratios and their median.
python3 - "$log" <<'PY'
import json, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    try:
        r = json.loads(line[: line.rindex("}") + 1])
    except ValueError:
        continue
    runs.setdefault(r["preset"], {}).setdefault(r["impl"], []).append(r["median_total_s"])
for preset, by in runs.items():
    pairs = list(zip(by.get("rltune", []), by.get("trl", [])))
    if not pairs:
        print(f"# {preset}: no complete pair (a run failed; see its line above)")
        continue
    ratios = [a / b for a, b in pairs]
    shown = ", ".join(f"{a:.2f}/{b:.2f}={q:.3f}" for (a, b), q in zip(pairs, ratios))
    print(f"# {preset}: rltune/TRL per round {shown}; median ratio {statistics.median(ratios):.3f}")
    # How steady each side was across the rounds: a ratio near the goal is only decided in a
    # stretch where both sides repeat to a few percent.
    for side, xs in (("rltune", [a for a, _ in pairs]), ("TRL", [b for _, b in pairs])):
        print(f"#   {side}: min {min(xs):.2f} median {statistics.median(xs):.2f} max {max(xs):.2f} s "
              f"(spread {100 * (max(xs) / min(xs) - 1):.0f}%)")
PY
