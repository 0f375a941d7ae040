#!/usr/bin/env python3
"""Counts turn-backs in coin-collector transcripts: where a policy loses TextWorld's chain games.

A coin-collector game of level L (5 to 15 here) is a chain of L rooms, the coin in the last;
every room has the way back and the way on. A move is

- a *turn-back* when it reverses the move before it, and that move was not itself a reversal:
  an unforced error, since the way on is the exit not taken to enter the room;
- a *reversal after a reversal* when both reverse the move before them: the return from a
  turn-back (right) or an oscillation (wrong); with a window of two turns the two look alike;
- *on* otherwise.

    rltune play --env ENV.toml --model DIR --episodes 128 --transcripts T.jsonl
    python3 bench/textworld_turnbacks.py T.jsonl [T2.jsonl ...]

prints, per file, the moves, the turn-backs and the reversals after a reversal, and the wins
among the episodes with 0, 1, 2 and 3 or more turn-backs. Standard library only; a malformed
line is an error naming the file and the line.
"""
import collections
import json
import sys

REVERSE = {"north": "south", "south": "north", "east": "west", "west": "east"}


def episodes(path):
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                e = json.loads(line)
                yield bool(e["won"]), [t["action"] for t in e["turns"]]
            except (ValueError, KeyError, TypeError) as err:
                sys.exit(f"{path}:{n}: not a transcript line of `rltune play --transcripts` ({err})")


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: textworld_turnbacks.py TRANSCRIPTS.jsonl [MORE.jsonl ...] (`rltune play --transcripts`)")
    for path in sys.argv[1:]:
        moves_total = turnbacks_total = reversals_total = 0
        wins = collections.defaultdict(list)  # min(turn-backs, 3) -> [won]
        for won, actions in episodes(path):
            moves, turnbacks = [], 0
            for a in actions:
                direction = a[3:] if a.startswith("go ") else None
                if direction not in REVERSE:
                    continue
                moves_total += 1
                if moves and REVERSE[moves[-1]] == direction:
                    if len(moves) >= 2 and REVERSE[moves[-2]] == moves[-1]:
                        reversals_total += 1
                    else:
                        turnbacks += 1
                moves.append(direction)
            turnbacks_total += turnbacks
            wins[min(turnbacks, 3)].append(won)
        episodes_total = sum(len(w) for w in wins.values())
        share = 100 * turnbacks_total / moves_total if moves_total else 0.0
        print(f"{path}: {episodes_total} episodes, won {sum(sum(w) for w in wins.values())}; {moves_total} moves, "
              f"{turnbacks_total} turn-backs ({share:.1f}%), {reversals_total} reversals after a reversal")
        for k in sorted(wins):
            print(f"  {k if k < 3 else '3+'} turn-backs: {len(wins[k])} episodes, won {sum(wins[k])}")


if __name__ == "__main__":
    main()
