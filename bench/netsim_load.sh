#!/usr/bin/env bash
# netsim load figures on this machine against today's serial verifier (issue 10, step 4).
# Each command prints its table; results (load.json, load.md, plots) land in bench/load/<name>/.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/load}
PY=${PYTHON:-python}
run() { nice -n 10 "$PY" -m netsim load "$@"; }
# The bundled target (SmolLM2-135M on llama.cpp) and the default draft, one draft model per edge.
run --edges 1,4,16 --profile lan --mode hybrid,cloud-only --duration 10 --warmup 2 --max-tokens 48 --out "$OUT/real-lan"
run --edges 1,4,16 --profile 3g --mode hybrid,cloud-only --duration 10 --warmup 2 --max-tokens 48 --out "$OUT/real-3g"
# The synthetic pair (target 20 ms per pass, draft 2 ms per token, emulated per device), up to 64 edges.
run --synthetic --edges 1,4,16,64 --profile lan --mode hybrid,cloud-only --duration 8 --warmup 1 --out "$OUT/synth-lan"
run --synthetic --edges 1,4,16,64 --profile 3g --mode hybrid,cloud-only --duration 10 --warmup 2 --out "$OUT/synth-3g"
# The same against the batching verifier (continuous batching; a synthetic pass costs 20 ms whatever it holds).
run --synthetic --edges 1,4,16,64 --profile lan --mode hybrid,cloud-only --duration 8 --warmup 1 \
    --verifier-arg=--batching --verifier-arg=on --out "$OUT/synth-lan-batched"
run --synthetic --edges 1,4,16,64 --profile 3g --mode hybrid,cloud-only --duration 10 --warmup 2 \
    --verifier-arg=--batching --verifier-arg=on --out "$OUT/synth-3g-batched"
