#!/usr/bin/env python3
"""Batched sampling throughput of llama.cpp, the workload of `rltune bench generate`.

B sequences of P prompt tokens each (row i, position j holds (131 i + 17 j + 1) mod (V - 1),
as rltune builds them), then N sampled tokens each, one llama_decode per step for the whole
batch (llama.cpp's `batched` example). Pure sampling at temperature 1 from the whole
vocabulary, as rltune samples: the softmax and draw in numpy (f64, vectorized over the rows),
from the logits llama.cpp returns; their time is reported apart (`median_sampling_s`), with the
throughput without them. EOS does not stop a sequence. One warm-up run, then --iters timed runs; prints one
JSON object with the medians.

Run it from the virtualenv that bench/generate_vs_llamacpp.sh makes:

    .venv-llamacpp/bin/python bench/llamacpp_generate.py --model M.gguf --threads 2
"""

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

import numpy as np

import llama_cpp as L


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--flash-attn", action="store_true", help="llama.cpp's flash attention on")
    args = ap.parse_args()
    if min(args.batch, args.prompt_tokens, args.new_tokens, args.iters) < 1:
        sys.exit("--batch, --prompt-tokens, --new-tokens and --iters must each be at least 1")
    if not os.path.isfile(args.model):
        sys.exit(f"--model {args.model}: no such file")

    L.llama_backend_init()
    t_load = time.perf_counter()
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(args.model.encode(), mparams)
    if not model:
        sys.exit(f"llama.cpp cannot load {args.model}")
    load_s = time.perf_counter() - t_load
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    b, p, n = args.batch, args.prompt_tokens, args.new_tokens
    cparams = L.llama_context_default_params()
    cparams.n_ctx = b * (p + n)
    cparams.n_batch = b * p
    cparams.n_ubatch = b * p
    cparams.n_seq_max = b
    cparams.n_threads = args.threads
    cparams.n_threads_batch = args.threads
    cparams.flash_attn = args.flash_attn
    cparams.kv_unified = True
    cparams.no_perf = True
    ctx = L.llama_init_from_model(model, cparams)
    if not ctx:
        sys.exit("llama.cpp cannot make a context of this size")
    batch = L.llama_batch_init(b * p, 0, b)
    prompts = [[(131 * i + 17 * j + 1) % (vocab - 1) for j in range(p)] for i in range(b)]

    def fill(entries):
        """entries: (token, position, sequence, wants logits)."""
        for k, (tok, pos, seq, logits) in enumerate(entries):
            batch.token[k] = tok
            batch.pos[k] = pos
            batch.n_seq_id[k] = 1
            batch.seq_id[k][0] = seq
            batch.logits[k] = logits
        batch.n_tokens = len(entries)

    def sample(rng, rows):
        """One token per row from the first `rows` outputs' logits (exact, f64 CDF)."""
        t = time.perf_counter()
        logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(rows, vocab)).astype(np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        cdf = np.cumsum(np.exp(logits), axis=1)
        u = rng.random(rows) * cdf[:, -1]
        toks = [min(int(np.searchsorted(cdf[i], u[i], side="right")), vocab - 1) for i in range(rows)]
        return toks, time.perf_counter() - t

    def run(seed):
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        rng = np.random.default_rng(seed)
        t0 = time.perf_counter()
        fill([(tok, j, i, j == p - 1) for i in range(b) for j, tok in enumerate(prompts[i])])
        if L.llama_decode(ctx, batch) != 0:
            sys.exit("llama_decode failed on the prompts")
        prefill = time.perf_counter() - t0
        toks, sampling = sample(rng, b)
        for step in range(1, n):
            fill([(toks[i], p + step - 1, i, True) for i in range(b)])
            if L.llama_decode(ctx, batch) != 0:
                sys.exit(f"llama_decode failed at step {step}")
            toks, spent = sample(rng, b)
            sampling += spent
        return time.perf_counter() - t0, prefill, sampling

    totals, prefills, samplings = [], [], []
    for it in range(args.iters + 1):
        total, prefill, sampling = run(it)
        print(
            f"{'warm-up' if it == 0 else 'run'} {it}: {total:.3f}s (prefill {prefill:.3f}s, "
            f"sampling {sampling:.3f}s, {b * n / total:.1f} new tokens/s)",
            file=sys.stderr,
        )
        if it > 0:
            totals.append(total)
            prefills.append(prefill)
            samplings.append(sampling)
    total, prefill = statistics.median(totals), statistics.median(prefills)
    sampling = statistics.median(samplings)
    with open("/proc/self/status") as f:
        hwm = next((int(l.split()[1]) / 1024 for l in f if l.startswith("VmHWM:")), float("nan"))
    print(json.dumps({
        "impl": "llama.cpp",
        "bench": "generate",
        "model": args.model,
        "llama_cpp_python": L.__version__ if hasattr(L, "__version__") else None,
        "system_info": L.llama_print_system_info().decode(errors="replace").strip(),
        "flash_attn": args.flash_attn,
        "batch": b,
        "prompt_tokens": p,
        "new_tokens": n,
        "load_s": load_s,
        "median_total_s": total,
        "median_prefill_s": prefill,
        "prefill_tokens_per_s": b * p / prefill,
        "decode_tokens_per_s": b * (n - 1) / (total - prefill),
        "new_tokens_per_s": b * n / total,
        "median_sampling_s": sampling,
        "new_tokens_per_s_without_sampling": b * n / (total - sampling),
        "peak_rss_mib": hwm,
        "threads": args.threads,
    }))
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)


if __name__ == "__main__":
    main()
