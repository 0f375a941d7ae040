#!/usr/bin/env bash
# Install the `openai` Python client (PyPI) into a virtualenv, for tools/openai/client_test.py,
# which drives `rltune serve` as an OpenAI-compatible server.
#
#   tools/openai/install.sh [VENV_DIR]
#
# VENV_DIR defaults to .venv-openai in the repository root (ignored by git). Environment: PYTHON
# picks the interpreter (default python3); OPENAI_SPEC the requirement (default "openai>=1.40,<3").
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${1:-$repo_root/.venv-openai}"
python="${PYTHON:-python3}"
spec="${OPENAI_SPEC:-openai>=1.40,<3}"

if ! command -v "$python" >/dev/null; then
    echo "install.sh: $python not found; set PYTHON=/path/to/python3" >&2
    exit 1
fi
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import openai' 2>/dev/null; then
    echo "install.sh: openai $("$venv/bin/python" -c 'import openai; print(openai.__version__)') already in $venv"
    exit 0
fi
start=$(date +%s)
echo "install.sh: creating $venv with $("$python" --version 2>&1)"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$spec"
version="$("$venv/bin/python" -c 'import openai; print(openai.__version__)')"
echo "install.sh: openai $version installed in $venv in $(( $(date +%s) - start ))s"
