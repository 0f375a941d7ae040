#!/usr/bin/env bash
# Batched sampling of SmolLM2-135M-Instruct on the CPU: rltune beside llama.cpp, same host, same
# workload (32 sequences × 32 prompt tokens, 64 sampled tokens each, pure sampling at T = 1,
# EOS not stopping), alternating rounds. Rows:
#   - rltune, f32 weights (the Q4_1 GGUF dequantized at load, as rltune trains it);
#   - rltune, f32, with the RLHF quickstart's all-linear r16 LoRA adapter (when one is given);
#   - llama.cpp on an f32 GGUF of the same weights (`rltune export --type f32`), flash
#     attention off (its default) and on: the same weight precision;
#   - llama.cpp on the Q4_1 GGUF itself, flash attention on: its fastest form here.
# llama.cpp is llama-cpp-python 0.3.16 built from source by pip into .venv-llamacpp (about ten
# minutes on two cores, once).
#
#   bench/generate_vs_llamacpp.sh [RLTUNE_BINARY] [ROUNDS] [ADAPTER_DIR]
#
# Writes bench/results/generate/<UTC date>-<host>.jsonl (one JSON object per run, each with
# the round) and prints the table of medians over rounds.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-target/release/rltune}
ROUNDS=${2:-3}
ADAPTER=${3:-}
ITERS=2
MODEL=target/models/SmolLM2-135M-Instruct.Q4_1.gguf
F32=target/bench/smollm2-f32.gguf
VENV=.venv-llamacpp

[ -x "$BIN" ] || { echo "no rltune binary at $BIN: cargo build --release -p rltune-cli" >&2; exit 2; }
[ -f "$MODEL" ] || tools/models/fetch_smollm2.sh
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
    python3 -m venv "$VENV"
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$VENV/bin/pip" install --quiet llama-cpp-python==0.3.16 numpy
fi
mkdir -p target/bench bench/results/generate
[ -f "$F32" ] || "$BIN" export --model "$MODEL" --type f32 --output "$F32" >&2

host=$(lscpu | grep 'Model name' | sed 's/Model name: *//')
out="bench/results/generate/$(date -u +%Y-%m-%d)-$(hostname | cut -c1-12).jsonl"
: > "$out"
echo "machine: $(nproc) CPUs, $host, $(date -u +%Y-%m-%dT%H:%MZ), rltune $(git rev-parse --short HEAD)" >&2
# One run: a label, then the command; its JSON line gets the label, the round and the host.
run() {
    local label=$1 round=$2
    shift 2
    "$@" 2>/dev/null | tail -1 |
        python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); d.pop("system_info",None); d.update(label=sys.argv[1], round=int(sys.argv[2]), host=sys.argv[3]); print(json.dumps(d))' \
            "$label" "$round" "$host" >> "$out"
    tail -1 "$out" | python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print("round %d: %s: %.1f new tokens/s" % (d["round"], d["label"], d["new_tokens_per_s"]), file=sys.stderr)'
}
LLAMA=("$VENV/bin/python" bench/llamacpp_generate.py --threads "$(nproc)" --iters "$ITERS")
for round in $(seq 1 "$ROUNDS"); do
    run "rltune f32" "$round" "$BIN" bench generate --model "$MODEL" --iters "$ITERS" --json
    if [ -n "$ADAPTER" ]; then
        run "rltune f32 + LoRA r16" "$round" "$BIN" bench generate --model "$MODEL" --adapter "$ADAPTER" --iters "$ITERS" --json
    fi
    run "llama.cpp f32" "$round" "${LLAMA[@]}" --model "$F32"
    run "llama.cpp f32, flash attention" "$round" "${LLAMA[@]}" --model "$F32" --flash-attn
    run "llama.cpp Q4_1, flash attention" "$round" "${LLAMA[@]}" --model "$MODEL" --flash-attn
done
python3 - "$out" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
labels = list(dict.fromkeys(r["label"] for r in rows))
med = lambda label, key: statistics.median(r[key] for r in rows if r["label"] == label)
base = med("rltune f32", "new_tokens_per_s")
print("| run | new tokens/s (median; runs) | prefill tokens/s | decode tokens/s | peak RSS MiB | rltune f32 / this |")
print("|---|---|---|---|---|---|")
for label in labels:
    runs = ", ".join(f"{r['new_tokens_per_s']:.0f}" for r in rows if r["label"] == label)
    tps = med(label, "new_tokens_per_s")
    print(f"| {label} | {tps:.0f} ({runs}) | {med(label, 'prefill_tokens_per_s'):.0f} | "
          f"{med(label, 'decode_tokens_per_s'):.0f} | {med(label, 'peak_rss_mib'):.0f} | {base / tps:.2f} |")
EOF
echo "results: $out" >&2
