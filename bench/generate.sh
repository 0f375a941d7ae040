#!/usr/bin/env bash
# Generation throughput of `rltune::generation::generate` on a random GPT-2-small-shaped model
# (f32, CPU): batch 16, 8-token prompts, 24 new tokens, one warm-up run then timed runs.
# Extra arguments go to the example: --runs N, --batch N, --profile (per-phase breakdown).
# Results are recorded in bench/LOG.md ("Generation throughput").
set -euo pipefail
cd "$(dirname "$0")/.."
echo "machine: $(nproc) CPUs, $(lscpu | grep 'Model name' | sed 's/Model name: *//'), $(date -u +%Y-%m-%dT%H:%MZ)" >&2
exec cargo run --release -p rltune-models --example bench_generate -- "$@"
