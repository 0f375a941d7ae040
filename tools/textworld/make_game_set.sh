#!/usr/bin/env bash
# Generate a training set, a validation set and a held-out (test) set of TextWorld games of one
# family, with distinct tw-make seeds, for `rltune quickstart --task textworld`.
#
#   tools/textworld/make_game_set.sh FAMILY N_TRAIN N_HELDOUT [OUT_DIR] [VENV_DIR]
#
# FAMILY is one of
#   coin      tw-coin_collector --level L, L = 5 + i mod 11 (5..15): a chain of L rooms, the
#             coin at the far end; the objective spells out the route (1 point)
#   custom    custom --world-size 3 --nb-objects 5 --quest-length 3 (1 point)
#   treasure  tw-treasure_hunter --level L, L = 1 + i mod 10: fetch one object among
#             distractors; taking a wrong one loses (1 point)
# where i counts the games of a split from 0. Training games use seeds 1..N_TRAIN, held-out
# games seeds 1000001..1000000+N_HELDOUT, validation games (N_VALIDATION of them, from the
# environment, default 32; 0 makes none) seeds 2000001..2000000+N_VALIDATION, so no two sets
# share a seed; the script also fails if a story file of one set is byte-identical to one of
# another. Settings are chosen on the validation games; the held-out games are the test set.
#
# OUT_DIR defaults to target/textworld-games/FAMILY; the games go to OUT_DIR/train/,
# OUT_DIR/validation/ and OUT_DIR/heldout/ (each a .z8 with the .json the bridge needs beside
# it). VENV_DIR defaults to .venv-textworld (tools/textworld/install.sh). Deterministic
# (PYTHONHASHSEED is fixed), and resumable: games already made are kept, so rerunning it on a
# set made before the validation split adds only the validation games. tw-make takes 3 to 9 s
# per game.
set -euo pipefail

usage="usage: make_game_set.sh FAMILY N_TRAIN N_HELDOUT [OUT_DIR] [VENV_DIR] (FAMILY: coin, custom, treasure)"
if [ $# -lt 3 ]; then
    echo "$usage" >&2
    exit 2
fi
family="$1" n_train="$2" n_heldout="$3" n_validation="${N_VALIDATION:-32}"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="${4:-$repo_root/target/textworld-games/$family}"
venv="${5:-$repo_root/.venv-textworld}"
tw_make="$venv/bin/tw-make"
for n in "$n_train" "$n_heldout"; do
    if ! [[ "$n" =~ ^[0-9]+$ ]] || [ "$n" -lt 1 ] || [ "$n" -gt 999999 ]; then
        echo "make_game_set.sh: N_TRAIN and N_HELDOUT must be integers in 1..999999, got '$n'" >&2
        exit 2
    fi
done
if ! [[ "$n_validation" =~ ^[0-9]+$ ]] || [ "$n_validation" -gt 999999 ]; then
    echo "make_game_set.sh: N_VALIDATION must be an integer in 0..999999, got '$n_validation'" >&2
    exit 2
fi
case "$family" in
    coin|custom|treasure) ;;
    *) echo "make_game_set.sh: unknown FAMILY '$family'; $usage" >&2; exit 2 ;;
esac
if [ ! -x "$tw_make" ]; then
    echo "make_game_set.sh: $tw_make not found; run tools/textworld/install.sh first" >&2
    exit 1
fi
export PYTHONHASHSEED=0

# make_split SPLIT COUNT FIRST_SEED
make_split() {
    local split="$1" count="$2" first="$3" i seed name args
    mkdir -p "$out/$split"
    for ((i = 0; i < count; i++)); do
        seed=$((first + i))
        case "$family" in
            coin) level=$((5 + i % 11)); name="coin_l${level}_s$seed"
                  args=(tw-coin_collector --level "$level") ;;
            custom) name="custom_w3_o5_q3_s$seed"
                    args=(custom --world-size 3 --nb-objects 5 --quest-length 3) ;;
            treasure) level=$((1 + i % 10)); name="treasure_l${level}_s$seed"
                      args=(tw-treasure_hunter --level "$level") ;;
        esac
        if [ -s "$out/$split/$name.z8" ] && [ -s "$out/$split/$name.json" ]; then
            continue
        fi
        "$tw_make" "${args[@]}" --seed "$seed" --format z8 --force --silent --output "$out/$split/$name.z8"
        echo "make_game_set.sh: $out/$split/$name.z8"
    done
}

start=$(date +%s)
make_split train "$n_train" 1
make_split heldout "$n_heldout" 1000001
[ "$n_validation" -eq 0 ] || make_split validation "$n_validation" 2000001
hashes() { [ -d "$out/$1" ] || return 0; (cd "$out/$1" && sha256sum -- *.z8 | awk '{print $1}' | sort -u); }
for pair in "train heldout" "train validation" "validation heldout"; do
    read -r a b <<<"$pair"
    shared="$(comm -12 <(hashes "$a") <(hashes "$b"))"
    if [ -n "$shared" ]; then
        echo "make_game_set.sh: $b games byte-identical to $a games (sha256):" >&2
        echo "$shared" >&2
        exit 1
    fi
done
echo "make_game_set.sh: $n_train training, $n_validation validation and $n_heldout held-out $family games in $out ($(( $(date +%s) - start ))s)"
