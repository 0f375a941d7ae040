#!/usr/bin/env bash
# Generate the small TextWorld games that test_bridge.py and the examples use.
#
#   tools/textworld/make_games.sh [OUT_DIR] [VENV_DIR]
#
# OUT_DIR defaults to target/textworld-games (ignored by git); VENV_DIR to .venv-textworld
# (made by install.sh). Each game is a .z8 story file plus the .json that the bridge needs beside
# it (and tw-make's .ni Inform 7 source). Deterministic: the same arguments give the same .z8
# bytes; PYTHONHASHSEED is fixed so that the .json's list order does not vary between runs.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="${1:-$repo_root/target/textworld-games}"
venv="${2:-$repo_root/.venv-textworld}"
tw_make="$venv/bin/tw-make"
if [ ! -x "$tw_make" ]; then
    echo "make_games.sh: $tw_make not found; run tools/textworld/install.sh first" >&2
    exit 1
fi
mkdir -p "$out"
export PYTHONHASHSEED=0

make_game() {  # make_game NAME ARGS...
    local name="$1"; shift
    "$tw_make" "$@" --format z8 --force --silent --output "$out/$name.z8"
    echo "make_games.sh: $out/$name.z8"
}

# Walk 5 rooms to a coin: 1 point, no objects.
make_game coin5_s6 tw-coin_collector --level 5 --seed 6
# Find one object among distractors: 1 point.
make_game treasure5_s4 tw-treasure_hunter --level 5 --seed 4
# 3 rooms, 5 objects, a 3-step quest (go, take, unlock): 1 point; admissible commands with capitals.
make_game custom_w3_o5_q3_s2 custom --world-size 3 --nb-objects 5 --quest-length 3 --seed 2
