#!/usr/bin/env bash
# The regime map (netsim/fleet/regime.py): hybrid / cloud-only tokens/s per H200 at a mean TPOT SLO,
# over target (8B bf16, 70B fp8), context (1k, 8k, 32k), link (lan, lte, 3g) and alpha (0.5, 0.7, 0.85):
# at 150 ms for greedy and for T 0.7 top-p 0.95 rounds (each with the model checked against the
# discrete-event simulation at four cells), and at 30 ms for greedy rounds. A model (about two
# minutes on a small machine), no GPU. The host path per round comes from bench/fleet/host_path.json
# (refresh it from bench/accept_maths.py). Results (regime.json, regime.md) land in bench/fleet/regime-*/.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/fleet}
PY=${PYTHON:-python}
for setting in greedy top-p; do
    "$PY" -m netsim.fleet.regime --setting "$setting" --slo-tpot-ms 150 --check --out "$OUT/regime-$setting"
done
"$PY" -m netsim.fleet.regime --setting greedy --slo-tpot-ms 30 --out "$OUT/regime-greedy-30ms"
