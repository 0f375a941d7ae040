#!/usr/bin/env bash
# Install TextWorld into a virtualenv for tools/textworld/bridge.py.
#
#   tools/textworld/install.sh [VENV_DIR]
#
# VENV_DIR defaults to .venv-textworld in the repository root (ignored by git).
# Needs: python3 (3.9-3.12) with the venv module, a C compiler (cc/gcc/clang) and make,
# because textworld depends on jericho, which pip builds from source (frotz, in C).
# Environment: PYTHON picks the interpreter (default python3); TEXTWORLD_SPEC picks the
# pip requirement (default "textworld>=1.7,<1.8").
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${1:-$repo_root/.venv-textworld}"
python="${PYTHON:-python3}"
spec="${TEXTWORLD_SPEC:-textworld>=1.7,<1.8}"

if ! command -v "$python" >/dev/null; then
    echo "install.sh: $python not found; set PYTHON=/path/to/python3" >&2
    exit 1
fi
if ! command -v cc >/dev/null && ! command -v gcc >/dev/null && ! command -v clang >/dev/null; then
    echo "install.sh: no C compiler found (cc, gcc or clang); jericho is built from source." >&2
    echo "            On Debian/Ubuntu: apt-get install build-essential" >&2
    exit 1
fi

start=$(date +%s)
echo "install.sh: creating $venv with $("$python" --version 2>&1)"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --upgrade pip wheel setuptools
"$venv/bin/python" -m pip install "$spec"
version="$("$venv/bin/python" -c 'import textworld; print(textworld.__version__)')"
echo "install.sh: textworld $version installed in $venv in $(( $(date +%s) - start ))s"
echo "install.sh: next: tools/textworld/make_games.sh"
