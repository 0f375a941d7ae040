#!/usr/bin/env bash
# Trajectory GRPO against GiGPO (step-level credit) on an agent quickstart's family, from one
# BC policy, over several RL seeds (PPO too where ALGORITHMS names it). Learning, not speed:
# each run is the quickstart itself (`rltune quickstart --task adventure`, or `--task
# textworld` with TASK=textworld), so its summary holds the random agent, BC and the RL policy
# on the same held-out (test) games with the paired difference, and BC and the RL policy on the
# validation games.
#
#   bench/adventure_credit.sh OUT [SEED...]      (default seeds: 42 1 2 3; 42 is grpo.seed's default)
#   ALGORITHMS="ppo gigpo grpo" bench/adventure_credit.sh OUT 4 5 6    (PPO too: --set ppo.seed=<SEED>)
#   TASK=textworld bench/adventure_credit.sh OUT 1 2 3   (the games: tools/textworld/make_game_set.sh coin 64 64)
#   QUICKSTART_ARGS="--preset tiny" bench/adventure_credit.sh OUT 1 2   (seconds: a smoke test of the script)
#
# Each OUT/s<SEED> runs the quickstart once per algorithm of ALGORITHMS (default `gigpo grpo`),
# `--algorithm ALG --set grpo.seed=<SEED>` (`ppo.seed` for ppo), each RL stage in its own
# folder. The first seed's first run builds the demonstrations, the tokenizer and the BC policy
# (they do not depend on the RL seed or algorithm); every other seed starts from a copy of them
# (from OUT/base where an earlier version of this script left a PPO base run there), so only the
# RL stage and the evaluation run there. Prints one line per finished run; OUT/results.tsv
# collects them. On a quiet 2-core host: adventure, about 15 minutes per RL run; TextWorld, about
# 17 per GiGPO or GRPO run and 5 for the shared stages (BC 239 s); each run's evaluation included.
set -euo pipefail
out=${1:?usage: bench/adventure_credit.sh OUT [SEED...]}
shift
seeds=(42 1 2 3)
[ $# -eq 0 ] || seeds=("$@")
task=${TASK:-adventure}
bin=${RLTUNE_BIN:-target/release/rltune}
[ -x "$bin" ] || { echo "build first: cargo build --release -p rltune-cli (or set RLTUNE_BIN)" >&2; exit 1; }
mkdir -p "$out"

row() { # summary file, label
  python3 - "$1" "$2" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
def cols(bc, rl, d):
    return [f"{100*bc['win_rate']:.1f}", f"{100*rl['win_rate']:.1f}", f"{100*d['delta']:+.1f}",
            f"{100*d['se']:.1f}", f"{d['delta']/d['se'] if d['se'] else 0:.2f}"]
row = [sys.argv[2]] + cols(s["bc"], s["ppo"], s["ppo_vs_bc"])
v = s.get("validation")
row += cols(v["bc"], v["rl"], v["rl_vs_bc"]) if v else ["-"] * 5
row.append(next((f"{t:.0f}" for name, t in s["stage_seconds"] if name in ("ppo", "grpo", "gigpo", "rloo")), "-"))
print("\t".join(row))
EOF
}

[ -f "$out/results.tsv" ] || printf 'run\tBC test win %%\tRL test win %%\ttest delta\ttest paired SE\ttest delta/SE\tBC validation win %%\tRL validation win %%\tvalidation delta\tvalidation paired SE\tvalidation delta/SE\tRL s\n' > "$out/results.tsv"
# The shared stages' source: an old OUT/base, else the first seed's folder once its first run
# has built them.
src="$out/base"
[ -f "$src/bc/model.safetensors" ] || src="$out/s${seeds[0]}"
for seed in "${seeds[@]}"; do
  dir="$out/s$seed"
  mkdir -p "$dir"
  if [ "$dir" != "$src" ]; then
    for stage in data tokenizer bc quickstart.json; do
      [ -e "$dir/$stage" ] || [ ! -e "$src/$stage" ] || cp -r "$src/$stage" "$dir/$stage"
    done
  fi
  for alg in ${ALGORITHMS:-gigpo grpo}; do
    key=grpo.seed summary="$dir/summary-$alg.json"
    [ "$alg" = ppo ] && key=ppo.seed summary="$dir/summary.json"
    # shellcheck disable=SC2086 # QUICKSTART_ARGS is a list of arguments
    "$bin" quickstart --task "$task" --output "$dir" --algorithm "$alg" --set "$key=$seed" \
      ${QUICKSTART_ARGS:-} > "$dir/$alg.log" 2>&1 || true
    [ -f "$summary" ] && row "$summary" "$alg seed $seed" | tee -a "$out/results.tsv"
  done
done
