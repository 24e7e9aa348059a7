#!/usr/bin/env bash
# KV of sessions that wait on their link (issue 18, item 3): a batched llama.cpp verifier whose
# --kv-tokens hold 4 sessions of 512 tokens, hybrid edges on 3g (300 ms RTT), without and with
# --kv-park on, run one after the other. Results: results/load/kvpark-3g-{off,on}/ (load.md has
# the idle share of sessions' KV, parks and restores, and what they cost per round).
#   flock /work/wt/bench.lock bash bench/kv_park.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/load}
PY=${PYTHON:-.venv/bin/python}
EDGES=${EDGES:-4,8,16}
# The bundled target on 1 thread; each edge drafts with models/smollm2-draft.gguf (its own copy,
# 1 thread, on the harness's core).
common=(--edges "$EDGES" --profile 3g --mode hybrid --drafter gguf --duration "${DURATION:-12}" --warmup 2
        --max-tokens 48 --slo-tpot-ms 400 --slo-ttft-ms 3000
        --verifier-arg=--threads=1 --verifier-arg=--n-ctx=512 --verifier-arg=--kv-tokens=2048)
for park in off on; do
  "$PY" -m netsim load "${common[@]}" --verifier-arg=--kv-park="$park" --out "$OUT/kvpark-3g-$park"
done
