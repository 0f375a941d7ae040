#!/usr/bin/env python3
"""Arithmetic word-free problems for the SmolLM2 GRPO example (docs/lora.md, "A real LM that
learns"): conversational prompts with an exact answer, as TRL's GRPO datasets hold them.

    python3 examples/smollm2-grpo/make_data.py --out target/smollm2-grpo

writes train.jsonl and heldout.jsonl, one row each:
    {"prompt": [{"role": "user", "content": "What is 37 + 48? ..."}], "answer": 85}
and sft.jsonl, the training problems with their gold answers as TRL's conversational
prompt-completion rows (the SFT control, sft-control.toml):
    {"prompt": [{"role": "user", ...}], "completion": [{"role": "assistant", "content": "85"}]}

The split is by the operand pair: a pair (a, b, op) is held out when a hash of it falls in the
held-out fifth, so no held-out problem (nor its commuted twin) is seen in training. Seeded and
deterministic: the same command writes the same bytes.
"""
import argparse
import hashlib
import json
import os
import random


def held_out(a, b, op):
    lo, hi = min(a, b), max(a, b)
    key = f"{lo}{op}{hi}" if op in "+*" else f"{a}{op}{b}"
    return hashlib.sha256(key.encode()).digest()[0] % 5 == 0


def problem(rng):
    op = rng.choice("+-")
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    if op == "-" and b > a:
        a, b = b, a
    answer = a + b if op == "+" else a - b
    text = f"What is {a} {op} {b}? Reply with the number only."
    return a, b, op, {"prompt": [{"role": "user", "content": text}], "answer": answer}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for train.jsonl and heldout.jsonl")
    p.add_argument("--train", type=int, default=2000, help="training problems (default 2000)")
    p.add_argument("--heldout", type=int, default=300, help="held-out problems (default 300)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    train, held, seen = [], [], set()
    while len(train) < args.train or len(held) < args.heldout:
        a, b, op, row = problem(rng)
        if (a, b, op) in seen:
            continue
        seen.add((a, b, op))
        side = held if held_out(a, b, op) else train
        if len(side) < (args.heldout if side is held else args.train):
            side.append(row)
    os.makedirs(args.out, exist_ok=True)
    sft = [{"prompt": r["prompt"], "completion": [{"role": "assistant", "content": str(r["answer"])}]} for r in train]
    for name, rows in (("train.jsonl", train), ("heldout.jsonl", held), ("sft.jsonl", sft)):
        path = os.path.join(args.out, name)
        with open(path + ".tmp", "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        os.replace(path + ".tmp", path)
        print(f"{path}: {len(rows)} problems")


if __name__ == "__main__":
    main()
