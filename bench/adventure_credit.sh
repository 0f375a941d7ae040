#!/usr/bin/env bash
# Trajectory GRPO against GiGPO (step-level credit) on an agent quickstart's family, from one
# BC policy, over several RL seeds; PPO at its default seed beside them. Learning, not speed:
# each run is the quickstart itself (`rltune quickstart --task adventure`, or `--task
# textworld` with TASK=textworld), so its summary holds the random agent, BC and the RL policy
# on the same held-out (test) games with the paired difference, and BC and the RL policy on the
# validation games.
#
#   bench/adventure_credit.sh OUT [SEED...]      (default seeds: 42 1 2 3; 42 is grpo.seed's default)
#   ALGORITHMS="ppo gigpo grpo" bench/adventure_credit.sh OUT 4 5 6    (PPO too: --set ppo.seed=<SEED>)
#   TASK=textworld bench/adventure_credit.sh OUT 1 2 3   (the games: tools/textworld/make_game_set.sh coin 64 64)
#
# OUT/base runs the whole quickstart (demonstrations, tokenizer, BC, PPO, evaluation) once; each
# OUT/s<SEED> starts from a copy of base's cached stages, so only the RL stage and the
# evaluation run there: `--algorithm gigpo` then `--algorithm grpo`, both with
# `--set grpo.seed=<SEED>`. Prints one line per finished run; OUT/results.tsv collects them.
# Adventure: about 12 minutes for base and 15 per RL run on a quiet 2-core host; TextWorld: about
# 13 minutes for base and 17 per GiGPO or GRPO run.
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
# A finished base is not run again (its evaluation alone is 3-6 minutes), so a second call on
# the same OUT adds seeds or algorithms only.
if [ ! -f "$out/base/summary.json" ]; then
  "$bin" quickstart --task "$task" --output "$out/base" > "$out/base.log" 2>&1 || true
  [ -f "$out/base/summary.json" ] && row "$out/base/summary.json" "ppo seed 3" | tee -a "$out/results.tsv"
fi

for seed in "${seeds[@]}"; do
  dir="$out/s$seed"
  mkdir -p "$dir"
  for stage in data tokenizer bc quickstart.json; do
    [ -e "$dir/$stage" ] || cp -r "$out/base/$stage" "$dir/$stage"
  done
  for alg in ${ALGORITHMS:-gigpo grpo}; do
    key=grpo.seed summary="$dir/summary-$alg.json"
    [ "$alg" = ppo ] && key=ppo.seed summary="$dir/summary.json"
    "$bin" quickstart --task "$task" --output "$dir" --algorithm "$alg" --set "$key=$seed" \
      > "$dir/$alg.log" 2>&1 || true
    [ -f "$summary" ] && row "$summary" "$alg seed $seed" | tee -a "$out/results.tsv"
  done
done
