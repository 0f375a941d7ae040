#!/usr/bin/env python3
"""Compares llama.cpp's logits (through llama-cpp-python) on an `rltune export` with rltune's.

    .venv-llamacpp/bin/python tools/models/check_llama_cpp.py --gguf tiny.gguf --expected logits.json

`logits.json` is written by the Rust test `llama_cpp_python_gives_rltunes_logits` (ignored unless
RLTUNE_LLAMA_CPP_PYTHON names a Python with llama_cpp): {"ids": [...], "logits": [[...], ...],
"tolerance": x}. The ids are evaluated in one batch with `logits_all=True` (no BOS added, no
tokenizer involved), with the KV cache in f32 (llama.cpp's default f16 cache alone moves
these logits by ~4e-3); the script prints the largest |llama.cpp − rltune| over every position and
token and exits 1 when it exceeds the tolerance.

llama-cpp-python builds llama.cpp from source (`pip install llama-cpp-python`, CMake + a C++
compiler; ~290 translation units, tens of minutes on 2 cores), so this check is not run in CI.
"""

import argparse
import json
import sys

import numpy as np
from llama_cpp import Llama


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--expected", required=True)
    args = ap.parse_args()
    exp = json.load(open(args.expected))
    ids = exp["ids"]
    want = np.asarray(exp["logits"], dtype=np.float64)
    llm = Llama(model_path=args.gguf, logits_all=True, n_ctx=max(32, len(ids)), n_batch=len(ids),
                n_threads=2, verbose=False, seed=0, type_k=0, type_v=0)  # an f32 KV cache (GGML_TYPE_F32)
    llm.eval(ids)
    got = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
    if got.shape != want.shape:
        print(f"FAILED: llama.cpp gave logits of shape {got.shape}, rltune {want.shape}")
        sys.exit(1)
    d = float(np.abs(got - want).max())
    same_argmax = bool((got.argmax(-1) == want.argmax(-1)).all())
    print(f"llama.cpp vs rltune on {args.gguf}: max |logit diff| {d:.3e} over {got.shape[0]} positions x "
          f"{got.shape[1]} tokens (logits up to {np.abs(want).max():.2f}); same argmax: {same_argmax}")
    if d > exp["tolerance"]:
        print(f"FAILED: above the tolerance {exp['tolerance']}")
        sys.exit(1)


if __name__ == "__main__":
    main()
