#!/usr/bin/env bash
# The regime map (netsim/fleet/regime.py): per GPU (H100, H200), the hybrid against both baselines an
# operator would run instead (plain decoding, and vLLM speculating for itself with a draft model, an
# EAGLE head or n-gram, the draft's cost charged on the GPU), over target (8B bf16, 70B fp8), context
# (1k, 8k, 32k), link (lan, lte, 3g) and alpha (0.5, 0.7, 0.85); then the discrete-event simulation of
# the map's points in a few cells (netsim/fleet/simcheck.py). A model, no GPU: about a minute for the
# maps and a few minutes for the simulation on a small machine.
#
#   regime                 SLO on the p95 gap between bursts reaching the user <= 150 ms, bf16 KV cache
#   regime-mean-tpot       the same judged on the mean time per output token (what the reader does not feel)
#   regime-fp8-kv          the KV cache in fp8 (twice the sessions; attention at the fp8 rate)
#   regime-top-p           T 0.7 top-p 0.95 rounds (the host path's top-p rows)
#
# Each writes regime.json and regime.md in results/fleet/<name>/ and its tables and headline figures in
# bench/results/gpu-<name>.json (the pages render them); the simulation writes bench/results/gpu-sim.json.
# The rounds-in-flight inputs are read from bench/continuations/summary.json, the host path per
# round from bench/fleet/host_path.json (refresh it from bench/accept_maths.py).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/fleet}
PY=${PYTHON:-python}
regime() { local name=$1; shift; nice -n 10 "$PY" -m netsim.fleet.regime "$@" --out "$OUT/$name" --result "gpu-$name"; }
regime regime
regime regime-mean-tpot --slo-on mean-tpot
regime regime-fp8-kv --kv-dtype fp8
regime regime-top-p --setting top-p
nice -n 10 "$PY" -m netsim.fleet.simcheck --result gpu-sim
