#!/usr/bin/env python3
"""A reward where a person rates each sample: use it as an rltune command reward.

rltune writes one JSON line per sample to this program's stdin,
{"query": "...", "response": "...", "meta": {...}}, and reads one line per sample back:
a number or {"reward": x}. stdin/stdout belong to rltune, so the person is reached through
the terminal (/dev/tty). Give the command reward no timeout (or a long one): people are slow.

    CommandReward::spawn(vec!["python3".into(), "crates/rltune/examples/rewards/rate_by_hand.py".into()])?
        .with_timeout(None)
"""
import json
import sys

with open("/dev/tty") as keyboard, open("/dev/tty", "w") as tty:
    for n, line in enumerate(sys.stdin, 1):
        sample = json.loads(line)
        tty.write(f"\n--- sample {n} ---\n{sample['query']}\033[1m{sample['response']}\033[0m\n")
        while True:
            tty.write("rating (e.g. -1 to 1): ")
            tty.flush()
            answer = keyboard.readline().strip()
            try:
                reward = float(answer)
                break
            except ValueError:
                tty.write(f"not a number: {answer!r}\n")
        print(json.dumps({"reward": reward}), flush=True)
