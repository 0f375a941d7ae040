#!/usr/bin/env bash
# Trajectory GRPO against GiGPO (step-level credit) on the adventure quickstart's family, from
# one BC policy, over several RL seeds; PPO at its default seed beside them. Learning, not
# speed: each run is the quickstart itself (`rltune quickstart --task adventure`), so its
# summary holds the random agent, BC and the RL policy on the same 500 held-out games with the
# paired difference.
#
#   bench/adventure_credit.sh OUT [SEED...]      (default seeds: 42 1 2 3; 42 is grpo.seed's default)
#   ALGORITHMS="ppo gigpo grpo" bench/adventure_credit.sh OUT 4 5 6    (PPO too: --set ppo.seed=<SEED>)
#
# OUT/base runs the whole quickstart (demonstrations, tokenizer, BC, PPO, evaluation); each
# OUT/s<SEED> starts from a copy of base's cached stages, so only the RL stage and the
# evaluation run there: `--algorithm gigpo` then `--algorithm grpo`, both with
# `--set grpo.seed=<SEED>`. Prints one line per finished run; OUT/results.tsv collects them.
# About 12 minutes for base and 15 per RL run on a quiet 2-core host.
set -euo pipefail
out=${1:?usage: bench/adventure_credit.sh OUT [SEED...]}
shift
seeds=(42 1 2 3)
[ $# -eq 0 ] || seeds=("$@")
bin=${RLTUNE_BIN:-target/release/rltune}
[ -x "$bin" ] || { echo "build first: cargo build --release -p rltune-cli (or set RLTUNE_BIN)" >&2; exit 1; }
mkdir -p "$out"

row() { # summary file, label
  python3 - "$1" "$2" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
d = s["ppo_vs_bc"]
print("\t".join([sys.argv[2], f"{100*s['bc']['win_rate']:.1f}", f"{100*s['ppo']['win_rate']:.1f}",
                 f"{100*d['delta']:+.1f}", f"{100*d['se']:.1f}", f"{d['delta']/d['se'] if d['se'] else 0:.2f}"]))
EOF
}

[ -f "$out/results.tsv" ] || printf 'run\tBC win %%\tRL win %%\tdelta\tpaired SE\tdelta/SE\n' > "$out/results.tsv"
"$bin" quickstart --task adventure --output "$out/base" > "$out/base.log" 2>&1 || true
[ -f "$out/base/summary.json" ] && row "$out/base/summary.json" "ppo seed 3" | tee -a "$out/results.tsv"

for seed in "${seeds[@]}"; do
  dir="$out/s$seed"
  mkdir -p "$dir"
  for stage in data tokenizer bc quickstart.json; do
    [ -e "$dir/$stage" ] || cp -r "$out/base/$stage" "$dir/$stage"
  done
  for alg in ${ALGORITHMS:-gigpo grpo}; do
    key=grpo.seed summary="$dir/summary-$alg.json"
    [ "$alg" = ppo ] && key=ppo.seed summary="$dir/summary.json"
    "$bin" quickstart --task adventure --output "$dir" --algorithm "$alg" --set "$key=$seed" \
      > "$dir/$alg.log" 2>&1 || true
    [ -f "$summary" ] && row "$summary" "$alg seed $seed" | tee -a "$out/results.tsv"
  done
done
