#!/usr/bin/env bash
# Alternating rounds of one PPO benchmark pair on the GPU machine, rltune then TRL 0.11.4, to
# read the ratio against the run-to-run spread of both sides (verify.sh times each side once).
# From the repository root, with .gpu/ filled by tools/cuda/pack.sh:
#
#   tools/cuda/pairs.sh --out "$OUT" [--rounds 3] [--iters 5] [--presets gpt2:f32,gpt2:bf16]
#
# Writes OUT/pairs.jsonl (one line per run: round, preset, dtype, side, the benchmark's JSON) and
# prints per preset each side's median, min and max of the per-run medians, and the ratio of
# the medians.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT="$PWD" OUTDIR="${OUT:-target/pairs}" ROUNDS=3 ITERS=5 PRESETS="gpt2:f32,gpt2:bf16" PACK=".gpu"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUTDIR="$2"; shift ;;
    --rounds) ROUNDS="$2"; shift ;;
    --iters) ITERS="$2"; shift ;;
    --presets) PRESETS="$2"; shift ;;
    -h | --help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "pairs.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUTDIR" && OUTDIR="$(cd "$OUTDIR" && pwd)"
WORK="$(mktemp -d /tmp/rltune-pairs.XXXXXX)"
BIN="$WORK/rltune"
xz -dc "$PACK/rltune.xz" >"$BIN" && chmod +x "$BIN" || { echo "pairs.sh: no $PACK/rltune.xz (tools/cuda/pack.sh)" >&2; exit 2; }
# shellcheck source=tools/cuda/cuda_libs.sh
. "$ROOT/tools/cuda/cuda_libs.sh"
SITE="$WORK/site-trl011"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$PACK"/wheels/trl011/*.whl >/dev/null 2>&1 \
  || echo "pairs.sh: the TRL wheels did not install; TRL's side will be empty" >&2
: >"$OUTDIR/pairs.jsonl"
record() { # record ROUND PRESET DTYPE SIDE LOG
  local line; line="$(grep '^{"' "$5" | tail -n1)"
  python3 -c 'import json,sys; print(json.dumps({"round": int(sys.argv[1]), "preset": sys.argv[2], "dtype": sys.argv[3], "side": sys.argv[4], "result": json.loads(sys.argv[5] or "{}")}))' \
    "$1" "$2" "$3" "$4" "$line" >>"$OUTDIR/pairs.jsonl"
}
for round in $(seq 1 "$ROUNDS"); do
  for pd in ${PRESETS//,/ }; do
    preset="${pd%%:*}" dtype="${pd##*:}"
    "$BIN" bench ppo --preset "$preset" --device cuda --dtype "$dtype" --iters "$ITERS" --json >"$WORK/r.log" 2>&1
    record "$round" "$preset" "$dtype" rltune "$WORK/r.log"
    PYTHONPATH="$SITE" python3 "$ROOT/bench/trl_ppo.py" --preset "$preset" --device cuda --iters "$ITERS" \
      $([ "$dtype" = bf16 ] && echo --bf16) --json >"$WORK/t.log" 2>&1
    record "$round" "$preset" "$dtype" trl "$WORK/t.log"
    echo "round $round $pd done"
  done
done
python3 - "$OUTDIR/pairs.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
keys = sorted({(r["preset"], r["dtype"]) for r in rows})
for p, d in keys:
    t = {s: [r["result"].get("median_total_s") for r in rows if (r["preset"], r["dtype"], r["side"]) == (p, d, s)] for s in ("rltune", "trl")}
    t = {s: [x for x in v if x] for s, v in t.items()}
    if not t["rltune"] or not t["trl"]:
        print(f"{p} {d}: missing runs {t}")
        continue
    m = {s: statistics.median(v) for s, v in t.items()}
    print(f"{p} {d}: rltune {m['rltune']:.3f} s [{min(t['rltune']):.3f}, {max(t['rltune']):.3f}], "
          f"TRL {m['trl']:.3f} s [{min(t['trl']):.3f}, {max(t['trl']):.3f}], ratio {m['rltune'] / m['trl']:.2f} "
          f"({len(t['rltune'])} / {len(t['trl'])} runs)")
PY
rm -rf "$WORK"
