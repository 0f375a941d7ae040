#!/usr/bin/env bash
# Checks that two commits train bit-identically: builds `rltune` (release) at BASE_REV and at
# HEAD_REV (default: HEAD), runs the quickstart tasks with `--preset tiny` for each, and compares
# every weights file (`*.safetensors`) and every `metrics.jsonl` by sha256.
#
#   tools/check_identical.sh BASE_REV [HEAD_REV] [--full] [--dev] [--keep]
#
# Variants: sentiment, --task adventure, --task arithmetic (GRPO, then --algorithm rloo in the
# same directory, which trains RLOO from the same SFT policy), --task essays, all `--preset tiny
# --seed 0`. (--task wnut needs the WNUT-2016 download, --task textworld TextWorld: not here.)
# --full adds the README's sentiment quickstart (`--preset default --seed 0`, minutes of run).
# --dev builds the dev profile instead of release (both sides alike; much faster to build where
# the dev dependencies are built already, e.g. CHECK_TARGET=target).
#
# metrics.jsonl holds wall-clock timings (`time/*` and keys ending in `_time`), which differ
# between any two runs, even of one binary: they are removed from every line before hashing (line
# and key order kept, numbers re-written as shortest round-trip floats, so any bit that differs
# still shows). Weights are hashed as written. The builds share one target directory
# (target/check-identical, or $CHECK_TARGET), so dependencies build once, and each commit's binary
# is kept there and reused. BASE_REV = HEAD_REV checks that the runs are deterministic.
# Exit status: 0 when everything matches, 1 on a difference, 2 on a usage or build error.
set -euo pipefail

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }

full=0 keep=0 profile=release revs=()
for a in "$@"; do
  case "$a" in
    --full) full=1 ;;
    --keep) keep=1 ;;
    --dev) profile=dev ;;
    -h|--help) usage ;;
    -*) echo "unknown option $a" >&2; usage ;;
    *) revs+=("$a") ;;
  esac
done
[ ${#revs[@]} -ge 1 ] && [ ${#revs[@]} -le 2 ] || usage
root=$(git rev-parse --show-toplevel)
base=$(git -C "$root" rev-parse --verify "${revs[0]}^{commit}") || { echo "no commit ${revs[0]}" >&2; exit 2; }
head=$(git -C "$root" rev-parse --verify "${revs[1]:-HEAD}^{commit}") || { echo "no commit ${revs[1]}" >&2; exit 2; }
command -v python3 >/dev/null || { echo "python3 is needed to strip the timings from metrics.jsonl" >&2; exit 2; }

work=$(mktemp -d "${TMPDIR:-/tmp}/rltune-identical.XXXXXX")
export CARGO_TARGET_DIR=${CHECK_TARGET:-$root/target/check-identical}
cleanup() {
  for side in base head; do
    [ -d "$work/src-$side" ] && git -C "$root" worktree remove --force "$work/src-$side" >/dev/null 2>&1 || true
  done
  if [ "$keep" = 1 ]; then echo "outputs kept in $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT

# Builds REV into $work/bin-SIDE/rltune; a binary built before for the same commit is reused
# ($CARGO_TARGET_DIR/identical-bins/SHA).
build() {
  local side=$1 rev=$2 cached=$CARGO_TARGET_DIR/identical-bins/$profile-$2/rltune
  mkdir -p "$work/bin-$side"
  if [ -x "$cached" ]; then
    echo "reusing the build of $side ($(git -C "$root" log -1 --format='%h %s' "$rev"))" >&2
  else
    git -C "$root" worktree add --detach "$work/src-$side" "$rev" >/dev/null 2>&1
    echo "building $side ($(git -C "$root" log -1 --format='%h %s' "$rev"))" >&2
    (cd "$work/src-$side" && cargo build --profile "$profile" --quiet -p rltune-cli) || { echo "build of $rev failed" >&2; exit 2; }
    mkdir -p "$(dirname "$cached")"
    local out=release
    [ "$profile" = dev ] && out=debug
    cp "$CARGO_TARGET_DIR/$out/rltune" "$cached"
  fi
  cp "$cached" "$work/bin-$side/rltune"
}

variants=(sentiment adventure arithmetic essays)
[ "$full" = 1 ] && variants+=(sentiment-full)

# Runs one variant with the binary of SIDE into $work/out-SIDE/VARIANT.
run_variant() {
  local side=$1 v=$2 bin=$work/bin-$side/rltune out=$work/out-$side/$2
  mkdir -p "$out"
  local log=$out.log
  case "$v" in
    sentiment) "$bin" quickstart --preset tiny --seed 0 --output "$out" ;;
    adventure) "$bin" quickstart --task adventure --preset tiny --seed 0 --output "$out" ;;
    arithmetic)
      "$bin" quickstart --task arithmetic --preset tiny --seed 0 --output "$out" &&
        "$bin" quickstart --task arithmetic --algorithm rloo --preset tiny --seed 0 --output "$out" ;;
    essays) "$bin" quickstart --task essays --preset tiny --seed 0 --output "$out" ;;
    sentiment-full) "$bin" quickstart --seed 0 --output "$out" ;;
  esac >"$log" 2>&1 || { echo "$side $v failed; its log:" >&2; tail -20 "$log" >&2; exit 2; }
}

# sha256 of a file; of metrics.jsonl without its wall-clock keys.
digest() {
  case "$1" in
    */metrics.jsonl)
      python3 - "$1" <<'EOF' | sha256sum | cut -c1-16 ;;
import json, sys
for line in open(sys.argv[1], encoding="utf-8"):
    row = json.loads(line)
    row = {k: v for k, v in row.items() if not (k.startswith("time/") or k.endswith("_time"))}
    print(json.dumps(row))
EOF
    *) sha256sum "$1" | cut -c1-16 ;;
  esac
}

build base "$base"
build head "$head"
for v in "${variants[@]}"; do
  for side in base head; do
    echo "running $side $v" >&2
    run_variant "$side" "$v"
  done
done

status=0
printf '%-15s %-58s %-16s %-16s %s\n' variant file base head same
for v in "${variants[@]}"; do
  files=$(cd "$work" && { (cd "out-base/$v" && find . -name '*.safetensors' -o -name metrics.jsonl);
    (cd "out-head/$v" && find . -name '*.safetensors' -o -name metrics.jsonl); } | sort -u)
  if [ -z "$files" ]; then echo "$v: no weights or metrics were written" >&2; status=1; fi
  for f in $files; do
    a=-; b=-
    [ -f "$work/out-base/$v/$f" ] && a=$(digest "$work/out-base/$v/$f")
    [ -f "$work/out-head/$v/$f" ] && b=$(digest "$work/out-head/$v/$f")
    same=yes
    if [ "$a" != "$b" ] || [ "$a" = - ]; then same=NO; status=1; fi
    printf '%-15s %-58s %-16s %-16s %s\n' "$v" "${f#./}" "$a" "$b" "$same"
  done
done
echo "base $(git -C "$root" rev-parse --short "$base"), head $(git -C "$root" rev-parse --short "$head"), $profile builds:" \
  "$([ $status = 0 ] && echo 'identical' || echo 'DIFFERENT')"
exit $status
