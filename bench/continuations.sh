#!/usr/bin/env bash
# Continuations against per-token, chain (hybrid-g4), today's single-guess pipeline and cloud-only,
# in one run per pair: the bundled pair (SmolLM2 target, models/smollm2-draft.gguf; 1 thread per
# model) on lte, 3g and geo-sat, then the synthetic pair on this CPU's verifier cost curve
# (bench/tree_netsim_synthetic.py --curves cpu: 19 ms + 31 ms per node). Run it under the shared lock:
#   flock /work/wt/bench.lock bash bench/continuations.sh
# Raw results go to results/continuations (ignored); the small summary and reports to bench/continuations.
set -euo pipefail
PY=${PY:-.venv/bin/python}
RAW=${RAW:-results/continuations}
OUT=${OUT:-bench/continuations}
mkdir -p "$RAW" "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}
"$PY" -m hybridspec.machine --summary > "$OUT/machine.txt"
date -u +%FT%TZ >> "$OUT/machine.txt"
"$PY" -m netsim experiment --profiles lte,3g,geo-sat --modes cloud-only,per-token,hybrid,pipeline,continuations \
    --workloads chat,summarisation --max-tokens 32 --gammas 4 --no-crossover --out "$RAW/bundled"
"$PY" bench/tree_netsim_synthetic.py --profiles 3g,geo-sat --workloads chat --curves cpu --cpu 19,31 \
    --modes cloud-only,per-token,hybrid,pipeline,continuations --out "$RAW/synthetic"
"$PY" bench/continuations_summary.py "$RAW" "$OUT"
cp "$RAW/bundled/report.md" "$OUT/bundled_report.md"
cp "$RAW/synthetic/cpu/report.md" "$OUT/synthetic_cpu_report.md"
