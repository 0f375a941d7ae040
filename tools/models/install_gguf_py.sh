#!/usr/bin/env sh
# Installs the PyPI `gguf` package (llama.cpp's gguf-py: pure Python + numpy, ~20 MB with its
# dependencies) into target/gguf-py (git-ignored), for tools/models/check_gguf_export.py and the
# Rust test that runs it (`the_gguf_package_reads_the_exports_as_llama_cpp_writes_them`).
#
#   tools/models/install_gguf_py.sh          # -> target/gguf-py (PYTHONPATH=target/gguf-py)
#
# The test skips loudly when the package is absent; RLTUNE_REQUIRE_GGUF_PY=1 makes it fail
# instead, and RLTUNE_GGUF_PY=DIR points it at another install.
set -eu
cd "$(dirname "$0")/../.."
dest=target/gguf-py
if PYTHONPATH="$dest" python3 -c "import gguf, numpy" 2>/dev/null; then
    echo "gguf already in $dest"
    exit 0
fi
python3 -m pip install --quiet --disable-pip-version-check --target "$dest" "gguf>=0.17"
PYTHONPATH="$dest" python3 -c "import gguf, importlib.metadata as m; print('gguf', m.version('gguf'), 'in $dest')"
