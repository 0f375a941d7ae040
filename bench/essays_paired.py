#!/usr/bin/env python3
"""Essays quickstart summaries side by side: each agent's per-essay F-score (mean ± SE) and the
RL agent's paired differences from BC and its controls, per split.

    python3 bench/essays_paired.py runs/ess-ptx-s0/summary-essays-ppo-ptx.json [...] [--tsv OUT]

Each summary is one seed's `summary-essays*.json`; the RL rows are named "PPO" and "PPO (greedy)"
whatever the stage (`config.ptx_coef` says whether it was PPO-ptx). A paired difference is the
mean of the per-essay differences (the same essays, in the same order) and its SE is their
standard deviation over √n. The script checks that its own means equal the summary's, so a
summary whose scores do not match its means is refused.
"""
import argparse
import json
import math
import sys

PAIRS = [
    ("PPO", "BC", "- BC (sampled)"),
    ("PPO (greedy)", "BC (greedy)", "- BC (greedy, both)"),
    ("PPO", "BC (T = 0.5)", "- BC T = 0.5"),
    ("PPO", "BC longer", "- BC longer (sampled)"),
    ("PPO (greedy)", "BC longer (greedy)", "- BC longer (greedy, both)"),
]


def mean_se(xs):
    n = len(xs)
    m = sum(xs) / n
    var = sum((x - m) ** 2 for x in xs) / (n - 1) if n > 1 else 0.0
    return m, math.sqrt(var / n)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("summaries", nargs="+")
    ap.add_argument("--tsv", help="also write every row here")
    args = ap.parse_args()
    rows = []
    for path in args.summaries:
        with open(path) as f:
            s = json.load(f)
        cfg = s["config"]
        label = f"seed {cfg['seed']}, ptx_coef {cfg.get('ptx_coef', 0)}, lr {cfg['ppo']['learning_rate']}"
        for split, key in [("test", "agents"), ("validation", "validation")]:
            agents = dict((name, e) for name, e in s.get(key, []))
            if not agents:
                continue
            for name, e in agents.items():
                m, _ = mean_se(e["scores"])
                if abs(m - e["mean"]) > 1e-9:
                    sys.exit(f"{path}: {split} {name}: scores average {m} but the summary says {e['mean']}")
                rows.append((label, split, name, len(e["scores"]), e["mean"], e["se"]))
            print(f"{label}, {split} ({len(next(iter(agents.values()))['scores'])} essays):")
            for name in ["BC", "BC (greedy)", "BC (T = 0.5)", "BC longer", "BC longer (greedy)", "PPO", "PPO (greedy)"]:
                if name in agents:
                    e = agents[name]
                    print(f"  {name:<20} {e['mean']:.3f} ± {e['se']:.3f}")
            for a, b, what in PAIRS:
                if a in agents and b in agents:
                    d = [x - y for x, y in zip(agents[a]["scores"], agents[b]["scores"])]
                    m, se = mean_se(d)
                    verdict = "above by 2 SE" if m > 2 * se else ("below by 2 SE" if m < -2 * se else "within 2 SE")
                    print(f"  {a + ' ' + what:<42} {m:+.3f} (paired SE {se:.3f}) {verdict}")
                    rows.append((label, split, f"{a} {what}", len(d), m, se))
    if args.tsv:
        with open(args.tsv, "w") as f:
            f.write("run\tsplit\trow\tessays\tmean\tse\n")
            for r in rows:
                f.write("\t".join([r[0], r[1], r[2], str(r[3]), f"{r[4]:.4f}", f"{r[5]:.4f}"]) + "\n")


if __name__ == "__main__":
    main()
