#!/usr/bin/env sh
# Installs VADER, the gold judge of `rltune quickstart --task rlhf`: PyPI's
# nltk-vader-sentiment==1.0.0 (pure Python, no dependencies, lexicons bundled) into
# target/judges/vader (git-ignored), where tools/judges/vader_reward.py imports it from.
#
#   tools/judges/install_vader.sh [DIR]
set -eu
cd "$(dirname "$0")/../.."
dir="${1:-target/judges/vader}"
python="${PYTHON:-python3}"
if PYTHONPATH="$dir" "$python" -c 'import vader, sys; sys.exit(vader.__version__ != "1.0.0")' 2>/dev/null; then
    echo "install_vader.sh: nltk-vader-sentiment 1.0.0 already in $dir"
    exit 0
fi
"$python" -m pip install --quiet --disable-pip-version-check --no-deps --target "$dir" nltk-vader-sentiment==1.0.0
echo "install_vader.sh: nltk-vader-sentiment 1.0.0 installed in $dir"
