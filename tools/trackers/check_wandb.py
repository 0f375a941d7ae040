#!/usr/bin/env python3
"""Check the W&B offline run an rltune run wrote (`[logging] wandb = "offline"`) with the `wandb`
package, offline.

    python check_wandb.py --run-dir RUN_DIR [--exit-code 0]

Reads every RUN_DIR/wandb/offline-run-*/run-*.wandb: the record framing with wandb's own
`DataStore` where the installed wandb still ships it (`wandb.sdk.internal.datastore`, before
wandb-core took over reading), else with the reader below, which follows that file; each record is
parsed with wandb's `wandb_internal_pb2.Record` and must serialize back to the same bytes (no
unknown or mis-typed field). Checks that the records are a header, the run (its id, project and
config), one history record per step holding every scalar of RUN_DIR/metrics.jsonl with the same
values, a summary and the exit record with --exit-code; that files/config.yaml and
files/wandb-summary.json load; and that `wandb sync --dry-run` finds the run. Never uploads:
WANDB_MODE is set to offline. Installs nothing. Exits 1 with the differences found.
"""

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import tomllib
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _metrics import compare, scalar_history  # noqa: E402

os.environ["WANDB_MODE"] = "offline"
os.environ.setdefault("WANDB_SILENT", "true")
import wandb  # noqa: E402
import yaml  # noqa: E402  (a dependency of wandb)
from wandb.proto import wandb_internal_pb2 as pb  # noqa: E402

BLOCK, HEADER = 32768, 7


def payloads_datastore(path):
    from wandb.sdk.internal import datastore  # wandb < 0.2x

    wandb._assert_is_internal_process = True
    ds = datastore.DataStore()
    ds.open_for_scan(str(path))
    out = []
    while (data := ds.scan_data()) is not None:
        out.append(data)
    return out


def payloads_here(path):
    """The reader of wandb's datastore.py (scan_data), for wandb versions without it."""
    data = Path(path).read_bytes()
    if data[:HEADER] != struct.pack("<4sHB", b":W&B", 0xBEE1, 0):
        raise ValueError("bad file header")
    pos, out, partial = HEADER, [], None
    while pos < len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            if data[pos:pos + left].strip(b"\0"):
                raise ValueError(f"byte {pos}: nonzero block trailer")
            pos += left
            continue
        crc, n, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk = data[pos + HEADER:pos + HEADER + n]
        if len(chunk) != n or zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            raise ValueError(f"byte {pos}: bad checksum or torn record")
        pos += HEADER + n
        if kind == 1 and partial is None:
            out.append(chunk)
        elif kind == 2 and partial is None:
            partial = chunk
        elif kind in (3, 4) and partial is not None:
            partial += chunk
            if kind == 4:
                out.append(partial)
                partial = None
        else:
            raise ValueError(f"byte {pos}: record type {kind} out of order")
    if partial is not None:
        raise ValueError("file ends inside a split record")
    return out


