#!/usr/bin/env python3
"""Reference PPO benchmark: TRL 0.11.4 classic ``PPOTrainer`` on CPU.

Workload (one timed iteration = generation + ``ppo_trainer.step``):

  preset | model                                                   | PPO batch
  -------+---------------------------------------------------------+------------------------------------------
  small  | GPT-2, 4 layers, 4 heads, d=256, vocab 8192,            | batch_size 64, mini_batch_size 16,
         | n_positions 64 (~5.27M params + 257 value head)         | ppo_epochs 4, 8 query + 24 response tokens
  gpt2   | GPT-2, 12 layers, 12 heads, d=768, vocab 50257,         | batch_size 16, mini_batch_size 4,
         | n_positions 1024 (~124.4M params, i.e. gpt2 "small")    | ppo_epochs 4, 8 query + 24 response tokens

Details (the Rust side, ``rltune-cli bench ppo``, is meant to do identical work):

* Models are built in-process from a ``GPT2Config`` (never from the hub):
  ``torch.manual_seed(0)``, randomly initialised ``GPT2LMHeadModel`` wrapped in
  ``trl.AutoModelForCausalLMWithValueHead``; reference model =
  ``trl.create_reference_model(model)``.
* ALL DROPOUTS ARE SET TO 0 (``resid_pdrop``, ``embd_pdrop``, ``attn_pdrop`` and the
  value head's ``summary_dropout_prob``) so both implementations do identical,
  deterministic-shape work. This deviates from the GPT-2 config defaults (0.1).
* Attention implementation is whatever transformers picks by default (SDPA for GPT-2 in 4.46).
* Tokenizer: a minimal in-process ``tokenizers`` WordLevel tokenizer with exactly
  ``vocab_size`` entries (``tok0`` .. ``tok{V-2}`` plus ``<|endoftext|>`` = id V-1),
  wrapped in ``PreTrainedTokenizerFast``; eos = pad = unk = ``<|endoftext|>``
  (id V-1), padding_side="right". It is only used by TRL for padding.
* Queries: 8 random token ids each, uniform in [0, V-2] (never the eos id); a fresh batch
  per iteration from a seeded generator.
* Generation: ``ppo_trainer.generate(queries, return_prompt=False, batch_size=B, **GEN_KWARGS)``
  i.e. TRL's own batched generation, all B queries in ONE ``model.generate`` call with the
  KV cache, where ``GEN_KWARGS`` is exactly::

      max_new_tokens=24, min_new_tokens=24, do_sample=True, top_k=0, top_p=1.0,
      temperature=1.0, pad_token_id=V-1, eos_token_id=V-1, use_cache=True

  Pure multinomial sampling from the full softmax. ``min_new_tokens=24`` together with the
  real ``eos_token_id`` makes transformers' ``MinNewTokensLengthLogitsProcessor`` set the
  eos logit to -inf at every one of the 24 steps, so EOS can never be sampled: every
  response is exactly 24 tokens, and TRL's post-processing (which truncates a response
  after its first eos id) never triggers. Passing ``eos_token_id=-1`` instead would NOT be
  enough: generate would no longer stop on EOS, but the eos id could still be sampled
  (p ~ 1/V per token; ~17% chance per 64x24 batch for ``small``) and TRL's
  ``_generate_batched`` would then cut that response after the tokenizer's eos id
  (transformers also warns about a negative eos id). The model's own
  generation_config has its GPT-2 default eos/bos 50256 overridden with V-1 as well.
* Scores: ``torch.randn`` (one float per sample), drawn outside the timed region; no
  reward model.
* PPOConfig: TRL defaults except batch_size / mini_batch_size / ppo_epochs above,
  gradient_accumulation_steps=1, seed=0, log_with=None (defaults: lr 1.41e-5 Adam,
  adaptive KL init_kl_coef 0.2, kl_penalty "kl", gamma 1, lam 0.95, cliprange 0.2,
  cliprange_value 0.2, vf_coef 0.1, no grad clipping, no early stopping).
  ``batched_forward_pass`` uses mini_batch_size as its forward batch size.
* One warm-up iteration, then ``--iters`` (default 3) timed iterations. Reported: medians
  of total (generation + step wall time), generation, step, and TRL's own
  ``time/ppo/optimize_step`` and ``time/ppo/forward_pass`` stats;
  tokens_per_s = B*24 / median_total; peak RSS (ru_maxrss, MiB).
* ``--device cpu`` (default): ``torch.set_num_threads(--threads)`` (default 2), and CUDA is hidden
  from torch (``CUDA_VISIBLE_DEVICES=""``) so that accelerate keeps TRL on the CPU.
  ``--device cuda``: accelerate puts the models on the GPU; each timed region ends with
  ``torch.cuda.synchronize()``, and ``peak_gpu_mib`` is ``torch.cuda.max_memory_allocated``.
* ``--bf16``: generation and step each run under ``torch.autocast("cpu", dtype=torch.bfloat16)``
  (linear/matmul/SDPA in bf16 through oneDNN, on AMX where the CPU has it; weights and Adam
  stay f32). The counterpart of ``rltune bench ppo --matmul-precision bf16``.

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python bench/trl_ppo.py --preset small --json
    HF_HUB_OFFLINE=1 .venv/bin/python bench/trl_ppo.py --preset gpt2 --iters 3 --json
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Hide CUDA from torch (and so from accelerate) unless --device cuda was asked for.
_argv = " ".join(sys.argv[1:]).replace("=", " ").split()
if "cuda" not in (_argv[_argv.index("--device") + 1] if "--device" in _argv[:-1] else "cpu"):
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from tokenizers.models import WordLevel  # noqa: E402
from tokenizers.pre_tokenizers import WhitespaceSplit  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from trl import (  # noqa: E402
    AutoModelForCausalLMWithValueHead,
    PPOConfig,
    PPOTrainer,
    create_reference_model,
)

PRESETS = {
    "small": dict(
        n_layer=4, n_head=4, n_embd=256, vocab_size=8192, n_positions=64,
        batch_size=64, mini_batch_size=16, ppo_epochs=4,
    ),
    "gpt2": dict(
        n_layer=12, n_head=12, n_embd=768, vocab_size=50257, n_positions=1024,
        batch_size=16, mini_batch_size=4, ppo_epochs=4,
    ),
    # Qwen2-0.5B's shape (494M parameters, tied embeddings), for the GPU: 128-token prompts and
    # 128 new tokens, as issue #36 asks; meant for --bf16 --device cuda.
    "qwen2-0.5b": dict(
        arch="qwen2", n_layer=24, n_head=14, n_kv_head=2, n_embd=896, intermediate=4864,
        vocab_size=151936, n_positions=32768, batch_size=64, mini_batch_size=8, ppo_epochs=4,
        query_len=128, response_len=128,
    ),
}
QUERY_LEN = 8
RESPONSE_LEN = 24
EOS_TOKEN = "<|endoftext|>"


def build_tokenizer(vocab_size):
    vocab = {f"tok{i}": i for i in range(vocab_size - 1)}
    vocab[EOS_TOKEN] = vocab_size - 1
    tk = Tokenizer(WordLevel(vocab=vocab, unk_token=EOS_TOKEN))
    tk.pre_tokenizer = WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        padding_side="right",
    )
    assert len(tok) == vocab_size, (len(tok), vocab_size)
    assert tok.eos_token_id == vocab_size - 1 and tok.pad_token_id == vocab_size - 1
    return tok


def build(preset, batch=None, mini_batch=None):
    p = dict(PRESETS[preset])
    p["batch_size"] = batch or p["batch_size"]
    p["mini_batch_size"] = mini_batch or p["mini_batch_size"]
    V = p["vocab_size"]
    tokenizer = build_tokenizer(V)
    if p.get("arch") == "qwen2":
        cfg = Qwen2Config(
            vocab_size=V,
            hidden_size=p["n_embd"],
            intermediate_size=p["intermediate"],
            num_hidden_layers=p["n_layer"],
            num_attention_heads=p["n_head"],
            num_key_value_heads=p["n_kv_head"],
            max_position_embeddings=p["n_positions"],
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            attention_dropout=0.0,
            bos_token_id=V - 1,
            eos_token_id=V - 1,
            pad_token_id=V - 1,
        )
        torch.manual_seed(0)
        base = Qwen2ForCausalLM(cfg)
        return wrap(base, tokenizer, p)
    cfg = GPT2Config(
        vocab_size=V,
        n_positions=p["n_positions"],
        n_embd=p["n_embd"],
        n_layer=p["n_layer"],
        n_head=p["n_head"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        bos_token_id=V - 1,
        eos_token_id=V - 1,
        pad_token_id=V - 1,
    )
    torch.manual_seed(0)
    base = GPT2LMHeadModel(cfg)
    return wrap(base, tokenizer, p)


def wrap(base, tokenizer, p):
    V = p["vocab_size"]
    base.generation_config.eos_token_id = V - 1
    base.generation_config.bos_token_id = V - 1
    base.generation_config.pad_token_id = V - 1
    model = AutoModelForCausalLMWithValueHead.from_pretrained(base, summary_dropout_prob=0.0)
    ref_model = create_reference_model(model)
    config = PPOConfig(
        batch_size=p["batch_size"],
        mini_batch_size=p["mini_batch_size"],
        ppo_epochs=p["ppo_epochs"],
        gradient_accumulation_steps=1,
        seed=0,
        log_with=None,
        exp_name="trl_ppo_bench",
    )
    trainer = PPOTrainer(config=config, model=model, ref_model=ref_model, tokenizer=tokenizer)
    n_params = sum(x.numel() for x in base.parameters())
    n_vhead = sum(x.numel() for x in model.v_head.parameters())
    return trainer, tokenizer, p, n_params, n_vhead


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--iters", type=int, default=3, help="timed iterations (after 1 warm-up)")
    ap.add_argument("--batch", type=int, help="PPO batch size instead of the preset's")
    ap.add_argument("--mini-batch", type=int, help="PPO mini-batch size instead of the preset's")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument(
        "--bf16",
        action="store_true",
        help="run generation and step under torch.autocast(device, dtype=torch.bfloat16) "
        "(on the CPU: matmuls in bf16 on AMX via oneDNN; compare with rltune --dtype bf16)",
    )
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda (accelerate's GPU)")
    args = ap.parse_args()

    cuda = args.device.startswith("cuda")
    torch.set_num_threads(args.threads)
    trainer, tokenizer, p, n_params, n_vhead = build(args.preset, args.batch, args.mini_batch)
    B = p["batch_size"]
    V = p["vocab_size"]
    query_len = p.get("query_len", QUERY_LEN)
    response_len = p.get("response_len", RESPONSE_LEN)
    eos = tokenizer.eos_token_id
    gen_kwargs = dict(
        max_new_tokens=response_len,
        min_new_tokens=response_len,
        do_sample=True,
        top_k=0,
        top_p=1.0,
        temperature=1.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos,
        use_cache=True,
    )
    data_gen = torch.Generator().manual_seed(1234)
    log = sys.stderr
    print(
        f"[trl_ppo] preset={args.preset} params={n_params} (+{n_vhead} v_head) B={B} "
        f"mb={p['mini_batch_size']} epochs={p['ppo_epochs']} threads={torch.get_num_threads()} "
        f"torch={torch.__version__} transformers={transformers.__version__} trl={trl.__version__}",
        file=log,
    )

    rows = []
    for it in range(args.warmup + args.iters):
        # eos id is V-1, so randint(0, V-1) never yields it.
        q = torch.randint(0, V - 1, (B, query_len), generator=data_gen)
        queries = [q[i] for i in range(B)]
        scores = list(torch.randn(B, generator=data_gen).unbind(0))

        autocast = torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=args.bf16)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        if cuda:
            queries = [x.to(trainer.accelerator.device) for x in queries]
        sync()
        t0 = time.perf_counter()
        with autocast:
            responses = trainer.generate(queries, return_prompt=False, batch_size=B, **gen_kwargs)
        sync()
        t1 = time.perf_counter()
        with autocast:
            stats = trainer.step(queries, responses, scores)
        sync()
        t2 = time.perf_counter()

        lens = {int(r.shape[0]) for r in responses}
        assert lens == {response_len}, f"response lengths {lens}"
        assert not any(bool((r == eos).any()) for r in responses), "EOS sampled"
        row = dict(
            total=t2 - t0,
            gen=t1 - t0,
            step=t2 - t1,
            opt=float(stats["time/ppo/optimize_step"]),
            fwd=float(stats["time/ppo/forward_pass"]),
        )
        warm = it < args.warmup
        print(
            f"[trl_ppo] {'warmup' if warm else 'iter'} {it}: total {row['total']:.3f}s "
            f"gen {row['gen']:.3f}s step {row['step']:.3f}s (fwd {row['fwd']:.3f}s, "
            f"opt {row['opt']:.3f}s) kl {float(stats['objective/kl']):.4f}",
            file=log,
            flush=True,
        )
        if not warm:
            rows.append(row)

    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = {
        "impl": "trl",
        "preset": args.preset,
        "median_total_s": med["total"],
        "median_generation_s": med["gen"],
        "median_step_s": med["step"],
        "median_optimize_step_s": med["opt"],
        "median_forward_pass_s": med["fwd"],
        "tokens_per_s": B * response_len / med["total"],
        "n_params": n_params,
        "train_tokens": B * (query_len + response_len) * p["ppo_epochs"],
        "peak_rss_mib": peak_rss_mib,
        "torch": torch.__version__,
        "trl": trl.__version__,
        "threads": torch.get_num_threads(),
        "matmul_precision": "bf16" if args.bf16 else "f32",
        "device": str(trainer.accelerator.device),
    }
    if cuda:
        out["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
        out["gpu"] = torch.cuda.get_device_name()
    if args.json:
        print(json.dumps(out))
    else:
        print(f"TRL {trl.__version__} PPO bench, preset {args.preset} "
              f"(torch {torch.__version__}, {out['threads']} threads, {len(rows)} timed iters)")
        for label, key, fmt in [
            ("median total", "median_total_s", "{:.3f} s"),
            ("median generation", "median_generation_s", "{:.3f} s"),
            ("median step", "median_step_s", "{:.3f} s"),
            ("  time/ppo/forward_pass", "median_forward_pass_s", "{:.3f} s"),
            ("  time/ppo/optimize_step", "median_optimize_step_s", "{:.3f} s"),
            ("tokens/s", "tokens_per_s", "{:.1f}"),
            ("peak RSS", "peak_rss_mib", "{:.1f} MiB"),
        ]:
            print(f"  {label:<26} {fmt.format(out[key])}")


if __name__ == "__main__":
    main()
