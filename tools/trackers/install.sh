#!/usr/bin/env bash
# Install the experiment trackers' Python packages into a virtualenv, for the tests that read
# what rltune's MLflow and W&B sinks write (tools/trackers/check_mlflow.py, check_wandb.py).
#
#   tools/trackers/install.sh [VENV_DIR]
#
# VENV_DIR defaults to .venv-trackers in the repository root (ignored by git). Training never
# needs these packages: the sinks are Rust. Environment: PYTHON picks the interpreter (default
# python3); MLFLOW_SPEC and WANDB_SPEC the pip requirements.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${1:-$repo_root/.venv-trackers}"
python="${PYTHON:-python3}"
mlflow_spec="${MLFLOW_SPEC:-mlflow>=2.9,<4}"
wandb_spec="${WANDB_SPEC:-wandb>=0.17,<1}"

if ! command -v "$python" >/dev/null; then
    echo "install.sh: $python not found; set PYTHON=/path/to/python3" >&2
    exit 1
fi
start=$(date +%s)
echo "install.sh: creating $venv with $("$python" --version 2>&1)"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$mlflow_spec" "$wandb_spec"
"$venv/bin/python" - <<'PY'
import mlflow, wandb
print(f"install.sh: mlflow {mlflow.__version__}, wandb {wandb.__version__}")
PY
echo "install.sh: installed in $venv in $(( $(date +%s) - start ))s ($(du -sh "$venv" | cut -f1))"
