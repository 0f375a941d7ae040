#!/usr/bin/env python3
"""Reference GRPO benchmark: TRL 1.16.0 ``GRPOTrainer`` on CPU, one optimizer step timed.

Workload (the Rust side, ``rltune bench grpo``, does identical work):

  preset | model                                         | GRPO batch
  -------+-----------------------------------------------+-------------------------------------------
  small  | GPT-2, 4 layers, 4 heads, d=256, vocab 8192,  | per_device_train_batch_size 64 completions
         | n_positions 64 (~5.27M params), dropouts 0     | = 8 prompts x num_generations 8;
         |                                               | 8 prompt + 24 completion tokens
  qwen2- | Qwen2-0.5B's shape (494M, tied embeddings,    | 16 completions = 2 prompts x 8;
  0.5b   | random), as bench/trl_ppo.py builds it         | 128 prompt + 128 completion tokens
                                                           (for the GPU: --device cuda --bf16)

* The model is built in-process (``torch.manual_seed(0)``, random ``GPT2LMHeadModel``), never
  loaded from the hub; ``--model DIR`` loads a local Hugging Face directory instead (e.g. the one
  ``rltune convert`` writes from SmolLM2's GGUF, which ``rltune bench grpo --model`` loads too),
  in f32, with the preset's batch geometry. f32 on the CPU (``bf16=False``; TRL's default would
  autocast to bf16).
* Generation is not timed and not run: as in ``tools/fixtures/make_grpo_fixture.py``, the
  trainer's ``_tokenize_prompts`` and ``_generate_single_turn`` are replaced by functions that
  return fixed random ids (prompt tokens and 24 completion tokens, never EOS, so every
  completion counts as truncated; ``mask_truncated_completions`` stays False). The reward
  function returns seeded normal draws.
* GRPOConfig: TRL 1.16.0 defaults (``loss_type="dapo"``, ``beta=0``: no reference model,
  ``num_iterations=1``: no old-logprob forward, ``max_grad_norm=1``, AdamW, linear schedule)
  except the batch geometry above, ``max_completion_length=24``, ``learning_rate=1e-5``
  (any value takes the same time), ``logging_steps=1``, and ``gradient_checkpointing=False``:
  TRL 1.16.0 turns it on by default, which recomputes every layer's forward in the backward
  (rltune keeps the activations); ``--gradient-checkpointing`` times TRL's default.
  ``--beta 0.04`` adds the reference model's forward and the k3 term.
* One timed step = ``on_step_begin`` to ``on_step_end`` of transformers' loop: TRL's
  ``_generate_and_score_completions`` with the patched generator (rewards, advantages,
  metrics), ``compute_loss`` forward, backward, gradient clipping, ``optimizer.step``,
  scheduler. After ``--warmup`` steps (default 1), ``--iters`` steps (default 5): the median.
* ``torch.set_num_threads(--threads)`` (default 2). ``--device cuda`` runs on the GPU
  (accelerate's device; CUDA stays hidden otherwise) and ``--bf16`` sets GRPOConfig's ``bf16``
  (autocast with f32 master weights, as rltune's ``--dtype bf16``).

Usage::

    .venv-trl1/bin/python bench/trl_grpo.py --preset small --json
"""

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import tempfile
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
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    TrainerCallback,
)
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

PRESETS = {
    "small": dict(n_layer=4, n_head=4, n_embd=256, vocab_size=8192, n_positions=64, batch=64, generations=8,
                  prompt_len=8, completion_len=24),
    "qwen2-0.5b": dict(arch="qwen2", n_layer=24, n_head=14, n_kv_head=2, n_embd=896, intermediate=4864,
                       vocab_size=151936, n_positions=32768, batch=16, generations=8,
                       prompt_len=128, completion_len=128),
}


