#!/usr/bin/env bash
# Replays the policies of bench/adventure_credit.sh on the same games, so that any two can be
# compared episode by episode (tools/compare_transcripts.py): BC and PPO of OUT/base, and every
# OUT/s<SEED>/{gigpo,grpo} that finished. Test games: the quickstart's own evaluation (500
# held-out games, seed 59297 = the quickstart seed 0 ^ 0xe7a1, which `rltune play` reproduces
# exactly); validation games: 250 of the validation split, the same seed.
#
#   bench/adventure_replay.sh OUT
#
# Writes OUT/replay/<split>/<run>.jsonl and prints the comparison of each split, BC first.
set -euo pipefail
out=${1:?usage: bench/adventure_replay.sh OUT}
bin=${RLTUNE_BIN:-target/release/rltune}
[ -x "$bin" ] || { echo "build first: cargo build --release -p rltune-cli (or set RLTUNE_BIN)" >&2; exit 1; }

# The [env], [agent] and [generation] tables of a run config: what `rltune play --env` reads.
env_config() {
  python3 - "$1" <<'EOF'
import re, sys
keep, out = False, []
for line in open(sys.argv[1]):
    m = re.match(r"\[([a-z_.]+)\]", line)
    if m:
        keep = m.group(1).split(".")[0] in ("env", "agent", "generation")
    if keep:
        out.append(line)
print("".join(out))
EOF
}

play() { # config, model, split, episodes, transcripts
  "$bin" play --env "$1" --model "$2" --seed 59297 --episodes "$4" --set "env.split=\"$3\"" \
    --transcripts "$5" --json > /dev/null
}

last_step() { ls -d "$1"/checkpoints/step-* | sed 's/.*step-//' | sort -n | tail -1; }

mkdir -p "$out/replay"
env_config "$out/base/ppo.toml" > "$out/replay/env.toml"
for split in heldout validation; do
  n=500
  [ "$split" = validation ] && n=250
  dir="$out/replay/$split"
  mkdir -p "$dir"
  runs=("bc=$out/base/bc" "ppo=$out/base/ppo/checkpoints/step-$(last_step "$out/base/ppo")")
  for s in "$out"/s*; do
    for alg in gigpo grpo; do
      [ -f "$s/summary-$alg.json" ] || continue
      runs+=("$alg-${s##*/s}=$s/$alg/checkpoints/step-$(last_step "$s/$alg")")
    done
  done
  files=()
  for r in "${runs[@]}"; do
    name=${r%%=*}
    [ -f "$dir/$name.jsonl" ] || play "$out/replay/env.toml" "${r#*=}" "$split" "$n" "$dir/$name.jsonl"
    files+=("$dir/$name.jsonl")
  done
  echo "== $split ($n games)"
  python3 tools/compare_transcripts.py "${files[@]}"
done
