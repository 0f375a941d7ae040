#!/usr/bin/env bash
# Generation throughput of two builds of the bench_generate example, interleaved:
#   bench/ab_generate.sh BIN_A BIN_B ROUNDS [bench_generate arguments]
# e.g. bench/ab_generate.sh /tmp/gen-a /tmp/gen-b 3 --family neox --new-tokens 128 --runs 3
# Build each side with `cargo build --release -p rltune-models --example bench_generate` and copy
# target/release/examples/bench_generate away. Prints a TSV: each round's median seconds,
# tokens/s and peak RSS (KiB, GNU time), A then B, with candle's element-wise pool at one
# thread as in the rltune binary; then, as `#` lines, each side's median over the rounds and
# B's time as a ratio of A's.
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 BIN_A BIN_B ROUNDS [bench_generate arguments]" >&2
  exit 2
fi
a=$1 b=$2 rounds=$3
shift 3
for bin in "$a" "$b"; do
  [ -x "$bin" ] || { echo "$bin: not an executable (build the bench_generate example)" >&2; exit 2; }
done
command -v /usr/bin/time >/dev/null || { echo "/usr/bin/time (GNU time) is needed for peak RSS" >&2; exit 2; }
export CANDLE_NUM_THREADS=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "# $(nproc) CPUs, $(lscpu | grep 'Model name' | sed 's/Model name: *//'), $(date -u +%Y-%m-%dT%H:%MZ), args: $*"
printf 'round\tbinary\tmedian_s\ttokens_per_s\tpeak_rss_kib\n'
for r in $(seq 1 "$rounds"); do
  for side in A B; do
    bin=$a
    [ "$side" = B ] && bin=$b
    /usr/bin/time -f '%M' -o "$tmp/rss" "$bin" "$@" >"$tmp/out" 2>"$tmp/err" || { cat "$tmp/err" >&2; exit 1; }
    grep '^{' "$tmp/out" | python3 -c 'import json, sys; d = json.load(sys.stdin); print(d["median_s"], d["tokens_per_s"], sep="\t", end="")' >"$tmp/row"
    printf '%s\t%s\t%s\t%s\n' "$r" "$side" "$(cat "$tmp/row")" "$(cat "$tmp/rss")" | tee -a "$tmp/rows"
  done
done
python3 - "$tmp/rows" <<'EOF'
import statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])]
med = {}
for side in "AB":
    mine = [r for r in rows if r[1] == side]
    med[side] = [statistics.median(float(r[i]) for r in mine) for i in (2, 3, 4)]
    print(f"# median of {len(mine)} rounds, {side}: {med[side][0]:.4f} s, {med[side][1]:.1f} tokens/s, "
          f"peak RSS {med[side][2]:.0f} KiB")
print(f"# B / A: time {med['B'][0] / med['A'][0]:.3f}, peak RSS {med['B'][2] / med['A'][2]:.3f}")
EOF