def build_model(p):
    V, eos = p["vocab_size"], p["vocab_size"] - 1
    torch.manual_seed(0)
    if p.get("arch") == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(
            vocab_size=V, hidden_size=p["n_embd"], intermediate_size=p["intermediate"],
            num_hidden_layers=p["n_layer"], num_attention_heads=p["n_head"],
            num_key_value_heads=p["n_kv_head"], max_position_embeddings=p["n_positions"],
            rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_dropout=0.0,
            bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
        ))
    return GPT2LMHeadModel(GPT2Config(
        vocab_size=V, n_positions=p["n_positions"], n_embd=p["n_embd"], n_layer=p["n_layer"],
        n_head=p["n_head"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
    ))


def build_tokenizer(vocab_size):
    eos = vocab_size - 1
    vocab = {f"t{i}": i for i in range(eos)}
    vocab["<eos>"] = eos
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>", bos_token="<eos>")
    hf.padding_side = "left"
    return hf


class StepTimer(TrainerCallback):
    def __init__(self, cuda=False):
        self.t0 = None
        self.times = []
        self.sync = torch.cuda.synchronize if cuda else (lambda: None)

    def on_step_begin(self, args, state, control, **kwargs):
        self.sync()
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.sync()
        self.times.append(time.perf_counter() - self.t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--iters", type=int, default=5, help="timed steps (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--beta", type=float, default=0.0, help="KL coefficient (0: no reference model)")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="TRL 1.16.0's default")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda (accelerate's GPU)")
    ap.add_argument("--bf16", action="store_true", help="GRPOConfig bf16: autocast, f32 weights")
    ap.add_argument("--model", help="a local Hugging Face model directory instead of the preset's random "
                    "weights (the preset keeps the batch geometry)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    p = PRESETS[args.preset]
    B, G = p["batch"], p["generations"]
    PROMPT_LEN, COMPLETION_LEN = p["prompt_len"], p["completion_len"]
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        V = model.config.vocab_size
    else:
        model = build_model(p)
        V = p["vocab_size"]
    eos = V - 1
    n_params = sum(t.numel() for t in model.parameters())
    steps = args.warmup + args.iters
    n_prompts = B // G
    gen = torch.Generator().manual_seed(1234)

    def rand_ids(n):
        return torch.randint(0, eos, (n,), generator=gen).tolist()

    def tokenize(prompts):
        return [rand_ids(PROMPT_LEN) for _ in prompts], None, {}

    def generate(prompt_ids, images, multimodal_fields, *a, **k):
        return [rand_ids(COMPLETION_LEN) for _ in prompt_ids], None

    def reward(prompts, completions, completion_ids, **kwargs):
        return torch.randn(len(completion_ids), generator=gen).tolist()

    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp, use_cpu=not cuda, bf16=args.bf16, report_to="none", disable_tqdm=True,
            save_strategy="no", logging_steps=1, seed=0, shuffle_dataset=False,
            per_device_train_batch_size=B, num_generations=G, max_completion_length=COMPLETION_LEN,
            learning_rate=1e-5, beta=args.beta, max_steps=steps,
            gradient_checkpointing=args.gradient_checkpointing,
        )
        dataset = Dataset.from_dict({"prompt": [f"p{i}" for i in range(n_prompts * steps)]})
        trainer = GRPOTrainer(
            model=model, reward_funcs=[reward], args=config, train_dataset=dataset,
            processing_class=build_tokenizer(V),
        )
        trainer._tokenize_prompts = tokenize
        trainer._generate_single_turn = generate
        timer = StepTimer(cuda)
        trainer.add_callback(timer)
        with contextlib.redirect_stdout(sys.stderr):  # the trainer prints its summary
            trainer.train()
    times = timer.times[args.warmup:]
    for i, t in enumerate(timer.times):
        print(f"[trl_grpo] {'warm-up' if i < args.warmup else 'step'} {i}: {t:.3f}s", file=sys.stderr)
    out = {
        "impl": "trl",
        "preset": args.preset,
        "model": args.model,
        "beta": args.beta,
        "gradient_checkpointing": args.gradient_checkpointing,
        "median_step_s": statistics.median(times),
        "steps_s": times,
        "tokens_per_s": B * COMPLETION_LEN / statistics.median(times),
        "n_params": n_params,
        "train_tokens": B * (PROMPT_LEN + COMPLETION_LEN),
        "device": args.device,
        "bf16": args.bf16,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "threads": torch.get_num_threads(),
    }
    if cuda:
        out["gpu"] = torch.cuda.get_device_name()
        out["peak_gpu_mib"] = torch.cuda.max_memory_reserved() / 1048576
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
