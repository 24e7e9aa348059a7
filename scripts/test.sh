#!/usr/bin/env bash
# Set up (first time) and run the whole test suite. Extra arguments go to pytest, e.g.
#   scripts/test.sh --fast        skip slow tests (real models, vLLM)
#   scripts/test.sh -k faults     one area
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
