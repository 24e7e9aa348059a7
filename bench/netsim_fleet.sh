#!/usr/bin/env bash
# netsim fleet on this machine's netsim load results (bench/netsim_load.sh): each load run is checked
# against the simulator calibrated on it, then the verifiers needed for 10^3..10^6 edges.
# Results (fleet.json, fleet.md, verifiers_vs_edges.png) land in results/fleet/<name>/. It calibrates on the
# synthetic runs kept in bench/load/synth-*/load.json; LOAD=results/load calibrates on a new bench/netsim_load.sh run.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/fleet}
LOAD=${LOAD:-bench/load}
PY=${PYTHON:-python}
fleet() { nice -n 10 "$PY" -m netsim fleet "$@"; }
# The headline: capacity and goodput at the SLO per H200 for each path of the vLLM backend, with and
# without KV offload and the draft budget, hybrid beside plain decoding and vLLM speculating for itself
# (the regime map's cell: 8B, 1k, lte, α 0.7, its workload); and SpecEdge's set-up. The GPU table also
# goes to the figures registry (bench/results/gpu-fleet.json).
fleet --calibrate "$LOAD/synth-lan/load.json" --calibrate "$LOAD/synth-lan-batched/load.json" \
    --profile lte --slo-tpot-ms 150 --slo-ttft-ms 2000 --specedge --out "$OUT/gpu" --result gpu-fleet
# The synthetic pair on lan, serial and batching verifier; capacity with edges on lte at p95 <= 150 ms.
fleet --calibrate "$LOAD/synth-lan/load.json" --calibrate "$LOAD/synth-lan-batched/load.json" \
    --profile lte --slo-ms 150 --gpu-table off --out "$OUT/synthetic"
# The same, with llama.cpp's measured pass cost (bench/verify_cost.py) and its 32-token batched passes.
fleet --calibrate "$LOAD/synth-lan/load.json" --calibrate "$LOAD/synth-lan-batched/load.json" \
    --cpu-cost-ms 15.9,7.15 --cpu-ubatch 32 --gpu-table off --out "$OUT/llamacpp"
# The synthetic pair on 3g, serial and batching verifier; capacity with edges on 3g at p95 <= 300 ms.
fleet --calibrate "$LOAD/synth-3g/load.json" --calibrate "$LOAD/synth-3g-batched/load.json" \
    --profile 3g --slo-ms 300 --gpu-table off --out "$OUT/synthetic-3g"