def item_key(item):
    return item.key or "/".join(item.nested_key)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--exit-code", type=int, default=0)
    args = ap.parse_args()
    problems = []
    run_id = json.loads((args.run_dir / "trackers.json").read_text())["wandb"]["run_id"]
    folders = sorted((args.run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    if not folders:
        report([f"no {args.run_dir}/wandb/offline-run-*-{run_id}"])
    try:
        read, reader = payloads_datastore, "wandb.sdk.internal.datastore.DataStore"
        read(next(folders[0].glob("*.wandb")))
    except ImportError:
        read, reader = payloads_here, "the reader of wandb's datastore.py in check_wandb.py"

    config = tomllib.loads((args.run_dir / "config.toml").read_text())
    history = {}
    exit_record = None
    for folder in folders:
        records = []
        for raw in read(folder / f"run-{run_id}.wandb"):
            rec = pb.Record()
            rec.ParseFromString(raw)
            if rec.SerializeToString() != raw:
                problems.append(f"{folder.name}: record {rec.num} does not re-serialize to its bytes")
            records.append(rec)
        kinds = [r.WhichOneof("record_type") for r in records]
        if kinds[:2] != ["header", "run"]:
            problems.append(f"{folder.name}: starts with {kinds[:2]}, not header, run")
        run = records[1].run
        if run.run_id != run_id or run.project != "rltune" or run.display_name != args.run_dir.name:
            problems.append(f"run record: id {run.run_id!r}, project {run.project!r}, name {run.display_name!r}")
        cfg = {item_key(i): json.loads(i.value_json) for i in run.config.update}
        if cfg.get("ppo", {}).get("learning_rate") != config["ppo"]["learning_rate"]:
            problems.append(f"run config ppo = {cfg.get('ppo')!r}")
        for rec in records:
            if rec.WhichOneof("record_type") == "history":
                items = {item_key(i): json.loads(i.value_json) for i in rec.history.item}
                if items.get("_step") != rec.history.step.num:
                    problems.append(f"history _step {items.get('_step')} != step.num {rec.history.step.num}")
                for k, v in items.items():
                    if not k.startswith("_") and not isinstance(v, dict):
                        history.setdefault(k, {})[rec.history.step.num] = v
        if kinds[-2:] != ["summary", "exit"]:
            problems.append(f"{folder.name}: ends with {kinds[-2:]}, not summary, exit")
        exit_record = records[-1].exit
        files = folder / "files"
        # config.toml is the last process's: a resumed run may differ from an earlier one in its
        # length (`steps`) alone.
        written = yaml.safe_load((files / "config.yaml").read_text())["ppo"]["value"]
        last = folder == folders[-1]
        strip = (lambda d: d) if last else (lambda d: {k: v for k, v in d.items() if k != "steps"})
        if strip(written) != strip(config["ppo"]):
            problems.append(f"{folder.name}/files/config.yaml: ppo differs from config.toml")
        json.loads((files / "wandb-summary.json").read_text())

    if exit_record is None or exit_record.exit_code != args.exit_code:
        problems.append(f"exit code {exit_record.exit_code if exit_record else None}, expected {args.exit_code}")
    expected = scalar_history(args.run_dir)
    if not expected:
        problems.append("metrics.jsonl has no scalars")
    for key, points in expected.items():
        got = sorted(history.get(key, {}).items())
        problems += compare(key, points, got)
    extra = set(history) - set(expected)
    if extra - {k for k in extra if k.endswith("_dist")}:
        problems.append(f"history keys not in metrics.jsonl: {sorted(extra)[:5]}")

    wandb_bin = Path(sys.executable).parent / "wandb"
    with tempfile.TemporaryDirectory() as tmp:  # the wandb command writes its logs to ./wandb
        sync = subprocess.run([wandb_bin, "sync", "--dry-run", *(str(f.resolve()) for f in folders)],
                              capture_output=True, text=True, timeout=120, cwd=tmp)
    if sync.returncode != 0 or f"run-{run_id}.wandb" not in sync.stdout + sync.stderr:
        problems.append(f"wandb sync --dry-run: rc {sync.returncode}: {sync.stdout[-300:]} {sync.stderr[-300:]}")
    problems += sync_probe(wandb_bin, folders[0], run_id)
    steps = max((len(p) for p in expected.values()), default=0)
    print(f"wandb {wandb.__version__}: run {run_id}, {len(folders)} offline folder(s), read with {reader}: "
          f"{len(expected)} metrics x {steps} steps")
    report(problems)


def sync_probe(wandb_bin, folder, run_id, wait_s=20):
    """`wandb sync` on a copy of `folder` against a server that is not there (127.0.0.1:9, a
    fake key, a temporary HOME): wandb-core reads the file's header and run record and says
    "[rltune/<id>] setting up run <id>" before it tries the network; after `wait_s` it is stopped
    (SIGTERM, so that it prints what it buffered). Nothing can be uploaded."""
    import shutil
    import threading

    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / folder.name
        shutil.copytree(folder, copy)
        env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
        env.update(HOME=tmp, WANDB_BASE_URL="http://127.0.0.1:9", WANDB_API_KEY="x" * 40,
                   WANDB_MODE="offline", WANDB_CONFIG_DIR=tmp, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen([wandb_bin, "sync", "--verbose", str(copy)], stdin=subprocess.DEVNULL, cwd=tmp,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        timer = threading.Timer(wait_s, proc.terminate)
        timer.start()
        want, seen = f"[rltune/{run_id}] setting up run {run_id}", []
        for line in proc.stdout:
            seen.append(line.rstrip())
            if want in line:
                break
        proc.kill()
        proc.wait()
        timer.cancel()
    if not any(want in line for line in seen):
        return [f"wandb sync did not read the run ({want!r} not said): {seen[-5:]}"]
    print(f"wandb sync (wandb-core) read the run: {want}")
    return []


def report(problems):
    if problems:
        print("FAILED:\n  " + "\n  ".join(problems))
        sys.exit(1)
    print("OK: every metric of metrics.jsonl is in the W&B run's history with the same steps and values")
    sys.exit(0)


if __name__ == "__main__":
    main()
