#!/usr/bin/env bash
# Set up (first time) and run the whole test suite. Extra arguments go to pytest, e.g.
#   scripts/test.sh --fast            skip slow tests (real models, vLLM)
#   scripts/test.sh -k faults         one area
# Two options check that the suite does not depend on the machine it runs on (see docs/testing.md):
#   scripts/test.sh --numpy-avx2 ...  numpy's AVX-512 kernels off (NPY_DISABLE_CPU_FEATURES), so an
#                                     AVX-512 machine runs the float paths an AVX2-only CPU runs;
#                                     on a CPU without AVX-512 it says so and runs as usual
#   scripts/test.sh --busy N ...      N processes burn a core each for the whole run (a busy machine)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

busy=0
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --numpy-avx2)
      off=$(.venv/bin/python -m hybridspec.machine --numpy-avx512)
      if [ -n "$off" ]; then
        export NPY_DISABLE_CPU_FEATURES="$off"
        echo "[test] numpy's AVX-512 kernels off: NPY_DISABLE_CPU_FEATURES=\"$off\"" >&2
      else
        echo "[test] --numpy-avx2: numpy runs no AVX-512 kernels on this CPU; nothing to turn off" >&2
      fi
      shift ;;
    --busy)
      busy=${2:?--busy needs a number of processes}
      shift 2 ;;
    --busy=*)
      busy=${1#--busy=}
      shift ;;
    *)
      args+=("$1")
      shift ;;
  esac
done

burners=()
stop_burners() { [ ${#burners[@]} -eq 0 ] || kill "${burners[@]}" 2>/dev/null || true; }
trap stop_burners EXIT
for _ in $(seq 1 "$busy"); do
  .venv/bin/python -c 'while True: pass' &
  burners+=($!)
done
[ "$busy" -eq 0 ] || echo "[test] $busy CPU-burning processes run beside the suite (pids ${burners[*]})" >&2
echo "[test] machine: $(.venv/bin/python -m hybridspec.machine --summary)" >&2

.venv/bin/python -m pytest ${args[@]+"${args[@]}"}
