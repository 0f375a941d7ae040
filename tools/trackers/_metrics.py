"""What a run directory's metrics.jsonl says, for the tracker checks (check_mlflow.py, check_wandb.py).

Reads as rltune's `logging/jsonl.rs` does: a line whose step is not above the earlier lines' steps
(a run resumed from an earlier checkpoint) supersedes the lines at or above it; a line that does
not parse (a crash's tail) is skipped. The scalars are the numbers and nulls (non-finite values)
of each line; arrays (`*_dist`) and texts (warnings) are not scalars.
"""

import json
import math
from pathlib import Path


def scalar_history(run_dir):
    """{key: [(step, value), ...]} in step order; value is None where metrics.jsonl has null."""
    rows = []
    for line in Path(run_dir, "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        step = row.get("step")
        if not isinstance(step, int):
            continue
        rows = [r for r in rows if r["step"] < step]
        rows.append(row)
    history = {}
    for row in rows:
        for key, value in row.items():
            if key == "step" or isinstance(value, (list, str, dict, bool)):
                continue
            history.setdefault(key, []).append((row["step"], value))
    return history


def same_value(expected, got):
    """A metrics.jsonl value against a tracker's: null is any non-finite number; numbers are
    equal after a round trip through their shortest decimal form."""
    if expected is None:
        return got is None or (isinstance(got, float) and not math.isfinite(got))
    return isinstance(got, (int, float)) and float(got) == float(expected)


def compare(name, expected, got):
    """Problems (strings) between two histories of one key: [(step, value), ...] each."""
    if len(expected) != len(got):
        return [f"{name}: {len(got)} points, metrics.jsonl has {len(expected)}"]
    problems = []
    for (es, ev), (gs, gv) in zip(expected, got):
        if es != gs or not same_value(ev, gv):
            problems.append(f"{name}: step {gs} = {gv!r}, metrics.jsonl has step {es} = {ev!r}")
    return problems[:3]
