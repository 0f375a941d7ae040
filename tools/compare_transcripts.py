#!/usr/bin/env python3
"""Compare agents played on the same games: `rltune play --seed S --transcripts FILE` for each.

    tools/compare_transcripts.py bc.jsonl ppo.jsonl grpo.jsonl

Prints each agent's win rate and mean normalized score with their standard errors, and each
agent's difference from the first with the paired standard error, clustered by game (episode i
of every file must be the same game: the same --seed and --episodes). A difference is
significant at about 95% when it exceeds two paired standard errors.
"""
import json
import math
import sys


def load(path):
    with open(path) as f:
        eps = [json.loads(line) for line in f if line.strip()]
    eps.sort(key=lambda e: e["episode"])
    return eps


def mean_se(xs):
    n = len(xs)
    m = sum(xs) / n
    var = sum((x - m) ** 2 for x in xs) / (n - 1) if n > 1 else 0.0
    return m, math.sqrt(var / n)


def paired(diffs, games):
    """The mean difference and its error clustered by game (episodes replaying one game are
    not independent), as `PairedDifference::win_rate` computes it: with G games and S_g the sum
    of game g's deviations from the mean, se^2 = G/(G - 1) * sum S_g^2 / n^2. With one episode a
    game it is the plain error."""
    n = len(diffs)
    m = sum(diffs) / n
    sums = {}
    for d, g in zip(diffs, games):
        sums[g] = sums.get(g, 0.0) + d - m
    big_g = len(sums)
    var = big_g / (big_g - 1) * sum(s * s for s in sums.values()) / n**2 if big_g > 1 else 0.0
    return m, math.sqrt(var)


def main(paths):
    if len(paths) < 1:
        sys.exit(__doc__)
    runs = [(p, load(p)) for p in paths]
    base_path, base = runs[0]
    for p, eps in runs:
        if [e["seed"] for e in eps] != [e["seed"] for e in base] or [e.get("game") for e in eps] != [
            e.get("game") for e in base
        ]:
            sys.exit(f"{p}: not the same games as {base_path} (play both with the same --seed and --episodes)")
    # The game of each episode (the clusters of the paired error): its seed and game file, or
    # the episode alone when it has neither. The same for every file, checked above.
    games = [
        (b["seed"], b.get("game")) if b["seed"] is not None or b.get("game") is not None else ("alone", b["episode"])
        for b in base
    ]
    print(f"{'agent':40} {'episodes':>8} {'win rate':>16} {'norm. score':>16} {'Δ win (paired SE)':>22}")
    for p, eps in runs:
        wins = [float(e["won"]) for e in eps]
        score = [e["score"] / e["max_score"] if e["max_score"] else 0.0 for e in eps]
        w, wse = mean_se(wins)
        s, sse = mean_se(score)
        d, dse = paired([a - float(b["won"]) for a, b in zip(wins, base)], games)
        delta = "" if p == base_path else f"{d:+.3f} ({dse:.3f})"
        print(f"{p:40} {len(eps):8d} {w:8.3f} ± {wse:.3f} {s:8.3f} ± {sse:.3f} {delta:>22}")


if __name__ == "__main__":
    main(sys.argv[1:])
