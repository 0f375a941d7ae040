#!/usr/bin/env bash
# Full fine-tuning, LoRA and partial freezing side by side: GRPO steps on SmolLM2-135M-Instruct
# (30 layers), the same prompts, seeds and batch, on this host. Prints each mode's seconds per
# step (the mean of the logged `time/grpo/step`, the update; and the generation's) and the peak
# resident memory of the whole process.
#
#   tools/models/fetch_smollm2.sh
#   python3 examples/smollm2-grpo/make_data.py --out target/smollm2-grpo
#   bench/partial_freezing.sh [BIN] [STEPS] [ROUNDS]
#
# Modes: full (every weight), lora (r 16 on every linear layer), freeze10 (trainable_layers =
# 10, the fork's "last third"), freeze1 (the last block only); a mode with "-ckpt" appended
# (full-ckpt, lora-ckpt) adds `[model] gradient_checkpointing = true`. Rounds interleave the
# modes. MODES="full lora" runs only those.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/rltune}
steps=${2:-4}
rounds=${3:-2}
out=target/bench-partial
mkdir -p "$out"
for round in $(seq "$rounds"); do
  for mode in ${MODES:-full lora freeze10 freeze1}; do
    # The example's config, without its [lora] table except in lora mode, without [eval].
    python3 - "$mode" "$out/$mode.toml" <<'EOF'
import re, sys
mode, path = sys.argv[1], sys.argv[2]
ckpt = mode.endswith("-ckpt")
mode = mode.removesuffix("-ckpt")
text = open("examples/smollm2-grpo/grpo-lora.toml").read()
text = re.sub(r"\n\[eval\]\n(?:[^\[\n].*\n)*", "\n", text)
if mode != "lora":
    text = re.sub(r"\n\[lora\]\n(?:[^\[\n].*\n)*", "\n", text)
if mode.startswith("freeze"):
    text = text.replace("[model]\n", f"[model]\ntrainable_layers = {mode[len('freeze'):]}\n", 1)
if ckpt:
    text = text.replace("[model]\n", "[model]\ngradient_checkpointing = true\n", 1)
open(path, "w").write(text)
EOF
    extra=(--set "grpo.max_steps=$steps" --set "logging.dir=\"$out/$mode\"" --set checkpoint.every=0)
    rm -rf "${out:?}/$mode"
    /usr/bin/time -f "%M" -o "$out/$mode.rss" "$bin" ppo --config "$out/$mode.toml" "${extra[@]}" \
      >"$out/$mode.log" 2>&1
    python3 - "$out/$mode" "$(cat "$out/$mode.rss")" "$mode" "$round" <<'EOF'
import json, sys
run, rss_kb, mode, rnd = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
rows = [json.loads(l) for l in open(f"{run}/metrics.jsonl")]
step = [r["time/grpo/step"] for r in rows[1:]]  # the first step warms up
gen = [r["time/rollout/generation"] for r in rows[1:]]
print(f"round {rnd} {mode:10s} update {sum(step)/len(step):6.2f} s/step  generation {sum(gen)/len(gen):6.2f} s/step  "
      f"peak RSS {rss_kb/1024:7.0f} MiB")
EOF
  done
done
