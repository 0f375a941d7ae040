#!/usr/bin/env python3
"""Reads an agent quickstart's `episodes-<stage>.jsonl` and splits a paired win-rate difference
by game: the difference, its plain and game-clustered standard errors (the same formulas as the
summary's `se_plain` and `se`), the share of the variance that lies between games, and the games
that moved most.

    python3 bench/paired_by_game.py DIR/episodes-grpo.jsonl                # test, bc vs the RL agent
    python3 bench/paired_by_game.py DIR/episodes-grpo.jsonl --split validation --top 5

When the quickstart's summary lies beside the file (`summary-<stage>.json`, or `summary.json` for
PPO) and the comparison is BC against the RL stage, the script checks its three figures against
the summary's `ppo_vs_bc` (test) or `validation.rl_vs_bc`, so the two implementations of the
formulas cannot drift apart unseen.

Standard library only. A malformed row is an error naming the file and the line.
"""
import argparse
import json
import math
import os
import sys
from collections import defaultdict


def read(path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                rows.append((r["split"], r["agent"], int(r["episode"]), r.get("seed"), r.get("game"), bool(r["won"])))
            except (ValueError, KeyError, TypeError) as e:
                sys.exit(f"{path}:{n}: not an episode record ({e}); expected the quickstart's episodes-<stage>.jsonl")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("episodes", help="DIR/episodes-<stage>.jsonl")
    ap.add_argument("--split", default="test", help="test (default) or validation")
    ap.add_argument("--base", default="bc", help="the agent subtracted (default: bc)")
    ap.add_argument("--other", help="the agent compared (default: the one agent that is not random or bc)")
    ap.add_argument("--top", type=int, default=3, help="games to list at each end (default 3)")
    a = ap.parse_args()

    rows = [r for r in read(a.episodes) if r[0] == a.split]
    agents = sorted({r[1] for r in rows})
    other = a.other or next((g for g in agents if g not in ("random", "bc")), None)
    if other is None or a.base not in agents or other not in agents:
        sys.exit(f"{a.episodes}: split {a.split!r} holds agents {agents}; name two with --base and --other")
    by = {ag: {r[2]: r for r in rows if r[1] == ag} for ag in (a.base, other)}
    diffs = []  # (game key, difference)
    for i, o in sorted(by[other].items()):
        b = by[a.base].get(i)
        if b is None:
            continue
        if (b[3], b[4]) != (o[3], o[4]):
            sys.exit(f"{a.episodes}: episode {i} is another game for {a.base} and {other}")
        key = (o[3], o[4], i if o[3] is None and o[4] is None else None)
        diffs.append((key, float(o[5]) - float(b[5])))
    n = len(diffs)
    if n < 2:
        sys.exit(f"{a.episodes}: {n} paired episodes on {a.split}; need at least 2")
    delta = sum(d for _, d in diffs) / n
    games = defaultdict(list)
    for k, d in diffs:
        games[k].append(d)

    def clustered(sums, clusters):
        return math.sqrt(clusters / (clusters - 1) * sum(s * s for s in sums) / n**2) if clusters > 1 else 0.0

    se = clustered([sum(d - delta for d in ds) for ds in games.values()], len(games))
    se_plain = clustered([d - delta for _, d in diffs], n)
    # One-way decomposition of the differences' sum of squares into within and between games.
    within = sum(sum((d - sum(ds) / len(ds)) ** 2 for d in ds) for ds in games.values())
    between = sum(len(ds) * (sum(ds) / len(ds) - delta) ** 2 for ds in games.values())
    total = within + between
    print(f"{a.split}: {other} - {a.base} over {n} episodes of {len(games)} games")
    print(f"  delta {100 * delta:+.2f} points; SE clustered by game {100 * se:.2f}, plain {100 * se_plain:.2f}"
          f" (ratio {se / se_plain if se_plain else float('nan'):.2f})")
    print(f"  sum of squares between games {between:.1f}, within {within:.1f}"
          f" ({100 * between / total if total else 0:.0f}% between)")
    means = sorted(((sum(ds) / len(ds), len(ds), k) for k, ds in games.items()), key=lambda t: t[0])
    gained = sum(1 for m, _, _ in means if m > 0)
    lost = sum(1 for m, _, _ in means if m < 0)
    print(f"  games gained {gained}, lost {lost}, level {len(means) - gained - lost}")

    check_summary(a.episodes, a.split, a.base, other, {"delta": delta, "se": se, "se_plain": se_plain})

    def name(k):
        seed, game, alone = k
        return f"game {game}" if game is not None else f"seed {seed}" if seed is not None else f"episode {alone}"

    lost_most = [t for t in means if t[0] < 0][: a.top]
    gained_most = [t for t in means[::-1] if t[0] > 0][: a.top]
    for label, part in (("lost most", lost_most), ("gained most", gained_most)):
        if part:
            print(f"  {label}: " + ", ".join(f"{name(k)} {100 * m:+.0f} ({c} ep.)" for m, c, k in part))


def check_summary(episodes, split, base, other, mine):
    """Compares `mine` with the quickstart summary's paired difference, when there is one."""
    if base != "bc":
        return
    folder, file = os.path.split(episodes)
    if not (file.startswith("episodes-") and file.endswith(".jsonl")):
        return
    stage = file[len("episodes-") : -len(".jsonl")]
    if stage != other:
        return
    path = os.path.join(folder, "summary.json" if stage == "ppo" else f"summary-{stage}.json")
    try:
        with open(path, encoding="utf-8") as f:
            summary = json.load(f)
    except FileNotFoundError:
        return
    except ValueError as e:
        sys.exit(f"{path}: not JSON ({e})")
    theirs = summary.get("ppo_vs_bc") if split == "test" else (summary.get("validation") or {}).get("rl_vs_bc")
    if not theirs:
        return
    for key, value in mine.items():
        ref = theirs.get(key)
        if ref is None:
            continue
        if abs(ref - value) > 1e-12:
            sys.exit(f"{path}: {split} {key} is {ref!r}, this script computes {value!r}; the two disagree")
    print(f"  agrees with {path} (delta, se" + (", se_plain)" if "se_plain" in theirs else ")"))


if __name__ == "__main__":
    main()
