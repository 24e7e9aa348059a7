#!/usr/bin/env bash
# netsim load on this machine: the batched verifier (the default) against the serial one
# (--batching off), N = 1, 4, 16, 64 edges, lan and 3g, hybrid and cloud-only (issue 10).
# Each command prints its table; results (load.json, load.md, plots) land in results/load/<name>/.
#   bash bench/netsim_load.sh            # everything (~40 min on 2 cores)
#   bash bench/netsim_load.sh real       # the bundled target only
#   bash bench/netsim_load.sh synthetic  # the synthetic pair only (bench/netsim_fleet.sh calibrates on it)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/load}
PY=${PYTHON:-.venv/bin/python}
WHAT=${1:-all}
run() { "$PY" -m netsim load "$@"; }
serial=(--verifier-arg=--batching --verifier-arg=off)
batched=(--verifier-arg=--batching --verifier-arg=on)
if [[ $WHAT == all || $WHAT == real ]]; then
  # The bundled target (SmolLM2-135M on llama.cpp) on 1 thread: the other core runs the edges and
  # the links, and llama.cpp's threads spin-wait, so 2 threads on a busy 2-core box stall. The
  # edges draft by prompt lookup (no model: 64 draft models would need these 2 cores more than the
  # verifier does), 2 ms per drafted token emulated as the device's time.
  for profile in lan 3g; do
    common=(--edges 1,4,16,64 --profile "$profile" --mode hybrid,cloud-only --drafter lookup
            --duration 10 --warmup 2 --max-tokens 48 --verifier-arg=--threads --verifier-arg=1)
    run "${common[@]}" "${batched[@]}" --out "$OUT/real-$profile-batched"
    run "${common[@]}" "${serial[@]}" --out "$OUT/real-$profile-serial"
  done
fi
if [[ $WHAT == all || $WHAT == synthetic ]]; then
  # The synthetic pair: target 20 ms per pass whatever it holds (as on a GPU), draft 2 ms per token
  # emulated per device.
  run --synthetic --edges 1,4,16,64 --profile lan --mode hybrid,cloud-only --duration 8 --warmup 1 \
      "${serial[@]}" --out "$OUT/synth-lan"
  run --synthetic --edges 1,4,16,64 --profile 3g --mode hybrid,cloud-only --duration 10 --warmup 2 \
      "${serial[@]}" --out "$OUT/synth-3g"
  run --synthetic --edges 1,4,16,64 --profile lan --mode hybrid,cloud-only --duration 8 --warmup 1 \
      "${batched[@]}" --out "$OUT/synth-lan-batched"
  run --synthetic --edges 1,4,16,64 --profile 3g --mode hybrid,cloud-only --duration 10 --warmup 2 \
      "${batched[@]}" --out "$OUT/synth-3g-batched"
fi
