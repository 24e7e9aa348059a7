#!/usr/bin/env bash
# The regime map (netsim/fleet/regime.py): per GPU (H100, H200), the hybrid against both baselines an
# operator would run instead (plain decoding, and vLLM speculating for itself with a draft model, an
# EAGLE head or n-gram, the draft's cost charged on the GPU), over target (8B bf16, 70B fp8), context
# (1k, 8k, 32k), link (lan, lte, 3g) and the device draft's acceptance curve (τ4 2.5, EAGLE-3's 3.08, 3.8);
# each side with its own acceptance curve (netsim/fleet/acceptance.py) and the device's drafting time from
# its table (netsim/fleet/devices.py); then the discrete-event simulation of the map's points in every
# cell where the hybrid comes within 10% of the better baseline (netsim/fleet/simcheck.py: the model's
# stated error, which decides ties), the maps again (their counts of wins and ties read that error), and
# the break-even per GPU, target and context (netsim/fleet/breakeven.py) with its plot. A model, no GPU:
# minutes for the maps and the break-even, longer for the simulation (hundreds of sessions a point) on a
# small machine; none of it depends on the machine's load.
#
#   regime                 SLO on the p95 gap between bursts reaching the user <= 150 ms, bf16 KV cache,
#                          the device a laptop GPU
#   regime-phone           the same with a phone-class device drafting
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
nice -n 10 "$PY" -m netsim.fleet.simcheck --result gpu-sim
regime regime
regime regime-phone --device phone
regime regime-mean-tpot --slo-on mean-tpot
regime regime-fp8-kv --kv-dtype fp8
regime regime-top-p --setting top-p
nice -n 10 "$PY" -m netsim.fleet.breakeven --out "$OUT/breakeven/breakeven.json" --result gpu-breakeven
"$PY" -m hybridspec.plots gpu-breakeven per-gpu
