#!/usr/bin/env python3
"""Check the MLflow file store an rltune run wrote (`[logging] mlflow`) with the `mlflow` package.

    python check_mlflow.py --run-dir RUN_DIR [--status FINISHED] [--experiment rltune]

Reads the run with `mlflow.search_runs` (by the experiment's name) and
`MlflowClient().get_metric_history`, and checks that every scalar of RUN_DIR/metrics.jsonl is a
metric of the run with the same steps and values, that its params hold the resolved config
(RUN_DIR/config.toml) and that its status is --status. Installs nothing: run it with the Python
of tools/trackers/install.sh. Exits 1 with the differences found.
"""

import argparse
import json
import os
import sys
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _metrics import compare, scalar_history  # noqa: E402

# mlflow 3.x keeps the file store behind this switch (FileStore.__init__).
os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
import mlflow  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--status", default="FINISHED")
    ap.add_argument("--experiment", default="rltune")
    args = ap.parse_args()
    ids = json.loads((args.run_dir / "trackers.json").read_text())["mlflow"]
    store = Path(ids["run_dir"]).parent.parent
    mlflow.set_tracking_uri(store.as_uri())
    client = MlflowClient()

    runs = mlflow.search_runs(experiment_names=[args.experiment])
    problems = []
    if ids["run_id"] not in set(runs["run_id"]):
        problems.append(f"search_runs({args.experiment!r}) does not find run {ids['run_id']}: {list(runs['run_id'])}")
        report(problems)
    run = client.get_run(ids["run_id"])
    if run.info.status != args.status:
        problems.append(f"status {run.info.status}, expected {args.status}")
    if run.info.end_time is None:
        problems.append("no end_time")
    if run.data.tags.get("mlflow.runName") != args.run_dir.name or run.info.run_name != args.run_dir.name:
        problems.append(f"run name {run.info.run_name!r}, expected {args.run_dir.name!r}")

    expected = scalar_history(args.run_dir)
    if not expected:
        problems.append("metrics.jsonl has no scalars")
    for key, points in expected.items():
        if f"metrics.{key}" not in runs.columns:
            problems.append(f"search_runs has no column metrics.{key}")
        history = sorted(client.get_metric_history(ids["run_id"], key), key=lambda m: (m.step, m.timestamp))
        problems += compare(key, points, [(m.step, m.value) for m in history])
    extra = set(run.data.metrics) - set(expected)
    if extra:
        problems.append(f"metrics not in metrics.jsonl: {sorted(extra)[:5]}")

    config = tomllib.loads((args.run_dir / "config.toml").read_text())
    params = run.data.params
    for table, key in [("ppo", "learning_rate"), ("logging", "report_every"), ("model", "path")]:
        want = config.get(table, {}).get(key)
        got = params.get(f"{table}.{key}")
        same = got == want if isinstance(want, str) else got is not None and float(got) == float(want)
        if want is not None and not same:
            problems.append(f"param {table}.{key} = {got!r}, config.toml has {want!r}")
    steps = max((len(p) for p in expected.values()), default=0)
    print(f"mlflow {mlflow.__version__}: run {ids['run_id']} ({args.experiment}, {run.info.status}): "
          f"{len(expected)} metrics x {steps} steps, {len(params)} params")
    report(problems)


def report(problems):
    if problems:
        print("FAILED:\n  " + "\n  ".join(problems))
        sys.exit(1)
    print("OK: every metric of metrics.jsonl is in MLflow with the same steps and values")
    sys.exit(0)


if __name__ == "__main__":
    main()
