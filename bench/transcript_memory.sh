#!/usr/bin/env bash
# Window against transcript memory ([agent] memory, issue #39): the same model plays the same
# held-out games with each, alternating over rounds, on this host. Prints per mode: episodes/s,
# turns/s, the prefill's seconds and share of the run, and the prefill tokens per turn.
#
#   bench/transcript_memory.sh BIN ENV_TOML MODEL [EPISODES] [ROUNDS]
#
# MODEL needs enough positions for whole episodes (a transcript that fills the context ends
# its episode early); ENV_TOML needs `actions = "admissible"` in its [agent] table. The two
# modes read different prompts, so their actions (and episode lengths) differ: compare the
# per-turn rates.
set -euo pipefail
bin=$1 env=$2 model=$3 episodes=${4:-64} rounds=${5:-2}
out=target/bench-transcript
mkdir -p "$out"
for round in $(seq "$rounds"); do
  for mode in window transcript; do
    "$bin" play --env "$env" --model "$model" --episodes "$episodes" --seed 5 --json \
      --set "agent.memory=\"$mode\"" >"$out/$mode.json" 2>"$out/$mode.log"
    python3 - "$out/$mode.json" "$out/$mode.log" "$mode" "$round" <<'PY'
import json, re, sys
report, log, mode, rnd = json.load(open(sys.argv[1])), open(sys.argv[2]).read(), sys.argv[3], sys.argv[4]
m = re.search(r"prefill: ([\d.]+) s of ([\d.]+) s \((\d+)%\), (\d+) tokens \(([\d.]+) per turn\)", log)
turns = report["episodes"] * report["mean_steps"]
secs = float(m.group(2))
print(f"round {rnd} {mode:<10} {report['episodes_per_second']:6.2f} episodes/s  {turns / secs:7.1f} turns/s  "
      f"prefill {float(m.group(1)):6.2f} s of {secs:6.2f} s ({m.group(3)}%)  {float(m.group(5)):6.1f} tokens/turn  "
      f"win {100 * report['win_rate']:.1f}%  steps {report['mean_steps']:.1f}")
PY
  done
done
